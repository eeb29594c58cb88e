"""`dlm serve`: the OpenAI-compatible server with continuous batching over denoising steps."""

from __future__ import annotations

from pathlib import Path

import typer

from dlm.cli import parallel as tp
from dlm.cli.model_options import DEVICE_OPTION, MODEL_ARGUMENT, QUANTIZATION_OPTION
from dlm.cli.output import cli_errors, emit_json, err_console


def serve(
    model: str | None = MODEL_ARGUMENT,
    model_path: str | None = typer.Option(
        None, "--model-path", "--model", help="MODEL as an option, as other servers spell it."
    ),
    config_file: Path | None = typer.Option(
        None, "--config", help="TOML or YAML file of settings (flags and DLM_* variables override it)."
    ),
    host: str | None = typer.Option(None, "--host", help="Bind address [127.0.0.1]."),
    port: int | None = typer.Option(None, "--port", help="Port [8000]; 0 picks a free one."),
    api_key: list[str] | None = typer.Option(
        None, "--api-key", help="Accepted API key (repeatable; also DLM_API_KEYS, --api-key-file)."
    ),
    api_key_file: Path | None = typer.Option(None, "--api-key-file", help="File with one API key per line."),
    served_model_name: str | None = typer.Option(
        None, "--served-model-name", help="Model name clients send [the directory name]."
    ),
    dtype: str | None = typer.Option(
        None, "--dtype", help="auto (per device, see dlm doctor), float32, bfloat16, float16."
    ),
    device: str | None = DEVICE_OPTION,
    quantization: str | None = QUANTIZATION_OPTION,
    gpu_memory_utilization: float | None = typer.Option(
        None,
        "--gpu-memory-utilization",
        help="Share (0-1] of each GPU's memory the server may use: a ceiling, nothing is reserved [no cap].",
    ),
    backend: str | None = typer.Option(
        None, "--backend", help="native, or transformers: load any checkpoint with transformers [native]."
    ),
    trust_remote_code: bool | None = typer.Option(
        None,
        "--trust-remote-code/--no-trust-remote-code",
        help="With --backend transformers: run the checkpoint's own Python code [off].",
    ),
    max_num_seqs: int | None = typer.Option(
        None, "--max-num-seqs", "--max-concurrency", help="Sequences sharing one forward (decoded concurrently) [8]."
    ),
    max_num_batched_tokens: int | None = typer.Option(
        None, "--max-num-batched-tokens", help="Canvas tokens in one forward [16384]."
    ),
    max_queue: int | None = typer.Option(None, "--max-queue", help="Waiting requests before 429 [64]."),
    max_tokens: int | None = typer.Option(None, "--max-tokens", help="Largest max_tokens per request [1024]."),
    default_max_tokens: int | None = typer.Option(
        None, "--default-max-tokens", help="max_tokens when a request gives none [min(128, max-tokens)]."
    ),
    max_steps: int | None = typer.Option(
        None,
        "--max-steps",
        help="Cap on every request's denoising steps (usage.denoising_steps), whatever its rule or family [1024].",
    ),
    refinement_steps: int | None = typer.Option(
        None, "--refinement-steps", help="Denoising steps per block when a request gives no steps [one token per step]."
    ),
    block_length: int | None = typer.Option(
        None, "--block-length", help="Block length when a request gives none [the family's]."
    ),
    max_model_len: int | None = typer.Option(None, "--max-model-len", help="Prompt + generation limit [the model's]."),
    step_graphs: str | None = typer.Option(
        None,
        "--step-graphs",
        help="auto, on, off: denoising forwards at static shapes, replayed as CUDA graphs on CUDA "
        "(bidirectional families; auto: CUDA only) [auto].",
    ),
    prefix_cache_mib: float | None = typer.Option(
        None,
        "--prefix-cache-mib",
        help="MiB of prompt K/V reused across requests sharing a prefix (block-causal families; "
        "exact, LRU); 0 turns it off [1024].",
    ),
    request_timeout: float | None = typer.Option(
        None, "--request-timeout", help="Seconds before a request is stopped [300]."
    ),
    shutdown_grace: float | None = typer.Option(
        None, "--shutdown-grace", help="Seconds SIGTERM waits for in-flight requests [30]."
    ),
    ready_wait: float | None = typer.Option(
        None, "--ready-wait", help="Seconds a request sent while the model loads waits for it, not 503 [120]."
    ),
    requests_per_minute: float | None = typer.Option(
        None, "--requests-per-minute", help="Per-key request rate (0: off)."
    ),
    tokens_per_minute: float | None = typer.Option(
        None, "--tokens-per-minute", help="Per-key generated-token rate (0: off)."
    ),
    max_body_bytes: int | None = typer.Option(None, "--max-body-bytes", help="Request body cap [1 MiB]."),
    public_metrics: bool | None = typer.Option(
        None, "--public-metrics/--private-metrics", help="Serve /metrics without a key [private]."
    ),
    log_prompts: bool | None = typer.Option(
        None, "--log-prompts/--no-log-prompts", help="Put prompt and output text in request logs [off]."
    ),
    warmup: bool | None = typer.Option(None, "--warmup/--no-warmup", help="Run a warm-up forward before /ready [on]."),
    ssl_certfile: Path | None = typer.Option(None, "--ssl-certfile", help="TLS certificate (with --ssl-keyfile)."),
    ssl_keyfile: Path | None = typer.Option(None, "--ssl-keyfile", help="TLS private key."),
    log_level: str | None = typer.Option(None, "--log-level", help="debug, info, warning, error."),
    deployment: str | None = typer.Option(
        None,
        "--deployment",
        "-d",
        help="Serve this store deployment's current release and accept hot swaps from `dlm release`/`dlm rollback`.",
    ),
    store: Path | None = typer.Option(
        None, "--store", help="Model store for --deployment (also DLM_STORE) [$DLM_HOME/store]."
    ),
    admin_port: int | None = typer.Option(
        None, "--admin-port", help="Admin endpoint port, always on 127.0.0.1 [0: any free one]."
    ),
    admin_key: str | None = typer.Option(
        None, "--admin-key", help="Admin endpoint key (prefer DLM_ADMIN_KEY or --admin-key-file) [random]."
    ),
    admin_key_file: Path | None = typer.Option(None, "--admin-key-file", help="File holding the admin key."),
    tensor_parallel_size: int | None = tp.TENSOR_PARALLEL_SIZE,
    nnodes: int | None = tp.NNODES,
    node_rank: int | None = tp.NODE_RANK,
    master_addr: str | None = tp.MASTER_ADDR,
    master_port: int | None = tp.MASTER_PORT,
    moe_parallel: str | None = tp.MOE_PARALLEL,
    json_out: bool = typer.Option(
        False, "--json", help="Print the effective configuration as JSON on stdout at start."
    ),
) -> None:
    """Serve MODEL (or a store deployment) over an OpenAI-compatible HTTP API (completions, chat, streaming)."""
    flags = {k: v for k, v in locals().items() if k not in ("config_file", "json_out", "api_key", "model_path")}
    flags["api_keys"] = api_key or None
    with cli_errors():
        if model_path is not None:
            if model is not None and model != model_path:
                from dlm.engine.errors import UsageError

                raise UsageError(f"MODEL ({model}) and --model-path ({model_path}) disagree: give one")
            flags["model"] = model_path
        from dlm.cli.server.config import load_config
        from dlm.cli.store.resolve import resolve_model

        config = load_config(config_file, flags)
        if config.deployment is not None:
            from dlm.cli.store.admin import running_server
            from dlm.cli.store.releases import current_checkpoint
            from dlm.cli.store.store import Store
            from dlm.engine.errors import DlmError

            current_checkpoint(Store(config.store), config.deployment)  # no release: usage error now
            other = running_server(Store(config.store), config.deployment)
            if other is not None:  # releases would hot-swap only one of the two
                raise DlmError(
                    f"deployment {config.deployment} is already served by process {other.pid} "
                    f"(admin endpoint {other.admin_url}); one server per deployment and store"
                )
        elif config.backend == "native":  # settings the checkpoint refuses fail before it loads
            from dlm.engine.config import load_config as model_config

            config.check_model(model_config(resolve_model(config.model)))
        else:
            resolve_model(config.model)  # a wrong path is a usage error before anything starts
        parallel = config.parallel()
        if json_out:
            emit_json(config.public())
        else:
            err_console.print("[bold]dlm serve[/] configuration:")
            for key, value in config.public().items():
                err_console.print(f"  {key} = {value}", highlight=False)

        if tp.run_worker(
            config.model,
            config.dtype,
            config.device,
            parallel,  # not rank 0: no HTTP
            config.gpu_memory_utilization,
            config.quantization,
        ):
            return

        from dlm.cli.server.run import serve as run_server

        code = run_server(config)
    raise typer.Exit(code)
