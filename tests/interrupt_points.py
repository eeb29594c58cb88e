"""`python -m tests.interrupt_points POINT ARGS...`: the `dlm ARGS` command, run as `python -m
dlm` runs it, with a Ctrl-C (SIGINT to itself) at POINT, so that tests/test_interrupts.py can
land one where a timer could only hit by chance:

- importing: while code that `exec()` made from a string runs, as the commands' modules import
  (dataclasses and namedtuple build their methods so, by the hundred);
- working: while a store command hashes or copies its files (sent from a worker thread);
- twice: as `working`, and again while the first one's exit is under way;
- swallowed: during the work, inside a library that catches the KeyboardInterrupt and goes on
  (torch does, when it fails to import numpy while it loads);
- finalizer: during the work, inside a `__del__`, whose exceptions Python prints and drops;
- after: once the command has finished, as the interpreter shuts down;
- hangup: a SIGHUP instead, as the commands' modules import (`dlm serve`'s reload signal).
"""

from __future__ import annotations

import atexit
import importlib.abc
import importlib.util
import os
import signal
import sys
import threading
import time
from types import ModuleType
from typing import Any


def interrupt() -> None:
    os.kill(os.getpid(), signal.SIGINT)


def interrupted_in_exec() -> None:
    """A Ctrl-C landing in code run from a string by exec(): its KeyboardInterrupt leaves
    through the exec() call."""
    exec("import os, signal\nos.kill(os.getpid(), signal.SIGINT)\nfor _ in range(1000):\n    pass\n")


class _After(importlib.abc.MetaPathFinder):
    """Calls `patch(module)` once `name` has been imported."""

    def __init__(self, name: str, patch: Any) -> None:
        self.name, self.patch = name, patch

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        assert spec is not None and spec.loader is not None
        loader, patch = spec.loader, self.patch

        class Patching(importlib.abc.Loader):
            def create_module(self, spec: Any) -> Any:
                return loader.create_module(spec)

            def exec_module(self, module: ModuleType) -> None:
                loader.exec_module(module)  # type: ignore[attr-defined]
                patch(module)

        spec.loader = Patching()
        return spec


def _patch_after(name: str, patch: Any) -> None:
    sys.meta_path.insert(0, _After(name, patch))


def _in_the_work(module: ModuleType, also: Any = None) -> None:
    """The first file hashed or copied sends SIGINT from its worker thread (then `also()`)."""
    real = module.parallel_map
    sent = threading.Event()

    def parallel_map(work: Any, *args: Any, **kwargs: Any) -> Any:
        def first(item: Any, advance: Any) -> Any:
            if not sent.is_set():
                sent.set()
                interrupt()
                if also is not None:
                    also()
            return work(item, advance)

        return real(first, *args, **kwargs)

    module.parallel_map = parallel_map


def _twice() -> None:
    time.sleep(0.5)  # the main thread has its KeyboardInterrupt and waits for this worker to end
    interrupt()


def _swallowed(module: ModuleType) -> None:
    real = module.check_structure

    def check_structure(*args: Any) -> None:
        try:
            interrupted_in_exec()
        except KeyboardInterrupt:
            pass  # as a library that catches every error would
        real(*args)

    module.check_structure = check_structure


class _Interrupting:
    def __del__(self) -> None:
        interrupted_in_exec()


def _in_a_finalizer(module: ModuleType) -> None:
    real = module.check_structure

    def check_structure(*args: Any) -> None:
        _Interrupting()  # dropped at once: its __del__ runs here
        real(*args)

    module.check_structure = check_structure


def arm(point: str) -> None:
    if point == "importing":
        _patch_after("typer", lambda module: interrupted_in_exec())
    elif point == "working":
        for name in ("dlm.cli.store.verify", "dlm.cli.store.fetch"):
            _patch_after(name, _in_the_work)
    elif point == "twice":
        for name in ("dlm.cli.store.verify", "dlm.cli.store.fetch"):
            _patch_after(name, lambda module: _in_the_work(module, _twice))
    elif point == "swallowed":
        _patch_after("dlm.cli.store.verify", _swallowed)
    elif point == "finalizer":
        _patch_after("dlm.cli.store.verify", _in_a_finalizer)
    elif point == "after":
        atexit.register(interrupt)
    elif point == "hangup":  # not a Ctrl-C: a SIGHUP (a reload) as the commands' modules import
        _patch_after("typer", lambda module: os.kill(os.getpid(), signal.SIGHUP))
    else:
        raise SystemExit(f"unknown point {point!r}")


if __name__ == "__main__":
    arm(sys.argv[1])
    sys.argv = ["dlm", *sys.argv[2:]]
    from dlm.cli.entry import main

    main()
