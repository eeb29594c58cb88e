"""docs/serve.md's tables hold what the server is: every ServeConfig setting with its default,
every error code the server's code can answer, every metric it registers, every route."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from dlm.cli.server.config import ServeConfig

ROOT = Path(__file__).parent.parent
DOC = (ROOT / "docs" / "serve.md").read_text()


def section(title: str) -> str:
    """The text of `## title` up to the next heading of the same level."""
    return DOC.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def table(text: str, header: str) -> list[list[str]]:
    """The rows (cells) of the first table in text whose header starts with `header`."""
    lines = text[text.index(header) :].splitlines()[2:]
    rows = []
    for line in lines:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split(" | ")])
    return rows


def documented_default(field: str, text: str) -> Any:
    """A default cell read as a value: `—` is unset, a number with its unit, true/false; any
    other words stand for a derived default (None)."""
    text = text.replace("`", "").split(" (")[0].strip()
    if text.startswith("—"):
        return None
    if text in ("true", "false"):
        return text == "true"
    number = re.fullmatch(r"(\d+(?:\.\d+)?) ?(s|MiB)?", text)
    if number:
        value = float(number.group(1))
        return value * 2**20 if number.group(2) == "MiB" and not field.endswith("_mib") else value
    return text


def test_the_settings_table_gives_every_setting_its_default() -> None:
    """Each ServeConfig field has a row of the Configuration table, whose default is the
    field's: its value, or for a field whose default is None (unset, or derived at start:
    the family's block length), a dash or words, never a value the server does not take."""
    rows = table(section("Configuration"), "| setting | default |")
    found: dict[str, str] = {}
    for cells in rows:
        names = [n for n in re.findall(r"`([a-z_]+)`", cells[0]) if n in ServeConfig.model_fields]
        defaults = cells[1].split(", ") if len(names) > 1 and cells[1].count(", ") == len(names) - 1 else None
        for i, name in enumerate(names):
            found[name] = defaults[i] if defaults else cells[1]
    assert sorted(found) == sorted(ServeConfig.model_fields), "docs/serve.md's settings table"
    declared = ServeConfig().model_dump()
    for name, cell in found.items():
        value, written = declared[name], documented_default(name, cell)
        if name in ("api_keys", "allowed_ips"):
            assert value == [] and written is None, name
        elif value is None:
            assert written is None or isinstance(written, str), f"{name}: {cell!r}, but unset by default"
        elif isinstance(value, bool):
            assert written is value, f"{name}: {cell!r}, but the default is {value!r}"
        elif isinstance(value, int | float):
            assert written == value, f"{name}: {cell!r}, but the default is {value!r}"
        else:
            assert written == value, f"{name}: {cell!r}, but the default is {value!r}"


def server_codes() -> set[str]:
    """Every `code` an APIError of the server's code is made with, and the codes of the
    engine's finish reasons (generation.ENDINGS)."""
    codes: set[str] = set()
    for path in (ROOT / "dlm" / "cli" / "server").glob("*.py"):
        codes |= set(re.findall(r'code="([a-z_]+)"', path.read_text()))
    from dlm.cli.server import generation

    endings = [v for v in vars(generation).values() if isinstance(v, dict)]
    for ending in endings:
        for value in ending.values():
            if isinstance(value, tuple) and len(value) == 4 and isinstance(value[0], int):
                codes.add(value[2])
    return codes


def test_every_error_code_the_server_answers_is_documented() -> None:
    """The Errors table names each code; the admin endpoint's are in Deployments and hot
    swaps, the logged-only client_closed in Logs."""
    elsewhere = {
        "client_closed": section("Logs"),
        "wrong_deployment": section("Deployments and hot swaps"),
        "swap_in_progress": section("Deployments and hot swaps"),
        "no_pending_release": section("Deployments and hot swaps"),
        "swap_failed": section("Deployments and hot swaps"),
    }
    errors = "\n".join(" | ".join(row) for row in table(section("Errors"), "| status | type / code |"))
    codes = server_codes()
    assert {"request_timeout", "engine_error", "shutdown", "invalid_json", "internal_error"} <= codes
    for code in codes:
        assert f"`{code}`" in elsewhere.get(code, errors), f"docs/serve.md never documents the code {code}"


def test_every_metric_is_in_the_metrics_table() -> None:
    """Each dlm_* family metrics.py registers (a counter as NAME_total) has a row."""
    source = (ROOT / "dlm" / "cli" / "server" / "metrics.py").read_text()
    names = set(re.findall(r'"(dlm_[a-z_]+)"', source))
    counters = set(re.findall(r'(?:counter|CounterMetricFamily)\(\s*"(dlm_[a-z_]+)"', source))
    rows = " ".join(row[0] for row in table(section("Metrics"), "| name | kind |"))
    documented = set(re.findall(r"`(dlm_[a-z_]+)", rows))
    assert len(names) > 20
    for name in names:
        assert (f"{name}_total" if name in counters else name) in documented, f"docs/serve.md: no row for {name}"


def test_every_route_is_in_the_endpoints_table() -> None:
    """Each method and path the app serves (HEAD aside, which every GET answers) has a row."""
    from dlm.cli.server.app import create_app

    rows = " ".join(row[0] for row in table(section("Endpoints"), "| path | key |"))
    app = create_app(ServeConfig())
    routes = {(m, r.path) for r in app.routes for m in getattr(r, "methods", None) or () if m != "HEAD"}
    routes.discard(("GET", "/docs/oauth2-redirect"))
    assert ("POST", "/v1/completions") in routes
    for method, path in routes:
        path = re.sub(r"\{(\w+):\w+\}", r"{\1}", path)  # {model:path}: the doc writes {model}
        assert f"`{method} {path}`" in rows, f"docs/serve.md's endpoints: no row for {method} {path}"


def test_the_usage_block_names_every_option() -> None:
    """The page's usage lines name each `dlm serve` option (one spelling of it) and no other."""
    from tests.test_cli_help import COMMANDS, OPTION

    block = DOC.split("\n\n", 2)[2].split("\n\n", 1)[0]
    assert block.lstrip().startswith("dlm serve")
    written = {opt for opt, _ in OPTION.findall(block)}
    params = [p for p in COMMANDS[("serve",)].params if p.param_type_name == "option" and p.name != "help"]
    spellings = {o for p in params for o in [*p.opts, *p.secondary_opts]}
    assert written <= spellings, written - spellings
    for param in params:
        assert written & {*param.opts, *param.secondary_opts}, f"docs/serve.md's usage lacks {param.opts[0]}"
