"""`dlm deploy kubernetes`: every rendered manifest validates against the Kubernetes schemas of
a current release (kubernetes-validate, offline) and LeaderWorkerSets against the CRD's schema
(tests/schemas/leaderworkerset-v1.json); a release changes only the pod template, rolled out
without losing capacity; resources come from `dlm estimate`'s plan."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from kubernetes_validate import utils as kv
from referencing import Registry, Resource
from typer.testing import CliRunner

from dlm.cli.main import app
from dlm.engine.checkpoint_writer import llada_config
from tests.serving import ROOT

KUBERNETES = "1.37"  # the newest release kubernetes-validate ships schemas for
LWS_SCHEMA = Path(__file__).parent / "schemas" / "leaderworkerset-v1.json"
COMMIT_A, COMMIT_B = "a" * 40, "b" * 40
runner = CliRunner()


def lws_validator() -> jsonschema.Draft202012Validator:
    """The CRD schema, with pod templates checked by Kubernetes' own (strict) definitions."""
    definitions = kv.schema_contents(f"kubernetes-json-schema/v{KUBERNETES}.0-local-strict/_definitions.json", "")
    registry = Registry().with_resource(
        "https://kubernetes.io/api/_definitions.json", Resource.from_contents(definitions)
    )
    schema = json.loads(LWS_SCHEMA.read_text())
    return jsonschema.Draft202012Validator(schema, registry=registry)


def validate(obj: dict[str, Any]) -> None:
    if obj["kind"] == "LeaderWorkerSet":
        lws_validator().validate(obj)
    else:
        kv.validate(obj, KUBERNETES, strict=True)


