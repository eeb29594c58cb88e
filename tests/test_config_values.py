"""config.json's numbers are checked where the file is parsed (`dlm.engine.config.parse_config`):
sizes are positive integers (never a fraction truncated, never 0), floats finite and in range
(Python's json reads `Infinity` and `NaN`), and the sizes together describe a model a tensor
can hold. Before, `"rope_theta": Infinity`, a negative `rms_norm_eps` or `"n_heads": 2.5`
passed `dlm verify`; every size 10**12 made verify's meta build raise torch's "Storage size
calculation overflowed" and end "could not verify ... says nothing about the checkpoint",
recording nothing, while `dlm estimate` printed negative memory. Now each is the typed
InvalidConfig naming the field and config.json: a failed verification recorded against
config.json, and the same one `error:` line (exit 2, as every config.json refusal) from
`estimate`, `generate` and `serve`.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from dlm.cli.store.fetch import fetch
from dlm.cli.store.store import Store
from dlm.engine.config import COMMON_DTYPES, MAX_ELEMENTS, NO_MASK, config_from_dict, load_config
from dlm.engine.errors import InvalidConfig, UsageError
from dlm.engine.registry import family_named
from dlm.engine.tiny_models import BUILDERS, special_ids
from tests.tiny_families import tiny_names
from tests.weights_helpers import cli, make_checkpoint

ERROR_LINE = re.compile(r"\W*error\b", re.IGNORECASE)


def _config(name: str) -> dict[str, Any]:
    config, _ = BUILDERS[name.removeprefix("tiny:")](*special_ids())
    return config


def _fields(config: dict[str, Any]) -> dict[str, Any]:
    """Where the family keeps its text model's fields (DiffusionGemma: under text_config)."""
    return config["text_config"] if "text_config" in config else config


def _hidden_key(fields: dict[str, Any]) -> str:
    return "d_model" if "d_model" in fields else "hidden_size"


def _heads_key(fields: dict[str, Any]) -> str:
    return "n_heads" if "n_heads" in fields else "num_attention_heads"


# damage: edits the text model's fields, returns (the key the error must name, its words)
DAMAGES: dict[str, Callable[[dict[str, Any]], tuple[str, str]]] = {
    "eps Infinity": lambda f: (f.update(rms_norm_eps=float("inf")), ("rms_norm_eps", "got Infinity"))[1],
    "eps NaN": lambda f: (f.update(rms_norm_eps=float("nan")), ("rms_norm_eps", "got NaN"))[1],
    "eps negative": lambda f: (f.update(rms_norm_eps=-1e-6), ("rms_norm_eps", "greater than 0"))[1],
    "eps zero": lambda f: (f.update(rms_norm_eps=0), ("rms_norm_eps", "greater than 0"))[1],
    "hidden zero": lambda f: (f.update({_hidden_key(f): 0}), (_hidden_key(f), "at least 1, got 0"))[1],
    "hidden negative": lambda f: (f.update({_hidden_key(f): -64}), (_hidden_key(f), "at least 1, got -64"))[1],
    "heads fraction": lambda f: (f.update({_heads_key(f): 2.5}), (_heads_key(f), "an integer, got 2.5"))[1],
    "heads string": lambda f: (f.update({_heads_key(f): "4"}), (_heads_key(f), 'an integer, got "4"'))[1],
}


@pytest.mark.parametrize("damage", list(DAMAGES))
@pytest.mark.parametrize("name", tiny_names())
def test_every_family_refuses_a_value_no_model_has(name: str, damage: str) -> None:
    config = copy.deepcopy(_config(name))
    config_from_dict(copy.deepcopy(config))  # sound as built
    key, words = DAMAGES[damage](_fields(config))
    with pytest.raises(InvalidConfig) as caught:
        config_from_dict(config)
    assert caught.value.key == key and caught.value.exit_code == 2
    assert str(caught.value).startswith(f"config.json field {key!r} must be"), caught.value
    assert words in str(caught.value), caught.value


