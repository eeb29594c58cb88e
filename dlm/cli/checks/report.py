"""Reports of a validation run: a rich table, a JSON document, and JUnit XML for CI."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from dlm.cli.checks.runner import FAILED, PASSED, SKIPPED, CheckResult

STYLE = {PASSED: "[green]passed[/]", FAILED: "[bold red]FAILED[/]", SKIPPED: "[yellow]skipped[/]"}


def counts(results: list[CheckResult]) -> dict[str, int]:
    return {s: sum(1 for r in results if r.status == s) for s in (PASSED, FAILED, SKIPPED)}


def render_table(results: list[CheckResult], url: str, console: Console) -> None:
    table = Table(title=f"dlm validate {escape(url)}", title_justify="left")
    table.add_column("check", no_wrap=True)
    table.add_column("result", no_wrap=True)
    table.add_column("time", justify="right", no_wrap=True)
    table.add_column("detail", overflow="fold")
    for r in results:
        table.add_row(r.name, STYLE[r.status], f"{r.seconds:.2f}s", escape(r.detail))  # the server's words
    console.print(table)
    c = counts(results)
    verdict = "[bold red]FAILED[/]" if c[FAILED] else "[bold green]PASSED[/]"
    console.print(f"{verdict}: {c[PASSED]} passed, {c[FAILED]} failed, {c[SKIPPED]} skipped")


def to_json(results: list[CheckResult], url: str) -> dict[str, Any]:
    c = counts(results)
    return {"url": url, "passed": c[FAILED] == 0, "counts": c, "checks": [r.to_dict() for r in results]}


# What XML 1.0 cannot hold, escaped or not: control characters but tab, newline and carriage
# return, lone surrogates (a JSON "\\ud800" decodes to one), U+FFFE and U+FFFF.
NOT_XML = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def xml_text(text: str) -> str:
    """`text` as XML can carry it: each character it cannot, as a visible `\\x1b`-style escape
    (a server's or a model's words may hold an ANSI colour code or a NUL)."""
    return NOT_XML.sub(lambda m: m.group().encode("unicode_escape", "backslashreplace").decode("ascii"), text)


def write_junit(results: list[CheckResult], url: str, path: str | Path) -> None:
    """One <testcase> per check: CI systems show failures and skips by check name."""
    c = counts(results)
    suite = ET.Element(
        "testsuite",
        name="dlm validate",
        tests=str(len(results)),
        failures=str(c[FAILED]),
        skipped=str(c[SKIPPED]),
        errors="0",
        time=f"{sum(r.seconds for r in results):.3f}",
    )
    ET.SubElement(ET.SubElement(suite, "properties"), "property", name="url", value=xml_text(url))
    for r in results:
        case = ET.SubElement(
            suite, "testcase", classname="dlm.validate", name=xml_text(r.name), time=f"{r.seconds:.3f}"
        )
        detail = xml_text(r.detail)
        if r.status == FAILED:
            ET.SubElement(case, "failure", message=detail).text = detail
        elif r.status == SKIPPED:
            ET.SubElement(case, "skipped", message=detail)
    root = ET.Element("testsuites")
    root.append(suite)
    ET.indent(root)
    # UTF-8 as the declaration says, whatever the locale's encoding
    Path(path).write_text(ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n", encoding="utf-8")
