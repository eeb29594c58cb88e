"""The thread governor (dlm/engine/runtime/thread_governor.py): its decisions under made-up
step times (no clock: it only sees the seconds it is given), that the serving loop and
`LLM.generate` apply its count on the thread that steps, and that the default model's ids do
not depend on it."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from dlm.engine import cpu_plan
from dlm.engine.runtime import thread_governor as tg
from dlm.engine.runtime.thread_governor import ThreadGovernor, for_plan
from tests.tiny_families import tiny_names

TOKENS = 64
Costs = Callable[[int, int], float]  # (step index, threads) -> seconds of that step


def drive(governor: ThreadGovernor, steps: int, seconds: Costs, start: int = 0) -> list[int]:
    """Run `steps` steps whose time `seconds` gives; the thread count of each."""
    used = []
    for i in range(start, start + steps):
        threads = governor.threads
        used.append(threads)
        governor.observe(seconds(i, threads), TOKENS)
    return used


def quiet(i: int, threads: int) -> float:
    return {1: 0.050, 2: 0.031}[threads]  # the 104M model on a quiet 2-core machine


def loaded(i: int, threads: int) -> float:
    return {1: 0.050, 2: 1.6}[threads]  # a team meeting other processes on its cores


@pytest.fixture(autouse=True)
def _threads() -> Iterator[None]:
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_quiet_machine_takes_every_core_after_one_probe() -> None:
    governor = ThreadGovernor(1, 2)
    used = drive(governor, tg.PROBE_EVERY + tg.PROBE_STEPS + 20, quiet)
    assert used[: tg.PROBE_EVERY] == [1] * tg.PROBE_EVERY  # the plan's count until its cost is known
    assert used[tg.PROBE_EVERY : tg.PROBE_EVERY + tg.PROBE_STEPS] == [2] * tg.PROBE_STEPS  # the probe
    assert governor.home == 2 and set(used[tg.PROBE_EVERY :]) == {2}
    assert governor.switches == 1


def test_loaded_machine_cuts_the_probe_short_and_waits_out_its_cost() -> None:
    governor = ThreadGovernor(1, 2)
    used = drive(governor, 2000, loaded)
    probes = [i for i, t in enumerate(used) if t == 2]
    assert probes[0] == tg.PROBE_EVERY and used[probes[0] + 1] == 1  # one slow step ends the probe
    assert governor.home == 1
    # every probe step lost 1.55 s: the next waits for 1.55 / PROBE_SHARE s (620 steps) at home
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps and all(gap == 1 + int(1.55 / tg.PROBE_SHARE / 0.050) for gap in gaps)
    lost = len(probes) * (1.6 - 0.050)
    assert lost <= tg.PROBE_SHARE * 2000 * 0.050 + 1.6  # within the share, but for the first probe


def test_collapse_at_home_falls_back_on_the_next_step() -> None:
    governor = ThreadGovernor(1, 2)
    drive(governor, 60, quiet)
    assert governor.home == 2
    used = drive(governor, 3, loaded, start=60)
    assert used == [2, 1, 1]  # one collapsed step, then the plan's count at once
    assert governor.home == 1 and not governor.costs[2]


def test_hysteresis_keeps_the_plan_within_the_margin() -> None:
    governor = ThreadGovernor(1, 2)
    used = drive(governor, 200, lambda i, t: {1: 0.050, 2: 0.050 / (tg.SPEEDUP - 0.05)}[t])
    assert governor.home == 1 and governor.switches == 0
    assert 2 in used  # probed, and the 1.1x was not enough


def test_the_team_reprobes_the_plan_and_returns_when_the_team_slows() -> None:
    governor = ThreadGovernor(1, 2)
    drive(governor, 60, quiet)
    assert governor.home == 2
    slower = {1: 0.050, 2: 0.060}  # the team got 2x slower gradually: no single collapsed step
    used = drive(governor, 40, lambda i, t: slower[t] if i >= 60 + tg.WINDOW else quiet(i, t), start=60)
    used += drive(governor, 2 * tg.PROBE_EVERY, lambda i, t: slower[t], start=100)
    assert 1 in used and governor.home == 1


def test_a_probe_compares_only_steps_of_like_batch_size() -> None:
    """Served at concurrency 8 the 104M model's steps fed 472 tokens (137 ms at one thread,
    80 ms at two), and the wave's tail one canvas of 59 (80 ms at two threads): per token that
    tail step cost 4.6x the full ones, which the governor once took for a collapsed team and
    stayed on one thread. A probe step of a size home has no cost for decides nothing."""
    governor = ThreadGovernor(1, 2)
    full = {1: 0.137, 2: 0.080}
    used = [governor.threads]
    for _ in range(tg.PROBE_EVERY):
        governor.observe(full[governor.threads], 472)
        used.append(governor.threads)
    assert governor.probing and governor.threads == 2
    governor.observe(0.080, 59)  # the tail: one canvas
    assert not governor.probing and governor.home == 1 and governor._owed == 0  # no verdict, no penalty
    governor.observe(full[1], 472)  # the next batch: the probe starts again at once
    assert governor.probing
    for _ in range(tg.PROBE_STEPS):
        governor.observe(full[governor.threads], 472)
    assert governor.home == 2 and governor.switches == 1  # like for like, the team wins
    governor.observe(0.080, 59)  # at home on the team, a small step is not a collapse either
    assert governor.home == 2


def test_governor_needs_two_counts() -> None:
    with pytest.raises(ValueError):
        ThreadGovernor(2, 2)


def test_for_plan_takes_every_core_above_the_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_plan, "default_threads", lambda: 4)
    governor = for_plan(3)
    assert governor is not None and (governor.base, governor.team) == (3, 4)
    assert for_plan(4) is None and for_plan(None) is None


class Scripted(ThreadGovernor):
    """Alternates 1 and 2 threads step by step and records, per step, the thread that ran it
    and its torch thread count (what the caller applied)."""

    def __init__(self) -> None:
        super().__init__(1, 2)
        self.seen: list[tuple[str, int]] = []
        self.steps = 0

    @property
    def threads(self) -> int:
        return 1 + self.steps % 2

    def observe(self, seconds: float, tokens: int) -> None:
        assert tokens > 0 and isinstance(seconds, float)  # a step's tokens and its duration
        self.seen.append((threading.current_thread().name, torch.get_num_threads()))
        self.steps += 1


def test_generate_applies_the_governor_and_keeps_the_ids() -> None:
    """The default model's ids with the thread count switched every step equal those at the
    plan's count (its kernels give the same bits at 1 and 2 threads on this CPU)."""
    from dlm.engine.llm import LLM

    llm = LLM(None, dtype="float32", device="cpu")
    prompt = llm.encode("What is 19 + 81?")
    kwargs = {"gen_length": 32, "steps": 32, "block_length": 32}
    llm.thread_governor = None
    plain = llm.generate(prompt, **kwargs)[0].output_ids
    scripted = Scripted()
    llm.thread_governor = scripted
    governed = llm.generate(prompt, **kwargs)[0].output_ids
    assert governed == plain
    # the first step is not observed; each later one ran with the count set after the one before
    assert len(scripted.seen) == 31
    assert [t for _, t in scripted.seen] == [1 + i % 2 for i in range(31)]
    assert {name for name, _ in scripted.seen} == {threading.current_thread().name}


