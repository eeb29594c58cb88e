"""Every command's `--help` shows every option whole, with its default; `dlm serve`'s options
are ServeConfig's settings, declared once (dlm/cli/server/config.py, dlm/cli/setting_options.py)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from typing import Any

import pytest

from dlm.cli.main import command
from dlm.cli.server.config import ServeConfig
from dlm.cli.setting_options import default, given, names, settings
from dlm.engine.parallel.distributed import ParallelConfig

BORDERS = re.compile(r"[│╭╮╰╯─]")


def commands(group: Any = None, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    """(path, click command) of every subcommand of `dlm`, the tidied command `dlm` runs."""
    group = group or command()
    for name, sub in group.commands.items():
        if hasattr(sub, "commands"):
            yield from commands(sub, (*path, name))
        else:
            yield (*path, name), sub


COMMANDS = dict(commands())


def rendered_help(path: tuple[str, ...], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> str:
    """`dlm PATH --help` as printed (wide, so no option name is cut), as one line of words."""
    monkeypatch.setenv("COLUMNS", "250")
    monkeypatch.setenv("TERMINAL_WIDTH", "250")
    with pytest.raises(SystemExit):
        command().main([*path, "--help"], prog_name="dlm")
    return " ".join(BORDERS.sub(" ", capsys.readouterr().out).split())


def shown_default(param: Any) -> str:
    """The `[default: ...]` typer prints for an option (a string: what a None default means)."""
    if isinstance(param.show_default, str):
        return f"({param.show_default})"
    if param.is_flag and param.secondary_opts:
        return (param.opts if param.default else param.secondary_opts)[0].lstrip("-")
    value = param.default
    return ", ".join(map(str, value)) if isinstance(value, list | tuple) else str(value)


def options(cmd: Any) -> list[Any]:
    """The options that take a value or have an off switch (a plain on-flag's default is off)."""
    return [
        p
        for p in cmd.params
        if p.param_type_name == "option"
        and not (p.is_flag and not p.secondary_opts)
        and not p.required
        and p.name != "help"
    ]


@pytest.mark.parametrize("path", list(COMMANDS), ids=" ".join)
def test_every_option_shows_its_help_whole_and_its_default(
    path: tuple[str, ...], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """No help text loses a bracketed word to the formatter ("Model name clients send ."), and
    every option says its default: its value, or in words what None means ("none" where
    nothing is set). An option with a default of None and no words for it fails here."""
    text = rendered_help(path, capsys, monkeypatch)
    for param in options(COMMANDS[path]):
        assert param.show_default is not False, f"{param.opts}: the default is hidden"
        assert param.default is not None or isinstance(param.show_default, str), (
            f"dlm {' '.join(path)} {param.opts[0]}: a default of None must say what it means (show_default)"
        )
        help_text = " ".join((param.help or "").replace("\\[", "[").split())
        envvar = f" [env var: {param.envvar}]" if param.envvar and param.show_envvar else ""
        expected = f"{help_text}{envvar} [default: {shown_default(param)}]".strip()
        assert expected in text, f"dlm {' '.join(path)} {param.opts[0]}: {expected!r} not in the help"


def setting_options() -> dict[str, Any]:
    return {p.name: p for p in options(COMMANDS[("serve",)]) if p.name in ServeConfig.model_fields}


def test_serve_offers_every_setting_with_servecofigs_default_and_help() -> None:
    """One declaration per setting: `dlm serve` has an option for every ServeConfig field
    but MODEL (its argument), named, defaulted and described by the field."""
    offered = setting_options()
    assert sorted(offered) == sorted(settings()) == sorted(set(ServeConfig.model_fields) - {"model"})
    for name, param in offered.items():
        field = ServeConfig.model_fields[name]
        assert param.help == field.description and field.description, name
        assert [*param.opts, *param.secondary_opts] == [o for n in names(name) for o in n.split("/")], name
        declared = default(name) if default(name) is not None else None
        assert param.default == declared or (param.default in (None, []) and declared in (None, [])), name
        assert declared == ServeConfig().model_dump()[name] or name in ("api_keys", "admin_key"), name


def test_the_step_graphs_default_is_off_as_declared(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    text = rendered_help(("serve",), capsys, monkeypatch)
    assert ServeConfig().step_graphs == "off" and "[default: off]" in text
    assert "Model name clients send. [default: (the directory name)]" in text


def test_only_the_options_given_override_the_settings_file() -> None:
    """The command line passes on what it gave, so a settings file or DLM_* variable decides
    every other setting (flags > environment > file)."""
    serve = COMMANDS[("serve",)]
    ctx = serve.make_context("serve", ["--port", "9000", "--no-warmup", "--api-key", "k", "-tp", "1"])
    assert given(ctx, settings()) == {"port": 9000, "warmup": False, "api_keys": ["k"], "tensor_parallel_size": 1}
    assert given(serve.make_context("serve", []), settings()) == {}


def test_the_tensor_parallel_defaults_agree_with_the_engines() -> None:
    """`dlm generate` passes the parallel options on as they come: their declared defaults
    (ServeConfig's) must be the engine's own."""
    engine = {f.name: f.default for f in dataclasses.fields(ParallelConfig)}
    for name in ("tensor_parallel_size", "nnodes", "node_rank", "master_addr", "master_port"):
        assert default(name) == engine[name], name
    assert default("moe_parallel") == engine["moe"]


def test_every_serve_setting_is_documented() -> None:
    """docs/serve.md names every setting (its key or its flag): a new field is documented."""
    from pathlib import Path

    doc = (Path(__file__).parent.parent / "docs" / "serve.md").read_text()
    for name in ServeConfig.model_fields:
        flags = [o for spelling in names(name) for o in spelling.split("/")] if name in settings() else []
        assert f"`{name}`" in doc or any(flag in doc for flag in flags), f"docs/serve.md never names {name}"


@pytest.mark.parametrize("path", list(COMMANDS), ids=" ".join)
def test_help_written_to_a_pipe_cuts_no_option_name(
    path: tuple[str, ...], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """As `dlm serve --help | grep ...` prints it: no terminal and no width set (capsys's
    stdout is no terminal). At rich's 80 columns `--tensor-parallel-size` printed as
    `--tensor-parallel…` and grep found nothing; `main` widens piped help first."""
    import typer.rich_utils

    from dlm.cli.main import piped_help_width

    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.delenv("TERMINAL_WIDTH", raising=False)
    monkeypatch.setattr(typer.rich_utils, "MAX_WIDTH", None)
    piped_help_width()
    with pytest.raises(SystemExit):
        command().main([*path, "--help"], prog_name="dlm")
    text = capsys.readouterr().out
    assert "…" not in text
    words = set(BORDERS.sub(" ", text).replace(",", " ").split())
    for param in COMMANDS[path].params:
        for name in [*param.opts, *param.secondary_opts]:
            if name.startswith("--"):
                assert name in words, f"dlm {' '.join(path)}: {name} not whole in piped help"


def usage_lines() -> dict[tuple[str, ...], str]:
    """docs/cli.md's usage block: each command's lines (from `dlm COMMAND` to the next `dlm`)."""
    from pathlib import Path

    doc = (Path(__file__).parent.parent / "docs" / "cli.md").read_text()
    block = doc.split("## Commands\n\n```\n", 1)[1].split("```", 1)[0]
    usage: dict[tuple[str, ...], str] = {}
    for line in block.splitlines():
        if line.startswith("dlm "):
            words = line.split()[1:]
            path = tuple(w for w in words[: next(i for i, w in enumerate(words) if not w.isalpha() or w != w.lower())])
            usage[path] = line
        else:
            usage[path] += "\n" + line
    return usage


OPTION = re.compile(r"(?<![\w-])(--?[a-z][a-z0-9-]*)(?: ([^\s\[\]()|]+(?:\|[^\s\[\]()|]+)*))?")


def test_the_usage_lines_of_docs_cli_name_every_option_and_its_default() -> None:
    """docs/cli.md's usage block names every option of every command (but --json and --help,
    which every command takes) and no option a command lacks, so a new flag without docs fails
    here; a literal value after an option (`--gen-length 128`, not `N` or `a|b`) is its default."""
    usage = usage_lines()
    assert sorted(usage) == sorted(COMMANDS)
    for path, cmd in COMMANDS.items():
        params = {o: p for p in cmd.params if p.param_type_name == "option" for o in [*p.opts, *p.secondary_opts]}
        assert "--json" in params, f"dlm {' '.join(path)} takes no --json"
        written = dict(OPTION.findall(usage[path]))
        assert sorted(written) == sorted(set(params) - {"--json", "--help"}), f"dlm {' '.join(path)}"
        for opt, value in written.items():
            if value and "|" not in value and (re.search("[a-z]", value) or re.fullmatch(r"[\d.:]+", value)):
                declared = params[opt].default
                same = str(declared) == value or (
                    isinstance(declared, int | float) and not isinstance(declared, bool) and float(value) == declared
                )
                assert same, f"docs/cli.md: dlm {' '.join(path)} {opt} {value}, but the default is {declared!r}"


# Each command's own page opens with its synopsis (deploy.md: both subcommands'). A flag added
# to a command was listed in docs/cli.md, which the test above holds, but could be left out of
# its page's (`dlm batch --kv-cache-dtype`, 2026-12-05).
PAGE_SYNOPSES: dict[str, list[tuple[str, ...]]] = {
    "serve.md": [("serve",)],
    "batch.md": [("batch",)],
    "validate.md": [("validate",)],
    "loadtest.md": [("loadtest",)],
    "estimate.md": [("estimate",)],
    "doctor.md": [("doctor",)],
    "deploy.md": [("deploy", "kubernetes"), ("deploy", "haproxy")],
}


def page_synopsis(page: str, path: tuple[str, ...], following: tuple[str, ...] | None) -> str:
    """The lines of `dlm PATH ...` in the page's first code block (indented or fenced), up to
    the next command's line or the block's end."""
    from pathlib import Path

    text = (Path(__file__).parent.parent / "docs" / page).read_text()
    block = re.search(r"^(?:```\n|    )(dlm .*?)(?:\n```|\n\n)", text, re.S | re.M)
    assert block is not None, f"docs/{page} opens with no synopsis"
    lines = block.group(1).split(f"dlm {' '.join(path)} ", 1)[1]
    return lines.split(f"dlm {' '.join(following)} ", 1)[0] if following else lines


@pytest.mark.parametrize("page", sorted(PAGE_SYNOPSES))
def test_each_commands_page_opens_with_every_option_it_has_and_none_it_lacks(page: str) -> None:
    """Every option has at least one of its spellings in the page's synopsis (`--openapi`'s
    `--no-openapi`, `-tp` for `--tensor-parallel-size`), and every option written exists."""
    paths = PAGE_SYNOPSES[page]
    for path, following in zip(paths, [*paths[1:], None], strict=True):
        params = [p for p in COMMANDS[path].params if p.param_type_name == "option"]
        written = set(dict(OPTION.findall(page_synopsis(page, path, following))))
        spellings = {o for p in params for o in [*p.opts, *p.secondary_opts]}
        assert not written - spellings, f"docs/{page}: dlm {' '.join(path)} has no {sorted(written - spellings)}"
        missing = [p.opts[0] for p in params if p.opts[0] != "--help" and not {*p.opts, *p.secondary_opts} & written]
        assert not missing, f"docs/{page}: the synopsis of dlm {' '.join(path)} leaves out {missing}"
