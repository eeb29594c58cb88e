"""Request parameters are declared once (dlm/engine/params.py): the `dlm generate` options and
the HTTP request fields are built from that declaration and must not drift from it; `steps`
bounds the denoising forwards whatever the commit rule; refusals name their field."""

from __future__ import annotations

from pathlib import Path
from typing import Any, get_args, get_type_hints

import pytest
import typer.main

from dlm.cli.main import app
from dlm.cli.server.protocol import IGNORED, NEUTRAL, PARAM_FIELDS, ChatRequest, CompletionRequest, DiffusionFields
from dlm.engine.errors import UsageError
from dlm.engine.params import DEFAULTS, PARAMS, Forwards, GenerationParams, ResolvedParams, cli_flag, http_name
from dlm.engine.registry import family_named

# `dlm generate` options that are not decoding parameters (model loading, prompt, output).
GENERATE_OTHER = {
    "model", "prompt", "prompt_ids", "chat", "chat_template_kwargs", "suffix_text", "suffix_ids",
    "dtype", "device", "quantization", "kv_cache_dtype", "thread_governor", "backend", "trust_remote_code", "json_out",
    "tensor_parallel_size", "nnodes", "node_rank", "master_addr", "master_port", "moe_parallel", "canvas",
}  # fmt: skip
# Request fields of the OpenAI API that are not decoding parameters.
OPENAI_OTHER = {
    "model", "max_output_tokens", "stream", "stream_options", "stop", "return_token_ids", "prompt", "echo",
    "logprobs", "top_logprobs", "suffix", "parallel_tool_calls",
    "messages", "max_completion_tokens", "tools", "tool_choice", "response_format", "chat_template_kwargs",
}  # fmt: skip


def _generate_command() -> Any:
    return typer.main.get_command(app).commands["generate"]  # type: ignore[attr-defined]


def test_every_generate_option_is_a_declared_parameter_with_its_default() -> None:
    options = {p.name: p for p in _generate_command().params}
    for name, option in options.items():
        if name in GENERATE_OTHER:
            continue
        assert name in PARAMS, f"--{name} is a decoding option not declared in GenerationParams"
        assert option.default == DEFAULTS[name], name
        assert cli_flag(name) in (option.opts[0], "/".join(option.opts + option.secondary_opts)), name
        assert option.help is not None and option.help.startswith(PARAMS[name].help), name
    for name in PARAMS:
        if cli_flag(name) is not None:
            assert name in options, f"GenerationParams.{name} is offered as {cli_flag(name)} but dlm generate lacks it"


def test_every_request_field_is_declared_or_listed() -> None:
    for model in (CompletionRequest, ChatRequest):
        for name, info in model.model_fields.items():
            if name in PARAM_FIELDS:
                assert info.default is None, f"{name}: an absent field means GenerationParams' default"
                assert info.description == PARAMS[PARAM_FIELDS[name]].help, name
            else:
                assert name in OPENAI_OTHER | set(IGNORED) | set(NEUTRAL), f"{name} is neither declared nor listed"
    assert set(DiffusionFields.model_fields) == set(PARAM_FIELDS)
    for name in PARAMS:
        if http_name(name) is not None:
            assert http_name(name) in CompletionRequest.model_fields, name


def _http_type(name: str) -> Any:
    """GenerationParams field `name`'s type as the body carries it: optional (absent: the
    default), a tuple as a JSON array, response_format as any JSON value (the engine's rule
    decides what a non-object is told, in the words of every entry point)."""
    if name == "response_format":
        return Any
    hint = get_type_hints(GenerationParams)[name]
    (base,) = [a for a in get_args(hint) if a is not type(None)] or [hint]
    if get_args(base)[1:] == (Ellipsis,):  # tuple[int, ...]
        base = list[get_args(base)[0]]  # type: ignore[misc]
    return base | None


def test_every_decoding_field_has_its_declared_type_strictly() -> None:
    """A decoding parameter's HTTP type is its declaration's, and every body is validated
    strictly: nothing is coerced (`"8"` is no max_tokens), as OpenAI types its fields."""
    for field, name in PARAM_FIELDS.items():
        assert DiffusionFields.model_fields[field].annotation == _http_type(name), field
    assert CompletionRequest.model_config.get("strict") and ChatRequest.model_config.get("strict")


@pytest.mark.parametrize(
    ("model", "fields", "param"),
    [
        (CompletionRequest, {"max_tokens": "8"}, "max_tokens"),
        (CompletionRequest, {"max_tokens": 8.0}, "max_tokens"),
        (CompletionRequest, {"logprobs": True}, "logprobs"),  # a count on /v1/completions
        (ChatRequest, {"logprobs": 1}, "logprobs"),  # a boolean on chat
        (ChatRequest, {"top_logprobs": "2"}, "top_logprobs"),
        (CompletionRequest, {"seed": "1"}, "seed"),
        (CompletionRequest, {"temperature": "0.5"}, "temperature"),
        (CompletionRequest, {"temperature": True}, "temperature"),
        (CompletionRequest, {"n": True}, "n"),
        (CompletionRequest, {"stream": "true"}, "stream"),
        (CompletionRequest, {"echo": 1}, "echo"),
        (CompletionRequest, {"stop_token_ids": ["1"]}, "stop_token_ids.0"),
        (ChatRequest, {"max_completion_tokens": "5"}, "max_completion_tokens"),
        (ChatRequest, {"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ],
)
def test_wrong_types_are_refused_naming_the_field_never_coerced(model: Any, fields: dict, param: str) -> None:
    from pydantic import ValidationError

    from dlm.cli.server.errors import validation_error

    base = {"prompt": "x"} if model is CompletionRequest else {"messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(ValidationError) as caught:
        model.model_validate({**base, **fields})
    error = validation_error(list(caught.value.errors()))
    assert (error.status, error.param, error.code) == (400, param, "invalid_value")
    ok = CompletionRequest.model_validate({"prompt": "x", "temperature": 1, "logprobs": 2, "top_p": 1})
    assert (ok.temperature, ok.logprobs) == (1.0, 2)  # a JSON integer is a number
    chat = ChatRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "logprobs": True})
    assert chat.top_logprobs_count() == 0


def test_misspelt_fields_are_refused_and_harmless_ones_accepted() -> None:
    from pydantic import ValidationError

    from dlm.cli.server.errors import validation_error

    with pytest.raises(ValidationError) as caught:
        CompletionRequest.model_validate({"prompt": "x", "treshold": 0.9})
    error = validation_error(list(caught.value.errors()))
    assert (error.status, error.param, error.code) == (400, "treshold", "unknown_parameter")
    sdk = {
        "user": "u",
        "metadata": {"a": "b"},
        "store": False,
        "service_tier": "auto",
        "parallel_tool_calls": True,
        "logit_bias": None,
        "stream_options": {"include_usage": True},
    }
    body = ChatRequest.model_validate({"messages": [{"role": "user", "content": "hi", "refusal": None}], **sdk})
    assert body.unsupported() is None
    refused = ChatRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"5": 1}})
    assert refused.unsupported() is not None and refused.unsupported()[0] == "logit_bias"  # type: ignore[index]


@pytest.mark.parametrize(
    ("body", "param", "code", "says"),
    [
        # a vision client's image part: it was "messages.0.content: Input should be a valid
        # string", the str member's complaint, though a list of parts is accepted
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages.0.content.0",
            "unsupported",
            "content parts of type 'image_url' are not supported",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "input_audio"}]}]},
            "messages.0.content.1",
            "unsupported",
            "'input_audio'",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
            "messages.0.content.0.text",
            "invalid_value",
            "required",
        ),
        ({"prompt": "x", "stop": ["a", 5]}, "stop.1", "invalid_value", "valid string"),  # not the whole `stop`
        ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content", "invalid_value", "valid string"),
    ],
)
def test_a_union_refusal_names_the_member_that_got_furthest(body: dict, param: str, code: str, says: str) -> None:
    """A value every member of a union refuses is named by the deepest refusal: the member
    the client meant (a list of parts, a list of stops), not the first one tried (a string)."""
    from pydantic import ValidationError

    from dlm.cli.server.errors import validation_error

    with pytest.raises(ValidationError) as caught:
        (ChatRequest if "messages" in body else CompletionRequest).model_validate(body)
    error = validation_error(list(caught.value.errors()))
    assert (error.status, error.param, error.code) == (400, param, code) and says in error.message, error.message


