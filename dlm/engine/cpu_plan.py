"""How a model runs on this CPU: its dtype (`--dtype auto`) and its intra-op thread count,
decided by timing a forward of the model's own shape once per machine, cached under $DLM_HOME.

Neither can be guessed from the CPU's flags. With AVX512-BF16/AMX a bf16 matmul is several
times an fp32 one at a 1024-wide layer, yet the 128-wide default model runs 1.3-1.5x slower in
bf16: at small shapes the casts around the norms and the elementwise work outweigh the
matmuls. Threads likewise: torch's OpenMP team (libgomp) synchronises at every parallel
region, and its idle threads spin-wait between regions; on a machine whose other cores are
busy (other processes, or this server's own event loop) a spinning teammate and the work it
waits for fight for the same cores: a two-thread team ran the default model's steps 9-18x
slower than one thread on this project's shared, loaded 2-core VM.

So the candidates (fp32 and, where the CPU computes it natively, bf16; one thread and a team
of every core but one, `max_team`) are timed on the model itself: `LLM` passes a timer that
runs the engine's own request on the model loaded in each dtype (dlm/engine/llm.py); a model
too large to hold twice (`MODEL_PROBE_MAX_BYTES`) is judged by one decoder layer of its shape
(`layer_timer`: norm, packed QKV, bidirectional attention, output projection, SwiGLU MLP,
LM head). Candidates alternate in rounds so that a busy neighbour slows all alike; the best
time of each counts. A candidate replaces the simpler one (fp32, one thread) only when it is
faster by a margin (`BF16_MIN_SPEEDUP`, `THREADS_MIN_SPEEDUP`): within it the simpler one is as
fast, fp32 is exact where bf16 rounds, and a team costs cores other work could use.

The result is cached in `$DLM_HOME/cpu_plan.json`, keyed by the CPU (model name, flags),
torch's version, the default thread count, the shape and how linear weights are held
(dlm/kernels/packed_linear.py): the next load of the same model on
the same machine reads it (delete the file to measure again). Tests replace `_forward_seconds`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, replace
from functools import cache
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from dlm.engine.home import dlm_home
from dlm.kernels import dispatch

log = logging.getLogger("dlm.engine")

# bf16 must beat fp32 by this factor to be chosen. Below it fp32 is nearly as fast and exact,
# and costs less memory: bf16 matmuls on a CPU go through oneDNN, whose per-shape kernels stay
# resident (a server of the default model grew 150-190 MiB over 32 requests in bf16, 13 MiB
# in fp32; docs/serve.md#memory).
BF16_MIN_SPEEDUP = 1.2
# More threads must beat one by this factor: a team costs a core the rest of the process
# (the server's event loop) and the machine's other work could use.
THREADS_MIN_SPEEDUP = 1.15
PROBE_TOKENS = 64  # rows of the probe forward: a short canvas (prompt + a 32-64 token block)
PROBE_ROUNDS = 5
CACHE_FILE = "cpu_plan.json"
# The loaded model is timed itself (held in both dtypes for a moment) up to this many bytes of
# checkpoint; a larger one is judged by one layer of its shape.
MODEL_PROBE_MAX_BYTES = 2 * 2**30
# `team_exact` also checks a batch of this many probe canvases: how a kernel splits a matmul
# over its threads depends on the rows.
EXACT_BATCH = 4
# ... with the LM head cut to this many rows of the vocabulary: its reduction (the hidden size)
# is what a thread split could reorder; fewer output columns leave a kernel less to split
# between threads but the reduction, so the check only gets stricter, and an 8B-shaped check
# takes seconds instead of tens.
EXACT_VOCAB = 4096
# ... and each of its matmuls at these few rows: a step decides a handful of positions, whose
# LM head (the tokens' statistics, their logprobs) runs at that many rows, and MKL's fp32 GEMM
# on the AMD Zen 4 VM rounds differently at 1 and 2 threads at 5-11 rows where 1-4, 64 and 256
# agree (oneDNN's bf16 agrees at every count tried).
EXACT_ROWS = (*range(1, 13), 31)


@dataclass(frozen=True)
class ModelShape:
    """The dimensions that decide a forward's cost per layer."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    # The linear layers' weights: "dense" (the dtype's) or a quantization method
    # (dlm/engine/quantization.py). Plans are cached per format: the loaded model is timed in
    # its own (a model too large for that has one layer timed, dense).
    weights: str = "dense"

    @classmethod
    def of(cls, config: Any) -> ModelShape:
        """From a `ModelConfig` (an MoE layer is timed as a dense one of its expert width)."""
        ffn = config.intermediate_size or (config.moe.expert_ffn if config.moe is not None else config.hidden_size)
        return cls(config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim, ffn, config.logits_size)

    @property
    def key(self) -> str:
        return "x".join(str(v) for v in asdict(self).values())


@dataclass(frozen=True)
class Candidate:
    dtype: torch.dtype
    threads: int

    @property
    def name(self) -> str:
        return f"{str(self.dtype).removeprefix('torch.')}/{self.threads}t"


@dataclass(frozen=True)
class CpuPlan:
    """The dtype and threads a model runs in on this CPU, the candidates' probe seconds
    (name -> best seconds) and whether they came from the cache."""

    dtype: torch.dtype
    threads: int
    seconds: dict[str, float]
    cached: bool

    def ratio(self, slow: Candidate, fast: Candidate) -> float | None:
        """slow's time over fast's, where both were measured."""
        a, b = self.seconds.get(slow.name), self.seconds.get(fast.name)
        return None if a is None or b is None or b <= 0 else a / b


Timer = Callable[["Candidate"], float]  # seconds of one forward in a candidate's dtype


@cache
def default_threads() -> int:
    """torch's intra-op thread count as the process started (OMP_NUM_THREADS, else the
    cores), read once before dlm changes it: the largest team a plan may choose."""
    return max(1, torch.get_num_threads())


def machine_key() -> str:
    """The CPU (model name and flags), torch's version and the default thread count."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        info = ""
    lines = [line for line in info.splitlines() if line.split(":")[0].strip() in ("model name", "flags", "Features")]
    cpu = "\n".join(sorted(set(lines)))
    digest = hashlib.sha256(f"{cpu}\n{torch.__version__}\n{default_threads()}".encode()).hexdigest()
    return digest[:16]


def _probe_inputs(shape: ModelShape, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    d, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim

    def rand(*size: int) -> torch.Tensor:
        return (torch.randn(*size, generator=g) / math.sqrt(size[-1])).to(dtype)

    linear = dispatch.prepare_linear_weight  # held as the loaded model's layers hold them
    return {
        "x": rand(1, PROBE_TOKENS, d),
        "norm": torch.ones(d, dtype=dtype),
        "qkv": linear(rand(q + 2 * kv, d)),
        "out": linear(rand(d, q)),
        "gate_up": linear(rand(2 * shape.ffn, d)),
        "down": linear(rand(d, shape.ffn)),
        "head": rand(shape.vocab, d),
    }


def _rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """As the models compute it: statistics in fp32, back in the model's dtype."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype) * weight


@torch.inference_mode()
def _layer_forward(shape: ModelShape, t: dict[str, torch.Tensor]) -> torch.Tensor:
    """One bidirectional decoder layer and the LM head at the model's dimensions."""
    x = t["x"]
    b, n, _ = x.shape
    q_size, kv_size = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    q, k, v = F.linear(_rms_norm(x, t["norm"]), t["qkv"]).split([q_size, kv_size, kv_size], dim=-1)
    q = q.view(b, n, shape.heads, shape.head_dim).transpose(1, 2)
    k = k.view(b, n, shape.kv_heads, shape.head_dim).transpose(1, 2)
    v = v.view(b, n, shape.kv_heads, shape.head_dim).transpose(1, 2)
    if shape.kv_heads != shape.heads:
        k = k.repeat_interleave(shape.heads // shape.kv_heads, dim=1)
        v = v.repeat_interleave(shape.heads // shape.kv_heads, dim=1)
    attn = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, q_size)
    x = x + F.linear(attn, t["out"])
    gate, up = F.linear(_rms_norm(x, t["norm"]), t["gate_up"]).split([shape.ffn, shape.ffn], dim=-1)
    x = x + F.linear(F.silu(gate) * up, t["down"])
    return F.linear(_rms_norm(x, t["norm"]), t["head"]).float().softmax(-1)


def layer_timer(shape: ModelShape) -> Timer:
    """Times one layer-shaped forward (`_layer_forward`) per candidate: the probe for a model
    too large to hold in two dtypes at once."""
    inputs: dict[torch.dtype, dict[str, torch.Tensor]] = {}

    def seconds(candidate: Candidate) -> float:
        tensors = inputs.get(candidate.dtype)
        if tensors is None:
            tensors = inputs[candidate.dtype] = _probe_inputs(shape, candidate.dtype)
        start = time.perf_counter()
        _layer_forward(shape, tensors)
        return time.perf_counter() - start

    return seconds


def _forward_seconds(timer: Timer, candidate: Candidate) -> float:
    """Seconds of one timed forward under `candidate` (its threads set on this thread)."""
    torch.set_num_threads(candidate.threads)
    return timer(candidate)


def measure(timer: Timer, candidates: Iterable[Candidate]) -> dict[str, float]:
    """Best seconds of each candidate's timed forward, alternated in rounds; the calling
    thread's thread count is restored afterwards."""
    candidates = list(candidates)
    before = torch.get_num_threads()
    best = {c.name: math.inf for c in candidates}
    try:
        for c in candidates:  # first call: kernel selection, packing buffers, the team's threads
            _forward_seconds(timer, c)
        for _ in range(PROBE_ROUNDS):
            for c in candidates:
                best[c.name] = min(best[c.name], _forward_seconds(timer, c))
    finally:
        torch.set_num_threads(before)
    return best


def _cache_path() -> Path:
    return dlm_home() / CACHE_FILE


def _read_cache() -> dict[str, Any]:
    try:
        data = json.loads(_cache_path().read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_cache(key: str, entry: dict[str, Any]) -> None:
    """Merge one entry into the cache file (written whole and renamed: a reader never sees
    half a file); a cache that cannot be written only means measuring again next time."""
    data = _read_cache()
    data[key] = entry
    path = _cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        tmp.replace(path)
    except OSError as exc:
        log.warning("could not write the CPU plan cache %s: %s", path, exc)


def max_team() -> int:
    """The largest intra-op team a plan may choose: every core but one. The server's event
    loop and request preparation need a core beside the forwards, and a team whose spinning
    threads share cores with other work slows tens of times (the module docstring)."""
    return max(1, default_threads() - 1)


def candidates_for(dtypes: Iterable[torch.dtype]) -> list[Candidate]:
    counts = sorted({1, max_team()})
    return [Candidate(dtype, n) for dtype in dtypes for n in counts]


def plan(shape: ModelShape, dtypes: Iterable[torch.dtype], timer: Timer | None = None) -> CpuPlan:
    """The fastest of `dtypes` x {1, default threads} for `shape`, measured or cached; the
    first dtype listed is the plain one (fp32) the others must beat by BF16_MIN_SPEEDUP.
    `timer` times the loaded model's own forward (`LLM` passes one where the model fits in
    memory twice); without it, one layer of the shape is timed."""
    wanted = candidates_for(dtypes)
    if len(wanted) == 1:  # nothing to choose between
        return CpuPlan(wanted[0].dtype, wanted[0].threads, {}, False)
    kind = "layer" if timer is None else "model"
    # How the candidates' linear weights are held (a plan timed before bf16 weights were
    # packed does not describe the packed model).
    layouts = "+".join(dispatch.linear_layout(d, torch.device("cpu")) for d in dict.fromkeys(c.dtype for c in wanted))
    key = f"{machine_key()}/{shape.key}/{kind}/{layouts}"
    cached = _read_cache().get(key)
    names = {c.name for c in wanted}
    if isinstance(cached, dict) and names <= set(cached):
        seconds, hit = {n: float(cached[n]) for n in names}, True
    else:
        seconds, hit = measure(timer or layer_timer(shape), wanted), False
        _write_cache(key, {**(cached if isinstance(cached, dict) else {}), **seconds})
    dtype = _pick_dtype(wanted, seconds)
    threads = _pick_threads([c for c in wanted if c.dtype == dtype], seconds)
    return CpuPlan(dtype, threads, seconds, hit)


def _best_threads_time(candidates: list[Candidate], seconds: dict[str, float]) -> float:
    return min(seconds[c.name] for c in candidates)


def _pick_dtype(candidates: list[Candidate], seconds: dict[str, float]) -> torch.dtype:
    plain = candidates[0].dtype
    best_plain = _best_threads_time([c for c in candidates if c.dtype == plain], seconds)
    choice, choice_time = plain, best_plain
    for dtype in dict.fromkeys(c.dtype for c in candidates if c.dtype != plain):
        t = _best_threads_time([c for c in candidates if c.dtype == dtype], seconds)
        if best_plain / t >= BF16_MIN_SPEEDUP and t < choice_time:
            choice, choice_time = dtype, t
    return choice


def _pick_threads(candidates: list[Candidate], seconds: dict[str, float]) -> int:
    one = next(c for c in candidates if c.threads == 1)
    choice = one
    for c in candidates:
        if c.threads > 1 and seconds[one.name] / seconds[c.name] >= THREADS_MIN_SPEEDUP:
            choice = c if seconds[c.name] < seconds[choice.name] else choice
    return choice.threads


@torch.inference_mode()
def _few_rows(tensors: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """The layer's linears at each of `EXACT_ROWS` rows, and the LM head as a step's logprobs
    take it (`hidden @ weight.T`, then a float log-softmax); the same inputs on every call."""
    g = torch.Generator().manual_seed(1)
    outputs = []
    for rows in EXACT_ROWS:
        for name in ("qkv", "out", "gate_up", "down", "head"):
            weight = tensors[name]
            x = (torch.randn(rows, weight.shape[1], generator=g) / math.sqrt(weight.shape[1])).to(weight.dtype)
            outputs.append(F.linear(x, weight))
        outputs.append(torch.log_softmax((x @ tensors["head"].T).float(), dim=-1))
    return outputs


def team_exact(shape: ModelShape, dtype: torch.dtype, threads: int, team: int) -> bool:
    """Whether forwards of `shape` in `dtype` give the same bits with `threads` and with `team`
    intra-op threads, measured once per machine and cached beside the plans.

    Why: the thread governor (dlm/engine/runtime/thread_governor.py) switches between the two
    counts step by step, and where a kernel splits a reduction by its thread count a step's
    logits, so possibly a token, depend on the count it ran with. That is a property of the CPU
    and its libraries, not of torch: on the Intel AMX VM oneDNN's bf16 matmuls with a long
    reduction (the 104M model's 2816-wide down projection) and MKL's fp32 ones differed between
    1 and 2 threads; on the AMD Zen 4 VM no shape did, nor the 104M and default models' answers.
    Checked on one layer of the shape with its linear weights held as the model holds them
    (`_layer_forward`: norm, QKV, attention, output projection, SwiGLU MLP, LM head) at a short
    canvas and at a batch of `EXACT_BATCH` (the LM head cut to `EXACT_VOCAB` rows), and each of
    its matmuls at the few rows a step's LM head runs at (`EXACT_ROWS`): the shapes and kernels
    of the model's steps, not a proof for every row count. A quantized model's
    linears are not what the probe runs: never exact here."""
    if shape.weights != "dense":
        return False
    layout = dispatch.linear_layout(dtype, torch.device("cpu"))
    key = f"{machine_key()}/{shape.key}/exact-rows/{layout}/{str(dtype).removeprefix('torch.')}/{threads}-{team}"
    cached = _read_cache().get(key)
    if isinstance(cached, dict) and isinstance(cached.get("exact"), bool):
        return bool(cached["exact"])
    probe = replace(shape, vocab=min(shape.vocab, EXACT_VOCAB))
    tensors = _probe_inputs(probe, dtype)
    batch = {**tensors, "x": torch.cat([tensors["x"].roll(i, dims=1) for i in range(EXACT_BATCH)])}
    before = torch.get_num_threads()
    try:
        outputs = []
        for count in (threads, team):
            torch.set_num_threads(count)
            outputs.append([_layer_forward(probe, t) for t in (tensors, batch)] + _few_rows(tensors))
    finally:
        torch.set_num_threads(before)
    exact = all(torch.equal(a, b) for a, b in zip(*outputs))
    _write_cache(key, {"exact": exact})
    return exact


def apply_threads(threads: int) -> None:
    """Run this thread's torch ops (and those of threads started later) with `threads`
    intra-op threads. Called on the thread that runs the model's forwards: the OpenMP
    thread count is a per-thread setting (torch's global count only seeds new threads)."""
    torch.set_num_threads(threads)