@pytest.mark.parametrize("name", tiny_names())
def test_every_family_refuses_sizes_no_tensor_can_hold(name: str) -> None:
    """A hidden size and vocabulary of 10**12: an embedding of 10**24 elements, which torch
    cannot even build on the meta device."""
    config = copy.deepcopy(_config(name))
    fields = _fields(config)
    fields.update({_hidden_key(fields): 10**12, "vocab_size": 10**12})
    with pytest.raises(InvalidConfig, match="more than any tensor can hold") as caught:
        config_from_dict(config)
    assert str(caught.value).startswith("config.json's sizes describe a model of about")
    assert f"{MAX_ELEMENTS:.3g} elements" in str(caught.value)


@pytest.mark.parametrize("name", tiny_names())
@pytest.mark.parametrize("value", ["false", "true", 2])
def test_every_family_refuses_a_yes_no_field_that_is_not_true_or_false(name: str, value: Any) -> None:
    """`bool("false")` is True: `"tie_word_embeddings": "false"` tied the embeddings."""
    config = copy.deepcopy(_config(name))
    fields = _fields(config)
    key = "weight_tying" if "d_model" in fields else "tie_word_embeddings"
    fields[key] = value
    with pytest.raises(InvalidConfig) as caught:
        config_from_dict(config)
    assert caught.value.key == key
    assert str(caught.value).startswith(f"config.json field {key!r} must be true or false, got"), caught.value
    fields[key] = False
    assert config_from_dict(config).tie_word_embeddings is (name == "diffusion_gemma")  # its layout ties always


@pytest.mark.parametrize("name", tiny_names())
def test_every_family_refuses_a_scaled_rope_it_would_not_run(name: str) -> None:
    """No family runs scaled RoPE: a YaRN `rope_scaling` was read by no one (Dream alone
    refused it) and the model decoded with plain RoPE. Plain RoPE's spellings pass."""
    config = copy.deepcopy(_config(name))
    fields = _fields(config)
    for plain in (
        None,
        {"rope_type": "default"},
        {"type": "default", "factor": 1.0},
        {"type": "mrope", "mrope_section": [16, 24, 24]},
        {"rope_type": "default", "mrope_section": [24, 20, 20], "mrope_interleaved": True},
    ):
        fields["rope_scaling"] = plain
        config_from_dict(copy.deepcopy(config))
    fields["rope_scaling"] = {"type": "yarn", "factor": 4.0}
    with pytest.raises(InvalidConfig) as caught:
        config_from_dict(config)
    assert caught.value.key == "rope_scaling"
    assert str(caught.value) == (
        'config.json field \'rope_scaling\' must be null (dlm runs plain RoPE), got {"type": "yarn", "factor": 4.0}'
    ), caught.value


def _kv_heads_key(fields: dict[str, Any]) -> str:
    return "n_kv_heads" if "n_kv_heads" in fields else "num_key_value_heads"


@pytest.mark.parametrize("name", tiny_names())
def test_every_family_refuses_heads_its_key_value_heads_do_not_divide(name: str) -> None:
    """Attention repeats each key/value head over a whole group of heads: 4 heads over 3."""
    config = copy.deepcopy(_config(name))
    fields = _fields(config)
    fields.update({_heads_key(fields): 4, _kv_heads_key(fields): 3})
    with pytest.raises(InvalidConfig) as caught:
        config_from_dict(config)
    assert caught.value.key == "num_kv_heads" and caught.value.exit_code == 2
    assert "4 attention heads over 3 key/value heads" in str(caught.value), caught.value


def _linear(name: str) -> bool:
    return config_from_dict(_config(name)).linear is not None


@pytest.mark.parametrize("name", [name for name in tiny_names() if _linear(name)])
def test_every_hybrid_family_refuses_value_heads_its_key_heads_do_not_divide(name: str) -> None:
    """Gated DeltaNet reads each key head with a whole group of value heads: 5 over 2 raised
    ValueError from the layer's build (a traceback from verify, generate and serve)."""
    config = copy.deepcopy(_config(name))
    fields = _fields(config)
    fields.update(linear_num_key_heads=2, linear_num_value_heads=5)
    with pytest.raises(InvalidConfig) as caught:
        config_from_dict(config)
    assert caught.value.key == "linear_num_value_heads" and caught.value.exit_code == 2
    assert "5 linear-attention value heads over 2 key heads" in str(caught.value), caught.value


