"""`dlm serve`: the OpenAI-compatible server with continuous batching over denoising steps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from rich.markup import escape

from dlm.cli import parallel as tp
from dlm.cli.model_options import MODEL_ARGUMENT
from dlm.cli.output import cli_errors, emit_json, err_console
from dlm.cli.paths import path_value
from dlm.cli.setting_options import given, with_settings


@with_settings()
def serve(
    ctx: typer.Context,
    model: str | None = MODEL_ARGUMENT,
    model_path: str | None = typer.Option(
        None, "--model-path", "--model", help="MODEL as an option, as other servers spell it.", show_default="none"
    ),
    config_file: Path | None = typer.Option(
        None,
        "--config",
        help="TOML or YAML file of settings (flags and DLM_* variables override it).",
        show_default="none",
        parser=path_value,
    ),
    json_out: bool = typer.Option(
        False, "--json", help="Print the effective configuration as JSON on stdout at start."
    ),
    **settings: Any,
) -> None:
    """Serve MODEL (or a store deployment) over an OpenAI-compatible HTTP API (completions, chat, streaming).

    Every other option is a serve setting (dlm/cli/server/config.py), also read from --config
    and DLM_* variables; the command line wins."""
    flags = {**given(ctx, settings), "model": model}
    with cli_errors():
        from dlm.cli.store.leases import holding

        with holding("dlm serve", "served"):  # a store version it resolves is leased while it runs
            if model_path is not None:
                if model is not None and model != model_path:
                    from dlm.engine.errors import UsageError

                    raise UsageError(f"MODEL ({model}) and --model-path ({model_path}) disagree: give one")
                flags["model"] = model_path
            from dlm.cli.server.config import ServeConfig, load_config
            from dlm.cli.store.resolve import resolve_version

            config = load_config(config_file, flags)
            asked = config.model  # MODEL as given (a store NAME is pinned to its version below: `ref`)
            ref: str | None = None
            if config.deployment is not None:
                from dlm.cli.store.admin import running_server
                from dlm.cli.store.releases import current_checkpoint
                from dlm.cli.store_ui import open_store
                from dlm.engine.errors import DlmError

                store = open_store(str(config.store) if config.store is not None else None)  # a file: usage error
                current_checkpoint(store, config.deployment)  # no store, no release: usage error now
                other = running_server(store, config.deployment)
                if other is not None:  # releases would hot-swap only one of the two
                    raise DlmError(
                        f"deployment {config.deployment} is already served by process {other.pid} "
                        f"(admin endpoint {other.admin_url}); one server per deployment and store"
                    )
            else:  # a wrong path is a usage error before anything starts; a store NAME, the version checked
                checkpoint, ref = resolve_version(config.model)
                config = config.pinned(ref)
                if config.backend == "native":  # settings the checkpoint refuses fail before it loads
                    from dlm.engine.config import load_config as model_config

                    config.check_model(model_config(checkpoint))
            parallel = config.parallel()
            if json_out:
                emit_json(config.public())
            else:
                err_console.print("[bold]dlm serve[/] configuration:")
                for key, value in config.public().items():
                    err_console.print(f"  {key} = {escape(str(value))}", highlight=False)

            if tp.run_worker(
                config.model,
                config.dtype,
                config.device,
                parallel,  # not rank 0: no HTTP
                config.gpu_memory_utilization,
                config.quantization,
                config.kv_cache_dtype,
            ):
                return

            from dlm.cli.server.run import serve as run_server

            def current() -> ServeConfig:
                """The settings as they read now (SIGHUP), MODEL pinned as at start while it
                names the same model (another is a change only a restart applies)."""
                again = load_config(config_file, flags)
                return again.pinned(ref) if again.model == asked else again

            code = run_server(config, current)
    raise typer.Exit(code)
