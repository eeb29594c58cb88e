"""`run_loadtest`: drive locust headless through the load levels and gather the results.

Importing this module imports locust, which monkey-patches the process for gevent: only
the `dlm loadtest` command (a process of its own) should import it.
"""

from __future__ import annotations

import csv
import json
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gevent
import httpx
import locust.stats
from locust.env import Environment
from locust.html import get_html_report
from locust.stats import PERCENTILES_TO_REPORT, StatsCSVFileWriter, stats_history

from dlm.cli.client.api import ApiClient, Verify
from dlm.cli.client.metrics import GENERATION_TOKENS, REQUEST_SUCCESS, MetricsFormatError, parse_samples
from dlm.cli.loadtest.stats import RequestRecord, summarize
from dlm.cli.loadtest.sweep import ramp
from dlm.cli.loadtest.thresholds import Condition
from dlm.cli.loadtest.users import Recorder, user_class
from dlm.cli.loadtest.vllm_format import level_result
from dlm.cli.loadtest.workload import Workload, model_card
from dlm.engine.errors import DlmError

# Sample the HTML report's charts every second (locust's default is 5 s), so short runs chart.
locust.stats.HISTORY_STATS_INTERVAL_SEC = 1
LOCUST_PREFIX = "locust"
# `vllm bench serve --save-result`-shaped results: one object, or a list for a sweep.
VLLM_RESULT = "vllm_result.json"


@dataclass(frozen=True)
class LoadPlan:
    url: str
    levels: list[int]  # user counts: one for a fixed run, several for a sweep
    duration: float  # seconds per level, ramp-up included
    spawn_rate: float | None  # users started per second; None: all at once
    workload: Workload
    out: Path
    api_key: str | None = None
    timeout: float = 60.0
    slo: tuple[Condition, ...] = ()
    verify: Verify = True  # TLS check of an https:// server (dlm.cli.client.api.tls_verify)

    def ramp(self, before: int, users: int) -> float:
        return ramp(before, users, self.spawn_rate)


def scrape(client: ApiClient) -> dict[str, float] | None:
    """The server's counters, or None when it exports none we can read."""
    try:
        response = client.get("/metrics", timeout=10)
        return parse_samples(response.text) if response.status_code == 200 else None
    except (httpx.HTTPError, MetricsFormatError):
        return None


def settled_scrape(
    client: ApiClient, before: dict[str, float] | None, ok: int, patience: float = 2.0
) -> dict[str, float] | None:
    """Scrape after the run, giving the server a moment to count the last responses it sent."""
    deadline = time.perf_counter() + patience
    while True:
        after = scrape(client)
        if before is None or after is None or time.perf_counter() >= deadline:
            return after
        if after.get(REQUEST_SUCCESS, 0.0) - before.get(REQUEST_SUCCESS, 0.0) >= ok:
            return after
        gevent.sleep(0.1)


def agreement(
    before: dict[str, float] | None, after: dict[str, float] | None, records: list[RequestRecord]
) -> dict[str, Any]:
    """Client totals against the server's counter deltas over the run."""
    if before is None or after is None:
        return {"available": False}
    ok = [r for r in records if r.ok]
    result: dict[str, Any] = {"available": True}
    for key, name, client in (
        ("requests", REQUEST_SUCCESS, len(ok)),
        ("output_tokens", GENERATION_TOKENS, sum(r.output_tokens or 0 for r in ok)),
    ):
        if name not in after:
            result[key] = {"counter": name, "missing": True}
            continue
        server = after[name] - before.get(name, 0.0)
        result[key] = {
            "counter": name,
            "client": client,
            "server": server,
            "mismatch": abs(client - server) / max(server, 1.0),
        }
    return result


def top_errors(records: list[RequestRecord], count: int = 3) -> list[dict[str, Any]]:
    """The most frequent reasons requests failed, so a run against a broken server says why."""
    reasons = Counter(
        (f"HTTP {r.status}: " if r.status and r.status != 200 else "") + (r.error or "") for r in records if not r.ok
    )
    return [{"error": error, "requests": n} for error, n in reasons.most_common(count)]


def served_card(client: ApiClient, model: str | None) -> dict[str, Any]:
    """The server's /v1/models card of `model` (default: the first it lists)."""
    try:
        response = client.get("/v1/models")
    except httpx.HTTPError as exc:
        raise DlmError(f"cannot reach {client.base_url}: {exc}") from None
    if response.status_code != 200:
        raise DlmError(
            f"{client.base_url}/v1/models answered HTTP {response.status_code}; "
            "is the URL right, and the key (--api-key)?"
        )
    where = f"{client.base_url}/v1/models"
    try:
        body = response.json()
    except ValueError:  # not JSON, or not UTF-8
        kind = response.headers.get("content-type", "no content-type")
        raise DlmError(f"{where} did not answer JSON ({kind}): {response.text[:80]!r}; is it an OpenAI API?") from None
    return model_card(body, model, where)