@pytest.fixture(scope="module")
def big_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The config.json of an 8B LLaDA (no weights): enough for the memory plan."""
    path = tmp_path_factory.mktemp("llada8b") / "config.json"
    config = llada_config(
        126464,
        126336,
        126081,
        d_model=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=32,
        mlp_hidden_size=12288,
        max_sequence_length=4096,
    )
    path.write_text(json.dumps(config))
    return path


def render(*args: str) -> list[dict[str, Any]]:
    result = runner.invoke(app, ["deploy", "kubernetes", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def by_kind(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {o["kind"]: o for o in objects}


SHAPES = {
    "replicas": ["--replicas", "3"],
    "replicas-autoscaled": ["--replicas", "2", "--max-replicas", "6"],
    "leaderworkerset": ["-tp", "16", "--nnodes", "2"],
    "leaderworkerset-autoscaled": ["-tp", "16", "--nnodes", "2", "--max-replicas", "4"],
}


@pytest.mark.parametrize("shape", SHAPES)
def test_every_manifest_validates(shape: str, big_config: Path) -> None:
    objects = render("org/llada-8b", "--revision", COMMIT_A, "--estimate-from", str(big_config), *SHAPES[shape])
    kinds = [o["kind"] for o in objects]
    workload = "LeaderWorkerSet" if "nnodes" in " ".join(SHAPES[shape]) else "Deployment"
    expected = ["ConfigMap", "PersistentVolumeClaim", workload, "Service", "PodDisruptionBudget"]
    assert kinds == expected + (["HorizontalPodAutoscaler"] if "autoscaled" in shape else [])
    for obj in objects:
        validate(obj)


def test_validation_rejects_a_wrong_field(big_config: Path) -> None:
    """The schemas are strict: a misspelt field or a wrong type fails, so the tests above mean something."""
    objects = by_kind(render("org/m", "--revision", COMMIT_A, "--estimate-from", str(big_config), "-tp", "8"))
    deployment = objects["Deployment"]
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessprobe"] = {}
    with pytest.raises(kv.ValidationError):
        validate(deployment)
    lws = by_kind(
        render("org/m", "--revision", COMMIT_A, "--estimate-from", str(big_config), "-tp", "8", "--nnodes", "2")
    )
    lws = lws["LeaderWorkerSet"]
    lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["image"] = 7
    with pytest.raises(jsonschema.ValidationError):
        validate(lws)
    lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["image"] = "dlm"
    lws["spec"]["rolloutStrategy"]["type"] = "Recreate"
    with pytest.raises(jsonschema.ValidationError):
        validate(lws)


def test_release_is_a_rolling_update_of_the_pod_template(big_config: Path) -> None:
    """A new revision or image changes the pod template (and the change cause) only; the
    rollout adds a pod before removing one, and only a ready pod takes traffic."""
    common = ["org/llada-8b", "--estimate-from", str(big_config), "--image", "dlm:1"]
    v1 = by_kind(render(*common, "--revision", COMMIT_A))
    v2 = by_kind(render(*common, "--revision", COMMIT_B))
    v3 = by_kind(render(*common[:-1], "dlm:2", "--revision", COMMIT_A))
    for other in (v2, v3):
        assert other["Deployment"]["spec"]["template"] != v1["Deployment"]["spec"]["template"]
        assert other["Deployment"]["metadata"]["annotations"] != v1["Deployment"]["metadata"]["annotations"]
        for kind in ("ConfigMap", "PersistentVolumeClaim", "Service", "PodDisruptionBudget"):
            assert other[kind] == v1[kind]
        assert {k: v for k, v in other["Deployment"]["spec"].items() if k != "template"} == {
            k: v for k, v in v1["Deployment"]["spec"].items() if k != "template"
        }
    spec = v2["Deployment"]["spec"]
    assert spec["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}}
    container = spec["template"]["spec"]["containers"][0]
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["startupProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    init = spec["template"]["spec"]["initContainers"][0]
    assert {"name": "DLM_FETCH_REVISION_FLAG", "value": f"--revision={COMMIT_B}"} in init["env"]
    assert "dlm verify" in init["command"][2]
    lws = by_kind(render(*common, "--revision", COMMIT_B, "-tp", "16", "--nnodes", "2"))["LeaderWorkerSet"]
    assert lws["spec"]["rolloutStrategy"]["rollingUpdateConfiguration"] == {"maxUnavailable": 0, "maxSurge": 1}


def test_resources_drain_and_probes_follow_the_plan(big_config: Path) -> None:
    from dlm.cli.estimate.plan import Serving, estimate

    objects = by_kind(
        render("org/m", "--revision", COMMIT_A, "--estimate-from", str(big_config), "-tp", "16", "--nnodes", "2")
    )
    template = objects["LeaderWorkerSet"]["spec"]["leaderWorkerTemplate"]
    assert template["size"] == 2
    leader, worker = template["leaderTemplate"], template["workerTemplate"]
    container = leader["spec"]["containers"][0]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": "8"}  # 16 ranks over 2 nodes
    assert "readinessProbe" not in worker["spec"]["containers"][0]  # workers answer no HTTP
    assert worker["spec"]["containers"][0]["args"][-2:] == ["--node-rank", "$(LWS_WORKER_INDEX)"]
    assert objects["Service"]["spec"]["selector"]["app.kubernetes.io/component"] == "leader"
    # the startup probe waits at least as long as reading the weights at the stated throughput
    plan = estimate(str(big_config), Serving(tp=16, batch=8, gen_length=1024))
    weights = sum(r["bytes"] for r in plan["memory_per_gpu"]["rows"] if r["name"].startswith("weights: "))
    probe = container["startupProbe"]
    assert probe["periodSeconds"] * probe["failureThreshold"] >= 8 * weights / 200e6
    # SIGTERM comes after the preStop delay; the grace period covers it and the server's drain
    assert container["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "10"]
    assert leader["spec"]["terminationGracePeriodSeconds"] >= 10 + 30
    # the store holds two versions during a release: the weights twice, plus a margin
    store = objects["PersistentVolumeClaim"]["spec"]["resources"]["requests"]["storage"]
    assert store == f"{math.ceil(2.2 * plan['parameters']['total'] * 2 / 1024**3)}Gi"
    volumes = {v["name"]: v for v in leader["spec"]["volumes"]}
    assert volumes["shm"]["emptyDir"]["medium"] == "Memory"
    assert volumes["store"]["persistentVolumeClaim"]["claimName"] == "dlm-store"


@pytest.mark.parametrize("how", ["--device", "--config"])
def test_cpu_replicas_ask_for_memory_not_gpus(how: str, tmp_path: Path, big_config: Path) -> None:
    """A CPU rendering (`--device cpu`, or `device = "cpu"` in the serve settings) requests no
    GPU, runs the CPU image, and its pods serve on the CPU."""
    from dlm.cli.estimate.plan import Serving, estimate

    settings = tmp_path / "serve.toml"
    settings.write_text('device = "cpu"\n')
    cpu = ["--device", "cpu"] if how == "--device" else ["--config", str(settings)]
    objects = by_kind(render("org/m", "--revision", COMMIT_A, "--estimate-from", str(big_config), *cpu))
    assert yaml.safe_load(objects["ConfigMap"]["data"]["serve.yaml"]) == {"device": "cpu"}
    container = objects["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in container["resources"]["requests"] and "limits" not in container["resources"]
    assert container["image"].endswith("-cpu")
    plan = estimate(str(big_config), Serving(batch=8, gen_length=1024))
    memory = int(container["resources"]["requests"]["memory"].removesuffix("Gi")) * 1024**3
    assert memory >= plan["memory_per_gpu"]["total_bytes"]  # the whole plan lives in host memory


def test_an_unreachable_hub_names_estimate_from(monkeypatch: pytest.MonkeyPatch) -> None:
    """Offline, the plan cannot read a hub SOURCE's config.json: the fix is --estimate-from
    (SOURCE is what the pods fetch), not another SOURCE."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    result = runner.invoke(app, ["deploy", "kubernetes", "org/not-in-any-cache", "--revision", COMMIT_A])
    assert result.exit_code == 1, result.output
    assert result.stderr.startswith("error: cannot read 'org/not-in-any-cache'"), result.stderr
    assert "give --estimate-from" in result.stderr and "pass a local checkpoint directory" not in result.stderr


