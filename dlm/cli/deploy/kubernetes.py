"""Kubernetes manifests for `dlm serve` replicas, rendered from the server's own settings.

One replica is one `dlm serve` process group. A group on one node is a pod of a
Deployment; a tensor-parallel group that spans nodes is a LeaderWorkerSet group (one pod per
node, the leader answers HTTP). Around it: a Service, a PodDisruptionBudget, the model store
on a PersistentVolumeClaim filled by an init container (`dlm fetch` at a pinned revision,
then `dlm verify`), the serve settings as a ConfigMap, and optionally a
HorizontalPodAutoscaler on dlm's queue depth.

Why the numbers are what they are:
- resources come from `dlm estimate`'s plan (dlm/cli/estimate/plan.py) at the server's
  tensor-parallel size, batch (`max_num_seqs`) and generation length, so a pod asks for what
  the model needs and a plan that does not fit the named GPU is refused before anything runs;
- a release (new revision or image) changes only the pod template, which Kubernetes rolls
  out with `maxUnavailable: 0, maxSurge: 1`: a new pod takes traffic only once `/ready`
  (weights loaded, warm-up forward done) answers 200, and an old pod leaves only then;
- on shutdown the pod first sleeps `drain_delay` seconds in its preStop hook (endpoints
  stop sending it traffic meanwhile), then `dlm serve` gets SIGTERM and drains for up to its
  `shutdown_grace`; the termination grace period covers both.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from dlm.cli.hub import HUB_ID
from dlm.cli.server.config import Cli, ServeConfig
from dlm.engine.errors import DlmError, UsageError

PORT = 8000  # the container's HTTP port
RENDEZVOUS_PORT = 29500  # torch.distributed rendezvous on the LeaderWorkerSet leader
STORE_MOUNT = "/var/lib/dlm"  # DLM_HOME; the store is $DLM_HOME/store
RUN_DIR = "/run/dlm"  # init container -> server: the store reference it fetched
CONFIG_DIR = "/etc/dlm"
GIB = 1024**3
HOST_OVERHEAD_BYTES = 4 * GIB  # Python, torch and the staging of one safetensors shard in host memory
WARMUP_SECONDS = 120  # CUDA context, kernel compilation and the warm-up forward, beyond reading weights
LWS_API = "leaderworkerset.x-k8s.io/v1"
# Set by the server itself; the init step supplies the model and the pod its address.
NOT_IN_CONFIG = {"model", "deployment", "store", "host", "port", "nnodes", "node_rank", "master_addr", "master_port"}
REVISION = re.compile(r"^[0-9a-f]{40}\Z")
QUANTITY = re.compile(r"\d+(\.\d+)?([KMGTPE]i|[kMGTPE])?", re.ASCII)  # kubectl reads ASCII digits only
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")  # RFC 1123 label: a namespace
# A container image reference as the runtimes parse it (distribution/reference's grammar):
# [HOST/]path/components[:tag][@digest], where the first part is a host only if it holds a
# '.' or a ':port' or is localhost (else it is a path component, lowercase); anything else
# is InvalidImageName at the pod, after the manifests applied.
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
_HOST = rf"(?:localhost(?::[0-9]+)?|{_LABEL}(?:\.{_LABEL})+(?::[0-9]+)?|{_LABEL}:[0-9]+|\[[0-9A-Fa-f:]+\](?::[0-9]+)?)"
IMAGE = re.compile(
    rf"(?:{_HOST}/)?{_COMPONENT}(?:/{_COMPONENT})*(?::[\w][\w.-]{{0,127}})?"
    r"(?:@[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9A-Fa-f]{32,})?",
    re.ASCII,
)
DNS_SUBDOMAIN = re.compile(r"(?=.{1,253}\Z)[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")  # a Secret

FETCH_SCRIPT = f"""set -eu
dlm fetch "$DLM_FETCH_SOURCE" $DLM_FETCH_REVISION_FLAG --name "$DLM_FETCH_NAME" --json > {RUN_DIR}/fetch.json
ref=$(python3 -c 'import json, sys; print(json.load(sys.stdin)["ref"])' < {RUN_DIR}/fetch.json)
dlm verify "$ref"
printf '%s' "$ref" > {RUN_DIR}/model
"""
SERVE_SCRIPT = (
    f'exec dlm serve "$(cat {RUN_DIR}/model)" --config {CONFIG_DIR}/serve.yaml --host 0.0.0.0 --port {PORT} "$@"'
)


class KubernetesSettings(BaseModel):
    """What a cluster adds to the serve settings, declared once: `dlm deploy kubernetes`'s
    options are built from these fields (dlm/cli/setting_options.py)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field("dlm", description="Name of every object (a DNS-1035 label).")
    source: str = Field(min_length=1, description="What `dlm fetch` takes: a hub repo id or a path mounted in the pod.")
    revision: Annotated[str | None, Cli(shown="none; a hub source needs one")] = Field(
        None, description="Hub commit the init step fetches (40 hex digits)."
    )
    model_name: Annotated[str | None, Cli(shown="the repo or directory name")] = Field(
        None, description="The model's name in the store."
    )
    image: Annotated[str | None, Cli(shown="dlm:VERSION-cuda, -cpu with --device cpu")] = Field(
        None, description="Container image."
    )
    namespace: Annotated[str | None, Cli(names=("--namespace", "-n"), shown="none: kubectl's")] = Field(
        None, description="Namespace of every object."
    )
    replicas: int = Field(2, ge=1, description="Replicas (the minimum with --max-replicas).")
    max_replicas: Annotated[int | None, Cli(shown="none: no autoscaler")] = Field(
        None, ge=1, description="Add a HorizontalPodAutoscaler on queue depth up to this many replicas."
    )
    target_waiting: float = Field(2.0, gt=0, description="Waiting requests per replica the autoscaler keeps.")
    gpu: Annotated[str | None, Cli(shown="none")] = Field(
        None, description="Refuse unless the memory plan fits this GPU of `dlm estimate`'s catalogue."
    )
    store_size: Annotated[str | None, Cli(shown="two copies of the weights, +10%")] = Field(
        None, description="Store volume size (a Kubernetes quantity)."
    )
    storage_class: Annotated[str | None, Cli(shown="the cluster's default")] = Field(
        None, description="StorageClass of the store volume."
    )
    store_access_mode: Literal["ReadWriteMany", "ReadWriteOnce"] = Field(
        "ReadWriteMany", description="ReadWriteMany (pods share it) or ReadWriteOnce (one replica)."
    )
    shm_size: str = Field("16Gi", description="/dev/shm size for NCCL (a memory-backed emptyDir).")
    drain_delay: int = Field(
        10, ge=0, description="preStop seconds before SIGTERM, while endpoints stop routing to the pod."
    )
    load_throughput_mb: float = Field(
        200.0, gt=0, description="MB/s a pod reads its weights at; sizes the startup probe."
    )
    api_keys: bool = Field(True, description="Require API keys (DLM_API_KEYS from a Secret).")
    api_key_secret: Annotated[str | None, Cli(shown="NAME-api-keys")] = Field(
        None, description="Secret holding `api-keys` (comma-separated)."
    )
    hf_token_secret: Annotated[str | None, Cli(shown="NAME-hf-token")] = Field(
        None, description="Secret holding `token` for gated repos."
    )

    @field_validator("name")
    @classmethod
    def _dns_label(cls, value: str) -> str:
        if not re.fullmatch(r"[a-z]([-a-z0-9]{0,40}[a-z0-9])?", value):
            raise ValueError("must be lowercase letters, digits and '-', start with a letter, at most 42 characters")
        return value

    @field_validator("image")
    @classmethod
    def _image(cls, value: str | None) -> str | None:
        if value is not None and (len(value) > 255 or not IMAGE.fullmatch(value)):
            raise ValueError("must be an image reference such as registry.example.com/dlm:0.1.0-cuda (lowercase path)")
        return value

    @field_validator("namespace")
    @classmethod
    def _namespace(cls, value: str | None) -> str | None:
        if value is not None and not DNS_LABEL.fullmatch(value):
            raise ValueError(
                "must be lowercase letters, digits and '-', start and end with a letter or digit, at most 63"
            )
        return value

    @field_validator("api_key_secret", "hf_token_secret", "storage_class")
    @classmethod
    def _object_name(cls, value: str | None) -> str | None:
        if value is not None and not DNS_SUBDOMAIN.fullmatch(value):
            raise ValueError("must be a Kubernetes object name: lowercase letters, digits, '-' and '.', at most 253")
        return value

    @field_validator("model_name")
    @classmethod
    def _store_name(cls, value: str | None) -> str | None:
        from dlm.cli.store.store import NAME_RE

        if value is not None and not NAME_RE.match(value):
            raise ValueError("must be a store name: letters, digits, '.', '_' or '-', starting with a letter or digit")
        return value

    def store_name(self) -> str:
        """The name the init step's `dlm fetch --name` stores the model under."""
        return self.model_name or self.source.rstrip("/").rsplit("/", 1)[-1]

    @field_validator("store_size", "shm_size")
    @classmethod
    def _quantity(cls, value: str | None) -> str | None:
        if value is not None and not QUANTITY.fullmatch(value):
            raise ValueError("must be a Kubernetes quantity such as 500Gi or 16Gi")
        return value

    def secret(self, which: Literal["api-keys", "hf-token"]) -> str:
        given = self.api_key_secret if which == "api-keys" else self.hf_token_secret
        return given or f"{self.name}-{which}"