def _masked(name: str) -> bool:
    return config_from_dict(_config(name)).mask_token_id != NO_MASK


@pytest.mark.parametrize("name", [name for name in tiny_names() if _masked(name)])
@pytest.mark.parametrize("past", [0, 1000])
def test_every_family_with_a_mask_refuses_one_outside_its_embedding(name: str, past: int) -> None:
    """Every canvas starts as MASK ids: one past the embedding's rows made the first forward
    raise IndexError (a traceback from `dlm generate`); a negative one too."""
    config = copy.deepcopy(_config(name))
    rows = config_from_dict(copy.deepcopy(config)).logits_size
    config["mask_token_id"] = rows + past
    with pytest.raises(InvalidConfig) as caught:
        config_from_dict(config)
    assert caught.value.key == "mask_token_id" and caught.value.exit_code == 2
    assert str(caught.value) == (
        f"config.json field 'mask_token_id' must be a row of the embedding (0..{rows - 1}), got {rows + past}"
    )
    config["mask_token_id"] = -1
    with pytest.raises(InvalidConfig, match=r"^config.json field 'mask_token_id' must be at least 0, got -1$"):
        config_from_dict(config)
    family = family_named(config_from_dict(_config(name)).family)
    config["mask_token_id"] = None  # null reads as absent: the family's documented MASK, or a refusal
    if family.mask_token_id is None:
        with pytest.raises(UsageError, match="config.json has no mask_token_id"):
            config_from_dict(config)
    else:  # the documented MASK of the real checkpoints: past a tiny vocabulary, so refused
        with pytest.raises(InvalidConfig, match=rf"\(0\.\.{rows - 1}\), got {family.mask_token_id}$"):
            config_from_dict(config)


@pytest.mark.parametrize("name", tiny_names())
@pytest.mark.parametrize("eos", [-5, 0, 10**9])
def test_every_family_refuses_an_eos_its_model_cannot_emit(name: str, eos: int) -> None:
    """An EOS outside the model's rows never stops an answer: every request ran to its length."""
    config = copy.deepcopy(_config(name))
    rows = config_from_dict(copy.deepcopy(config)).logits_size
    eos = rows if eos == 0 else eos  # one past the last row
    _fields(config)["eos_token_id"] = eos
    config["eos_token_id"] = eos
    with pytest.raises(InvalidConfig) as caught:
        config_from_dict(config)
    assert caught.value.key == "eos_token_id"
    assert (
        str(caught.value) == f"config.json field 'eos_token_id' must be a token of the model (0..{rows - 1}), got {eos}"
    )


@pytest.mark.parametrize("name", tiny_names())
def test_every_family_keeps_every_eos_a_list_names(name: str) -> None:
    config = copy.deepcopy(_config(name))
    _fields(config)["eos_token_id"] = config["eos_token_id"] = [7, 3, 9]
    parsed = config_from_dict(config)
    assert (parsed.eos_token_ids, parsed.eos_token_id) == ((7, 3, 9), 7)
    _fields(config)["eos_token_id"] = config["eos_token_id"] = [7, "3"]
    with pytest.raises(InvalidConfig, match="field 'eos_token_id' must be an integer"):
        config_from_dict(config)


@pytest.mark.parametrize("name", tiny_names())
def test_every_family_joins_the_eos_ids_generation_config_lists(name: str, tmp_path: Path) -> None:
    """A chat model may list its end of turn only in generation_config.json (SDAR's
    `<|im_end|>` beside config.json's `<|endoftext|>`): each ends an answer, after config.json's
    own (whose first still fills the canvas after an early stop); one it repeats counts once.
    Before, generation_config.json's were dropped and a chat answer ran to its length."""
    config = copy.deepcopy(_config(name))
    _fields(config)["eos_token_id"] = config["eos_token_id"] = 7
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [9, 7, 3]}))
    parsed = load_config(tmp_path)
    assert (parsed.eos_token_ids, parsed.eos_token_id) == ((7, 9, 3), 7)


