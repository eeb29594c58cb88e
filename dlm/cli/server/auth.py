"""API keys: which caller is this? Keys are compared in constant time and never logged.

Every presented key is hashed and compared with `hmac.compare_digest` against every known
key's hash (no early exit), so neither the key's length nor how much of it matched leaks
through timing. Callers are named by `key_id` (a hash prefix) in logs and rate limits.
"""

from __future__ import annotations

import hashlib
import hmac

from starlette.requests import HTTPConnection

from dlm.cli.server.config import key_id
from dlm.cli.server.errors import APIError

ANONYMOUS = "anonymous"


class KeyRing:
    def __init__(self, keys: list[str]) -> None:
        self._digests = [(hashlib.sha256(k.encode()).digest(), key_id(k)) for k in keys]

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def knows(self, authorization: str | None) -> bool:
        """Whether `Authorization: Bearer KEY` names one of these keys (never raises)."""
        try:
            return self.enabled and self.identify(authorization) is not None
        except APIError:
            return False

    def identify(self, authorization: str | None) -> str:
        """The caller's key id from an `Authorization: Bearer KEY` header, or 401."""
        if not self.enabled:
            return ANONYMOUS
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise _unauthorized("missing API key: send `Authorization: Bearer <key>`")
        presented = hashlib.sha256(token.strip().encode()).digest()
        found = None
        for digest, name in self._digests:
            if hmac.compare_digest(presented, digest):
                found = name
        if found is None:
            raise _unauthorized("invalid API key")
        return found


def authorization(request: HTTPConnection) -> str | None:
    """The request's `Authorization` header, for `KeyRing.identify`; 401 when it has several:
    which one names the caller is ambiguous (RFC 9110 allows one), and reading the first
    served `Bearer KEY` then `Bearer bad`, which a proxy checking the last one saw as bad."""
    values = request.headers.getlist("authorization")
    if len(values) > 1:
        raise _unauthorized("several Authorization headers: send one")
    return values[0] if values else None


def _unauthorized(message: str) -> APIError:
    return APIError(
        401,
        message,
        type="authentication_error",
        code="invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )
