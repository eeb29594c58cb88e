"""Tensor and expert parallelism across processes on torch.distributed: launch, lockstep, failure.

One model is split over `tensor_parallel_size` ranks (processes; one per GPU with NCCL, or
CPU processes with gloo). Every rank builds the same engine over its shard. Rank 0, the
driver, owns scheduling: requests reach it alone, it validates them, and before each step it
broadcasts the step's new work (the requests admitted since the last step) over a gloo
control group. Every rank then runs the same `step()`: the same batch, the same forward with
the layers' collectives (`dlm/engine/parallel/state.py`), the same combined LM-head statistics,
hence the same commits. Decisions therefore never need to be sent back; the only traffic is
the small step messages, the layers' all-reduces and the few statistics per decided row.
Sampling stays identical on every rank because each request carries a seed (rank 0 draws
one when neither the request nor its family's defaults give one: DiffusionGemma's default
seed is kept, as in a single process) and the noise of a token depends only on (seed, row, id).

Launch: on one node `start_driver` spawns ranks 1..N-1 itself (torch.multiprocessing,
spawn). Across nodes every node runs the same command with `--nnodes`, `--node-rank`,
`--master-addr`, `--master-port` (node 0 hosts the driver and spawns its other local ranks;
other nodes call `serve_worker`), or torchrun starts one process per rank and the torchrun
variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) take precedence.

Failure: init and every collective have a timeout (`timeout_s`), so a hung rank fails the
group instead of hanging it; a dead rank breaks its connections, so collectives fail at once.
The driver watches the ranks it spawned: a failure names the rank that died and how, at once
to a listener (`DistributedEngine.on_failure`: a server idles between requests, so no
collective would notice), and a watchdog ends the driver process if it is not already
failing a few seconds later. A group that failed runs no more steps (`EngineFailed`).
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from dlm.engine.errors import DlmError, EngineFailed, UsageError
from dlm.engine.parallel import state as parallel_state
from dlm.engine.params import GenerationParams, ResolvedParams
from dlm.engine.runtime.interface import Engine
from dlm.engine.runtime.request import RequestState

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
TIMEOUT_VAR = "DLM_DIST_TIMEOUT"  # seconds: overrides `timeout_s` (init and each collective)
CONTROL_TIMEOUT = timedelta(days=365)  # a worker's wait for the driver's next step
WATCHDOG_GRACE_S = 5.0  # after a spawned rank dies, how long the driver may take to fail by itself


@dataclass(frozen=True)
class ParallelConfig:
    """How one model is split and where its ranks are. Unset fields come from the torchrun
    variables or defaults (`resolved`)."""

    tensor_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    moe: str = "auto"  # auto | ep (experts split over ranks) | tp (every expert split)
    timeout_s: float = 600.0  # process-group init and each collective
    load_timeout_s: float = 3600.0  # the wait for every rank to finish loading its shard

    def resolved(self) -> ParallelConfig:
        """Validate, taking the torchrun variables when they are set (then each process is
        one rank; the group size is WORLD_SIZE)."""
        env = os.environ
        config = self
        if TIMEOUT_VAR in env:
            config = replace(config, timeout_s=float(env[TIMEOUT_VAR]))
        if all(v in env for v in TORCHRUN_VARS):
            world = int(env["WORLD_SIZE"])
            if self.tensor_parallel_size not in (1, world):
                raise UsageError(
                    f"--tensor-parallel-size {self.tensor_parallel_size} differs from torchrun's WORLD_SIZE {world}"
                )
            config = replace(
                config,
                tensor_parallel_size=world,
                master_addr=env.get("MASTER_ADDR", self.master_addr),
                master_port=int(env["MASTER_PORT"]) if "MASTER_PORT" in env else self.master_port,
            )
        if config.tensor_parallel_size < 1:
            raise UsageError(f"--tensor-parallel-size must be at least 1, got {config.tensor_parallel_size}")
        if config.nnodes < 1 or config.tensor_parallel_size % config.nnodes:
            raise UsageError(
                f"--nnodes {config.nnodes} must divide --tensor-parallel-size {config.tensor_parallel_size}"
            )
        if not 0 <= config.node_rank < config.nnodes:
            raise UsageError(f"--node-rank must be in 0..{config.nnodes - 1}, got {config.node_rank}")
        if config.moe not in parallel_state.MOE_MODES:
            raise UsageError(f"--moe-parallel must be one of {', '.join(parallel_state.MOE_MODES)}, got {config.moe!r}")
        if config.timeout_s <= 0:
            raise UsageError(f"the collective timeout must be positive, got {config.timeout_s}")
        if config.master_port is not None and not 1 <= config.master_port <= 65535:
            raise UsageError(f"--master-port must be a port in 1..65535, got {config.master_port}")
        if config.master_addr is not None and not config.master_addr.strip():  # an unset "$ADDR": no address
            raise UsageError("--master-addr is empty: give node 0's address (or leave it out on one node)")
        if config.nnodes > 1 and not torchrun() and (config.master_addr is None or config.master_port is None):
            raise UsageError("multi-node runs need --master-addr and --master-port (node 0's address)")
        return config

    @property
    def parallel(self) -> bool:
        return self.tensor_parallel_size > 1

    @property
    def ranks_per_node(self) -> int:
        return self.tensor_parallel_size // self.nnodes


def torchrun() -> bool:
    """Whether torchrun (or an equivalent launcher) started this process as one rank."""
    return all(v in os.environ for v in TORCHRUN_VARS)


@dataclass(frozen=True)
class Place:
    """One rank: its global and node-local index and the rendezvous address."""

    rank: int
    world: int
    local_rank: int
    addr: str
    port: int


def this_process(config: ParallelConfig) -> Place:
    """The rank this process plays: torchrun's RANK, else the node's first rank."""
    if torchrun():
        env = os.environ
        return Place(
            int(env["RANK"]),
            int(env["WORLD_SIZE"]),
            int(env["LOCAL_RANK"]),
            config.master_addr or "127.0.0.1",
            int(config.master_port or 29500),
        )
    port = config.master_port if config.master_port is not None else _free_port()
    return Place(
        config.node_rank * config.ranks_per_node,
        config.tensor_parallel_size,
        0,
        config.master_addr or "127.0.0.1",
        port,
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class EngineSpec:
    """What every rank loads (picklable: it crosses to the spawned ranks)."""

    model_dir: str
    dtype: str = "auto"
    device: str = "auto"
    gpu_memory_utilization: float | None = None  # each rank's ceiling on its GPU
    quantization: str | None = None  # each rank quantizes the shard it reads
    kv_cache_dtype: str = "auto"  # each rank's K/V caches of its heads (quantization.KV_CACHE_DTYPES)


def rank_device(device: str, local_rank: int) -> torch.device:
    """One GPU per rank on a node (cuda:LOCAL_RANK); CPU ranks share the CPU."""
    from dlm.engine.device import resolve_device

    resolved = resolve_device(device)
    return torch.device("cuda", local_rank) if resolved.type == "cuda" else resolved


@dataclass
class Group:
    """This process's membership: the tensor group is the default group (NCCL on CUDA,
    gloo on CPU); `control` is a gloo group for the driver's step messages."""

    place: Place
    backend: str
    control: Any
    threads: int  # this process's torch threads before joining (restored on leaving)