def _qwen_experts(name: str) -> bool:
    """Whether the family places Qwen-style experts (`mlp_only_layers`, a softmax router)."""
    moe = config_from_dict(_config(name)).moe
    return moe is not None and moe.router == "softmax"


@pytest.mark.parametrize("name", [name for name in tiny_names() if _qwen_experts(name)])
@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("abc", 'must be a list of layer indices, got "abc"'),
        (3, "must be a list of layer indices, got 3"),
        ([0, "1"], "must be an integer"),
        ([-1], "must be at least 0"),
        ([99], "names layer 99, past the model's"),
    ],
)
def test_a_dense_layer_list_that_names_no_layer_is_refused(name: str, value: Any, words: str) -> None:
    """mlp_only_layers "abc" was read as the set of its characters: no layer, silently."""
    config = copy.deepcopy(_config(name))
    _fields(config)["mlp_only_layers"] = value
    with pytest.raises(InvalidConfig) as caught:
        config_from_dict(config)
    assert caught.value.key == "mlp_only_layers" and words in str(caught.value), caught.value


@pytest.mark.parametrize("name", [name for name in tiny_names() if not _masked(name)])
def test_a_family_without_a_mask_never_reads_the_field(name: str) -> None:
    """DiffusionGemma's canvas starts as random tokens: a mask_token_id there is not its MASK."""
    config = copy.deepcopy(_config(name))
    config["mask_token_id"] = 10**6
    assert config_from_dict(config).mask_token_id == NO_MASK


def _every_size(config: dict[str, Any]) -> None:
    for key, value in list(config.items()):
        if type(value) is int and not key.endswith("token_id"):
            config[key] = 10**12


CHECKPOINT_DAMAGES: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "rope_theta Infinity": (
        lambda c: c.update(rope_theta=float("inf")),
        "config.json field 'rope_theta' must be a finite number, got Infinity",
    ),
    "rms_norm_eps NaN": (
        lambda c: c.update(rms_norm_eps=float("nan")),
        "config.json field 'rms_norm_eps' must be a finite number, got NaN",
    ),
    "d_model 0": (lambda c: c.update(d_model=0), "config.json field 'd_model' must be at least 1, got 0"),
    "every size 10**12": (_every_size, "config.json's sizes describe a model of about"),
    "n_layers 10**6 over 1": (
        lambda c: c.update(n_layers=10**6),
        "config.json describes a model of about",
    ),
    "mask_token_id past the embedding": (
        lambda c: c.update(mask_token_id=10**6),
        "config.json field 'mask_token_id' must be a row of the embedding",
    ),
}


# generation_config.json as written (bytes, or a value json writes), and the words of its refusal
GENERATION_DAMAGES: dict[str, tuple[Any, str]] = {
    "eos past the model": (
        {"eos_token_id": [298, 10**6]},
        "generation_config.json field 'eos_token_id' must be a token of the model (0..299), got 1000000",
    ),
    "eos a string": ({"eos_token_id": "298"}, "generation_config.json field 'eos_token_id' must be an integer"),
    "not JSON": (b'{"eos_token_id": ', "generation_config.json is not valid UTF-8 JSON"),
    "not an object": ([298], "generation_config.json does not hold a JSON object"),
}


def _generation_damaged(good: Path, kind: str, directory: Path) -> tuple[Path, str]:
    """`good` with a generation_config.json every command must refuse (it was read as absent,
    or its EOS ids dropped), naming that file, not config.json."""
    content, words = GENERATION_DAMAGES[kind]
    shutil.copytree(good, directory)
    data = content if isinstance(content, bytes) else json.dumps(content).encode()
    (directory / "generation_config.json").write_bytes(data)
    return directory, words


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("good") / "tiny", shards=1)