@pytest.mark.parametrize(("n", "best_of", "taken"), [(None, 1, True), (3, 3, True), (None, 2, False), (2, 3, False)])
def test_best_of_equal_to_n_asks_for_nothing_more(n: int | None, best_of: int, taken: bool) -> None:
    """best_of answers, the best n returned: best_of = n (vLLM's default) is every answer
    asked for; more would need a ranking dlm does not make. best_of = n > 1 was refused."""
    body = CompletionRequest.model_validate({"prompt": "x", "n": n, "best_of": best_of})
    assert (body.unsupported() is None) == taken, body.unsupported()


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(threshold=1.5), "threshold"),
        (dict(steps=0), "steps"),
        (dict(refinement_steps=0), "refinement_steps"),
        (dict(steps=8, refinement_steps=2), "refinement_steps"),
        (dict(gen_length=8, min_tokens=9), "min_tokens"),
        (dict(mode="ar"), "mode"),
        (dict(top_k=3), "top_k"),
        (dict(seed=2**63), "seed"),
        (dict(threshold=0.9, factor=1.0), "factor"),
    ],
)
def test_refusals_name_their_field(kwargs: dict, field: str) -> None:
    with pytest.raises(UsageError) as caught:
        GenerationParams(**kwargs).validate(8, 512)
    assert caught.value.field == field


def test_clover_rules_are_part_of_validation() -> None:
    clover = family_named("clover")
    with pytest.raises(UsageError, match="32-token blocks") as caught:
        GenerationParams(gen_length=32, block_length=16).validate(4, 512, clover, fixed_block=32)
    assert caught.value.field == "block_length"
    with pytest.raises(UsageError, match="guidance"):
        GenerationParams(gen_length=32, cfg_scale=1.0).validate(4, 512, clover, fixed_block=32)


def test_step_budget_resolution() -> None:
    resolved = GenerationParams(gen_length=64, block_length=16, refinement_steps=3).validate(4, 512)
    assert isinstance(resolved, ResolvedParams) and (resolved.steps, resolved.refinement_steps) == (12, None)
    assert resolved.validate(4, 512) == resolved  # resolving again changes nothing
    assert GenerationParams(gen_length=64, block_length=16, refinement_steps=99).validate(4, 512).steps == 64
    # A server's --max-steps lowers the default (one token per step, or refinement steps)...
    assert GenerationParams(gen_length=64, block_length=16, max_steps=10).validate(4, 512).steps == 8
    assert GenerationParams(gen_length=64, refinement_steps=8, max_steps=6).validate(4, 512).steps == 6
    # ...and leaves an explicit steps to the server (it answers steps_exceeded).
    assert GenerationParams(gen_length=64, steps=32, max_steps=8).validate(4, 512).steps == 32


@pytest.mark.parametrize("field", ["steps", "refinement_steps"])
def test_steps_below_one_per_sub_block_are_raised_to_it(field: str) -> None:
    """openPangu and Fast-dLLM v2 denoise a block in sub-blocks of a forward each at least:
    fewer steps than that are raised to one per sub-block (not refused: any `steps` is an
    ordinary request), and the forwards stay bounded by what was resolved."""
    family = family_named("fast_dllm_v2")
    forwards = Forwards(sub_blocks=4)
    value = 2 if field == "refinement_steps" else 4  # two 32-token blocks: 2 steps each
    resolved = GenerationParams(gen_length=64, block_length=32, **{field: value}).validate(
        8, 512, family, forwards=forwards
    )
    assert (resolved.steps, resolved.steps_per_block, resolved.max_forwards) == (8, 4, 8)
    enough = GenerationParams(gen_length=64, block_length=32, **{field: 4 if field == "refinement_steps" else 8})
    assert enough.validate(8, 512, family, forwards=forwards).steps == 8