def join(place: Place, config: ParallelConfig, device: torch.device) -> Group:
    """Initialise the process group for `place` and make it this process's TP state."""
    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"
    threads = torch.get_num_threads()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        # Ranks of one node share its cores (and a test may run more ranks than cores).
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // config.ranks_per_node))
    dist.init_process_group(
        backend,
        init_method=f"tcp://{place.addr}:{place.port}",
        rank=place.rank,
        world_size=place.world,
        timeout=timedelta(seconds=config.timeout_s),
    )
    # Each process sets its own side's timeout. A worker waits for the driver's next step however
    # idle it is; the driver's send waits until each rank takes the message (gloo hands it over
    # only then), so a rank stopped outside a collective must fail it like any other.
    control_timeout = timedelta(seconds=config.timeout_s) if place.rank == 0 else CONTROL_TIMEOUT
    control = dist.new_group(backend="gloo", timeout=control_timeout)
    parallel_state.set_state(parallel_state.TPState(place.rank, place.world, dist.group.WORLD, config.moe))
    return Group(place, backend, control, threads)


def leave(group: Group | None = None) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    parallel_state.set_state(parallel_state.TPState())
    if group is not None:
        torch.set_num_threads(group.threads)


def _loaded_barrier(group: Group, config: ParallelConfig) -> None:
    """Wait until every rank has its shard; names a rank that does not get there."""
    import torch.distributed as dist

    dist.monitored_barrier(group=group.control, timeout=timedelta(seconds=config.load_timeout_s))