def _damaged(good: Path, kind: str, directory: Path) -> tuple[Path, str]:
    edit, words = CHECKPOINT_DAMAGES[kind]
    shutil.copytree(good, directory)
    config = json.loads((directory / "config.json").read_text())
    edit(config)
    (directory / "config.json").write_text(json.dumps(config))  # json writes Infinity, NaN
    return directory, words


@pytest.mark.parametrize("kind", list(CHECKPOINT_DAMAGES))
def test_verify_records_the_config_as_failed(kind: str, good: Path, tmp_path: Path) -> None:
    """A store version whose config.json holds it: the verification is recorded, failed,
    with one finding against config.json (the meta build's overflow recorded nothing)."""
    source, words = _damaged(good, kind, tmp_path / "src")
    store = Store(tmp_path / "store")
    result = fetch(str(source), store)
    ref = f"{result.manifest.name}@{result.manifest.version}"
    code, stdout, stderr = cli("verify", ref, "--store", str(store.root), "--json")
    assert code == 1 and "Traceback" not in stderr, stderr
    failures = json.loads(stdout)["failures"]
    assert [(f["file"], f["check"]) for f in failures] == [("config.json", "config")], failures
    assert failures[0]["problem"].startswith(words), failures
    manifest = store.manifest(*ref.split("@"))
    assert manifest.state == "failed"
    assert manifest.verification is not None and manifest.verification.failures[0].file == "config.json"


@pytest.mark.parametrize("kind", list(CHECKPOINT_DAMAGES))
@pytest.mark.parametrize(
    "command",
    [
        ["estimate", "{dir}"],
        ["generate", "{dir}", "--prompt-ids", "1,2,3", "--gen-length", "8"],
        ["serve", "{dir}", "--port", "0", "--no-warmup"],
    ],
    ids=["estimate", "generate", "serve"],
)
def test_commands_refuse_it_with_verifys_words(
    kind: str, command: list[str], good: Path, tmp_path: Path, server_logging: None
) -> None:
    directory, words = _damaged(good, kind, tmp_path / "bad")
    code, stdout, stderr = cli(*[part.format(dir=directory) for part in command])  # re-raises a crash
    assert "Traceback" not in stdout + stderr, stderr[-2000:]
    assert code == 2, (code, stderr[-2000:])  # as every config.json refusal
    errors = [line for line in stderr.splitlines() if ERROR_LINE.match(line)]
    assert len(errors) == 1 and errors[0].startswith(f"error: {words}"), stderr[-2000:]


@pytest.mark.parametrize("kind", list(GENERATION_DAMAGES))
def test_verify_records_a_bad_generation_config_against_that_file(kind: str, good: Path, tmp_path: Path) -> None:
    directory, words = _generation_damaged(good, kind, tmp_path / "src")
    code, stdout, stderr = cli("verify", str(directory), "--json")
    assert code == 1 and "Traceback" not in stderr, stderr
    failures = json.loads(stdout)["failures"]
    assert [(f["file"], f["check"]) for f in failures] == [("generation_config.json", "config")], failures
    assert failures[0]["problem"].startswith(words), failures


@pytest.mark.parametrize("kind", list(GENERATION_DAMAGES))
@pytest.mark.parametrize(
    "command",
    [
        ["generate", "{dir}", "--prompt-ids", "1,2,3", "--gen-length", "8"],
        ["serve", "{dir}", "--port", "0", "--no-warmup"],
    ],
    ids=["generate", "serve"],
)
def test_commands_refuse_a_bad_generation_config_naming_it(
    kind: str, command: list[str], good: Path, tmp_path: Path, server_logging: None
) -> None:
    """(`dlm estimate` plans memory, which generation_config.json has no part in.)"""
    directory, words = _generation_damaged(good, kind, tmp_path / "bad")
    code, stdout, stderr = cli(*[part.format(dir=directory) for part in command])
    assert "Traceback" not in stdout + stderr and code == 2, (code, stderr[-2000:])
    errors = [line for line in stderr.splitlines() if ERROR_LINE.match(line)]
    assert len(errors) == 1 and errors[0].startswith(f"error: {words}"), stderr[-2000:]


