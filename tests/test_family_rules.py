"""A request's family rules come from the checkpoint's config alone (dlm/engine/family_rules.py):
the default and the only block length, the forwards a block costs, and the one validation
that `dlm generate` runs before loading and `LLMEngine.validate` after."""

from __future__ import annotations

import pytest

from dlm.engine import family_rules
from dlm.engine.block_checkpoints import family_config
from dlm.engine.checkpoint_writer import clover_config, dream_config, llada_config
from dlm.engine.config import config_from_dict
from dlm.engine.errors import Unsupported, UsageError
from dlm.engine.parallel.divisibility import check_tensor_parallel
from dlm.engine.params import Forwards, GenerationParams

CLOVER = config_from_dict(clover_config(64, 63, 62))
SDAR = config_from_dict(family_config("sdar", vocab_size=64, mask_token_id=63, eos_token_id=62))
PANGU = config_from_dict(family_config("pangu", vocab_size=64, mask_token_id=63, eos_token_id=62))
LLADA = config_from_dict(llada_config(64, 63, 62))
DREAM = config_from_dict(dream_config(64, 63, 62))


def test_clover_decodes_its_trained_block_only_and_pays_a_commit_pass_per_block() -> None:
    assert family_rules.fixed_block(CLOVER) == 32
    assert family_rules.forwards(CLOVER) == Forwards(per_block=1, whole_blocks=True)
    assert family_rules.validate(GenerationParams(gen_length=64), 4, CLOVER).block_length == 32
    # Any gen_length: the last block is decoded whole and the answer cut from it.
    seven = family_rules.validate(GenerationParams(gen_length=7), 4, CLOVER)
    assert (seven.block_length, seven.canvas_length, seven.num_blocks) == (32, 32, 1)
    with pytest.raises(Unsupported, match="clover decodes 32-token blocks") as caught:
        family_rules.validate(GenerationParams(gen_length=32, block_length=16), 4, CLOVER)
    assert caught.value.field == "block_length"


def test_block_causal_forwards_follow_the_family_block_rules() -> None:
    sdar, pangu = family_rules.forwards(SDAR), family_rules.forwards(PANGU)
    assert (sdar.aligned_grid, sdar.per_block, sdar.causal_context) == (True, 0, False)
    assert (pangu.aligned_grid, pangu.sub_blocks, pangu.per_block, pangu.causal_context) == (False, 4, 1, True)
    assert family_rules.fixed_block(SDAR) is None
    # SDAR's block_size (4) by default; 3 prompt tokens + 8 on its absolute grid: 3 blocks.
    resolved = family_rules.validate(GenerationParams(gen_length=8), 3, SDAR)
    assert (resolved.block_length, resolved.decoded_blocks) == (4, 3)
    ar = family_rules.validate(GenerationParams(gen_length=8, mode="ar"), 3, SDAR)
    assert (ar.block_length, ar.steps) == (1, 8)


def test_bidirectional_families_take_any_block_and_one_forward_per_step() -> None:
    assert family_rules.fixed_block(LLADA) is None
    assert family_rules.forwards(LLADA) == Forwards()
    resolved = family_rules.validate(GenerationParams(gen_length=64), 4, LLADA)
    assert (resolved.block_length, resolved.max_forwards) == (32, 64)
    with pytest.raises(UsageError, match="mode 'ar' is not available"):
        family_rules.validate(GenerationParams(gen_length=8, mode="ar"), 4, LLADA)


def test_tensor_parallel_split_is_checked_from_the_config() -> None:
    check_tensor_parallel(LLADA, 2)  # 4 heads
    three = config_from_dict(llada_config(64, 63, 62, d_model=48, n_heads=3, n_kv_heads=3))
    with pytest.raises(
        UsageError, match="3 attention heads and 3 KV heads are not divisible by the tensor-parallel size 2"
    ):
        check_tensor_parallel(three, 2)


@pytest.mark.parametrize(
    ("config", "fields", "named"),
    [
        (LLADA, {"cfg_scale": 1.0, "cache": "prefix"}, "cache"),
        (SDAR, {"factor": 0.5}, "threshold"),
        (SDAR, {"cache": "prefix"}, "cache"),
        (DREAM, {"factor": 0.5}, "threshold"),
        (DREAM, {"remasking": "random"}, "alg"),
    ],
    ids=["llada-cfg-cache", "sdar-factor", "sdar-cache", "dream-factor", "dream-remasking"],
)
def test_a_refusal_names_the_fields_to_use_as_each_entry_point_spells_them(
    config: object, fields: dict, named: str
) -> None:
    """A refusal that points to another field names it as a field (`Name`), so the server
    spells it as a body field and the CLI as its own: never a CLI flag in an HTTP answer."""
    with pytest.raises(UsageError) as caught:
        family_rules.validate(GenerationParams(gen_length=8, **fields), 4, config)  # type: ignore[arg-type]
    spelt = caught.value.spelt(lambda name: f"<{name}>")
    assert f"<{named}>" in spelt and "--" not in spelt, spelt