def kubernetes_settings(**values: Any) -> KubernetesSettings:
    """Validate the cluster settings once, as a usage error naming the field."""
    try:
        settings = KubernetesSettings(**{k: v for k, v in values.items() if v is not None})
    except ValidationError as exc:
        from dlm.cli.setting_options import option_error

        raise option_error(exc, KubernetesSettings, arguments=("source",)) from None
    hub = HUB_ID.match(settings.source) and not Path(settings.source).exists()
    if hub and (settings.revision is None or not REVISION.match(settings.revision)):
        raise UsageError(
            "--revision must be a full 40-digit commit for a hub source: a branch would let pods started "
            "at different times serve different weights"
        )
    if not hub and settings.revision is not None:  # the init step's `dlm fetch` would refuse it in every pod
        from dlm.cli.store.fetch import LOCAL_REVISION

        raise UsageError(f"{LOCAL_REVISION} (SOURCE {settings.source!r} is a path)")
    if settings.model_name is None:  # the name the pods' `dlm fetch --name` would refuse in every pod
        from dlm.cli.store.store import NAME_RE

        if not NAME_RE.match(settings.store_name()):
            raise UsageError(
                f"SOURCE {settings.source!r} gives no valid store name ({settings.store_name()!r}); "
                "give --model-name (letters, digits, '.', '_' or '-', starting with a letter or digit)"
            )
    if settings.max_replicas is not None and settings.max_replicas < settings.replicas:
        raise UsageError(f"--max-replicas ({settings.max_replicas}) is below --replicas ({settings.replicas})")
    return settings


