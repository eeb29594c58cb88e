"""`dlm batch INPUT OUTPUT`: offline inference over an OpenAI Batch API JSONL file."""

from __future__ import annotations

from pathlib import Path

import typer

from dlm.cli.model_options import DEVICE_OPTION, QUANTIZATION_OPTION
from dlm.cli.output import cli_errors, emit_json, err_console


def batch(
    input_file: Path = typer.Argument(..., metavar="INPUT", help="OpenAI Batch API requests, one JSON per line."),
    output_file: Path = typer.Argument(..., metavar="OUTPUT", help="Results, one JSON per line (appended; resumable)."),
    model: str | None = typer.Option(
        None, "--model", help="Checkpoint directory, store name or tiny:FAMILY [the embedded default model]."
    ),
    config_file: Path | None = typer.Option(None, "--config", help="`dlm serve` settings file (limits, defaults)."),
    max_concurrency: int = typer.Option(8, "--max-concurrency", help="Requests decoded together [8]."),
    dtype: str | None = typer.Option(None, "--dtype", help="auto (per device, see dlm doctor), float32, bfloat16."),
    device: str | None = DEVICE_OPTION,
    quantization: str | None = QUANTIZATION_OPTION,
    json_out: bool = typer.Option(False, "--json", help="Print the counts as JSON on stdout."),
) -> None:
    """Answer every request of INPUT into OUTPUT, as `dlm serve` would; a killed run resumes."""
    with cli_errors():
        import asyncio

        from rich.progress import Progress

        from dlm.cli.batch import answered, read_requests, run_batch
        from dlm.cli.server.config import load_config
        from dlm.cli.store.resolve import resolve_model
        from dlm.engine.errors import UsageError

        if max_concurrency < 1:
            raise UsageError("--max-concurrency must be at least 1")
        requests = read_requests(input_file)
        model_dir = resolve_model(model)
        flags = {
            "model": str(model_dir),
            "max_num_seqs": max_concurrency,
            "dtype": dtype,
            "device": device,
            "quantization": quantization,
            "max_queue": max(len(requests), 1),
            "ready_wait": 0,
        }
        config = load_config(config_file, flags)
        if config.backend == "native":  # settings the checkpoint refuses fail before it loads
            from dlm.engine.config import load_config as model_config

            config.check_model(model_config(model_dir))
        done = len(answered(output_file) & {r.custom_id for r in requests})
        with Progress(console=err_console, transient=True) as progress:
            task = progress.add_task("batch", total=len(requests), completed=done)
            summary = asyncio.run(
                run_batch(config, requests, output_file, max_concurrency, lambda: progress.advance(task))
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
                f"{summary.completed} answered, {summary.failed} failed, {summary.skipped} already in {output_file}"
            )