def test_settings_are_the_serve_settings(tmp_path: Path, big_config: Path) -> None:
    """The ConfigMap holds what was given, and `dlm serve` reads it back as the same settings."""
    from dlm.cli.server.config import load_config

    settings = tmp_path / "serve.toml"
    settings.write_text("max_num_seqs = 4\nmax_tokens = 256\npublic_metrics = true\nshutdown_grace = 60\n")
    objects = by_kind(
        render("org/m", "--revision", COMMIT_A, "--estimate-from", str(big_config), "--config", str(settings))
    )
    shipped = tmp_path / "shipped.yaml"
    shipped.write_text(objects["ConfigMap"]["data"]["serve.yaml"])
    assert yaml.safe_load(shipped.read_text()) == {
        "max_num_seqs": 4,
        "max_tokens": 256,
        "public_metrics": True,
        "shutdown_grace": 60,
    }
    assert load_config(shipped, environ={}) == load_config(settings, environ={})
    pod = objects["Deployment"]["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] >= 10 + 60


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["org/m", "--revision", "main"], "--revision must be a full 40-digit commit"),
        (["org/m"], "--revision must be a full 40-digit commit"),
        (["org/m", "--revision", COMMIT_A, "-tp", "8", "--nnodes", "3"], "must be a multiple of nnodes"),
        (["org/m", "--revision", COMMIT_A, "--name", "Bad_Name"], "--name 'Bad_Name': must be lowercase"),
        (["org/m", "--revision", COMMIT_A, "--store-access-mode", "ReadWriteOnce"], "must be ReadWriteMany"),
        (["org/m", "--revision", COMMIT_A, "--store-size", "lots"], "must be a Kubernetes quantity"),
        (["org/m", "--revision", COMMIT_A, "--gpu", "A100-40GB", "--config", "TP1"], "more than A100-40GB has"),
        (["org/m", "--revision", COMMIT_A, "--config", "KEYS"], "API keys go in the Secret"),
        # The push URL's password was shipped in the ConfigMap, which API keys never are.
        (["org/m", "--revision", COMMIT_A, "--config", "PUSH"], "metrics_push_url holds credentials"),
        # Manifests that rendered with exit 0 and could never run (a new user's attack):
        ([""], "SOURCE '': "),
        (["org/m", "--revision", COMMIT_A, "--device", "tpu"], "device: must be auto, cpu, cuda or cuda:N"),
        (["CKPT", "--revision", COMMIT_A], "--revision applies to hub sources, not to a local directory"),
        # Names kubectl or the pods' `dlm fetch --name` refuse: they rendered with exit 0.
        (["org/m", "--revision", COMMIT_A, "--namespace", "team a"], "--namespace 'team a': must be"),
        (["org/m", "--revision", COMMIT_A, "--namespace", "Prod"], "--namespace 'Prod': must be"),
        (["org/m", "--revision", COMMIT_A, "--model-name", "a/b"], "--model-name 'a/b': must be a store name"),
        (["org/m", "--revision", COMMIT_A, "--api-key-secret", "Keys!"], "--api-key-secret 'Keys!': must be"),
        (["org/m", "--revision", COMMIT_A, "--storage-class", "fast ssd"], "--storage-class 'fast ssd': must be"),
        (["/models/my model"], "give --model-name"),
        # Another script's digits (int() reads them, kubectl and torch do not): rendered, exit 0.
        (["org/m", "--revision", COMMIT_A, "--store-size", "\u0663Gi"], "must be a Kubernetes quantity"),
        (["org/m", "--revision", COMMIT_A, "--device", "cuda:\u0661"], "device: must be auto, cpu, cuda or cuda:N"),
        (["org/m", "--revision", COMMIT_A + "\n"], "--revision must be a full 40-digit commit"),
        # Image references no runtime pulls (InvalidImageName at every pod): rendered, exit 0.
        (
            ["org/m", "--revision", COMMIT_A, "--image", "registry.example.com/dlm:0.1 cuda"],
            "--image 'registry.example.com/dlm:0.1 cuda': must be",
        ),
        (["org/m", "--revision", COMMIT_A, "--image", "Team/dlm:1"], "--image 'Team/dlm:1': must be"),
        (["org/m", "--revision", COMMIT_A, "--image", "dlm:"], "--image 'dlm:': must be"),
    ],
)
def test_bad_settings_are_one_line_errors(args: list[str], message: str, tmp_path: Path, big_config: Path) -> None:
    files = {
        "TP1": "max_num_seqs = 64\n",
        "KEYS": 'api_keys = ["sk-1"]\n',
        "PUSH": 'metrics_push_url = "http://ops:s3cret@pushgateway:9091"\n',
    }
    args = [str(big_config.parent) if a == "CKPT" else a for a in args]
    for i, arg in enumerate(args):
        if arg in files:
            args[i] = str(tmp_path / "serve.toml")
            (tmp_path / "serve.toml").write_text(files[arg])
    result = runner.invoke(app, ["deploy", "kubernetes", *args, "--estimate-from", str(big_config)])
    assert result.exit_code in (1, 2), result.output
    assert "Traceback" not in result.output and "Value error" not in result.output
    assert message in result.output


