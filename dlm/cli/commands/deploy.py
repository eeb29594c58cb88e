"""`dlm deploy`: render a Kubernetes deployment or a proxy configuration for `dlm serve` replicas."""

from __future__ import annotations

from pathlib import Path

import typer

from dlm.cli import parallel as tp
from dlm.cli.output import cli_errors, emit_json, err_console

app = typer.Typer(
    help="Render deployments of `dlm serve`: Kubernetes manifests, an HAProxy configuration (docs/deploy.md).",
    no_args_is_help=True,
)


@app.command("kubernetes")
def kubernetes(
    source: str = typer.Argument(
        ..., help="What the init step fetches: a hub repo id (org/name) or a path mounted in the pod."
    ),
    revision: str | None = typer.Option(None, "--revision", help="Hub commit to pin (40 hex digits)."),
    name: str | None = typer.Option(None, "--name", help="Name of the Kubernetes objects [dlm]."),
    model_name: str | None = typer.Option(None, "--model-name", help="Name in the store [the repo's name]."),
    image: str | None = typer.Option(None, "--image", help="Container image [dlm:0.1.0-cuda]."),
    namespace: str | None = typer.Option(None, "--namespace", "-n", help="Namespace of every object."),
    replicas: int | None = typer.Option(None, "--replicas", help="Replicas (the minimum with --max-replicas) [2]."),
    max_replicas: int | None = typer.Option(
        None, "--max-replicas", help="Add a HorizontalPodAutoscaler on queue depth up to this many replicas."
    ),
    target_waiting: float | None = typer.Option(
        None, "--target-waiting", help="Waiting requests per replica the autoscaler keeps [2]."
    ),
    config_file: Path | None = typer.Option(
        None, "--config", help="The serve settings (TOML/YAML, as `dlm serve --config`); shipped as a ConfigMap."
    ),
    tensor_parallel_size: int | None = tp.TENSOR_PARALLEL_SIZE,
    nnodes: int | None = tp.NNODES,
    gpu: str | None = typer.Option(None, "--gpu", help="Refuse unless the memory plan fits this GPU."),
    estimate_from: str | None = typer.Option(
        None, "--estimate-from", help="Checkpoint dir or config.json to plan memory from [SOURCE]."
    ),
    store_size: str | None = typer.Option(None, "--store-size", help="Store volume size [2.2 x the weights]."),
    storage_class: str | None = typer.Option(None, "--storage-class", help="StorageClass of the store volume."),
    store_access_mode: str | None = typer.Option(
        None, "--store-access-mode", help="ReadWriteMany (pods share it) or ReadWriteOnce (one replica)."
    ),
    shm_size: str | None = typer.Option(None, "--shm-size", help="/dev/shm size for NCCL [16Gi]."),
    drain_delay: int | None = typer.Option(
        None, "--drain-delay", help="preStop seconds before SIGTERM, while endpoints drop the pod [10]."
    ),
    load_throughput_mb: float | None = typer.Option(
        None, "--load-throughput-mb", help="MB/s a pod reads weights at; sizes the startup probe [200]."
    ),
    api_key_secret: str | None = typer.Option(
        None, "--api-key-secret", help="Secret holding `api-keys` (comma-separated) [NAME-api-keys]."
    ),
    no_api_keys: bool = typer.Option(False, "--no-api-keys", help="Serve without API keys."),
    hf_token_secret: str | None = typer.Option(
        None, "--hf-token-secret", help="Secret holding `token` for gated repos [NAME-hf-token]."
    ),
    out: Path | None = typer.Option(None, "--out", help="Write a Kustomize base into this folder instead of stdout."),
    json_out: bool = typer.Option(False, "--json", help="Print the objects as a JSON list on stdout."),
) -> None:
    """Render a Kubernetes deployment of SOURCE: Deployment (or LeaderWorkerSet across nodes), Service, ..."""
    with cli_errors():
        from dlm.cli.deploy import kubernetes as k8s

        settings = k8s.kubernetes_settings(
            name=name or "dlm",
            source=source,
            revision=revision,
            model_name=model_name,
            image=image,
            namespace=namespace,
            replicas=replicas,
            max_replicas=max_replicas,
            target_waiting=target_waiting,
            gpu=gpu,
            store_size=store_size,
            storage_class=storage_class,
            store_access_mode=store_access_mode,
            shm_size=shm_size,
            drain_delay=drain_delay,
            load_throughput_mb=load_throughput_mb,
            api_keys=not no_api_keys,
            api_key_secret=api_key_secret,
            hf_token_secret=hf_token_secret,
        )
        flags = {"tensor_parallel_size": tensor_parallel_size, "nnodes": nnodes}
        config, serve_settings = k8s.serve_settings(config_file, flags)
        report = k8s.plan_report(config, estimate_from or source, gpu)
        objects = k8s.render(config, settings, report, serve_settings)
        if out is not None:
            for path in k8s.write_base(objects, out):
                err_console.print(f"wrote {path}", highlight=False)
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
        300.0, "--request-timeout", help="The servers' request_timeout: the longest a request may take."
    ),
    out: Path | None = typer.Option(None, "--out", help="Write the configuration to this file instead of stdout."),
) -> None:
    """Render an HAProxy configuration: least-outstanding-requests balancing, safe retries, SSE, weighted A/B split."""
    with cli_errors():
        from dlm.cli.deploy.haproxy import ProxySettings, parse_group, render

        text = render(
            ProxySettings(
                groups=tuple(parse_group(g) for g in group),
                bind=bind,
                check_interval_ms=check_interval_ms,
                request_timeout=request_timeout,
            )
        )
        if out is None:
            typer.echo(text, nl=False)
        else:
            out.write_text(text)
            err_console.print(f"wrote {out}", highlight=False)