def serve_settings(file: Path | None, flags: dict[str, Any]) -> tuple[ServeConfig, dict[str, Any]]:
    """The serve settings, validated as `dlm serve` validates them, and the part the pods read
    (`dlm serve --config`): what was given, minus what the pod supplies itself. This
    machine's DLM_* variables are not read: an API key set here must not leak into the cluster.
    API keys belong in a Secret, never in a ConfigMap, and so do the metrics push URL's
    credentials (`http://user:password@gateway`), which the ConfigMap showed to every reader."""
    from dlm.cli.server.config import load_config, read_file
    from dlm.cli.server.metrics_push import split_credentials

    config = load_config(file, flags, environ={})
    if config.api_keys or config.api_key_file is not None:
        raise UsageError("API keys go in the Secret (--api-key-secret), not in the serve settings")
    if config.metrics_push_url is not None and split_credentials(config.metrics_push_url)[1] is not None:
        raise UsageError(
            "metrics_push_url holds credentials, which the ConfigMap would show to every reader: give the "
            "URL without them, and the pods DLM_METRICS_PUSH_URL with them from a Secret (it wins over the file)"
        )
    if config.admin_enabled:
        raise UsageError("a Kubernetes replica is released by a rollout, not hot-swapped: drop the admin settings")
    if config.tensor_parallel_size % config.nnodes:
        raise UsageError(
            f"tensor_parallel_size ({config.tensor_parallel_size}) must be a multiple of nnodes ({config.nnodes})"
        )
    given = {**(read_file(file) if file is not None else {}), **{k: v for k, v in flags.items() if v is not None}}
    resolved = config.model_dump(mode="json")  # as validated: `--device CUDA:0` ships as cuda:0
    return config, {k: resolved.get(k, v) for k, v in given.items() if k not in NOT_IN_CONFIG}


