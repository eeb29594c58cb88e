"""The arguments of the commands that call a running server (`dlm validate`, `dlm loadtest`):
its URL, how its TLS certificate is checked (turned into a check by
dlm.cli.client.api.tls_verify), and the model id they ask for."""

from __future__ import annotations

from typing import Any

import typer

from dlm.cli.paths import path_value

URL_ARGUMENT: Any = typer.Argument(..., metavar="URL", help="Base URL of the server, e.g. http://127.0.0.1:8000.")
CACERT_OPTION: Any = typer.Option(
    None,
    "--cacert",
    envvar="DLM_CACERT",
    help="PEM file of the CA that signed an https:// server's certificate (a private CA).",
    show_default="the system's CAs",
    parser=path_value,
)
INSECURE_OPTION: Any = typer.Option(
    False, "--insecure", help="Do not check an https:// server's certificate (testing only)."
)


def check_model_id(model: str | None) -> None:
    """`--model` of a server's client (validate, loadtest): an empty one ('', an unset
    "$MODEL") is bad usage, never the first model of /v1/models, which it was read as."""
    from dlm.engine.errors import UsageError

    if model is not None and not model.strip():
        raise UsageError("--model is empty (leave the option out for the first of /v1/models)")