@pytest.mark.parametrize(
    "reference",
    ["registry.example.com/dlm:0.1.0-cuda", "localhost:5000/dlm", "[::1]:5000/team/dlm:x", "dlm@sha256:" + "a" * 64],
)
def test_image_references_runtimes_pull_render(reference: str, big_config: Path) -> None:
    objects = by_kind(render("org/m", "--revision", COMMIT_A, "--estimate-from", str(big_config), "--image", reference))
    assert objects["Deployment"]["spec"]["template"]["spec"]["containers"][0]["image"] == reference


def test_the_default_image_is_a_reference_runtimes_pull() -> None:
    from dlm.cli.deploy.kubernetes import IMAGE, KubernetesSettings, image
    from dlm.cli.server.config import load_config

    for device in ("cpu", "cuda"):
        config = load_config(flags={"device": device}, environ={})
        assert IMAGE.fullmatch(image(KubernetesSettings(source="org/m"), config))


def test_the_plan_holds_what_the_pods_serve(tmp_path: Path, big_config: Path) -> None:
    """The plan's context is the max_model_len the pods' `dlm serve` holds, and its generation
    at most what fits in it. A model of 512 positions at the default max_tokens (1024), and
    max_model_len 120 with max_tokens 100 (both served as they are), failed with '--context
    (512) must exceed --gen-length (1024)', flags deploy does not have; a max_model_len the
    model cannot hold, or a block length its family refuses, which `dlm serve` refuses at
    start, rendered."""
    short = tmp_path / "short" / "config.json"
    short.parent.mkdir()
    short.write_text(json.dumps({**json.loads(big_config.read_text()), "max_sequence_length": 512}))
    settings = tmp_path / "serve.toml"
    for toml, source, context in (
        ("", short, 512),
        ("max_model_len = 120\nmax_tokens = 100\n", big_config, 120),
        ("max_model_len = 1024\nmax_tokens = 1024\n", big_config, 1024),
    ):
        settings.write_text(toml)
        result = runner.invoke(
            app,
            ["deploy", "kubernetes", "org/m", "--revision", COMMIT_A, "--estimate-from", str(source)]
            + ["--config", str(settings), "--json"],
        )
        assert result.exit_code == 0, result.output
        from dlm.cli.deploy.kubernetes import plan_report
        from dlm.cli.server.config import load_config

        report = plan_report(load_config(settings, environ={}), str(source), None, None)
        assert report["serving"]["context"] == context and report["serving"]["gen_length"] < context
    settings.write_text("max_model_len = 8192\n")  # the 8B LLaDA holds 4096 positions
    result = runner.invoke(
        app,
        ["deploy", "kubernetes", "org/m", "--revision", COMMIT_A, "--estimate-from", str(big_config)]
        + ["--config", str(settings)],
    )
    assert result.exit_code == 2 and "max_model_len (8192) exceeds the model's maximum (4096)" in result.output
    settings.write_text("block_length = 64\n")  # Clover decodes 32-token blocks only
    clover = runner.invoke(
        app,
        ["deploy", "kubernetes", "org/m", "--revision", COMMIT_A, "--estimate-from", "tiny:clover"]
        + ["--config", str(settings)],
    )
    assert clover.exit_code == 2 and "clover decodes 32-token blocks only" in clover.output


