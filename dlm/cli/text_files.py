"""Text files a user names (settings files, validate suites, key files), read in one place.

Each problem is one usage error naming the file (exit 2): one that cannot be read, bytes that
are not UTF-8 (a UnicodeDecodeError was a traceback), YAML that does not parse (PyYAML's
message spans several lines, with a caret under the spot; the contract is one `error:`
line). A byte order mark opening the file, which Notepad and PowerShell write, is skipped, as
it is in JSONL files (dlm/cli/jsonl.py): kept, it was part of the first API key of a key file.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from dlm.engine.errors import UsageError


def read_text(path: Path, what: str) -> str:
    """The text of `what` (e.g. "config file") at `path`."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise UsageError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    return _decoded(data, f"{what} {path}")


def read_stdin(what: str) -> str:
    """The text of `what` (e.g. "the prompt") on standard input, read to its end."""
    return _decoded(sys.stdin.buffer.read(), f"{what} on standard input")


def _decoded(data: bytes, named: str) -> str:
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise UsageError(f"{named} is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start})") from None


def load_yaml(text: str, what: str) -> Any:
    """`yaml.safe_load`, its error on one line: `WHAT is not valid YAML at line L, column C: ...`.
    A mapping that names a key twice is refused, as YAML says and as a TOML file, a JSON body
    and a JSONL line are (dlm/cli/jsonl.py `unique_keys`): PyYAML kept the last value, so a
    settings file's second `host:` silently replaced the first."""
    import yaml

    class UniqueKeys(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            seen: set[Any] = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base` overrides by design
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    twice = key in seen
                except TypeError:  # an unhashable key: SafeLoader refuses it itself
                    continue
                if twice:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"the key {key!r} appears twice in one mapping", key_node.start_mark
                    )
                seen.add(key)
            return super().construct_mapping(node, deep)

    try:
        return yaml.load(text, Loader=UniqueKeys)  # noqa: S506 - a SafeLoader
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UsageError(f"{what} is not valid YAML{where}: {problem}") from None
