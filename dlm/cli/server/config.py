"""ServeConfig: every knob of `dlm serve`, from one validated source.

Values come from a TOML or YAML file, then `DLM_*` environment variables, then command-line
flags; later sources win. The merged result is validated once (unknown keys and bad values
are usage errors naming the field) and printed at start with secrets replaced by key ids.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, SecretStr, ValidationError, field_validator

from dlm.cli.text_files import load_yaml, read_text
from dlm.engine.errors import UsageError
from dlm.engine.params import DEFAULTS, MODES
from dlm.engine.quantization import CHOICES as QUANTIZATION_CHOICES
from dlm.engine.quantization import KV_CACHE_DTYPES

GEN_LENGTH = DEFAULTS["gen_length"]  # a request's length when neither it nor the server says

if TYPE_CHECKING:
    from dlm.engine.config import ModelConfig
    from dlm.engine.parallel.distributed import ParallelConfig
    from dlm.engine.params import GenerationParams

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


def key_id(key: str) -> str:
    """A stable, non-reversible name for an API key, for logs and metrics."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:8]


@dataclass(frozen=True)
class Cli:
    """How a setting is spelt on `dlm serve`'s command line where its field alone does not say.

    `names`: the option's names (default: `--field-name`; a bool: `--field-name/--no-field-name`);
    `shown`: the default in words, for a setting whose default (None) means something
    ("the model's"), or "none" where it means nothing is set."""

    names: tuple[str, ...] = ()
    shown: str | None = None


def derived_default_length(max_tokens: int) -> int:
    """The max_tokens of a request that gives none, where `default_max_tokens` is not set:
    OpenAI's default answer length, within the server's limit."""
    return min(GEN_LENGTH, max_tokens)


@dataclass(frozen=True)
class Live:
    """A setting a running server takes on a reload (SIGHUP: `Service.reload`), read afresh by
    every request that follows; every other needs a restart."""


LIVE = Live()