def test_serve_applies_the_governor_on_the_engine_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--thread-governor`: the serving loop sets the governor's count before each step, on
    the engine thread, and reports each step's time and tokens to it."""
    import dlm.engine.llm as llm_module
    from dlm.engine.runtime.async_engine import ENGINE_THREAD
    from tests.serving import in_process_server

    made: list[Scripted] = []

    def scripted(planned: int | None) -> Scripted:
        made.append(Scripted())
        return made[-1]

    monkeypatch.setattr(llm_module, "for_plan", scripted)
    with in_process_server(model="tiny:llada", dtype="float32", device="cpu", thread_governor=True) as client:
        response = client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 8, "steps": 8})
        assert response.status_code == 200, response.text
    [governor] = made
    assert len(governor.seen) >= 8
    assert {name for name, _ in governor.seen} == {ENGINE_THREAD}
    assert [t for _, t in governor.seen] == [1 + i % 2 for i in range(len(governor.seen))]


def test_no_thread_governor_has_no_governor(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--no-thread-governor` neither governs nor checks whether it could."""
    import dlm.engine.llm as llm_module
    from dlm.engine.llm import LLM

    monkeypatch.setattr(llm_module, "for_plan", lambda planned: pytest.fail("no governor was asked for"))
    monkeypatch.setattr(cpu_plan, "team_exact", lambda *args: pytest.fail("nothing to decide"))
    assert LLM("tiny:llada", dtype="float32", device="cpu", thread_governor=False).thread_governor is None


@pytest.mark.parametrize(
    ("distributed", "device", "planned", "words"),
    [
        (True, "cpu", 1, "tensor-parallel"),
        (False, "cuda", None, "cuda"),
        (False, "cpu", None, "no CPU thread plan"),
        (False, "cpu", 4, "every core (4)"),
    ],
)
def test_why_no_governor_names_each_reason(
    monkeypatch: pytest.MonkeyPatch, distributed: bool, device: str, planned: int | None, words: str
) -> None:
    monkeypatch.setattr(cpu_plan, "default_threads", lambda: 4)
    assert words in tg.why_no_governor(distributed, device, planned)


def test_a_governor_asked_for_but_not_possible_is_said_not_silent(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """`--thread-governor` where there is nothing to govern (here: the plan's threads are
    every core) is said, by the server's log and on the LLM (which `dlm generate` prints),
    rather than silently ignored; without the flag nothing is said."""
    from dlm.engine.llm import LLM
    from tests.serving import in_process_server

    monkeypatch.setattr(cpu_plan, "default_threads", lambda: 1)
    llm = LLM("tiny:llada", dtype="float32", device="cpu", thread_governor=True)
    assert llm.thread_governor is None
    assert llm.thread_governor_off is not None and "every core (1)" in llm.thread_governor_off
    assert LLM("tiny:llada", dtype="float32", device="cpu").thread_governor_off is None
    with (
        caplog.at_level("WARNING", logger="dlm.server"),
        in_process_server(model="tiny:llada", dtype="float32", device="cpu", thread_governor=True),
    ):
        pass
    assert any("thread_governor" in r.getMessage() and "every core" in r.getMessage() for r in caplog.records)


@pytest.mark.slow
def test_generate_says_the_governor_is_off_under_tensor_parallelism() -> None:
    """Each rank runs its forwards on the CPU plan's threads: `dlm generate -tp 2
    --thread-governor` says the flag has no effect there (it said nothing)."""
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "dlm", "generate", "tiny:llada", "--prompt-ids", "1,2", "--gen-length", "4"]
        + ["--dtype", "float32", "--tensor-parallel-size", "2", "--thread-governor"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "thread governor: off" in " ".join(result.stderr.split()), result.stderr


# --- on by default where switching cannot change an answer (`cpu_plan.team_exact`) ---

# A shape of its own: the plan cache of the test session is shared, keyed by the shape.
EXACT_SHAPE = cpu_plan.ModelShape(hidden=16, heads=2, kv_heads=2, head_dim=8, ffn=24, vocab=40)


def test_team_exact_compares_the_forwards_bits_at_both_counts_and_caches_the_verdict(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A forward whose result depends on the thread count is not exact; the verdict is
    measured once per machine and shape (a later call reads it, running nothing)."""
    runs: list[int] = []

    def by_count(shape: cpu_plan.ModelShape, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        runs.append(torch.get_num_threads())
        return torch.tensor([float(torch.get_num_threads())])

    monkeypatch.setattr(cpu_plan, "_layer_forward", by_count)
    monkeypatch.setattr(cpu_plan, "_few_rows", lambda tensors: [])
    before = torch.get_num_threads()
    assert cpu_plan.team_exact(EXACT_SHAPE, torch.float32, 1, 2) is False
    assert sorted(set(runs)) == [1, 2] and torch.get_num_threads() == before  # both counts ran, restored
    runs.clear()
    monkeypatch.setattr(cpu_plan, "_layer_forward", lambda shape, tensors: torch.zeros(1))
    assert cpu_plan.team_exact(EXACT_SHAPE, torch.float32, 1, 2) is False and runs == []  # the cached verdict
    assert cpu_plan.team_exact(EXACT_SHAPE, torch.float32, 1, 3) is True  # another team: measured again


def test_team_exact_also_compares_the_few_rows_a_steps_lm_head_runs_at(monkeypatch: pytest.MonkeyPatch) -> None:
    """The canvas-sized forward agreeing is not enough: MKL's fp32 GEMM on the AMD VM rounded
    the LM head differently at 1 and 2 threads at 5-11 rows only, so the governor, on by
    default there, changed logprobs run to run (tests/test_serve_infill_logprobs_n.py failed
    one run in two). The verdict covers the matmuls at each of those row counts."""
    seen: list[int] = []
    real = cpu_plan._few_rows

    def by_count(tensors: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        seen.append(len(tensors))
        return [torch.tensor([float(torch.get_num_threads())])]

    monkeypatch.setattr(cpu_plan, "_layer_forward", lambda shape, tensors: torch.zeros(1))
    monkeypatch.setattr(cpu_plan, "_few_rows", by_count)
    shape = cpu_plan.ModelShape(hidden=16, heads=2, kv_heads=2, head_dim=8, ffn=40, vocab=40)
    assert cpu_plan.team_exact(shape, torch.float32, 1, 2) is False and len(seen) == 2
    rows = real(cpu_plan._probe_inputs(shape, torch.float32))
    assert len(rows) == 6 * len(cpu_plan.EXACT_ROWS) and 5 in cpu_plan.EXACT_ROWS


def test_team_exact_runs_the_real_layer_and_a_count_against_itself_is_exact() -> None:
    """The probe itself is deterministic (fixed inputs, fp32 here): the same count twice gives
    the same bits, so a False verdict can only come from the thread count."""
    assert cpu_plan.team_exact(EXACT_SHAPE, torch.float32, 1, 1) is True
    assert isinstance(cpu_plan.team_exact(EXACT_SHAPE, torch.float32, 1, 2), bool)


def test_a_quantized_model_is_never_called_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe holds dense weights: it says nothing of a quantized model's kernels."""
    monkeypatch.setattr(cpu_plan, "_layer_forward", lambda shape, tensors: pytest.fail("nothing to run"))
    quantized = cpu_plan.ModelShape(16, 2, 2, 8, 24, 40, weights="int8")
    assert cpu_plan.team_exact(quantized, torch.float32, 1, 2) is False


@pytest.mark.parametrize(
    ("shape", "planned", "exact", "governed"),
    [
        (EXACT_SHAPE, 1, True, True),
        (EXACT_SHAPE, 1, False, False),
        (None, 1, True, False),  # no native layers to check (the transformers backend)
        (EXACT_SHAPE, None, True, False),  # no plan (not a CPU)
        (EXACT_SHAPE, 2, True, False),  # the plan already gives every core
    ],
)
def test_governs_by_default_only_with_a_team_to_choose_and_exact_forwards(
    monkeypatch: pytest.MonkeyPatch,
    shape: cpu_plan.ModelShape | None,
    planned: int | None,
    exact: bool,
    governed: bool,
) -> None:
    monkeypatch.setattr(cpu_plan, "default_threads", lambda: 2)
    monkeypatch.setattr(cpu_plan, "team_exact", lambda shape, dtype, threads, team: exact)
    assert tg.governs_by_default(shape, torch.float32, planned) is governed


@pytest.mark.parametrize(
    ("asked", "exact", "governed"),
    [(None, True, True), (None, False, False), (False, True, False), (True, False, True)],
)
def test_llm_governs_by_default_where_exact_and_as_asked_otherwise(
    monkeypatch: pytest.MonkeyPatch, asked: bool | None, exact: bool, governed: bool
) -> None:
    """`thread_governor` None (the default: `dlm serve`/`dlm generate` without the flag) turns
    the governor on where this CPU's forwards are exact at both counts; `--thread-governor` and
    `--no-thread-governor` decide regardless."""
    from dlm.engine.llm import LLM

    checked: list[tuple[int, int]] = []

    def team_exact(shape: cpu_plan.ModelShape, dtype: torch.dtype, threads: int, team: int) -> bool:
        checked.append((threads, team))
        return exact

    monkeypatch.setattr(cpu_plan, "default_threads", lambda: 2)
    monkeypatch.setattr(cpu_plan, "team_exact", team_exact)
    llm = LLM("tiny:llada", dtype="float32", device="cpu", thread_governor=asked)
    assert (llm.thread_governor is not None) is governed
    assert checked == ([(1, 2)] if asked is None else [])
    assert llm.thread_governor_off is None


def test_the_command_line_spells_auto_on_and_off() -> None:
    """`--thread-governor` / `--no-thread-governor` / neither (auto) reach the settings as
    True / False / None."""
    from dlm.cli.server.config import ServeConfig

    assert ServeConfig().thread_governor is None
    assert ServeConfig(thread_governor=False).thread_governor is False


@pytest.mark.parametrize("exact", [True, False])
def test_health_says_whether_the_thread_count_is_governed(monkeypatch: pytest.MonkeyPatch, exact: bool) -> None:
    """An operator sees whether the default turned the governor on (it depends on the CPU)."""
    from tests.serving import in_process_server

    monkeypatch.setattr(cpu_plan, "default_threads", lambda: 2)
    monkeypatch.setattr(cpu_plan, "team_exact", lambda shape, dtype, threads, team: exact)
    with in_process_server(model="tiny:llada", dtype="float32", device="cpu") as client:
        assert client.get("/health").json()["thread_governor"] is exact


# --- every family the registry decodes (`tiny_names`: a new family joins by itself) ---


@pytest.mark.parametrize("name", tiny_names())
def test_every_family_keeps_its_ids_with_the_count_switched_every_step(name: str) -> None:
    """Compared in fp32: each family's ids through `LLM.generate` with the thread count
    switched every step equal those at the plan's count (the default turns the governor on
    for any family whose forwards `cpu_plan.team_exact` calls exact), and each step after the
    first ran with the count set after the one before it."""
    from dlm.engine.llm import LLM

    llm = LLM(f"tiny:{name}", dtype="float32", device="cpu", thread_governor=False)
    prompt = [5, 6, 7, 8]
    plain = llm.generate(prompt, gen_length=16)[0].output_ids
    scripted = Scripted()
    llm.thread_governor = scripted
    assert llm.generate(prompt, gen_length=16)[0].output_ids == plain
    assert scripted.seen and [t for _, t in scripted.seen] == [1 + i % 2 for i in range(len(scripted.seen))]

    assert {thread for thread, _ in scripted.seen} == {threading.current_thread().name}


@pytest.mark.parametrize("name", tiny_names())
def test_every_family_is_served_the_same_ids_with_the_count_switched_on_the_engine_thread(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """Compared in fp32: `dlm serve` (and `dlm batch`, which answers through the same server)
    sets the governor's count on the engine thread before each step of every family's
    engine, and the ids it serves equal those of a server without the governor."""
    import dlm.engine.llm as llm_module
    from dlm.engine.runtime.async_engine import ENGINE_THREAD
    from tests.serving import in_process_server

    made: list[Scripted] = []

    def scripted(planned: int | None) -> Scripted:
        made.append(Scripted())
        return made[-1]

    monkeypatch.setattr(llm_module, "for_plan", scripted)
    body = {"prompt": [5, 6, 7], "max_tokens": 16, "seed": 1, "return_token_ids": True}
    answers = []
    for governed in (False, True):
        settings = {"model": f"tiny:{name}", "dtype": "float32", "device": "cpu", "thread_governor": governed}
        with in_process_server(**settings) as client:
            response = client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            answers.append(response.json()["choices"][0]["token_ids"])
    assert answers[1] == answers[0]
    [governor] = made
    assert governor.seen and {thread for thread, _ in governor.seen} == {ENGINE_THREAD}
    assert [t for _, t in governor.seen] == [1 + i % 2 for i in range(len(governor.seen))]


@pytest.mark.parametrize("name", tiny_names())
def test_dlm_batch_governs_by_default_on_the_engine_thread(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, name: str
) -> None:
    """`dlm batch` (no governor flag: auto) turns the governor on where the default would, as
    `dlm serve` does, and its server applies the count on the engine thread before each step
    of every family's engine (in process: the default decided as on an exact CPU)."""
    import json

    import dlm.engine.llm as llm_module
    from dlm.engine.runtime.async_engine import ENGINE_THREAD
    from tests.weights_helpers import cli

    made: list[Scripted] = []

    def scripted(planned: int | None) -> Scripted:
        made.append(Scripted())
        return made[-1]

    monkeypatch.setattr(llm_module, "governs_by_default", lambda shape, dtype, planned: True)
    monkeypatch.setattr(llm_module, "for_plan", scripted)
    body = {"prompt": [5, 6, 7], "max_tokens": 8, "seed": 1}
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"custom_id": "q", "method": "POST", "url": "/v1/completions", "body": body}) + "\n")
    code, _, stderr = cli("batch", str(source), str(tmp_path / "out.jsonl"), "--model", f"tiny:{name}")
    assert code == 0, stderr
    assert json.loads((tmp_path / "out.jsonl").read_text())["response"]["status_code"] == 200
    [governor] = made
    assert governor.seen and {thread for thread, _ in governor.seen} == {ENGINE_THREAD}
    assert [t for _, t in governor.seen] == [1 + i % 2 for i in range(len(governor.seen))]
