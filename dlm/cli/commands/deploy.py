"""`dlm deploy`: render a Kubernetes deployment or a proxy configuration for `dlm serve` replicas."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from rich.markup import escape

from dlm.cli import parallel as tp
from dlm.cli.deploy.kubernetes import KubernetesSettings
from dlm.cli.output import cli_errors, emit_json, err_console, writable_dir, writable_file
from dlm.cli.paths import path_value
from dlm.cli.setting_options import default, given, setting_option, with_settings

app = typer.Typer(
    help="Render deployments of `dlm serve`: Kubernetes manifests, an HAProxy configuration (docs/deploy.md).",
    no_args_is_help=True,
)


@app.command("kubernetes")
@with_settings(KubernetesSettings, skip=("source",))
def kubernetes(
    ctx: typer.Context,
    source: str = typer.Argument(
        ..., help="What the init step fetches: a hub repo id (org/name) or a path mounted in the pod."
    ),
    config_file: Path | None = typer.Option(
        None,
        "--config",
        help="The serve settings (TOML/YAML, as `dlm serve --config`); shipped as a ConfigMap.",
        show_default="none",
        parser=path_value,
    ),
    tensor_parallel_size: int | None = tp.TENSOR_PARALLEL_SIZE,
    nnodes: int | None = tp.NNODES,
    device: str = setting_option("device"),
    estimate_from: str | None = typer.Option(
        None,
        "--estimate-from",
        help="Checkpoint directory or config.json to plan memory from (what to give when SOURCE is a hub id "
        "and the hub is out of reach).",
        show_default="SOURCE",
    ),
    out: Path | None = typer.Option(
        None,
        "--out",
        help="Write a Kustomize base into this folder instead of stdout.",
        show_default="stdout",
        parser=path_value,
    ),
    json_out: bool = typer.Option(False, "--json", help="Print the objects as a JSON list on stdout."),
    **settings: Any,
) -> None:
    """Render a Kubernetes deployment of SOURCE: Deployment (or LeaderWorkerSet across nodes), Service, ...

    The options after --json are the cluster's settings (dlm/cli/deploy/kubernetes.py); the
    serve settings come from --config, with --tensor-parallel-size, --nnodes and --device on top."""
    with cli_errors():
        from dlm.cli.deploy import kubernetes as k8s
        from dlm.engine.errors import UsageError

        if out is not None and json_out:  # --json was dropped without a word: the files were written, stdout empty
            raise UsageError(
                "--out and --json both say where the objects go (a Kustomize base, or JSON on stdout): give one"
            )
        cluster = k8s.kubernetes_settings(source=source, **settings)
        if out is not None:  # before the plan: a folder no file can be written in is bad usage
            writable_dir("--out", out)
        flags = given(ctx, ("tensor_parallel_size", "nnodes", "device"))  # the rest: the settings file's
        config, serve_settings = k8s.serve_settings(config_file, flags)
        planned = source if estimate_from is None else estimate_from  # "" is refused, not SOURCE
        report = k8s.plan_report(config, planned, cluster.gpu, None if estimate_from is not None else cluster.revision)
        objects = k8s.render(config, cluster, report, serve_settings)
        if out is not None:
            for path in k8s.write_base(objects, out):
                err_console.print(f"wrote {escape(str(path))}", highlight=False)
        elif json_out:
            emit_json(objects)
        else:
            typer.echo(k8s.to_yaml(objects), nl=False)


@app.command("haproxy")
def haproxy(
    group: list[str] = typer.Option(
        ..., "--group", "-g", help="NAME[:WEIGHT]=HOST:PORT[,HOST:PORT...]; two groups split traffic by weight."
    ),
    bind: str = typer.Option("0.0.0.0:8080", "--bind", help="Address the proxy listens on."),
    check_interval_ms: int = typer.Option(1000, "--check-interval-ms", help="How often each /ready is polled."),
    request_timeout: float = typer.Option(
        default("request_timeout"),
        "--request-timeout",
        help="The servers' request_timeout: the longest a request may take.",
    ),
    out: Path | None = typer.Option(
        None,
        "--out",
        help="Write the configuration to this file instead of stdout.",
        show_default="stdout",
        parser=path_value,
    ),
    json_out: bool = typer.Option(
        False, "--json", help='Print {"config", "out", "bind", "groups"} on stdout instead of the configuration.'
    ),
) -> None:
    """Render an HAProxy configuration: least-outstanding-requests balancing, safe retries, SSE, weighted A/B split."""
    with cli_errors():
        from dataclasses import asdict

        from dlm.cli.deploy.haproxy import ProxySettings, parse_group, render

        settings = ProxySettings(
            groups=tuple(parse_group(g) for g in group),
            bind=bind,
            check_interval_ms=check_interval_ms,
            request_timeout=request_timeout,
        )
        text = render(settings)
        if out is not None:
            writable_file("--out", out)
            out.write_text(text)
            err_console.print(f"wrote {escape(str(out))}", highlight=False)
        if json_out:
            groups = [asdict(g) for g in settings.groups]
            emit_json({"config": text, "out": None if out is None else str(out), "bind": bind, "groups": groups})
        elif out is None:
            typer.echo(text, nl=False)