def test_any_gen_length_and_steps_resolve_on_every_layout() -> None:
    """No gen_length / block_length / steps combination an OpenAI client may send is refused:
    a block grid decodes whole blocks (the answer cut at gen_length), LLaDA a shorter last
    block; `steps` below one per block is raised to it, and need not divide the blocks."""
    grid = Forwards(aligned_grid=True, whole_blocks=True)
    sdar = family_named("sdar")
    resolved = GenerationParams(gen_length=7, block_length=32).validate(5, 512, sdar, forwards=grid)
    assert (resolved.canvas_length, resolved.decoded_blocks, resolved.num_blocks) == (32, 1, 1)
    straddling = GenerationParams(gen_length=16, block_length=8, steps=2).validate(5, 512, sdar, forwards=grid)
    assert (straddling.decoded_blocks, straddling.steps, straddling.max_forwards) == (3, 3, 3)
    uneven = GenerationParams(gen_length=16, block_length=8, steps=5).validate(8, 512)
    assert (uneven.steps_per_block, uneven.canvas_length, uneven.num_blocks) == (2, 16, 2)
    partial = GenerationParams(gen_length=50, block_length=32).validate(8, 512)
    assert (partial.canvas_length, partial.num_blocks, partial.decoded_blocks) == (50, 2, 2)
    # The default spends one forward per answer token: 16 tokens on 3 blocks, 5 steps each.
    assert GenerationParams(gen_length=16, block_length=8).validate(5, 512, sdar, forwards=grid).max_forwards == 15


PROMPT = list(range(5, 29))  # 24 tokens: on the block grid of the block-causal tiny models