def _nests(name: str) -> bool:
    return "text_config" in _config(name) or config_from_dict(_config(name)).layer_types != ()


# where: the nested field; edit: puts a value of the wrong JSON type there
NESTED: dict[str, Callable[[dict[str, Any]], str]] = {
    "text_config a string": lambda c: (c.update(text_config="x"), "text_config")[1],
    "text_config a list": lambda c: (c.update(text_config=[1]), "text_config")[1],
    "rope_parameters a list": lambda c: (
        _fields(c).update(rope_parameters=[1]),
        "text_config.rope_parameters" if "text_config" in c else "rope_parameters",
    )[1],
}


@pytest.mark.parametrize("nested", list(NESTED))
@pytest.mark.parametrize("name", [name for name in tiny_names() if _nests(name)])
def test_a_nested_field_of_the_wrong_json_type_is_refused_naming_it(name: str, nested: str) -> None:
    """A family reading nested objects (DiffusionGemma's text_config, the hybrids'
    rope_parameters): a string or list there raised AttributeError ('str' object has no
    attribute 'get'), a traceback from every command; the hybrids said "'str' object is
    not a mapping" naming no field."""
    config = copy.deepcopy(_config(name))
    where = NESTED[nested](config)  # a flat config (Clover's) also reads a nested text_config
    with pytest.raises(InvalidConfig) as caught:
        config_from_dict(config)
    assert caught.value.key == where and caught.value.exit_code == 2
    assert str(caught.value).startswith(f"config.json field {where!r} must be an object, got "), caught.value


@pytest.mark.parametrize(
    "where",
    ["rope_parameters.full_attention", "rope_parameters.sliding_attention", "per_layer_config", "per_layer_config.1"],
)
def test_diffusion_gemma_refuses_a_nested_rope_or_layer_entry_that_is_not_an_object(where: str) -> None:
    config = copy.deepcopy(_config("diffusion_gemma"))
    text = config["text_config"]
    *path, last = where.split(".")
    parent = text
    for part in path:
        parent = parent.setdefault(part, {})
    parent[last] = "x" if last == "1" else [1]
    if where == "per_layer_config.1":
        text["layer_types"][1] = "full_attention"
    with pytest.raises(InvalidConfig) as caught:
        config_from_dict(config)
    assert caught.value.key == f"text_config.{where}", caught.value
    assert str(caught.value).startswith(f"config.json field 'text_config.{where}' must be an object"), caught.value


@pytest.mark.parametrize("name", [name for name in tiny_names() if config_from_dict(_config(name)).layer_types])
@pytest.mark.parametrize("value", ["short", "a string", "unknown types"])
def test_layer_types_must_give_each_layer_a_known_type(name: str, value: str) -> None:
    """A layer_types list shorter than the layers was taken as it was by the hybrids: the
    layers past its end had no type (IndexError building the model)."""
    config = copy.deepcopy(_config(name))
    fields = _fields(config)
    layers = config_from_dict(copy.deepcopy(config)).num_layers
    fields["layer_types"] = {
        "short": fields["layer_types"][:1] if fields.get("layer_types") else ["full_attention"],
        "a string": "full_attention",
        "unknown types": [1] * layers,
    }[value]
    where = "text_config.layer_types" if "text_config" in config else "layer_types"
    with pytest.raises(InvalidConfig) as caught:
        config_from_dict(config)
    assert caught.value.key == where and caught.value.exit_code == 2
    assert str(caught.value).startswith(f"config.json field {where!r} must be a list of {layers} layer types")


def _experts(name: str) -> bool:
    config = config_from_dict(_config(name))
    return config.moe is not None or config.canvas is not None