class ServeConfig(BaseModel):
    """Every setting of `dlm serve`, declared once: its name (the config-file key, `DLM_<NAME>`
    and, unless `Cli` says otherwise, `--name`), type, default, range and help text (the
    description). `dlm serve`'s options are generated from these fields
    (dlm/cli/setting_options.py), so adding a setting is adding a field here."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    # `model` is the command's MODEL argument (or --model-path), not an option.
    model: str | None = Field(None, description="Checkpoint directory; none: the embedded default model.")
    served_model_name: Annotated[str | None, Cli(shown="the directory name")] = Field(
        None, min_length=1, pattern=r"\S", description="Model name clients send."
    )
    host: str = Field("127.0.0.1", min_length=1, pattern=r"^\S+$", description="Bind address.")
    port: int = Field(8000, ge=0, le=65535, description="Port; 0 picks a free one.")
    dtype: str = Field("auto", description="auto (per device, see dlm doctor), float32, bfloat16, float16.")
    device: str = Field("auto", description="auto, cpu, cuda, cuda:N.")
    quantization: Annotated[str | None, Cli(shown="none, or the checkpoint's own")] = Field(
        None,
        description=f"Weights of the linear layers and experts: {', '.join(QUANTIZATION_CHOICES)} "
        "(quantized at load; fp8 on CUDA only; docs/quantization.md).",
    )
    kv_cache_dtype: str = Field(
        "auto",
        description=f"{'|'.join(KV_CACHE_DTYPES)}: how requests' K/V caches store values (int8: about half of bf16, "
        "block-causal families; docs/quantization.md).",
    )
    gpu_memory_utilization: Annotated[float | None, Cli(shown="no cap")] = Field(
        None,
        gt=0,
        le=1,
        description="Share (0-1] of each GPU's memory the server may use: a ceiling, nothing is reserved (CUDA only).",
    )
    thread_governor: Annotated[
        bool | None, Cli(shown="auto: on where this CPU's forwards give the same bits at either count")
    ] = Field(
        None,
        description="On a CPU, switch the forwards between the planned threads and every core by measured step "
        "time (faster on a quiet machine; forced on, a model whose kernels round by thread count may then "
        "answer differently run to run: docs/serve.md#threads).",
    )
    backend: Literal["native", "transformers"] = Field(
        "native", description="native, or transformers: load any checkpoint with transformers."
    )
    trust_remote_code: bool = Field(
        False, description="With --backend transformers: run the checkpoint's own Python code."
    )
    # tensor parallelism (docs/parallelism.md): as `dlm generate`; torchrun's variables win
    tensor_parallel_size: Annotated[int, Cli(names=("--tensor-parallel-size", "-tp"))] = Field(
        1,
        ge=1,
        description="Split the model over N processes (one per GPU; gloo CPU processes without CUDA); "
        "rank 0 serves HTTP.",
    )
    nnodes: int = Field(1, ge=1, description="Nodes the tensor-parallel ranks span (run the command on each).")
    node_rank: int = Field(0, ge=0, description="This node's index (0 = the node that answers).")
    master_addr: Annotated[str | None, Cli(shown="none: one node")] = Field(
        None, description="Node 0's address (multi-node)."
    )
    master_port: Annotated[int | None, Cli(shown="none: one node")] = Field(
        None, ge=1, le=65535, description="Node 0's rendezvous port (multi-node)."
    )
    moe_parallel: Literal["auto", "ep", "tp"] = Field(
        "auto", description="auto, ep (experts split over ranks) or tp (each expert split)."
    )
    # security
    api_keys: Annotated[list[SecretStr], Cli(names=("--api-key",), shown="none: no key needed")] = Field(
        default_factory=list,
        description="Accepted API key (repeatable; also DLM_API_KEYS, --api-key-file).",
    )
    api_key_file: Annotated[Path | None, Cli(shown="none")] = Field(
        None, description="File with one API key per line (# comments)."
    )
    public_metrics: Annotated[bool, Cli(names=("--public-metrics/--private-metrics",))] = Field(
        False, description="Serve /metrics without a key (with 2+ API keys it needs the admin key)."
    )
    metrics_push_url: Annotated[str | None, Cli(shown="none: /metrics is scraped")] = Field(
        None,
        description="Prometheus Pushgateway to push the metrics to, every metrics-push-interval seconds "
        "(job dlm, instance HOSTNAME:PORT; /metrics is served as well).",
    )
    metrics_push_interval: float = Field(15.0, gt=0, description="Seconds between two metrics pushes.")
    max_body_bytes: int = Field(1 << 20, ge=1024, description="Request body cap in bytes; beyond: 413.")
    requests_per_minute: Annotated[float, LIVE] = Field(0, ge=0, description="Per-key request rate (0: unlimited).")
    tokens_per_minute: Annotated[float, LIVE] = Field(
        0, ge=0, description="Per-key generated-token rate (0: unlimited)."
    )
    ssl_certfile: Annotated[Path | None, Cli(shown="none: plain HTTP")] = Field(
        None, description="TLS certificate (with --ssl-keyfile)."
    )
    ssl_keyfile: Annotated[Path | None, Cli(shown="none: plain HTTP")] = Field(None, description="TLS private key.")
    allowed_ips: Annotated[list[str], Cli(names=("--allow-ip",), shown="none: every address")] = Field(
        [],
        description="Client address or network (CIDR) allowed to call the server (repeatable); others get 403. "
        "/health and /ready stay open to probes.",
    )
    # connections (docs/serve.md#hardening): idle and slow clients are closed
    read_timeout: float = Field(
        30.0, gt=0, description="Seconds to receive a request's headers, and again its body; then closed / 408."
    )
    keep_alive_timeout: int = Field(5, ge=1, description="Seconds an idle keep-alive connection stays open.")
    max_connections: int = Field(
        1000, ge=1, description="Open connections and requests; beyond, uvicorn answers 503 at once."
    )
    # scheduling and limits
    max_num_seqs: Annotated[int, Cli(names=("--max-num-seqs", "--max-concurrency")), LIVE] = Field(
        8, ge=1, description="Sequences sharing one forward (decoded concurrently)."
    )
    max_num_batched_tokens: int = Field(16384, ge=1, description="Canvas tokens in one forward.")
    max_queue: Annotated[int, LIVE] = Field(
        64, ge=0, description="Requests waiting for a slot (not for the next step) before 429."
    )
    max_queue_per_key: Annotated[int | None, Cli(shown="half the queue with 2+ keys, else all of it"), LIVE] = Field(
        None, ge=0, description="Waiting requests one API key may hold, so one key cannot fill the queue."
    )
    max_tokens: int = Field(1024, ge=1, description="Largest max_tokens (canvas length) per request.")
    default_max_tokens: Annotated[int | None, Cli(shown=f"min({GEN_LENGTH}, max-tokens)"), LIVE] = Field(
        None,
        ge=1,
        description="max_tokens when a request gives none (at most what the context leaves after its prompt).",
    )
    max_steps: Annotated[int, LIVE] = Field(
        1024,
        ge=1,
        description="Cap on every request's denoising steps (usage.denoising_steps), whatever its rule or family.",
    )
    refinement_steps: Annotated[int | None, Cli(shown="one token per step"), LIVE] = Field(
        None, ge=1, description="Denoising steps per block when a request gives no steps."
    )
    block_length: Annotated[int | None, Cli(shown="the family's"), LIVE] = Field(
        None, ge=1, description="Block length when a request gives none."
    )
    decode_mode: Annotated[str, LIVE] = Field(
        DEFAULTS["mode"],
        description=f"{'|'.join(MODES)}: decoding mode of requests that send no decode_mode (ar: block-causal "
        "families only; refused at start on others).",
    )
    max_model_len: Annotated[int | None, Cli(shown="the model's, at most max-num-batched-tokens")] = Field(
        None, ge=2, description="Prompt + generation limit."
    )
    # Off until the CUDA-graph path has run on a GPU (benchmarks/gpu_check.py checks its ids
    # against eager ones): a wrong replay would not be caught by any CPU test.
    step_graphs: str = Field(
        "off",
        description="auto, on, off: denoising forwards at static shapes, replayed as CUDA graphs on CUDA "
        "(bidirectional families; auto: CUDA only; on: also static shapes on a CPU).",
    )
    prefix_cache_mib: float = Field(
        1024.0,
        ge=0,
        description="MiB of prompt K/V reused across requests sharing a prefix (block-causal families; "
        "exact, LRU); 0 turns it off.",
    )
    prefix_cache_shared: Annotated[bool, Cli(names=("--prefix-cache-shared/--prefix-cache-per-key",))] = Field(
        False, description="Share cached prompts between API keys (only keys that trust each other); else one per key."
    )
    response_cache_size: int = Field(
        0,
        ge=0,
        description="Answers kept for identical requests of one API key (non-streamed, seeded or without random "
        "draws; LRU), answered again without a forward; 0 turns it off.",
    )
    request_timeout: Annotated[float, LIVE] = Field(
        300.0, gt=0, description="Seconds from a request's arrival before it is stopped."
    )
    shutdown_grace: float = Field(30.0, ge=0, description="Seconds SIGTERM waits for in-flight requests.")
    ready_wait: float = Field(
        120.0, ge=0, description="Seconds a request sent while the model loads waits for it, not 503."
    )
    # releases (docs/weights.md): serve a store deployment and accept hot swaps
    deployment: Annotated[str | None, Cli(names=("--deployment", "-d"), shown="none: serve MODEL")] = Field(
        None,
        description="Serve this store deployment's current release and accept hot swaps from "
        "`dlm release`/`dlm rollback`.",
    )
    store: Annotated[Path | None, Cli(shown="$DLM_HOME/store")] = Field(
        None, description="Model store for --deployment (also DLM_STORE)."
    )
    admin_port: int = Field(
        0, ge=0, le=65535, description="Admin endpoint port, always on 127.0.0.1 (0: any free one)."
    )
    admin_key: Annotated[SecretStr | None, Cli(shown="random")] = Field(
        None, description="Admin endpoint key (prefer DLM_ADMIN_KEY or --admin-key-file, which `ps` does not show)."
    )
    admin_key_file: Annotated[Path | None, Cli(shown="none")] = Field(None, description="File holding the admin key.")
    # operations
    openapi: bool = Field(
        True, description="Serve the API's description at /openapi.json and /docs (no key needed, as /health)."
    )
    warmup: bool = Field(True, description="Run a warm-up forward before /ready.")
    log_prompts: Annotated[bool, LIVE] = Field(False, description="Put prompt and output text in request logs.")
    log_level: Annotated[str, LIVE] = Field("info", description="critical, error, warning, info, debug.")
    # default_max_tokens was not given: `load_config` derived it from max_tokens (a reload
    # derives it again from the max_tokens served, which only a restart changes)
    _derived_default_length: bool = PrivateAttr(False)
    # The API keys `load_config` read (the key file's as it was then): the keys a server built
    # from this configuration accepts, which a reload compares with its own reading.
    _keys: list[str] | None = PrivateAttr(None)

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        from dlm.engine.device import device_name

        try:
            return device_name(value)
        except UsageError as exc:
            raise ValueError(str(exc).removeprefix("device ")) from None

    @field_validator("allowed_ips", mode="before")
    @classmethod
    def _allowed_ips(cls, value: Any) -> Any:
        """A list, or one text of comma-separated entries (`DLM_ALLOWED_IPS`, a file's string);
        each an address or a network, checked here so a typo stops the start."""
        import ipaddress

        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, list):
            return value
        out = []
        for item in items:
            text = str(item).strip()
            try:
                ipaddress.ip_network(text, strict=False)
            except ValueError:
                raise ValueError(f"{text!r} is not an IP address or network (CIDR)") from None
            out.append(text)
        return out

    def allowed_networks(self) -> list[Any]:
        """The allow-list as networks (empty: every address may call). An IPv4 client is
        matched by its IPv4 address, also when a dual-stack socket shows it as ::ffff:a.b.c.d
        (app.AllowList), so an entry written in that mapped form (::ffff:10.0.0.0/104) is the
        IPv4 network it names: kept as IPv6, it admitted none of its clients."""
        import ipaddress

        mapped = ipaddress.IPv6Network("::ffff:0:0/96")
        networks = []
        for entry in self.allowed_ips:
            network = ipaddress.ip_network(entry, strict=False)
            if isinstance(network, ipaddress.IPv6Network) and network.subnet_of(mapped):
                network = ipaddress.ip_network(f"{network.network_address.ipv4_mapped}/{network.prefixlen - 96}")
            networks.append(network)
        return networks

    @field_validator("metrics_push_url")
    @classmethod
    def _push_url(cls, value: str | None) -> str | None:
        """An http(s) URL naming a host, as prometheus-client sends to it (`host:9091` alone
        would be read as a URL scheme `host`), without a query or fragment: the push path is
        appended to the URL as written (`?a=b` ended up before `/metrics/job/...`). Its host and
        port are checked as the push reads them: `http://gw:9O91`, a port out of range or no host
        (`http://:9091`) were accepted at start and then failed every push."""
        if value is None:
            return value
        if re.fullmatch(r"https?://[^/\s?#]+(/[^\s?#]*)?", value) is None:
            raise ValueError(
                "must be the Pushgateway's http:// or https:// URL (no query or fragment), e.g. http://pushgateway:9091"
            )
        parts = urlsplit(value)
        try:
            _ = parts.port  # reading it is the check: a port that is no number 0-65535 raises
        except ValueError as exc:
            raise ValueError(f"the Pushgateway's port: {exc}") from None
        if not parts.hostname:
            raise ValueError("names no host, e.g. http://pushgateway:9091")
        return value

    @field_validator("decode_mode")
    @classmethod
    def _decode_mode(cls, value: str) -> str:
        """The request field's choices (GenerationParams.mode): the family's refusal of a
        mode comes later, from the checkpoint (`check_defaults`)."""
        if value not in MODES:
            raise ValueError(f"must be one of {', '.join(MODES)}")
        return value

    @field_validator("step_graphs")
    @classmethod
    def _graphs(cls, value: str) -> str:
        from dlm.engine.runtime.step_graphs import CHOICES

        if value not in CHOICES:
            raise ValueError(f"must be one of {', '.join(CHOICES)}")
        return value

    @field_validator("quantization")
    @classmethod
    def _quantization(cls, value: str | None) -> str | None:
        from dlm.engine.quantization import method_named

        try:
            method = method_named(value)
        except UsageError as exc:
            raise ValueError(str(exc).removeprefix("--quantization ")) from None
        return None if method is None else method.name

    @field_validator("kv_cache_dtype")
    @classmethod
    def _kv_cache_dtype(cls, value: str) -> str:
        """The storage's choices; a family without the cache it quantizes is refused when
        the model's family is known (`dlm.engine.quantization.check_kv_cache_dtype`)."""
        if value not in KV_CACHE_DTYPES:
            raise ValueError(f"must be one of {', '.join(KV_CACHE_DTYPES)}")
        return value

    @field_validator("store", mode="before")
    @classmethod
    def _store(cls, value: Any) -> Any:
        from dlm.cli.store.store import store_path_problem

        if isinstance(value, str):  # as the store commands' --store: '' is not the current directory
            problem = store_path_problem(value)
            if problem is not None:
                raise ValueError(problem)
        return value

    @field_validator("log_level")
    @classmethod
    def _level(cls, value: str) -> str:
        levels = ("critical", "error", "warning", "info", "debug")
        if value.lower() not in levels:
            raise ValueError(f"must be one of {', '.join(levels)}")
        return value.lower()

    def model_len(self, model_max: int) -> int:
        """The served max_model_len for a model whose positions end at `model_max`; a setting
        that cannot work is a usage error (checked from config.json before loading, and again
        for every version a deployment loads)."""
        if self.max_model_len is not None and self.max_model_len > model_max:
            raise UsageError(f"max_model_len ({self.max_model_len}) exceeds the model's maximum ({model_max})")
        if self.max_model_len is not None and self.max_model_len > self.max_num_batched_tokens:
            raise UsageError(
                f"max_model_len ({self.max_model_len}) exceeds max_num_batched_tokens "
                f"({self.max_num_batched_tokens}): such a request could never run"
            )
        return self.max_model_len or min(model_max, self.max_num_batched_tokens)

    def queue_share(self, tenants: int) -> int:
        """Waiting requests one API key may hold (`max_queue_per_key`, or its default: half
        the queue with `tenants`, the distinct API keys, two or more)."""
        if self.max_queue_per_key is not None:
            return min(self.max_queue_per_key, self.max_queue)
        return -(-self.max_queue // 2) if tenants >= 2 else self.max_queue

    @property
    def default_gen_length(self) -> int:
        """The max_tokens of a request that gives none: `default_max_tokens`, else min(128,
        max_tokens), as `load_config` fills it (a ServeConfig made in Python, as `create_app`
        takes it, answered such a request with max_tokens, 1024 tokens)."""
        return self.default_max_tokens or derived_default_length(self.max_tokens)

    def pinned(self, ref: str | None) -> ServeConfig:
        """This config with MODEL pinned to the store version `ref` it was checked as (a bare
        NAME is its newest verified version whenever it is read: a fetch between the check of
        the checkpoint and its load made the server load another version, unchecked), served
        under the name given."""
        if ref is None or ref == self.model:
            return self
        return self.model_copy(update={"model": ref, "served_model_name": self.served_model_name or self.model})

    def decoding_params(self, given: dict[str, Any]) -> GenerationParams:
        """A request's decoding fields (`given`, by GenerationParams name) with this server's
        defaults for what it leaves out: the length, the block length, the decoding mode,
        per-block steps (unless it gives a step count), and --max-steps, which every request
        gets."""
        from dlm.engine.params import AR_FIXED, GenerationParams

        defaults: dict[str, Any] = {
            "gen_length": self.default_gen_length,
            "block_length": self.block_length,
            "mode": self.decode_mode,
        }
        if "steps" not in given and not GenerationParams(**given).edits:  # draft-and-edit bounds its own steps
            defaults["refinement_steps"] = self.refinement_steps
        if given.get("mode", self.decode_mode) == "ar":  # it fixes these itself; only a request's own are refused
            defaults = {k: v for k, v in defaults.items() if k not in AR_FIXED}
        values = {k: v for k, v in defaults.items() if v is not None} | given
        return GenerationParams(**values, max_steps=self.max_steps)

    def check_model(self, model: ModelConfig) -> None:
        """Refuse, from the checkpoint's config.json before it loads (and before any
        tensor-parallel rank spawns), settings it cannot serve: the context length, a split its
        heads do not allow, and decoding defaults its family refuses (e.g. another block length
        for Clover), which would fail every request that relies on them. A default length
        over the model's context is left to requests to shorten."""
        from dlm.engine.parallel.divisibility import check_tensor_parallel

        self.check_lengths(model)
        check_tensor_parallel(model, self.parallel().tensor_parallel_size)

    def check_lengths(self, model: ModelConfig) -> None:
        """`check_model` without the parallel split (what `dlm deploy` checks for pods whose
        ranks are placed by the cluster): the K/V cache storage, the context length and the
        decoding defaults."""
        from dlm.engine.family_rules import validate
        from dlm.engine.quantization import check_kv_cache_dtype
        from dlm.engine.registry import family_named

        check_kv_cache_dtype(self.kv_cache_dtype, family_named(model.family))  # as the load would, first
        self.model_len(model.max_position_embeddings)
        self.check_defaults(lambda params, prompt_length: validate(params, prompt_length, model))

    @classmethod
    def live(cls) -> tuple[str, ...]:
        """The settings marked `LIVE`: what a reload changes on a running server."""
        return tuple(name for name, field in cls.model_fields.items() if LIVE in field.metadata)

    def reloaded(self, new: ServeConfig) -> tuple[ServeConfig, dict[str, tuple[Any, Any]], list[str]]:
        """This configuration with `new`'s live settings; the live settings changed (old,
        new), and the names of the others `new` changes, which only a restart applies. A
        default length `new` does not give is derived from the max_tokens served (its own
        needs a restart); one given over it is a `UsageError`."""
        live = self.live()
        if new._derived_default_length:  # not given: min(128, max_tokens) of the max_tokens served
            new = new.model_copy(update={"default_max_tokens": derived_default_length(self.max_tokens)})
        if new.default_gen_length > self.max_tokens:
            raise UsageError(
                f"default_max_tokens ({new.default_gen_length}) exceeds max_tokens ({self.max_tokens}), "
                "which a reload does not change (a restart does)"
            )
        changed = [name for name in type(self).model_fields if getattr(self, name) != getattr(new, name)]
        if self.keys() != new.keys() and not {"api_keys", "api_key_file"} & set(changed):
            changed.append("api_key_file")  # the same path, edited: its keys take a restart too
        applied = {name: (getattr(self, name), getattr(new, name)) for name in changed if name in live}
        merged = self.model_copy(update={name: values[1] for name, values in applied.items()})
        return merged, applied, [name for name in changed if name not in live]

    def check_defaults(self, validate: Callable[[GenerationParams, int], object]) -> None:
        """Refuse decoding defaults (`block_length`, `refinement_steps`, `decode_mode`) the
        model's family refuses, with `validate` (the family's one validation: from config.json
        before loading, or a loaded engine's, which is what a deployment's releases and the
        transformers backend get): a default its family refuses would fail every request that
        relies on it. A refusal of the prompt is not the defaults'."""
        try:
            validate(self.decoding_params({}), 1)
        except UsageError as exc:
            if exc.field != "prompt":  # said as the setting's refusal, not a request's
                raise UsageError(f"a default this server gives requests is refused: {exc}", field=exc.field) from None

    def keys(self) -> list[str]:
        """Every accepted API key: the list plus the key file (one per line, # comments).
        Each is stripped, as the admin key is: a client cannot present a key's surrounding
        whitespace (`KeyRing.identify` strips the header's token, and HTTP drops it), so an
        unstripped `DLM_API_KEY` from a secret ending in a newline refused every request.
        Once `load_config` has read them, those: the file edited later is a restart's."""
        if self._keys is not None:
            return list(self._keys)
        keys = [k.get_secret_value() for k in self.api_keys]
        if self.api_key_file is not None:
            lines = read_text(self.api_key_file, "api_key_file").splitlines()
            keys += [line for line in lines if line.strip() and not line.strip().startswith("#")]
        return [_presentable_key(k, "an API key") for k in keys]

    def public(self) -> dict[str, Any]:
        """The configuration as printed at start: no secrets, only key ids (and a push URL's
        password masked: `http://user:***@gateway:9091`)."""
        data = self.model_dump(mode="json", exclude={"api_keys", "admin_key"})
        if self.metrics_push_url is not None:
            from dlm.cli.server.metrics_push import masked

            data["metrics_push_url"] = masked(self.metrics_push_url)
        data["api_keys"] = [key_id(k) for k in self.keys()]
        admin = self.configured_admin_key()
        data["admin_key"] = key_id(admin) if admin else None
        return data

    @property
    def admin_enabled(self) -> bool:
        """The admin endpoint runs for a deployment, or when an admin key was given."""
        return self.deployment is not None or self.admin_key is not None or self.admin_key_file is not None

    def parallel(self) -> ParallelConfig:
        """The tensor-parallel layout, resolved with torchrun's variables. Hot swaps would load
        a second model beside the first, which a process group of fixed shards cannot do."""
        from dlm.engine.parallel.distributed import ParallelConfig

        parallel = ParallelConfig(
            tensor_parallel_size=self.tensor_parallel_size,
            nnodes=self.nnodes,
            node_rank=self.node_rank,
            master_addr=self.master_addr,
            master_port=self.master_port,
            moe=self.moe_parallel,
        ).resolved()
        if parallel.parallel and self.admin_enabled:
            raise UsageError(
                "hot swaps (--deployment, the admin endpoint) are not supported with tensor "
                "parallelism: serve the release's checkpoint and restart the server to change it"
            )
        return parallel

    def configured_admin_key(self) -> str | None:
        """The admin key from `admin_key` or the content of `admin_key_file`, if any."""
        if self.admin_key is not None:
            key = self.admin_key.get_secret_value()
        elif self.admin_key_file is not None:
            key = read_text(self.admin_key_file, "admin_key_file")
        else:
            return None
        return _presentable_key(key, "the admin key")


def _presentable_key(key: str, what: str) -> str:
    """`key` stripped, as a client presents it in `Authorization: Bearer KEY`; a `UsageError`
    naming `what` (never the key) for one no request can present: empty, or with a character
    outside ASCII, which the OpenAI SDK cannot put in a header at all and whose UTF-8 bytes,
    as curl sends them, the server reads as Latin-1 (other characters): its holder got 401
    on every request."""
    key = key.strip()
    if not key:
        raise UsageError(f"{what} is empty")
    if not key.isascii():
        raise UsageError(f"{what} has a character outside ASCII, which no HTTP client can present as written")
    return key


def _aliases() -> dict[str, str]:
    """A setting's other long spellings on the command line, as file keys and `DLM_` names:
    `max_concurrency` is `max_num_seqs` (`--max-concurrency`), `model_path` is `model`
    (`--model-path`), as the deployment guides and other servers spell them. Not `api_key`:
    `--api-key` adds one key, as `DLM_API_KEY` does beside `DLM_API_KEYS`."""
    out = {"model_path": "model"}
    for name, field in ServeConfig.model_fields.items():
        if name == "api_keys":
            continue
        for meta in field.metadata:
            if isinstance(meta, Cli):
                for flag in meta.names:
                    key = flag.removeprefix("--").replace("-", "_")
                    if flag.startswith("--") and "/" not in flag and key != name:
                        out[key] = name
    return out


def _normalise(mapping: Mapping[str, Any], source: str) -> dict[str, Any]:
    if not isinstance(mapping, Mapping):
        raise UsageError(f"{source}: expected a table of settings")
    aliases = _aliases()
    out: dict[str, Any] = {}
    for raw, value in mapping.items():
        key = str(raw).replace("-", "_")
        name = aliases.get(key, key)
        if name in out:
            raise UsageError(f"{source}: {name} is given twice ({raw} is another name for it): give one")
        out[name] = value
    return out


# Deployment guide 003's settings file (service / model / decode / observability sections):
# each key is a setting of ours, or states what dlm always does (accepted with that value only,
# refused with any other: taken silently it would promise a behaviour dlm does not have).
GUIDE_KEYS: dict[tuple[str, str], str] = {
    ("service", "listen_port"): "port",
    ("service", "max_concurrency"): "max_num_seqs",
    ("model", "path"): "model",
    ("model", "dtype"): "dtype",
    ("model", "max_context_length"): "max_model_len",
    ("decode", "default_mode"): "decode_mode",
    ("observability", "log_level"): "log_level",
}
GUIDE_FIXED: dict[tuple[str, str], tuple[Any, str]] = {
    ("decode", "enable_causal_mask_fusion"): (
        True,
        "the block-causal families apply their causal mask inside the one attention call of a forward",
    ),
    ("observability", "metrics_enabled"): (True, "/metrics is always served"),
    ("observability", "health_path"): ("/health", "the liveness probe is /health (readiness: /ready)"),
}
GUIDE_MODES = {"autoregressive": "ar"}  # default_mode's spelling of ours (`diffusion` is the same)


def _guide_sections(data: Any, source: str) -> Any:
    """Guide 003's sectioned file as flat settings (`GUIDE_KEYS`); any other layout as it is.
    Its sections are recognised by name with a table as value (`model: /path` stays the flat
    setting); an unknown key in a section is refused, as an unknown setting is."""
    sections = {"service", "decode", "observability", "model"}
    if not isinstance(data, Mapping) or not any(k in sections and isinstance(v, Mapping) for k, v in data.items()):
        return data
    out: dict[str, Any] = {}
    for section, value in data.items():
        if section not in sections or not isinstance(value, Mapping):
            if section in out:  # a section's key set it first (YAML keeps the file's order)
                raise UsageError(f"{source}: {section} and a key of a section name the same setting: give one")
            out[section] = value
            continue
        for key, given in value.items():
            where = (section, str(key).replace("-", "_"))  # as every key of a file: `-` or `_`
            if where in GUIDE_FIXED:
                fixed, why = GUIDE_FIXED[where]
                if given != fixed:  # the value as YAML and TOML spell it (`true`, `"/health"`), not Python's
                    raise UsageError(f"{source}: {section}.{key} can only be {json.dumps(fixed)} in dlm: {why}")
            elif where in GUIDE_KEYS:
                if where == ("decode", "default_mode") and isinstance(given, str):  # a list: the setting's refusal
                    given = GUIDE_MODES.get(given, given)
                if GUIDE_KEYS[where] in out:
                    raise UsageError(f"{source}: {section}.{key} and another key name the same setting: give one")
                out[GUIDE_KEYS[where]] = given
            else:
                raise UsageError(
                    f"{source}: unknown setting {section}.{key} (the guide's sections take: "
                    f"{', '.join(f'{s}.{k}' for s, k in (*GUIDE_KEYS, *GUIDE_FIXED))})"
                )
    return out


def read_file(path: Path) -> dict[str, Any]:
    """Settings from a .toml or .yaml/.yml file (a top-level `[serve]` table is accepted, and
    deployment guide 003's sectioned layout: `GUIDE_KEYS`)."""
    text = read_text(path, "config file")
    if path.suffix == ".toml":
        try:
            data: Any = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise UsageError(f"config file {path} is not valid TOML: {exc}") from exc
    elif path.suffix in (".yaml", ".yml"):
        data = load_yaml(text, f"config file {path}") or {}
    else:
        raise UsageError(f"config file {path} must end in .toml, .yaml or .yml")
    if isinstance(data, Mapping) and set(data) == {"serve"}:
        data = data["serve"]
    return _normalise(_guide_sections(data, f"config file {path}"), str(path))


def read_env(environ: Mapping[str, str]) -> dict[str, Any]:
    """`DLM_<FIELD>` for every field (lists comma-separated); `DLM_API_KEY` adds one key. An
    empty `DLM_STORE` is unset, as for every command (`store_env`)."""
    from dlm.cli.store.store import store_env

    out: dict[str, Any] = {}
    aliases = {name: sorted(a for a, n in _aliases().items() if n == name) for name in ServeConfig.model_fields}
    for name, field in ServeConfig.model_fields.items():
        spellings = [f"DLM_{n.upper()}" for n in (name, *aliases[name]) if f"DLM_{n.upper()}" in environ]
        if len(spellings) > 1:
            raise UsageError(f"{' and '.join(spellings)} name the same setting ({name}): set one")
        value = store_env(environ) if name == "store" else environ.get(spellings[0]) if spellings else None
        if value is None:
            continue
        out[name] = [v.strip() for v in value.split(",") if v.strip()] if field.annotation == list[SecretStr] else value
    if environ.get("DLM_API_KEY"):
        out["api_keys"] = [*out.get("api_keys", []), environ["DLM_API_KEY"]]
    return out


def setting(name: str, value: Any) -> Any:
    """`value` for setting `name`, validated as `dlm serve` validates it (None: its default),
    for a command that takes one serve setting (`dlm doctor --port`): a bad value is the
    same usage error."""
    return getattr(load_config(flags={name: value}, environ={}), name)


def setting_error(exc: ValidationError) -> UsageError:
    """A settings model's first validation error as the one `error:` line: the setting's
    path and pydantic's message without the "Value error, " it wraps our validators' in."""
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "config"
    return UsageError(f"invalid setting {where}: {str(first['msg']).removeprefix('Value error, ')}")


def load_config(
    file: Path | None = None,
    flags: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> ServeConfig:
    """Merge file < environment < flags (flags given as None are "not given") and validate."""
    merged: dict[str, Any] = read_file(file) if file is not None else {}
    merged.update(read_env(os.environ if environ is None else environ))
    merged.update({k: v for k, v in (flags or {}).items() if v is not None and v != []})
    try:
        config = ServeConfig(**merged)
    except ValidationError as exc:
        raise setting_error(exc) from None
    if (config.ssl_certfile is None) != (config.ssl_keyfile is None):
        raise UsageError("TLS needs both ssl_certfile and ssl_keyfile")
    if config.default_max_tokens is None:
        config.default_max_tokens = derived_default_length(config.max_tokens)
        config._derived_default_length = True
    elif config.default_max_tokens > config.max_tokens:
        raise UsageError(f"default_max_tokens ({config.default_max_tokens}) exceeds max_tokens ({config.max_tokens})")
    config._keys = config.keys()  # a missing key file is a start-up error, not a runtime one
    config.configured_admin_key()
    if config.deployment is not None and config.model is not None:
        raise UsageError("give MODEL or --deployment, not both: a deployment serves its current release")
    from dlm.engine.llm import check_backend
    from dlm.engine.quantization import method_named

    quantization = method_named(config.quantization)
    check_backend(
        config.backend,
        config.tensor_parallel_size > 1,  # not parallel(): `dlm deploy` reads pods' settings, no rendezvous yet
        None if quantization is None else config.quantization,
        config.kv_cache_dtype,
        config.trust_remote_code,
    )
    return config