@pytest.fixture(scope="module")
def engines(tiny_llada: Path, tiny_dream: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    from dlm.engine.block_checkpoints import write_tiny
    from dlm.engine.llm import LLM
    from tests.tp_checkpoints import write_family

    paths = {"llada": tiny_llada, "dream": tiny_dream, "clover": write_family(tmp_path_factory.mktemp("c"), "clover")}
    for family in ("llada2_moe", "sdar", "pangu"):
        paths[family] = write_tiny(tmp_path_factory.mktemp(family), family)
    return {name: LLM(path, dtype="float32", device="cpu") for name, path in paths.items()}


RULES = [{"threshold": 0.99}, {"factor": 0.01}, {}]


@pytest.mark.parametrize("family", ["llada", "dream", "llada2_moe", "sdar", "pangu", "clover"])
@pytest.mark.parametrize("rule", RULES, ids=["threshold", "factor", "schedule"])
@pytest.mark.parametrize("budget", ["steps", "max_steps"])
def test_steps_bound_the_forwards_whatever_the_rule(engines: dict, family: str, rule: dict, budget: str) -> None:
    """Tiny random weights are never confident: a threshold or factor rule commits one token
    per forward, so without the bound a 32-token block would take 32 forwards."""
    fam = family_named(engines[family].config.family)
    if "factor" in rule and (fam.sampler == "dream" or fam.block_causal):
        pytest.skip("the factor rule is LLaDA's")
    block = 32 if family == "pangu" else None  # 4 sub-blocks and a commit forward per block
    params = GenerationParams(gen_length=32, block_length=block, early_stop=False, **rule, **{budget: 8})
    seq = engines[family].engine.generate([PROMPT], params)[0]
    assert seq.finished and len(seq.output_ids) == 32
    assert seq.nfe <= seq.params.max_forwards, (seq.nfe, seq.params)
    # A server's limit bounds every forward; `steps` bounds the denoising steps, and openPangu
    # and Clover spend one forward more per block (docs/serve.md).
    extra = seq.params.decoded_blocks if family in ("pangu", "clover") and budget == "steps" else 0
    assert seq.params.max_forwards <= 8 + extra, seq.params


def test_dream_whole_sequence_threshold_rule_is_the_one_exception(engines: dict) -> None:
    """Dream's alg confidence_threshold, named, without a cache is Fast-dLLM's whole-sequence
    rule, which adds steps until every token clears the threshold (tests/test_dream_confidence_
    threshold.py); one forward per token bounds it, and a server whose cap is below that
    refuses the request (steps_exceeded). A plain threshold is bounded like every family's."""
    engine = engines["dream"].engine
    named = GenerationParams(gen_length=32, alg="confidence_threshold", threshold=0.99, early_stop=False, steps=8)
    seq = engine.generate([PROMPT], named)[0]
    assert seq.params.threshold_quota and seq.nfe > 8 and seq.params.max_forwards == 32, seq.params
    plain = engine.validate(GenerationParams(gen_length=32, threshold=0.99, steps=8), len(PROMPT))
    assert not plain.threshold_quota and plain.max_forwards == 8


@pytest.mark.parametrize("family", ["sdar", "pangu"])
def test_the_prefill_of_a_long_prompt_counts_against_max_steps(engines: dict, family: str) -> None:
    engine = engines[family].engine
    prompt = [(7 * i) % 300 + 1 for i in range(3001)]
    params = GenerationParams(gen_length=8, block_length=8, threshold=0.99, max_steps=6, early_stop=False)
    seq = engine.generate([prompt], params)[0]
    assert seq.query_lengths[0] == 2048 and seq.nfe <= seq.params.max_forwards <= 6, (seq.nfe, seq.params)


@pytest.mark.parametrize("family", ["llada2_moe", "sdar"])
def test_an_absolute_grid_splits_the_steps_over_every_block_it_decodes(engines: dict, family: str) -> None:
    """A 22-token prompt ends inside a block: the grid decodes one block more than
    gen_length / block_length, and `steps` still bounds the forwards."""
    engine, prompt = engines[family].engine, PROMPT[:22]
    params = GenerationParams(gen_length=32, steps=16, threshold=0.99, early_stop=False)
    seq = engine.generate([prompt], params)[0]
    assert seq.params.decoded_blocks == seq.params.num_blocks + 1
    assert seq.finished and seq.nfe <= 16, (seq.nfe, seq.params)
    # Fewer steps than blocks decoded: one step per block (not refused).
    too_few = engine.validate(GenerationParams(gen_length=32, steps=seq.params.num_blocks), len(prompt))
    assert too_few.steps == too_few.max_forwards == seq.params.decoded_blocks


@pytest.mark.slow
def test_refinement_steps_on_the_command_line(tiny_llada: Path) -> None:
    import json

    from tests.test_cli import dlm

    common = ("generate", str(tiny_llada), "--prompt-ids", "1,2,3", "--gen-length", "16", "--block-length", "8")
    per_block = dlm(*common, "--refinement-steps", "2", "--threshold", "0.99", "--dtype", "float32", "--json")
    assert per_block.returncode == 0, per_block.stderr
    out = json.loads(per_block.stdout)
    assert out["params"]["steps"] == 4 and out["nfe"] <= 4
    in_all = json.loads(dlm(*common, "--steps", "4", "--threshold", "0.99", "--dtype", "float32", "--json").stdout)
    assert in_all["output_ids"] == out["output_ids"] and in_all["nfe"] == out["nfe"]
    both = dlm(*common, "--steps", "4", "--refinement-steps", "2")
    assert both.returncode == 2 and "error: give steps (in all) or refinement_steps (per block)" in both.stderr


@pytest.mark.parametrize(("text", "ids"), [("1,2,3", [1, 2, 3]), (" 4, 5 ", [4, 5]), ("7", [7]), ("-1", [-1])])
def test_command_line_ids_parse(text: str, ids: list[int]) -> None:
    from dlm.cli.params import parse_ids

    assert parse_ids(text, "--prompt-ids") == ids


@pytest.mark.parametrize(
    ("text", "says"), [("", "is empty"), ("1,,2", "comma-separated"), ("1,2,", "comma"), ("1,x", "comma")]
)
def test_command_line_ids_with_a_gap_or_a_word_are_refused(text: str, says: str) -> None:
    """`1,,2` was read as [1, 2]: an empty element is refused, not dropped."""
    from dlm.cli.params import parse_ids
    from dlm.engine.errors import UsageError

    with pytest.raises(UsageError, match=says):
        parse_ids(text, "--prompt-ids")


FOREIGN_FIELDS = [
    ("dream", {"cfg_scale": 1.5}),
    ("dream", {"factor": 1.0}),
    ("dream", {"remasking": "random"}),
    ("dream", {"drafts": 2}),
    ("llada", {"edit_threshold": 0.5}),
    ("llada", {"alg": "entropy"}),
    ("llada", {"top_k": 5}),
    ("llada", {"mode": "ar"}),
    ("sdar", {"cfg_scale": 1.5}),
    ("sdar", {"factor": 1.0}),
]


@pytest.mark.parametrize(("family", "field"), FOREIGN_FIELDS, ids=[f"{f}-{next(iter(x))}" for f, x in FOREIGN_FIELDS])
def test_another_familys_field_is_unsupported_not_invalid(family: str, field: dict) -> None:
    """A well-formed field the family cannot honour is `Unsupported` (HTTP `unsupported`),
    as docs/serve.md says; all but alg and top_k here were plain usage errors (`invalid_value`)."""
    from dlm.engine.errors import Unsupported
    from dlm.engine.params import GenerationParams
    from dlm.engine.registry import family_named

    with pytest.raises(Unsupported) as refused:
        GenerationParams(gen_length=8, **field).validate(4, 4096, family_named(family))
    assert refused.value.field == next(iter(field))  # named, for the HTTP error's `param`


def test_a_command_line_only_parameter_says_in_serve_md_why() -> None:
    """A decoding parameter `dlm generate` offers but the HTTP body does not (neither declared
    nor mapped by the request layer, as `stop` and `logprobs` are) is named in docs/serve.md
    with why, so its absence over HTTP is a decision, not a gap (`early_stop` was neither)."""
    serve = (Path(__file__).parents[1] / "docs" / "serve.md").read_text()
    for name in PARAMS:
        if cli_flag(name) is not None and http_name(name) is None and name not in CompletionRequest.model_fields:
            assert f"`{name}`" in serve and "not offered over HTTP" in serve, name


@pytest.mark.parametrize(
    ("lengths", "refused"),
    [
        ({"max_completion_tokens": 3, "max_tokens": 5}, "max_tokens (5) disagrees with it (3)"),
        ({"max_completion_tokens": 3, "max_output_tokens": 5}, "max_output_tokens (5) disagrees with it (3)"),
        ({"max_completion_tokens": 3, "max_tokens": 3}, None),
        ({"max_completion_tokens": 3}, None),
    ],
)
def test_chat_lengths_given_twice_must_agree(lengths: dict[str, int], refused: str | None) -> None:
    """max_completion_tokens 3 beside max_tokens 5 was answered with 3 tokens, max_tokens
    dropped without a word (max_output_tokens beside max_tokens was already refused)."""
    from pydantic import ValidationError

    from dlm.cli.server.errors import validation_error

    body = {"messages": [{"role": "user", "content": "hi"}], **lengths}
    if refused is None:
        assert ChatRequest.model_validate(body).max_completion_tokens == 3
        return
    with pytest.raises(ValidationError) as caught:
        ChatRequest.model_validate(body)
    error = validation_error(list(caught.value.errors()))
    assert (error.status, error.param) == (400, "max_completion_tokens") and refused in error.message