def image(settings: KubernetesSettings, config: ServeConfig) -> str:
    """The image the pods run: the one given, else the CUDA or CPU build of this version."""
    from importlib.metadata import version

    return settings.image or f"dlm:{version('dlm')}-{'cpu' if config.device == 'cpu' else 'cuda'}"


# --------------------------------------------------------------------------- sizes
def quantity(n_bytes: float) -> str:
    """Bytes as a Kubernetes quantity, rounded up to a whole GiB."""
    return f"{max(1, math.ceil(n_bytes / GIB))}Gi"


class Sizing(BaseModel):
    """What one pod needs, from the memory plan."""

    gpus_per_pod: int
    host_memory_bytes: int
    checkpoint_bytes: int  # the weights once, at the serving dtype (what the store holds per version)
    startup_seconds: int


def sizing(config: ServeConfig, report: dict[str, Any], settings: KubernetesSettings) -> Sizing:
    """Pod resources from `dlm estimate`'s report for this server's shape."""
    from dlm.cli.estimate.plan import WEIGHT_FORMATS

    ranks_per_pod = config.tensor_parallel_size // config.nnodes
    per_gpu = report["memory_per_gpu"]
    weights_per_rank = sum(r["bytes"] for r in per_gpu["rows"] if r["name"].startswith("weights: "))
    if settings.gpu is not None:
        verdict = report["verdicts"][0]
        if not verdict["fits"]:
            raise DlmError(
                f"the plan needs {quantity(per_gpu['total_bytes'])} per GPU at TP {config.tensor_parallel_size}, "
                f"more than {verdict['gpu']} has; smallest TP that fits: {verdict['smallest_tp'] or 'none'}"
            )
    cpu = config.device == "cpu"
    serving = report["serving"]
    weights_per_pod = weights_per_rank * ranks_per_pod
    read_seconds = weights_per_pod / (settings.load_throughput_mb * 1e6)
    return Sizing(
        gpus_per_pod=0 if cpu else ranks_per_pod,
        # on CPU every rank's whole plan lives in host memory; on GPU the host stages weights
        host_memory_bytes=(per_gpu["total_bytes"] * ranks_per_pod if cpu else weights_per_pod) + HOST_OVERHEAD_BYTES,
        checkpoint_bytes=round(
            report["parameters"]["total"] * WEIGHT_FORMATS[serving["dtype"]].bytes_per_param(serving["group_size"])
        ),
        startup_seconds=math.ceil(read_seconds) + WARMUP_SECONDS,
    )