def _broadcast(group: Group, message: Any) -> Any:
    import torch.distributed as dist

    box = [message]
    dist.broadcast_object_list(box, src=0, group=group.control)
    return box[0]


@dataclass
class Step:
    """The driver's message before each step. `new`: sequences made since the last step
    (request id, prompt ids, params); `running`: the ids of the running set, in order, as
    the driver's engine holds it now (however it got there: `add_request`, a scheduler
    admitting or aborting requests), so every rank steps the same sequences; `forget`:
    ids the driver dropped without running them (a waiting request that was cancelled);
    `stop` ends the workers."""

    new: list[tuple[int, list[int], GenerationParams]] = field(default_factory=list)
    running: list[int] = field(default_factory=list)
    forget: list[int] = field(default_factory=list)
    stop: bool = False


def _build(spec: EngineSpec, device: torch.device) -> Engine:
    from dlm.engine.dtype import checkpoint_dtype, choose_dtype
    from dlm.engine.runtime.engine import cap_device_memory, load_engine

    cap_device_memory(device, spec.gpu_memory_utilization)
    dtype = choose_dtype(spec.dtype, device, checkpoint_dtype(spec.model_dir)).dtype
    return load_engine(
        spec.model_dir, dtype, device, quantization=spec.quantization, kv_cache_dtype=spec.kv_cache_dtype
    )