def test_api_keys_come_from_a_secret(big_config: Path) -> None:
    def server_env(*args: str) -> list[dict[str, Any]]:
        objects = by_kind(render("org/m", "--revision", COMMIT_A, "--estimate-from", str(big_config), *args))
        return objects["Deployment"]["spec"]["template"]["spec"]["containers"][0]["env"]

    keys = [e for e in server_env() if e["name"] == "DLM_API_KEYS"]
    assert keys == [
        {"name": "DLM_API_KEYS", "valueFrom": {"secretKeyRef": {"name": "dlm-api-keys", "key": "api-keys"}}}
    ]
    keys = [e for e in server_env("--api-key-secret", "prod-keys") if e["name"] == "DLM_API_KEYS"]
    assert keys[0]["valueFrom"]["secretKeyRef"]["name"] == "prod-keys"
    assert not [e for e in server_env("--no-api-keys") if e["name"] == "DLM_API_KEYS"]


def test_kustomize_base(tmp_path: Path, big_config: Path) -> None:
    out = tmp_path / "base"
    result = runner.invoke(
        app,
        [
            "deploy",
            "kubernetes",
            "org/m",
            "--revision",
            COMMIT_A,
            "--estimate-from",
            str(big_config),
            "--out",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    kustomization = yaml.safe_load((out / "kustomization.yaml").read_text())
    files = [yaml.safe_load((out / name).read_text()) for name in kustomization["resources"]]
    assert [f["kind"] for f in files] == [
        "ConfigMap",
        "PersistentVolumeClaim",
        "Deployment",
        "Service",
        "PodDisruptionBudget",
    ]
    for obj in files:
        validate(obj)


def test_out_and_json_together_are_refused(tmp_path: Path, big_config: Path) -> None:
    """`--out DIR --json` wrote the base and printed nothing on stdout, --json dropped without
    a word (docs/deploy.md: `[--out DIR | --json]`): bad usage, before anything is written."""
    out = tmp_path / "base"
    args = ["deploy", "kubernetes", "org/m", "--revision", COMMIT_A, "--estimate-from", str(big_config)]
    result = runner.invoke(app, [*args, "--out", str(out), "--json"])
    assert result.exit_code == 2, result.output
    assert result.stdout == "" and "give one" in result.stderr and not out.exists()


@pytest.mark.slow
def test_init_script_fetches_verifies_and_names_the_model(tmp_path: Path) -> None:
    """The init container's script, run here with sh against a local source: the store ends up
    holding a verified version and the file the server reads names it."""
    from dlm.cli.deploy.kubernetes import FETCH_SCRIPT, RUN_DIR
    from dlm.engine.default_model import ensure_default_model

    source = ensure_default_model()
    run = tmp_path / "run"
    run.mkdir()
    script = FETCH_SCRIPT.replace(RUN_DIR, str(run))
    bin_dir = tmp_path / "bin"  # `dlm` as the image has it, from this checkout
    bin_dir.mkdir()
    (bin_dir / "dlm").write_text(f'#!/bin/sh\nexec {sys.executable} -m dlm "$@"\n')
    (bin_dir / "dlm").chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "DLM_HOME": str(tmp_path / "home"),
        "DLM_STORE": str(tmp_path / "home" / "store"),
        "DLM_FETCH_SOURCE": str(source),
        "DLM_FETCH_NAME": "tiny",
        "DLM_FETCH_REVISION_FLAG": "",
    }
    done = subprocess.run(["sh", "-c", script], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    ref = (run / "model").read_text()
    assert ref.startswith("tiny@")
    listed = subprocess.run(
        [sys.executable, "-m", "dlm", "models", "--json"], env=env, cwd=ROOT, capture_output=True, text=True
    )
    assert ref.split("@")[1] in listed.stdout and "verified" in listed.stdout


def test_quantized_pods_are_sized_for_their_quantized_weights(tmp_path: Path, big_config: Path) -> None:
    """`quantization` in the serve settings reaches the sizing, on the device the pods run: a CPU
    pod of the 8B model asks for the memory `dlm estimate --quantization int4 --device cpu`
    plans, less than a bf16 pod's."""
    from dlm.cli.estimate.plan import Serving, estimate

    def request(settings: str) -> int:
        path = tmp_path / "serve.toml"
        path.write_text(settings)
        args = ("org/m", "--revision", COMMIT_A, "--estimate-from", str(big_config), "--config", str(path))
        container = by_kind(render(*args))["Deployment"]["spec"]["template"]["spec"]["containers"][0]
        return int(container["resources"]["requests"]["memory"].removesuffix("Gi")) * 1024**3

    plan = estimate(str(big_config), Serving(quantization="int4", device="cpu"))
    int4 = request('device = "cpu"\nquantization = "int4"\n')
    assert int4 >= plan["memory_per_gpu"]["total_bytes"]
    assert int4 < request('device = "cpu"\n')


def test_the_shipped_settings_are_the_validated_ones(big_config: Path) -> None:
    """`--device CUDA:0` was accepted and shipped as typed (`device: CUDA:0`) while the image
    was chosen from the validated `cuda:0`: the pods read what dlm validated."""
    objects = by_kind(render("org/m", "--revision", COMMIT_A, "--estimate-from", str(big_config), "--device", "CUDA:0"))
    assert yaml.safe_load(objects["ConfigMap"]["data"]["serve.yaml"])["device"] == "cuda:0"
