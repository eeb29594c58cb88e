"""`dlm batch INPUT OUTPUT`: offline inference over an OpenAI Batch API JSONL file."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import typer
from rich.markup import escape

from dlm.cli.output import cli_errors, emit_json, err_console, progress
from dlm.cli.paths import path_value
from dlm.cli.setting_options import default, setting_option


def batch(
    input_file: Path = typer.Argument(
        ..., metavar="INPUT", help="OpenAI Batch API requests, one JSON per line.", parser=path_value
    ),
    output_file: Path = typer.Argument(
        ..., metavar="OUTPUT", help="Results, one JSON per line (appended; resumable).", parser=path_value
    ),
    model: str | None = typer.Option(
        None,
        "--model",
        help="Checkpoint directory, store name or tiny:FAMILY.",
        show_default="--config's model, else the embedded default model",
    ),
    config_file: Path | None = typer.Option(
        None, "--config", help="`dlm serve` settings file (limits, defaults).", show_default="none", parser=path_value
    ),
    max_concurrency: int | None = typer.Option(
        None,
        "--max-concurrency",
        help="Requests decoded together.",
        show_default=f"the settings file's max_num_seqs, else {default('max_num_seqs')}",
    ),
    dtype: str | None = setting_option("dtype", from_file=True),
    device: str | None = setting_option("device", from_file=True),
    quantization: str | None = setting_option("quantization", from_file=True),
    kv_cache_dtype: str | None = setting_option("kv_cache_dtype", from_file=True),
    json_out: bool = typer.Option(False, "--json", help="Print the counts as JSON on stdout."),
) -> None:
    """Answer every request of INPUT into OUTPUT, as `dlm serve` would; a killed run resumes."""
    with cli_errors():
        from dlm.cli.store.leases import holding

        with holding("dlm batch"):  # a store version it resolves is leased while it runs
            import asyncio

            from dlm.cli.batch import claim_output, read_requests, run_batch
            from dlm.cli.server.config import load_config
            from dlm.cli.store.resolve import resolve_version
            from dlm.engine.errors import UsageError

            if max_concurrency is not None and max_concurrency < 1:
                raise UsageError("--max-concurrency must be at least 1")
            requests = read_requests(input_file)
            flags = {
                # MODEL as given, as `dlm serve` takes it: the server's one rule names the served
                # model from it (`Service.model_name`) and matches a body's `model` against that, so
                # a line asking for `tiny:llada` is answered by `dlm batch --model tiny:llada`.
                "model": model,
                "max_num_seqs": max_concurrency,
                "dtype": dtype,
                "device": device,
                "quantization": quantization,
                "kv_cache_dtype": kv_cache_dtype,
                "ready_wait": 0,
            }
            config = load_config(config_file, flags)
            if config.deployment is not None:  # a deployment has one server, the one releases swap
                raise UsageError("dlm batch answers with --model, not a deployment")
            # A wrong path is a usage error before anything starts; a store NAME, the version checked.
            model_dir, ref = resolve_version(config.model)
            config = config.pinned(ref)
            if config.backend == "native":  # settings the checkpoint refuses fail before it loads
                from dlm.engine.config import load_config as model_config

                config.check_model(model_config(model_dir))
            with (
                claim_output(output_file, requests) as output,
                _server_log_lines(),
                progress() as bar,
            ):
                task = bar.add_task("batch", total=len(requests), completed=len(requests) - len(output.todo))
                summary = asyncio.run(
                    run_batch(config, requests, output, config.max_num_seqs, lambda: bar.advance(task))
                )
            counts = {
                "total": summary.total,
                "skipped": summary.skipped,
                "completed": summary.completed,
                "failed": summary.failed,
                "output": str(output_file),
            }
            if json_out:
                emit_json(counts)
            else:
                err_console.print(
                    f"{summary.completed} answered, {summary.failed} failed, {summary.skipped} already in "
                    f"{escape(str(output_file))}",
                    highlight=False,
                )


class _OneLine(logging.Formatter):
    """A server log record as one line: what failed and why, without the traceback (the
    failing line's result holds the same cause)."""

    def format(self, record: logging.LogRecord) -> str:
        text = f"{record.name} {record.levelname.lower()}: {record.getMessage()}"
        exc = record.exc_info[1] if record.exc_info else None
        return f"{text}: {type(exc).__name__}: {exc}" if exc is not None else text


@contextmanager
def _server_log_lines() -> Iterator[None]:
    """The in-process server's warnings and errors on stderr, one line each, for the run."""
    handler = logging.StreamHandler()
    handler.setLevel(logging.WARNING)
    handler.setFormatter(_OneLine())
    logger = logging.getLogger("dlm")
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
