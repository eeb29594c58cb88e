"""The locust user: a closed loop of streamed completions, each timed and recorded.

Streaming is what lets a user time the first chunk (TTFT). Each request reaches locust's
statistics (so its CSV and HTML reports show it) and dlm's own `RequestRecord`, which also
keeps the usage fields locust has no place for. TTFT and TPOT are pushed to locust as
extra request types, so its reports chart them beside the end-to-end latency.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import httpx
from locust import User, task

from dlm.cli.client.api import ApiClient, Verify
from dlm.cli.loadtest.stats import RequestRecord
from dlm.cli.loadtest.workload import Workload

# A user whose request got no answer at all (connection refused or reset: the server died or is
# restarting) waits this long before its next. Closed-loop users retried at once, thousands of
# refused requests a second that report nothing more than the first few and take the CPU the
# server needs to come back.
NO_ANSWER_PAUSE_S = 1.0


class RequestFailed(Exception):
    """What locust lists as the failure of one request."""


@dataclass
class Recorder:
    """Records of every finished request; `level` is the load level now running."""

    level: int = 0
    records: list[RequestRecord] = field(default_factory=list)


def user_class(
    url: str, api_key: str | None, timeout: float, workload: Workload, recorder: Recorder, verify: Verify = True
) -> type[User]:
    counter = itertools.count()

    class CompletionUser(User):
        host = url
        unanswered = False  # the last request got no HTTP answer

        def wait_time(self) -> float:
            """Closed loop: the next request as soon as one finishes, unless it got no answer."""
            return NO_ANSWER_PAUSE_S if self.unanswered else 0.0

        def on_start(self) -> None:
            self.api = ApiClient(url, api_key, timeout, max_connections=1, verify=verify)

        def on_stop(self) -> None:
            self.api.close()

        @task
        def complete(self) -> None:
            path, body = workload.request(next(counter))
            level = recorder.level
            start = time.perf_counter()
            timed_out = False
            try:
                result = self.api.stream(path, body)
                usage = result.usage or {}
                record = RequestRecord(
                    level,
                    start,
                    result.e2e,
                    result.status,
                    result.error,
                    result.ttft,
                    usage.get("completion_tokens"),
                    usage.get("prompt_tokens"),
                    usage.get("denoising_steps"),
                    [b - a for a, b in zip(result.text_times, result.text_times[1:])],
                    result.text,
                )
                length = len(result.text)
            except httpx.HTTPError as exc:
                record = RequestRecord(level, start, time.perf_counter() - start, 0, f"{type(exc).__name__}: {exc}")
                timed_out = isinstance(exc, httpx.TimeoutException)
                length = 0
            except Exception as exc:  # noqa: BLE001 - a garbled answer is a failed request, not a crashed user
                record = RequestRecord(
                    level, start, time.perf_counter() - start, 0, f"unexpected answer ({type(exc).__name__}: {exc})"
                )
                length = 0
            recorder.records.append(record)
            self.unanswered = record.status == 0 and not timed_out  # a timeout has waited already
            failure = (
                None
                if record.ok
                else RequestFailed(f"HTTP {record.status}: {record.error}" if record.status else record.error)
            )
            fire = self.environment.events.request.fire
            fire(
                request_type="POST",
                name=path,
                response_time=record.e2e * 1000,
                response_length=length,
                exception=failure,
                context={},
            )
            # Time to first token and per output token as locust entries of their own, so its
            # stats and report show their percentiles beside the whole request's.
            for request_type, seconds in (("TTFT", record.ttft), ("TPOT", record.tpot)):
                if record.ok and seconds is not None:
                    fire(
                        request_type=request_type,
                        name=path,
                        response_time=seconds * 1000,
                        response_length=0,
                        exception=None,
                        context={},
                    )

    return CompletionUser
