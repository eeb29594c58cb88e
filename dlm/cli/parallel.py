"""The tensor-parallel flags and launch step shared by `dlm generate` and `dlm serve`.

Every rank runs the same command line (docs/parallelism.md): the process that is rank 0
goes on to generate or serve, any other (a node k > 0, a torchrun rank) serves the driver
as a worker until it stops the group. The options are the serve settings of the same names
(dlm/cli/setting_options.py); `dlm generate` takes them as they come, `dlm deploy` only those
given (its settings file decides the rest).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dlm.cli.output import err_console
from dlm.cli.setting_options import setting_option

if TYPE_CHECKING:
    from dlm.engine.parallel.distributed import ParallelConfig

# The serve settings of the same names (dlm/cli/server/config.py) declare them.
TENSOR_PARALLEL_SIZE = setting_option("tensor_parallel_size")
NNODES = setting_option("nnodes")
NODE_RANK = setting_option("node_rank")
MASTER_ADDR = setting_option("master_addr")
MASTER_PORT = setting_option("master_port")
MOE_PARALLEL = setting_option("moe_parallel")


def parallel_config(
    tensor_parallel_size: int | None,
    nnodes: int | None,
    node_rank: int | None,
    master_addr: str | None,
    master_port: int | None,
    moe_parallel: str | None,
) -> ParallelConfig:
    """The flags given (the others keep their defaults), resolved with torchrun's variables."""
    from dlm.engine.parallel.distributed import ParallelConfig

    # Keyword arguments of mixed types: only the flags given, the rest keep ParallelConfig's defaults.
    given: dict[str, Any] = dict(
        tensor_parallel_size=tensor_parallel_size,
        nnodes=nnodes,
        node_rank=node_rank,
        master_addr=master_addr,
        master_port=master_port,
        moe=moe_parallel,
    )
    return ParallelConfig(**{k: v for k, v in given.items() if v is not None}).resolved()


def run_worker(
    model: str | None,
    dtype: str,
    device: str,
    parallel: ParallelConfig,
    gpu_memory_utilization: float | None = None,
    quantization: str | None = None,
    kv_cache_dtype: str = "auto",
) -> bool:
    """Whether this process is a worker rank, not rank 0: it then serves the driver until the
    group stops, and the command has nothing else to do."""
    from dlm.cli.store.resolve import resolve_model
    from dlm.engine.parallel.distributed import EngineSpec, is_driver, serve_worker

    if is_driver(parallel):
        return False
    err_console.print(
        f"[dim]tensor-parallel worker: serving rank 0 at {parallel.master_addr}:{parallel.master_port} "
        "until it stops[/]",
        highlight=False,
    )
    spec = EngineSpec(str(resolve_model(model)), dtype, device, gpu_memory_utilization, quantization, kv_cache_dtype)
    serve_worker(spec, parallel)
    return True
