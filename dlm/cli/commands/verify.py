"""`dlm verify`: re-hash a store version against its manifest and check its structure."""

from __future__ import annotations

import typer
from rich.markup import escape

from dlm.cli.output import cli_errors, emit_json, err_console
from dlm.cli.store_ui import (
    JSON_OPTION,
    STORE_OPTION,
    WORKERS_OPTION,
    ByteBar,
    check_workers,
    counted,
    human_size,
    open_store,
    render_findings,
)


def verify(
    model: str = typer.Argument(
        ..., help="Store name[@version], or a checkpoint directory or tiny:FAMILY (structure only)."
    ),
    workers: int | None = WORKERS_OPTION,
    store: str | None = STORE_OPTION,
    json_out: bool = JSON_OPTION,
) -> None:
    """Check every file's sha256, the safetensors headers, the shard index, config.json and
    the tokenizer. Exits 1 if anything is wrong, naming each file and problem."""
    with cli_errors():
        from dlm.cli.store.verify import verify_model
        from dlm.engine.errors import DlmError

        report = verify_model(model, open_store(store), progress=ByteBar(), workers=check_workers(workers))
        if json_out:
            emit_json(report.to_json())
        render_findings(report)
        rate = report.bytes_hashed / report.hash_seconds / 1e6 if report.hash_seconds else 0.0
        target = f"{report.model}@{report.version}" if report.model else report.path
        err_console.print(
            f"{escape(str(target))}: {report.files} files, {human_size(report.bytes_hashed)} hashed in "
            f"{report.hash_seconds:.2f}s ({rate:.0f} MB/s), family {report.family or '?'}",
            highlight=False,
        )
        if not report.ok:
            files = len({f.file for f in report.failures})
            raise DlmError(
                f"verification failed: {counted(len(report.failures), 'problem')} in {counted(files, 'file')}"
            )
        err_console.print(
            "[green]verified[/]" if report.model else "[green]structure ok[/] (no manifest: hashes not checked)"
        )