@pytest.mark.parametrize("name", [name for name in tiny_names() if _experts(name)])
def test_every_mixture_of_experts_refuses_to_route_to_more_experts_than_it_has(name: str) -> None:
    """top_k past the experts: the first forward's topk raised "selected index k out of
    range", a traceback from generate and serve, after verify had said OK."""
    config = copy.deepcopy(_config(name))
    fields = _fields(config)
    key = "top_k_experts" if "top_k_experts" in fields else "num_experts_per_tok"
    fields[key] = fields["num_experts"] + 1
    with pytest.raises(InvalidConfig) as caught:
        config_from_dict(config)
    assert caught.value.key == key and caught.value.exit_code == 2
    assert str(caught.value) == (
        f"config.json field {key!r} must be at most num_experts ({fields['num_experts']}), got {fields[key]}"
    )


@pytest.mark.parametrize(
    ("groups", "key", "words"),
    [
        ({"n_group": 3}, "n_group", "must divide num_experts (8) into equal groups, got 3"),
        ({"n_group": 2, "topk_group": 3}, "topk_group", "must be at most n_group (2), got 3"),
        (
            {"n_group": 4, "topk_group": 1, "num_experts_per_tok": 3},
            "num_experts_per_tok",
            "must be at most the experts of topk_group groups (2), got 3",
        ),
    ],
)
def test_llada2_refuses_expert_groups_its_router_cannot_form(groups: dict[str, int], key: str, words: str) -> None:
    """LLaDA2's router views the experts as n_group equal groups and keeps the best
    topk_group: 8 experts in 3 groups raised "shape ... is invalid", 3 of 2 groups
    "selected index k out of range"."""
    config = copy.deepcopy(_config("llada2_moe"))
    assert config["num_experts"] == 8
    config.update(groups)
    with pytest.raises(InvalidConfig) as caught:
        config_from_dict(config)
    assert caught.value.key == key and str(caught.value) == f"config.json field {key!r} {words}"


@pytest.mark.parametrize("name", [name for name in tiny_names() if "d_model" not in _fields(_config(name))])
def test_every_family_refuses_a_rotary_part_wider_than_the_head(name: str) -> None:
    """partial_rotary_factor 2: RoPE's halves no longer matched the head's columns, and the
    first forward raised "The size of tensor a (16) must match the size of tensor b (32)"."""
    config = copy.deepcopy(_config(name))
    _fields(config)["partial_rotary_factor"] = 2.0
    with pytest.raises(InvalidConfig) as caught:
        config_from_dict(config)
    assert caught.value.key == "partial_rotary_factor" and caught.value.exit_code == 2
    assert str(caught.value) == "config.json field 'partial_rotary_factor' must be at most 1, got 2.0"


def test_diffusion_gemma_refuses_a_global_rotary_part_wider_than_the_head() -> None:
    config = copy.deepcopy(_config("diffusion_gemma"))
    config["text_config"].setdefault("rope_parameters", {}).setdefault("full_attention", {})
    config["text_config"]["rope_parameters"]["full_attention"]["partial_rotary_factor"] = 1.5
    key = "text_config.rope_parameters.full_attention.partial_rotary_factor"
    with pytest.raises(InvalidConfig, match=rf"^config.json field '{re.escape(key)}' must be at most 1, got 1.5$"):
        config_from_dict(config)


@pytest.mark.parametrize("name", tiny_names())
@pytest.mark.parametrize("key", ["torch_dtype", "dtype"])
@pytest.mark.parametrize("value", ["float128", "nn", 5, ["bfloat16"]])
def test_every_family_refuses_a_dtype_torch_does_not_have(name: str, key: str, value: Any) -> None:
    """transformers reads the dtype as `getattr(torch, name)` whenever it parses config.json
    (loading the tokenizer, too): "float128" made `dlm generate` compute its tokens and then
    end in that AttributeError's traceback, and `dlm verify` blame the tokenizer."""
    config = copy.deepcopy(_config(name))
    config[key] = value
    with pytest.raises(InvalidConfig) as caught:
        config_from_dict(config)
    assert caught.value.key == key and caught.value.exit_code == 2
    assert str(caught.value) == (
        f"config.json field {key!r} must name a torch dtype (float32, bfloat16, ...), got {json.dumps(value)}"
    )
    config[key] = "float8_e4m3fn"  # any dtype torch has
    config_from_dict(config)


