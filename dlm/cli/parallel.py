"""The tensor-parallel flags and launch step shared by `dlm generate` and `dlm serve`.

Every rank runs the same command line (docs/parallelism.md): the process that is rank 0
goes on to generate or serve, any other (a node k > 0, a torchrun rank) serves the driver
as a worker until it stops the group. Defaults are None ("not given") so `dlm serve` can take
them from its config file or DLM_* variables instead.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import typer

from dlm.cli.output import err_console

if TYPE_CHECKING:
    from dlm.engine.parallel.distributed import ParallelConfig

TENSOR_PARALLEL_SIZE = typer.Option(
    None,
    "--tensor-parallel-size",
    "-tp",
    help="Split the model over N processes (one per GPU; gloo CPU processes without CUDA) [1].",
)
NNODES = typer.Option(None, "--nnodes", help="Nodes the tensor-parallel ranks span (run the command on each) [1].")
NODE_RANK = typer.Option(None, "--node-rank", help="This node's index (0 = the node that answers) [0].")
MASTER_ADDR = typer.Option(None, "--master-addr", help="Node 0's address (multi-node).")
MASTER_PORT = typer.Option(None, "--master-port", help="Node 0's rendezvous port (multi-node).")
MOE_PARALLEL = typer.Option(
    None, "--moe-parallel", help="auto, ep (experts split over ranks) or tp (each expert split) [auto]."
)


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
    spec = EngineSpec(str(resolve_model(model)), dtype, device, gpu_memory_utilization, quantization)
    serve_worker(spec, parallel)
    return True
