"""What the weights commands share: the --store option, a byte progress bar on stderr, and
the table of verification problems."""

from __future__ import annotations

import time
from typing import Any

import typer

from dlm.cli.output import err_console, progress


class StoreArgument(str):
    """--store's value, with where it came from: `DLM_STORE` when click read it from the
    variable, else `--store`; `open_store` names it when it refuses the value."""

    source = "--store"


def _store_argument(ctx: typer.Context, param: typer.CallbackParam, value: str | None) -> str | None:
    if value is None:
        return None
    argument = StoreArgument(value)
    source = ctx.get_parameter_source(param.name or "store")
    if source is not None and source.name == "ENVIRONMENT":
        argument.source = "DLM_STORE"
    return argument


STORE_OPTION: Any = typer.Option(
    None,
    "--store",
    envvar="DLM_STORE",
    callback=_store_argument,
    help="Store directory.",
    show_default="$DLM_HOME/store",
)
JSON_OPTION: Any = typer.Option(False, "--json", help="Print a JSON result on stdout.")
WORKERS_OPTION: Any = typer.Option(
    None, "--workers", help="Files transferred / hashed in parallel.", show_default="CPU count"
)


def check_workers(workers: int | None) -> int | None:
    """--workers as given: at least one (0 and negative counts were taken silently); more
    than there are files is harmless."""
    from dlm.engine.errors import UsageError

    if workers is not None and workers < 1:
        raise UsageError(f"--workers must be at least 1, got {workers}")
    return workers


def open_store(path: str | None) -> Any:
    """The store at --store / DLM_STORE (else $DLM_HOME/store). An empty --store is refused:
    it read as the current directory, and a fetch filled ./models with no word; a path that
    is a file, or lies under one (`FILE/store`: listed as an empty store, or "Not a
    directory" from whichever command first tried to create it), is refused by name before
    any command tries to lock or create under it, naming where the path came from (--store,
    DLM_STORE, or DLM_HOME for the default store)."""
    from dlm.cli.store.store import Store, check_store_path, store_root_problem
    from dlm.engine.errors import UsageError
    from dlm.engine.home import expand_user

    source = path.source if isinstance(path, StoreArgument) else "--store"
    store = Store(expand_user(check_store_path(path, source), source) if path is not None else None)
    if (problem := store_root_problem(store.root)) is not None:
        if path is None:  # no --store, DLM_STORE unset or empty: the default, under DLM_HOME
            raise UsageError(f"the store at $DLM_HOME/store: {problem} (check DLM_HOME)")
        raise UsageError(f"{source} {problem}")
    return store


class ByteBar:
    """dlm.cli.store.hashing.ByteProgress on stderr: a rich bar on a terminal; elsewhere (a
    log, a pipe) one line when the work ends, with the bytes and the rate."""

    def __init__(self) -> None:
        self._progress: Any = None
        self._task: Any = None
        self._description, self._bytes, self._start = "", 0, 0.0

    def start(self, description: str, total_bytes: int) -> None:
        from rich.progress import BarColumn, DownloadColumn, TextColumn, TimeRemainingColumn, TransferSpeedColumn

        self._description, self._bytes, self._start = description, 0, time.perf_counter()
        self._progress = progress(
            TextColumn("{task.description}"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            transient=False,
        )
        self._progress.start()
        self._task = self._progress.add_task(description, total=total_bytes)

    def advance(self, nbytes: int) -> None:
        self._bytes += nbytes
        self._progress.advance(self._task, nbytes)

    def stop(self) -> None:
        self._progress.stop()
        if self._progress.disable:  # no bar was drawn: say what it would have ended with
            from rich.filesize import decimal

            seconds = time.perf_counter() - self._start
            rate = f", {decimal(round(self._bytes / seconds))}/s" if seconds > 0 else ""
            err_console.print(f"{self._description} {decimal(self._bytes)} in {seconds:.2f}s{rate}", highlight=False)


def render_findings(report: Any) -> None:
    """Failures (and warnings) of a VerifyReport as a table on stderr (file names and problems
    are the checkpoint's: shown as they are, never read as rich markup)."""
    from rich.markup import escape
    from rich.table import Table

    rows = [("FAIL", f) for f in report.failures] + [("warn", f) for f in report.warnings]
    if not rows:
        return
    table = Table(title=f"verification of {escape(str(report.path))}", title_justify="left")
    table.add_column("")
    table.add_column("file", no_wrap=True)  # whole, so it can be copied and grepped
    table.add_column("check")
    table.add_column("problem", overflow="fold")
    for level, finding in rows:
        style = "red" if level == "FAIL" else "yellow"
        table.add_row(f"[{style}]{level}[/]", escape(finding.file), escape(finding.check), escape(finding.problem))
    err_console.print(table)


def counted(n: int, noun: str) -> str:
    """`1 problem`, `2 problems`: a count with its noun in the right number."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def human_size(n: int) -> str:
    size = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if size < 1000 or unit == "TB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{n} B"