def write_locust_reports(env: Environment, writer: StatsCSVFileWriter, out: Path) -> None:
    """Final CSV tables (the periodic writer may lag by a second) and the HTML report."""
    writer.close_files()
    base = out / LOCUST_PREFIX
    for suffix, table in (
        ("stats", writer.requests_csv),
        ("failures", writer.failures_csv),
        ("exceptions", writer.exceptions_csv),
    ):
        with open(f"{base}_{suffix}.csv", "w", newline="") as handle:
            table(csv.writer(handle))
    (out / f"{LOCUST_PREFIX}_report.html").write_text(get_html_report(env, show_download_link=False), encoding="utf-8")


def run_loadtest(
    plan: LoadPlan, on_tick: Callable[[dict[str, Any]], None] | None = None
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Run every level; return (per-level summaries, totals and the agreement with /metrics;
    the vLLM-shaped result of each level)."""
    plan.out.mkdir(parents=True, exist_ok=True)
    with ApiClient(plan.url, plan.api_key, plan.timeout, verify=plan.verify) as client:
        workload = plan.workload
        if workload.model is None or workload.requests is None:  # the server says which model it serves
            workload = workload.for_model(served_card(client, workload.model))
        before = scrape(client)
        recorder = Recorder()
        env = Environment(
            user_classes=[user_class(plan.url, plan.api_key, plan.timeout, workload, recorder, plan.verify)],
            host=plan.url,
            stop_timeout=plan.timeout,
        )
        # A Ctrl-C's KeyboardInterrupt may land in gevent's hub or in a user's greenlet: it reaches
        # this greenlet either way, and is no error for the hub to print a traceback of.
        hub = gevent.get_hub()
        hub.NOT_ERROR = (*hub.NOT_ERROR, KeyboardInterrupt)
        runner = env.create_local_runner()
        writer = StatsCSVFileWriter(env, PERCENTILES_TO_REPORT, str(plan.out / LOCUST_PREFIX), full_history=True)
        greenlets = [gevent.spawn(stats_history, runner), gevent.spawn(writer.stats_writer)]
        windows: list[tuple[float, float]] = []
        previous = 0
        started = time.perf_counter()
        interrupted = False
        try:
            for index, users in enumerate(plan.levels):
                begin = time.perf_counter()
                steady = begin + plan.ramp(previous, users)
                windows.append((steady, steady))  # its end is set as it runs: a Ctrl-C keeps what it measured
                recorder.level = index
                runner.start(users, plan.spawn_rate or users)
                end = begin + plan.duration
                while (now := time.perf_counter()) < end:
                    gevent.sleep(min(1.0, end - now))
                    windows[-1] = (steady, max(steady, time.perf_counter()))
                    if on_tick:
                        current = [r for r in recorder.records if r.level == index and r.start >= steady]
                        on_tick(
                            {
                                "level": index,
                                "users": users,
                                "levels": len(plan.levels),
                                "elapsed": time.perf_counter() - begin,
                                "duration": plan.duration,
                                **summarize(current, max(time.perf_counter() - steady, 1e-9), list(plan.slo)),
                            }
                        )
                windows[-1] = (steady, time.perf_counter())
                previous = users
        except KeyboardInterrupt:
            # Ctrl-C: the levels so far are results too (a long sweep's hour is not thrown away);
            # the users leave at once rather than finish their requests, the caller exits 130.
            interrupted = True
            env.stop_timeout = 0
        runner.quit()  # users finish the request in flight (stop_timeout), start no other
        for greenlet in greenlets:
            greenlet.kill()
        after = settled_scrape(client, before, sum(1 for r in recorder.records if r.ok))
    if not windows:  # interrupted before the first level began: nothing was measured
        raise KeyboardInterrupt
    write_locust_reports(env, writer, plan.out)
    records = recorder.records
    levels, vllm = [], []
    endpoint = workload.request(0)[0]
    for index, (users, (steady, end)) in enumerate(zip(plan.levels, windows)):
        window = [r for r in records if r.level == index and r.start >= steady]
        levels.append({"users": users, **summarize(window, end - steady, list(plan.slo))})
        vllm.append(level_result(window, end - steady, users, workload.model, endpoint, list(plan.slo)))
    (plan.out / VLLM_RESULT).write_text(json.dumps(vllm if len(vllm) > 1 else vllm[0], indent=2) + "\n")
    with open(plan.out / "requests.jsonl", "w") as handle:
        for record in records:
            handle.write(json.dumps(record.to_dict()) + "\n")
    return {
        "interrupted": interrupted,
        "url": plan.url,
        "model": workload.model,
        "prompts": workload.prompts,
        "levels": levels,
        "totals": summarize(records, (windows[-1][1] if windows else started) - started, list(plan.slo)),
        "server_metrics": agreement(before, after, records),
        "top_errors": top_errors(records),
    }, vllm
