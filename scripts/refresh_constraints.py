"""Refresh constraints.txt: the exact versions of every dependency that CI installs and tests.

    python3 scripts/refresh_constraints.py

Why a lock: pyproject.toml declares ranges (what dlm works with); a fresh machine resolves the
newest releases inside them, and one bad release breaks it the day it appears. The README's
set-up line, .ci/run and the Dockerfiles install with `-c constraints.txt`, so a fresh machine
gets what CI tested. .ci/run also installs the newest releases in a second environment and runs
the quick loop there, so a break shows in CI before it reaches the lock (docs/install.md).

How: a throw-away virtual environment, `pip install torch==<pin> -e '.[dev]'` with no
constraint of ours (the newest releases the ranges allow), then `pip freeze`. torch keeps the
README's pin; its local build label (+cpu) is dropped so that the CUDA build of the same
release also satisfies it. Run it on the Python CI uses (3.11); review the diff, run .ci/run.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "constraints.txt"
TORCH = "torch==2.13.0"  # the README's pin: a CPU build from local disk
HEADER = """\
# The exact versions CI installed and tested (CPython {python}, Linux x86_64, CPU torch).
# Used as `pip install -c constraints.txt ...` by the README's set-up line, .ci/run and the
# Dockerfiles. Refresh: python3 scripts/refresh_constraints.py (docs/install.md). Generated.
# Each pin applies from CPython {python} on; an older Python resolves the declared ranges.
"""


def frozen(python: Path) -> list[str]:
    """`pip freeze` of that environment, without dlm itself, local build labels dropped."""
    lines = subprocess.run(
        [str(python), "-m", "pip", "freeze", "--exclude-editable"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.splitlines()
    pins = []
    for line in lines:
        name, sep, version = line.partition("==")
        if not sep or name.lower() == "dlm":
            continue
        pins.append(f"{name}=={re.sub(r'[+].*$', '', version)}")
    return sorted(pins, key=str.lower)


def install_newest(venv: Path) -> Path:
    """A virtual environment at `venv` with the newest releases the declared ranges allow (torch
    at the README's pin); returns its python."""
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    python = venv / "bin" / "python"
    pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, TORCH], check=True)
    subprocess.run([*pip, "-e", f"{ROOT}[dev]"], check=True)
    return python


def locked() -> list[str]:
    """The pins constraints.txt holds now (without their markers)."""
    lines = OUT.read_text().splitlines()
    return [line.partition(";")[0].strip() for line in lines if line and not line.startswith("#")]


def check(venv: Path) -> int:
    """Install the newest releases into `venv` (kept, for the caller's tests) and print how they
    differ from the lock: 0 when they match, 1 when they differ, 2 when they cannot be installed."""
    try:
        python = install_newest(venv)
    except subprocess.CalledProcessError as exc:
        print(f"the newest releases do not install: {exc}", file=sys.stderr)
        return 2
    now, lock = set(frozen(python)), set(locked())
    for pin in sorted(now ^ lock, key=str.lower):
        print(f"{'newest' if pin in now else 'locked'}: {pin}")
    return int(now != lock)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=OUT, help="where to write (default: constraints.txt)")
    parser.add_argument(
        "--check",
        type=Path,
        metavar="VENV",
        help="write nothing: install the newest releases into VENV and list how they differ from "
        "constraints.txt (exit 0 same, 1 different, 2 not installable)",
    )
    args = parser.parse_args()
    if args.check:
        return check(args.check)
    with tempfile.TemporaryDirectory(prefix="dlm-lock-") as tmp:
        pins = frozen(install_newest(Path(tmp) / "venv"))
    version = ".".join(map(str, sys.version_info[:2]))
    marker = f' ; python_version >= "{version}"'  # newer releases drop older Pythons (numpy 2.3+: 3.11)
    args.out.write_text(HEADER.format(python=version) + "".join(f"{pin}{marker}\n" for pin in pins))
    print(f"wrote {len(pins)} pins to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
