"""Whether the Hugging Face hub (or the mirror in HF_ENDPOINT) can answer now.

huggingface_hub retries a failed request five times with growing pauses (about 25 s with
no network); a command that only wants to know must not make a user wait that long. One
bounded request answers instead, and offline mode (HF_HUB_OFFLINE) is honoured at once.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

HUB_TIMEOUT_S = 2.0
# A hub repo id, `org/name`, as every command tells one from a path or a store name: ASCII
# (the hub's rule; re.ASCII, else \w is any script's letters) and nothing after it.
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+\Z", re.ASCII)


@dataclass(frozen=True)
class HubStatus:
    endpoint: str
    offline: bool  # HF_HUB_OFFLINE is set: nothing is asked
    problem: str | None  # why it cannot be reached (offline mode included); None: it answered
    http_status: int | None = None


def hub_status() -> HubStatus:
    """One HEAD request to the endpoint, unless offline mode is set."""
    import httpx
    from huggingface_hub import constants

    endpoint = constants.ENDPOINT
    if constants.HF_HUB_OFFLINE:
        return HubStatus(endpoint, True, "offline mode (HF_HUB_OFFLINE)")
    try:
        response = httpx.head(endpoint, timeout=HUB_TIMEOUT_S, follow_redirects=False)
    except httpx.HTTPError as exc:
        return HubStatus(endpoint, False, f"{endpoint} unreachable ({str(exc) or type(exc).__name__})")
    return HubStatus(endpoint, False, None, response.status_code)
