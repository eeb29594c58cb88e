"""Ctrl-C and the end of the `dlm` process: `error: interrupted` once and exit 130 (docs/cli.md),
wherever the signal lands (tests/test_interrupts.py lands one at each of the places below).

Python's own SIGINT handling (a KeyboardInterrupt at the next bytecode) falls short of that:
- a KeyboardInterrupt that leaves code exec() made from a string (dataclasses and namedtuple
  build their methods so, by the hundred while the commands import) is noted as unhandled for
  good: under `python -m dlm` the interpreter then ends by sending itself SIGINT (exit status
  -2), though the program caught it and asked for 130;
- a second Ctrl-C while the first one's exit runs (it may wait for a worker thread hashing a
  large file) raised a KeyboardInterrupt that nothing catches;
- while the interpreter shuts down, Python restores the default handler: a Ctrl-C then is
  death by the signal, after the command said what it did;
- a library may catch the KeyboardInterrupt and carry on (torch does, when the interrupt lands
  in its import of numpy; numpy then fails to import for the rest of the process), and Python
  itself drops one that lands in a finalizer (a `__del__`), after printing its traceback.

So the entry point (`dlm.cli.entry`) installs `_on_sigint`: the first SIGINT raises
KeyboardInterrupt and is remembered (`check` raises it again where a change must not follow
it: `dlm.cli.store.releases.transaction`; one a finalizer dropped is not printed), a second
one ends the process at once. `end` (a command's outcome) and `interrupted` end the process:
from then on SIGINT is ignored (the one disposition that survives the interpreter's shutdown),
and after a Ctrl-C the shutdown is skipped (`os._exit`, once the streams and logs are
flushed) rather than run with a stale note of it.
"""

from __future__ import annotations

import os
import signal
import sys
from types import FrameType
from typing import Any, NoReturn

EXIT_CODE = 130
_unraisable_hook = sys.unraisablehook
_installed = False
_received = False
_reported = False


def install() -> None:
    """Handle SIGINT as above in this process, unless it is ignored (`nohup`, a background
    job of a non-interactive shell) or something other than Python's default handles it."""
    global _installed, _unraisable_hook
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _on_sigint)
        _unraisable_hook, sys.unraisablehook = sys.unraisablehook, _unraisable
        _installed = True


def _on_sigint(signum: int, frame: FrameType | None) -> None:
    global _received
    if _received:  # the first one's exit is under way, or a library swallowed it
        if not _reported:
            report()
        _flush_and_exit(EXIT_CODE)
    _received = True
    raise KeyboardInterrupt


def _unraisable(unraisable: Any) -> None:
    """What Python cannot raise (an exception in a finalizer) goes to the previous hook, but
    the KeyboardInterrupt of a Ctrl-C that landed there: noted, it is not a crash to print."""
    if not isinstance(unraisable.exc_value, KeyboardInterrupt):
        _unraisable_hook(unraisable)


def check() -> None:
    """KeyboardInterrupt if Ctrl-C was pressed, also where a library caught the first one."""
    if _received:
        raise KeyboardInterrupt


def report() -> None:
    """The contract's line for an interrupted command (the one place that writes it)."""
    global _reported
    _reported = True
    sys.stderr.write("error: interrupted\n")
    sys.stderr.flush()


def interrupted() -> NoReturn:
    """End the process for a Ctrl-C: the contract's line, exit 130."""
    report()
    _end(EXIT_CODE, teardown=not _received)


def end(code: int) -> NoReturn:
    """End the process with `code`, the command's outcome. The interpreter's teardown is also
    skipped where triton was imported (torch imports it when it builds a model on the meta
    device): triton's native module prints dozens of "nanobind: leaked ..." lines there,
    which read like a crash at the end of every `dlm serve` or `dlm batch`. Everything dlm
    writes is closed by then."""
    _end(code, teardown=not _received and "triton" not in sys.modules)


def _end(code: int, teardown: bool) -> NoReturn:
    if _installed:  # the outcome is decided: a Ctrl-C from now on changes nothing
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    if teardown:
        sys.exit(code)
    _flush_and_exit(code)


def _flush_and_exit(code: int) -> NoReturn:
    import logging

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed pipe, or a write the signal interrupted
            pass
    os._exit(code)