def plan_report(config: ServeConfig, estimate_from: str, gpu: str | None, revision: str | None) -> dict[str, Any]:
    """`dlm estimate`'s report for the server's shape: its TP, batch and generation length,
    from `estimate_from` (a hub SOURCE at the pinned `revision`). A hub out of reach is fixed
    by --estimate-from, not by another SOURCE: SOURCE is what the pods fetch."""
    from dlm.cli.estimate.plan import HubUnreachable, Serving, architecture_from_config, load_source
    from dlm.cli.estimate.plan import plan_report as estimate_report

    try:
        source = load_source(estimate_from, revision)
    except HubUnreachable as exc:
        raise DlmError(
            f"cannot read {exc.repo_id!r} from the Hugging Face hub ({exc.why}) to size the pods; give "
            "--estimate-from with the checkpoint's directory or its config.json (SOURCE stays what the pods fetch)"
        ) from None
    # What the pods' `dlm serve` checks from config.json before loading is checked here (a
    # max_model_len the model cannot hold, decoding defaults its family refuses): such pods
    # would never start. The plan's context is what they hold, its generation what fits in it.
    model = architecture_from_config(source.raw).config
    config.check_lengths(model)  # the split: estimate's check_tensor_parallel, in the same words
    context = config.model_len(model.max_position_embeddings)
    serving = Serving(
        dtype=config.dtype,
        tp=config.tensor_parallel_size,
        batch=config.max_num_seqs,
        context=context,
        gen_length=min(config.max_tokens, context - 1),
        block_length=config.block_length,  # None: the model's (`plan.model_block_length`)
        quantization=config.quantization,
        device="cpu" if config.device == "cpu" else "cuda",
    )
    return estimate_report(source, serving, gpu)


# --------------------------------------------------------------------------- objects
def _labels(settings: KubernetesSettings, component: str | None = None) -> dict[str, str]:
    labels = {"app.kubernetes.io/name": "dlm", "app.kubernetes.io/instance": settings.name}
    if component is not None:
        labels["app.kubernetes.io/component"] = component
    return labels


def _meta(settings: KubernetesSettings, name: str, **extra: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "labels": _labels(settings)}
    if settings.namespace is not None:
        meta["namespace"] = settings.namespace
    return {**meta, **extra}


def _http_probe(path: str, period: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": period,
        "timeoutSeconds": 5,
        "failureThreshold": failures,
    }


STORE_ENV = [
    {"name": "DLM_HOME", "value": STORE_MOUNT},
    {"name": "HF_HOME", "value": f"{STORE_MOUNT}/hf"},
    {"name": "HF_HUB_DISABLE_PROGRESS_BARS", "value": "1"},
]


def _init_container(settings: KubernetesSettings) -> dict[str, Any]:
    model_name = settings.store_name()
    return {
        "name": "fetch",
        "image": settings.image,
        "command": ["sh", "-c", FETCH_SCRIPT],
        "env": [
            *STORE_ENV,
            {"name": "DLM_FETCH_SOURCE", "value": settings.source},
            {"name": "DLM_FETCH_NAME", "value": model_name},
            {
                "name": "DLM_FETCH_REVISION_FLAG",
                "value": f"--revision={settings.revision}" if settings.revision else "",
            },
            {
                "name": "HF_TOKEN",
                "valueFrom": {"secretKeyRef": {"name": settings.secret("hf-token"), "key": "token", "optional": True}},
            },
        ],
        "volumeMounts": [{"name": "store", "mountPath": STORE_MOUNT}, {"name": "run", "mountPath": RUN_DIR}],
        "securityContext": _container_security(),
    }