def worker_loop(engine: Engine, group: Group) -> None:
    """A non-driver rank: mirror each step message's running set (admissions, aborts), run
    the step, until told to stop. A sequence that left the running set unfinished was
    aborted by the driver."""
    seqs: dict[int, RequestState] = {}
    running: list[int] = []
    while True:
        message: Step = _broadcast(group, None)
        if message.stop:
            return
        for rid, prompt_ids, params in message.new:
            seqs[rid] = engine.make_sequence(prompt_ids, params)
        for rid in set(running) - set(message.running):
            seq = seqs.pop(rid)
            if not seq.finished:
                engine.abort(seq)
        for rid in message.forget:
            seqs.pop(rid, None)
        for rid in message.running:
            if rid not in running:  # admitted since the last step: appended, as on the driver
                engine.add(seqs[rid])
        running = message.running
        if [s.seq_id for s in engine.running] != [seqs[rid].seq_id for rid in running]:
            raise RuntimeError("this rank's running set is out of step with the driver's")
        engine.step()


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by signal {-code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class SpawnedRanks:
    """The ranks this process started on its node, watched by a thread.

    When one dies before `close`, its description is kept for the error, and if the driver
    has not failed by itself `WATCHDOG_GRACE_S` later (a collective that does not notice,
    a driver busy elsewhere), the watchdog prints the error and ends the process: a dead
    rank never leaves a silent hang."""

    def __init__(self, spec: EngineSpec, config: ParallelConfig, first: Place, count: int) -> None:
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.processes: dict[int, Any] = {}
        for local in range(1, count):
            place = replace(first, rank=first.rank + local, local_rank=local)
            p = ctx.Process(target=_rank_main, args=(spec, config, place), daemon=True, name=f"dlm-tp-rank{place.rank}")
            p.start()
            self.processes[place.rank] = p
        self.failure: str | None = None
        self.failing = False  # set once the driver reports the failure itself
        self.on_failure: Callable[[str], None] | None = None  # told of a death at once
        self.closing = False
        self._thread = threading.Thread(target=self._watch, daemon=True, name="dlm-tp-watchdog")
        self._thread.start()

    def _watch(self) -> None:
        while not self.closing:
            dead = [(rank, p) for rank, p in self.processes.items() if p.exitcode is not None]
            if dead and not self.closing:
                # A rank killed by a signal is the cause; ranks exiting with an error in the
                # same instant are usually its peers reporting the broken connection.
                rank, p = min(dead, key=lambda item: (item[1].exitcode >= 0, item[0]))
                self.failure = f"tensor-parallel rank {rank} (pid {p.pid}) {_describe_exit(p.exitcode)}"
                if self.on_failure is not None:
                    self.on_failure(self.failure)
                deadline = time.monotonic() + WATCHDOG_GRACE_S
                while time.monotonic() < deadline and not self.failing:
                    time.sleep(0.05)
                if not self.failing and not self.closing:
                    sys.stderr.write(f"error: {self.failure}\n")
                    sys.stderr.flush()
                    self.terminate()
                    os._exit(1)
                return
            time.sleep(0.1)

    def stopped(self) -> str | None:
        """A live rank that is not running (stopped by a signal or a debugger), named, else
        None. Read from /proc (Linux only): a rank hung while running (a deadlock, a slow
        device) cannot be told from a slow one, so only this kind of hang gets a name."""
        for rank, p in self.processes.items():
            try:
                with open(f"/proc/{p.pid}/stat") as stat:
                    state = stat.read().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if state in ("T", "t"):
                return f"tensor-parallel rank {rank} (pid {p.pid}) is stopped (SIGSTOP or a debugger)"
        return None

    def terminate(self) -> None:
        self.closing = True
        for p in self.processes.values():
            if p.is_alive():
                p.kill()

    def wait(self) -> None:
        """Wait for the ranks to finish (after a stop message): their exits are expected."""
        self.closing = True
        for p in self.processes.values():
            p.join()


def _follow_driver(spec: EngineSpec, config: ParallelConfig, place: Place) -> Group:
    """What every worker rank does, however it was started: join the group, load its shard,
    run the driver's steps until the driver stops the group."""
    device = rank_device(spec.device, place.local_rank)
    group = join(place, config, device)
    engine = _build(spec, device)
    _loaded_barrier(group, config)
    worker_loop(engine, group)
    return group


def _rank_main(spec: EngineSpec, config: ParallelConfig, place: Place) -> None:
    """Entry point of a spawned rank (and of a torchrun rank other than 0)."""
    try:
        _follow_driver(spec, config, place)
        leave()
    except Exception as exc:  # noqa: BLE001 - a rank reports any failure by name, then exits
        # Not an `error:` line: the driver prints the one error of the command.
        sys.stderr.write(f"tensor-parallel rank {place.rank} stopped: {exc}\n")
        sys.stderr.flush()
        os._exit(1)


class Deadline:
    """The driver's backstop: a thread that ends the process (after killing the ranks it
    spawned) when an armed deadline passes, whatever the driver is blocked in. Collectives
    have their own timeouts; this covers anything that does not time out by itself."""

    def __init__(self, spawned: SpawnedRanks | None) -> None:
        self.spawned = spawned
        self._at: float | None = None
        self._what = ""
        threading.Thread(target=self._watch, daemon=True, name="dlm-tp-deadline").start()

    def arm(self, seconds: float, what: str) -> None:
        self._what, self._at = what, time.monotonic() + seconds

    def disarm(self) -> None:
        self._at = None

    def _watch(self) -> None:
        while True:
            time.sleep(0.2)
            at = self._at
            if at is not None and time.monotonic() > at:
                hung = self.spawned.stopped() if self.spawned is not None else None
                sys.stderr.write(f"error: {self._what}{f': {hung}' if hung else ''}\n")
                sys.stderr.flush()
                if self.spawned is not None:
                    self.spawned.terminate()
                os._exit(1)


class DistributedEngine(Engine):
    """The driver's view of the group (satisfies `Engine`): the local engine's model and
    running set, with sequences made here mirrored to every rank before each step."""

    path: str | None = None  # native engines only
    max_num_seqs: int | None = None

    def __init__(self, engine: Engine, group: Group, spawned: SpawnedRanks | None, timeout_s: float) -> None:
        self.engine, self.group, self.spawned, self.timeout_s = engine, group, spawned, timeout_s
        self.config, self.loaded, self.warmup_params = engine.config, engine.loaded, engine.warmup_params
        self._pending: list[tuple[int, list[int], GenerationParams]] = []
        self._ids: dict[int, tuple[int, RequestState]] = {}  # id(sequence) -> (request id, sequence)
        self._next_id = 0
        self._lock = threading.Lock()  # a server makes sequences on its event loop during steps
        self._closed = False
        self._failure: EngineFailed | None = None  # the group is down: no collective may run
        self._deadline = Deadline(spawned)

    @property
    def running(self) -> list[RequestState]:
        """The local engine's running set: the one list (each step message copies its order)."""
        return self.engine.running

    @property
    def tensor_parallel_size(self) -> int:
        return self.group.place.world

    @property
    def capabilities(self) -> tuple[str, ...]:
        return self.engine.capabilities

    def reproducible(self, params: ResolvedParams) -> bool:
        return self.engine.reproducible(params)

    def validate(self, params: GenerationParams, prompt_length: int) -> ResolvedParams:
        return self.engine.validate(params, prompt_length)

    def check_request(self, prompt_ids: list[int], params: GenerationParams) -> ResolvedParams:
        return self.engine.check_request(prompt_ids, params)  # nothing built, so nothing for the ranks

    def make_sequence(self, prompt_ids: list[int], params: GenerationParams) -> RequestState:
        return self._register(prompt_ids, [self.engine.make_sequence(prompt_ids, self._seeded(prompt_ids, params))])[0]

    def make_sequences(self, prompt_ids: list[int], params: GenerationParams) -> list[RequestState]:
        return self._register(prompt_ids, self.engine.make_sequences(prompt_ids, self._seeded(prompt_ids, params)))

    def _seeded(self, prompt_ids: list[int], params: GenerationParams) -> GenerationParams:
        """Every rank must draw the same sampling noise, so every request is seeded here;
        resolved first, so that a seed the family fills when none is given (DiffusionGemma's
        `DEFAULT_CANVAS_SEED`, dlm/engine/family_rules.py) is the one used, as in a single
        process: drawing one before resolving made an unseeded DiffusionGemma request answer
        differently at 2 ranks than at 1, and differently on every run."""
        resolved = self.engine.validate(params, len(prompt_ids))
        return resolved if resolved.seed is not None else replace(resolved, seed=secrets.randbits(31))

    def _register(self, prompt_ids: list[int], seqs: list[RequestState]) -> list[RequestState]:
        """Sequences built (and validated) here, announced to the ranks with the next step."""
        with self._lock:
            for seq in seqs:
                rid = self._next_id = self._next_id + 1
                self._ids[id(seq)] = (rid, seq)
                self._pending.append((rid, list(prompt_ids), seq.params))  # resolved: ranks do not re-validate
        return seqs

    def add(self, seq: RequestState) -> None:
        self.engine.add(seq)

    def abort(self, seq: RequestState, reason: str = "abort") -> None:
        """The next step message leaves `seq` out: every rank aborts it then."""
        self.engine.abort(seq, reason)

    def cache_bytes(self) -> int:
        return self.engine.cache_bytes()

    def on_failure(self, callback: Callable[[str], None]) -> None:
        """Call `callback(message)` as soon as a rank this process spawned dies, even between
        steps; the group then refuses further steps."""
        if self.spawned is None:
            return

        spawned = self.spawned

        def notify(message: str) -> None:
            spawned.failing = True  # handled: the watchdog leaves the process to the listener
            self._failure = self._failure or _down(message)
            callback(str(self._failure))

        spawned.on_failure = notify
        if spawned.failure is not None:  # a rank died before anyone listened
            notify(spawned.failure)

    def step(self) -> list[RequestState]:
        if self._failure is not None:
            raise self._failure
        with self._lock:
            running = [self._ids[id(seq)][0] for seq in self.engine.running]
            live = {id(seq) for seq in self.engine.running}
            forget = [rid for key, (rid, seq) in self._ids.items() if key not in live and seq.finished]
            self._ids = {k: v for k, v in self._ids.items() if k in live or not v[1].finished}
            message, self._pending = Step(self._pending, running, forget), []
        return self._guarded(lambda: (_broadcast(self.group, message), self.engine.step())[1])

    def _guarded(self, run: Callable[[], Any], limit_s: float | None = None) -> Any:
        """Run a step (or the load barrier) of the group: a backend error becomes the
        failure's message, and the process ends if it overruns its time limit."""
        limit = self.timeout_s if limit_s is None else limit_s
        self._deadline.arm(
            limit + WATCHDOG_GRACE_S, f"the tensor-parallel group made no progress for {limit:g}s (a rank is hung)"
        )
        try:
            return run()
        except Exception as exc:  # noqa: BLE001 - collectives raise backend-specific errors
            raise self.failure(exc) from exc
        finally:
            self._deadline.disarm()

    def failure(self, exc: BaseException) -> EngineFailed:
        """The error to report for a failed collective (and every later step): the rank that
        died when one did (ranks this process spawned), else a timeout (a hung rank) or the
        backend's error."""
        self._failure = self._failure or self._diagnose(exc)
        return self._failure

    def _diagnose(self, exc: BaseException) -> EngineFailed:
        timed_out = "timed out" in str(exc).lower()
        if self.spawned is not None:
            self.spawned.failing = True
            deadline = time.monotonic() + (0.0 if timed_out else 2.0)  # an exit code may lag the sockets
            while self.spawned.failure is None and time.monotonic() < deadline:
                time.sleep(0.05)
            if self.spawned.failure is not None:
                return _down(self.spawned.failure)
        if timed_out:
            hung = self.spawned.stopped() if self.spawned is not None else None
            return EngineFailed(
                f"a tensor-parallel collective timed out after {self.timeout_s:g}s: "
                f"{hung or 'a rank is hung or slower than the timeout'} (set {TIMEOUT_VAR} to change it)"
            )
        return EngineFailed(f"the tensor-parallel group failed: {exc}")

    def close(self) -> None:
        """Stop the workers and leave the group (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._deadline.arm(self.timeout_s + WATCHDOG_GRACE_S, "the tensor-parallel group did not stop in time")
        try:
            if self._failure is None:  # a failed group cannot take the message: its ranks are killed
                _broadcast(self.group, Step(stop=True))
                if self.spawned is not None:
                    self.spawned.wait()
        finally:
            if self.spawned is not None:
                self.spawned.terminate()
            leave(self.group)
            self._deadline.disarm()


def _down(death: str) -> EngineFailed:
    return EngineFailed(f"{death}; the tensor-parallel group is down")


def check_split(spec: EngineSpec, config: ParallelConfig) -> None:
    """Refuse, before any process starts, a group size the model's layers cannot split
    (heads, intermediate size, vocabulary, experts): rank 0's shard is built on `meta`
    under the target group, so the layers' own rules answer."""
    from dlm.engine.runtime.engine import build_on_meta, weights_config

    model_config = weights_config(Path(spec.model_dir))
    target = parallel_state.TPState(rank=0, size=config.tensor_parallel_size, moe=config.moe)
    with parallel_state.using(target):
        build_on_meta(model_config)


def start_driver(spec: EngineSpec, config: ParallelConfig) -> DistributedEngine:
    """Rank 0: spawn this node's other ranks (unless torchrun did), join, load, and return
    the engine that drives the group."""
    config = config.resolved()
    place = this_process(config)
    if place.rank != 0:
        raise UsageError(f"this process is rank {place.rank}, not the driver: run it with serve_worker")
    check_split(spec, config)
    spawned = None if torchrun() else SpawnedRanks(spec, config, place, config.ranks_per_node)
    group: Group | None = None
    try:
        device = rank_device(spec.device, place.local_rank)
        group = join(place, config, device)
        engine = _build(spec, device)
        driver = DistributedEngine(engine, group, spawned, config.timeout_s)
        driver._guarded(lambda: _loaded_barrier(driver.group, config), config.load_timeout_s)
        return driver
    except BaseException:
        if spawned is not None:
            spawned.terminate()
        leave(group)
        raise


def serve_worker(spec: EngineSpec, config: ParallelConfig) -> None:
    """A process that is not the driver: a torchrun rank, or the first process of node
    k > 0 (which spawns the node's other ranks). Returns when the driver stops the group."""
    config = config.resolved()
    place = this_process(config)
    spawned = None if torchrun() else SpawnedRanks(spec, config, place, config.ranks_per_node)
    group: Group | None = None  # known once the driver stopped it; leave() ends it regardless
    try:
        group = _follow_driver(spec, config, place)
        if spawned is not None:
            spawned.wait()
    except Exception as exc:  # noqa: BLE001
        raise DlmError(f"tensor-parallel rank {place.rank}: {exc}") from exc
    finally:
        if spawned is not None:
            spawned.terminate()
        leave(group)


def is_driver(config: ParallelConfig) -> bool:
    """Whether this process is rank 0 under `config` (resolved)."""
    return int(os.environ["RANK"]) == 0 if torchrun() else config.node_rank == 0