@pytest.mark.parametrize(
    "name", [n for n in tiny_names() if family_named(config_from_dict(_config(n)).family).block_length_field]
)
@pytest.mark.parametrize("value", [0, False])
def test_a_block_size_of_zero_is_refused_not_replaced_by_the_familys(name: str, value: Any) -> None:
    """A block_size (bd_size) of 0 was read as absent: the family's default block size was
    used silently."""
    config = copy.deepcopy(_config(name))
    key = str(family_named(config_from_dict(copy.deepcopy(config)).family).block_length_field)
    config[key] = value
    with pytest.raises(InvalidConfig) as caught:
        config_from_dict(config)
    assert caught.value.key == key and str(caught.value).startswith(f"config.json field {key!r} must be")


@pytest.mark.parametrize(
    ("generation", "key", "words"),
    [
        ({"max_denoising_steps": "x"}, "max_denoising_steps", 'must be an integer, got "x"'),
        ({"max_denoising_steps": 0}, "max_denoising_steps", "must be at least 1, got 0"),
        ({"stability_threshold": 1.5}, "stability_threshold", "must be an integer, got 1.5"),
        ({"t_min": -1}, "t_min", "must be greater than 0, got -1"),
        ({"t_max": float("inf")}, "t_max", "must be a finite number, got Infinity"),
        (
            {"sampler_config": {"entropy_bound": float("nan")}},
            "sampler_config.entropy_bound",
            "must be a finite number, got NaN",
        ),
    ],
)
def test_diffusion_gemma_refuses_sampler_defaults_its_requests_could_not_have(
    generation: dict[str, Any], key: str, words: str, tmp_path: Path
) -> None:
    """generation_config.json gives DiffusionGemma's sampler defaults: a string of steps made
    the first request raise ValueError (a traceback from generate), NaN was refused naming
    the request field (entropy_bound), not the file that held it."""
    config = copy.deepcopy(_config("diffusion_gemma"))
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    with pytest.raises(InvalidConfig) as caught:
        load_config(tmp_path)
    assert caught.value.key == key and caught.value.exit_code == 2
    assert str(caught.value) == f"generation_config.json field {key!r} {words}"


# Fields dlm never reads, which transformers validates when it parses config.json to pick
# the tokenizer class: each raised from inside transformers (a traceback from generate).
TOKENIZER_CONFIG_DAMAGES: dict[str, dict[str, Any]] = {
    "id2label 5": {"id2label": 5},
    "num_labels 'x'": {"num_labels": "x"},
    "rope_parameters 5": {"rope_parameters": 5},
}


@pytest.mark.parametrize("kind", list(TOKENIZER_CONFIG_DAMAGES))
def test_a_field_only_transformers_reads_fails_the_tokenizer_in_one_line(kind: str, good: Path, tmp_path: Path) -> None:
    directory = tmp_path / "bad"
    shutil.copytree(good, directory)
    config = json.loads((directory / "config.json").read_text())
    config.update(TOKENIZER_CONFIG_DAMAGES[kind])
    (directory / "config.json").write_text(json.dumps(config))
    code, stdout, stderr = cli("generate", str(directory), "--prompt", "hi", "--gen-length", "8")
    assert "Traceback" not in stdout + stderr and code == 2, (code, stderr[-2000:])
    errors = [line for line in stderr.splitlines() if ERROR_LINE.match(line)]
    assert len(errors) == 1, stderr[-2000:]
    assert errors[0].startswith(f"error: could not load the tokenizer in {directory} (transformers reads config.json")
    code, stdout, _ = cli("verify", str(directory), "--json")
    failures = json.loads(stdout)["failures"]
    assert code == 1 and [(f["file"], f["check"]) for f in failures] == [("tokenizer", "tokenizer")], failures


def test_the_dtype_names_taken_without_torch_are_torch_dtypes() -> None:
    """check_dtypes takes COMMON_DTYPES without importing torch: each must be what torch
    itself names a dtype, or a config.json naming it would pass and fail later."""
    import torch

    assert all(isinstance(getattr(torch, name, None), torch.dtype) for name in COMMON_DTYPES)