def _container_security() -> dict[str, Any]:
    return {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def _server_container(
    config: ServeConfig, settings: KubernetesSettings, size: Sizing, args: list[str], answers_http: bool
) -> dict[str, Any]:
    resources: dict[str, Any] = {"requests": {"memory": quantity(size.host_memory_bytes), "cpu": "2"}}
    if size.gpus_per_pod:
        resources["requests"]["nvidia.com/gpu"] = str(size.gpus_per_pod)
        resources["limits"] = {"nvidia.com/gpu": str(size.gpus_per_pod)}
    container: dict[str, Any] = {
        "name": "dlm",
        "image": settings.image,
        "command": ["sh", "-c", SERVE_SCRIPT, "dlm-serve"],
        "args": args,
        "env": list(STORE_ENV),
        "resources": resources,
        "volumeMounts": [
            {"name": "store", "mountPath": STORE_MOUNT},
            {"name": "run", "mountPath": RUN_DIR},
            {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
            {"name": "shm", "mountPath": "/dev/shm"},
        ],
        "securityContext": _container_security(),
    }
    if settings.api_keys:
        secret = {"secretKeyRef": {"name": settings.secret("api-keys"), "key": "api-keys"}}
        container["env"].append({"name": "DLM_API_KEYS", "valueFrom": secret})
    if config.nnodes > 1:
        container["ports"] = [{"name": "rendezvous", "containerPort": RENDEZVOUS_PORT}]
        container["env"] = [*container["env"], {"name": "NCCL_SOCKET_IFNAME", "value": "eth0"}]
    if answers_http:
        container["ports"] = [{"name": "http", "containerPort": PORT}, *container.get("ports", [])]
        container["startupProbe"] = _http_probe("/ready", 10, math.ceil(size.startup_seconds / 10))
        container["readinessProbe"] = _http_probe("/ready", 5, 2)
        container["livenessProbe"] = _http_probe("/health", 10, 3)
        container["lifecycle"] = {"preStop": {"exec": {"command": ["sleep", str(settings.drain_delay)]}}}
    return container


def _pod_template(
    config: ServeConfig,
    settings: KubernetesSettings,
    size: Sizing,
    component: str,
    args: list[str],
    answers_http: bool,
) -> dict[str, Any]:
    annotations = {"dlm/model-source": settings.source, "dlm/model-revision": settings.revision or "content-addressed"}
    if answers_http:
        annotations |= {
            "prometheus.io/scrape": "true",
            "prometheus.io/port": str(PORT),
            "prometheus.io/path": "/metrics",
        }
    return {
        "metadata": {"labels": _labels(settings, component), "annotations": annotations},
        "spec": {
            "terminationGracePeriodSeconds": settings.drain_delay + math.ceil(config.shutdown_grace) + 15,
            "securityContext": {
                "runAsNonRoot": True,
                "runAsUser": 1000,
                "runAsGroup": 1000,
                "fsGroup": 1000,
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "initContainers": [_init_container(settings)],
            "containers": [_server_container(config, settings, size, args, answers_http)],
            "volumes": [
                {"name": "store", "persistentVolumeClaim": {"claimName": f"{settings.name}-store"}},
                {"name": "run", "emptyDir": {}},
                {"name": "config", "configMap": {"name": f"{settings.name}-serve"}},
                {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": settings.shm_size}},
            ],
        },
    }


def _rollout_annotations(settings: KubernetesSettings) -> dict[str, str]:
    """`kubectl rollout history` shows what each revision served."""
    pin = f"@{settings.revision}" if settings.revision else ""
    return {"kubernetes.io/change-cause": f"dlm deploy: {settings.source}{pin}, image {settings.image}"}


def _workload(config: ServeConfig, settings: KubernetesSettings, size: Sizing) -> dict[str, Any]:
    autoscaled = settings.max_replicas is not None
    meta = _meta(settings, settings.name, annotations=_rollout_annotations(settings))
    if config.nnodes == 1:
        spec: dict[str, Any] = {
            "selector": {"matchLabels": _labels(settings, "server")},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "template": _pod_template(config, settings, size, "server", [], True),
        }
        if not autoscaled:  # with an autoscaler, `kubectl apply` must not reset its count
            spec["replicas"] = settings.replicas
        return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta, "spec": spec}
    group = ["--nnodes", "$(LWS_GROUP_SIZE)", "--master-addr", "$(LWS_LEADER_ADDRESS)"]
    group += ["--master-port", str(RENDEZVOUS_PORT)]
    spec = {
        "leaderWorkerTemplate": {
            "size": config.nnodes,
            "restartPolicy": "RecreateGroupOnPodRestart",
            "leaderTemplate": _pod_template(config, settings, size, "leader", [*group, "--node-rank", "0"], True),
            "workerTemplate": _pod_template(
                config, settings, size, "worker", [*group, "--node-rank", "$(LWS_WORKER_INDEX)"], False
            ),
        },
        "rolloutStrategy": {
            "type": "RollingUpdate",
            "rollingUpdateConfiguration": {"maxUnavailable": 0, "maxSurge": 1},
        },
        "startupPolicy": "LeaderCreated",
    }
    if not autoscaled:
        spec["replicas"] = settings.replicas
    return {"apiVersion": LWS_API, "kind": "LeaderWorkerSet", "metadata": meta, "spec": spec}


def render(
    config: ServeConfig, settings: KubernetesSettings, report: dict[str, Any], serve_settings: dict[str, Any]
) -> list[dict[str, Any]]:
    """Every object of the deployment, in the order `kubectl apply` should create them."""
    import yaml

    shared = config.nnodes > 1 or settings.replicas > 1 or settings.max_replicas is not None
    if shared and settings.store_access_mode == "ReadWriteOnce":
        raise UsageError("several pods share the store volume: it must be ReadWriteMany (or run one replica)")
    settings = settings.model_copy(update={"image": image(settings, config)})
    size = sizing(config, report, settings)
    http_selector = _labels(settings, "leader" if config.nnodes > 1 else "server")
    store_spec: dict[str, Any] = {
        "accessModes": [settings.store_access_mode],
        # a release fetches the new version beside the one still serving
        "resources": {"requests": {"storage": settings.store_size or quantity(2.2 * size.checkpoint_bytes)}},
    }
    if settings.storage_class is not None:
        store_spec["storageClassName"] = settings.storage_class
    objects: list[dict[str, Any]] = [
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": _meta(settings, f"{settings.name}-serve"),
            "data": {"serve.yaml": yaml.safe_dump(serve_settings, sort_keys=True)},
        },
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": _meta(settings, f"{settings.name}-store"),
            "spec": store_spec,
        },
        _workload(config, settings, size),
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": _meta(settings, settings.name),
            "spec": {
                "selector": http_selector,
                "ports": [{"name": "http", "port": PORT, "targetPort": "http", "protocol": "TCP"}],
            },
        },
        {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": _meta(settings, settings.name),
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": _labels(settings)}},
        },
    ]
    if settings.max_replicas is not None:
        workload = objects[2]
        objects.append(
            {
                "apiVersion": "autoscaling/v2",
                "kind": "HorizontalPodAutoscaler",
                "metadata": _meta(settings, settings.name),
                "spec": {
                    "scaleTargetRef": {
                        "apiVersion": workload["apiVersion"],
                        "kind": workload["kind"],
                        "name": settings.name,
                    },
                    "minReplicas": settings.replicas,
                    "maxReplicas": settings.max_replicas,
                    "metrics": [
                        {
                            "type": "Pods",
                            "pods": {
                                "metric": {"name": "dlm_num_requests_waiting"},
                                "target": {"type": "AverageValue", "averageValue": f"{settings.target_waiting:g}"},
                            },
                        }
                    ],
                    # a new replica takes minutes to load: scale up at once, down slowly
                    "behavior": {"scaleDown": {"stabilizationWindowSeconds": 600}},
                },
            }
        )
    return objects


def _dump(obj: dict[str, Any]) -> str:
    """YAML without anchors: objects share sub-dicts (the store environment), readers expect
    each manifest written out in full."""
    import yaml

    class Dumper(yaml.SafeDumper):
        def ignore_aliases(self, data: Any) -> bool:
            return True

    return yaml.dump(obj, Dumper=Dumper, sort_keys=False)


def to_yaml(objects: list[dict[str, Any]]) -> str:
    return "---\n".join(_dump(o) for o in objects)


def write_base(objects: list[dict[str, Any]], directory: Path) -> list[Path]:
    """One file per object plus a kustomization.yaml listing them: a Kustomize base."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for obj in objects:
        path = directory / f"{obj['kind'].lower()}.yaml"
        path.write_text(_dump(obj))
        paths.append(path)
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [p.name for p in paths],
    }
    (directory / "kustomization.yaml").write_text(_dump(kustomization))
    return [*paths, directory / "kustomization.yaml"]
