"""Every Triton kernel against its torch twin, on CPU through Triton's interpreter.

Shapes are small (the interpreter is slow) but cover the edges: vocabulary not a multiple
of the split or the tile, row counts not a multiple of the row tile, ragged batches, block
sizes 1/4/32 and a KV-cache prefix, GQA, partial rotary, an expert nobody routes to.
Tolerances: exact or within 1 ulp of the output dtype where the twins do the same
arithmetic in the same order (fp16/bf16 outputs, rotary, MoE in 16 bits); where only the
summation order differs (fp32 reductions, attention), the kernel's error against a float64
oracle must not exceed twice the twin's plus one ulp at the output's scale.
"""

from __future__ import annotations

import pytest
import torch

from dlm.kernels.attention import attention_torch
from dlm.kernels.attention_triton import attention_triton
from dlm.kernels.moe import fused_moe_torch
from dlm.kernels.moe_triton import expert_tiles, fused_moe_triton
from dlm.kernels.rms_norm import rms_norm_torch
from dlm.kernels.rms_norm_triton import rms_norm_triton
from dlm.kernels.rotary import rotary_torch
from dlm.kernels.rotary_triton import rotary_triton
from dlm.kernels.token_stats import (
    VocabPartial,
    combine,
    token_stats_partial_torch,
    token_stats_torch,
    token_stats_unfused,
)
from dlm.kernels.token_stats_triton import token_stats_partial_triton, token_stats_triton

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest |a - b| in units of the last place of a's dtype at max(|a|, |b|)."""
    info = torch.finfo(a.dtype)
    a64, b64 = a.double(), b.double()
    _, exponent = torch.frexp(torch.maximum(a64.abs(), b64.abs()).clamp_min(info.tiny))
    ulp = torch.ldexp(torch.full_like(a64, info.eps), exponent - 1)
    return ((a64 - b64).abs() / ulp).max().item()


def assert_as_accurate(out: torch.Tensor, twin: torch.Tensor, oracle: torch.Tensor) -> None:
    """`out` is no further from the float64 oracle than twice the twin, plus one ulp."""
    err_out = (out.double() - oracle).abs().max().item()
    err_twin = (twin.double() - oracle).abs().max().item()
    one_ulp = torch.finfo(out.dtype).eps * oracle.abs().max().item()
    assert err_out <= 2 * err_twin + one_ulp, (err_out, err_twin, one_ulp)


def randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_token_stats(dtype: torch.dtype, temperature: float) -> None:
    # 21 rows (row tile 16), vocab 1000 split by 300 -> 384-column splits, d 40 (tile 64).
    hidden, weight = randn(21, 40, seed=1, dtype=dtype), randn(1000, 40, seed=2, dtype=dtype, scale=2)
    kw = dict(temperature=temperature, want_entropy=True, want_margin=True, chunk_size=300)
    ours = token_stats_triton(hidden, weight, generator=torch.Generator().manual_seed(7), **kw)
    twin = token_stats_torch(hidden, weight, generator=torch.Generator().manual_seed(7), **kw)
    assert torch.equal(ours.token, twin.token)
    for a, b in ((ours.prob, twin.prob), (ours.entropy, twin.entropy), (ours.margin, twin.margin)):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-8)
    if temperature == 0 and dtype == torch.float32:
        oracle = token_stats_unfused(hidden, weight, want_entropy=True, want_margin=True)
        assert torch.equal(ours.token, oracle.token)
        assert torch.allclose(ours.entropy, oracle.entropy, rtol=1e-5)


def test_sampling_noise_is_the_same_in_both_backends_and_follows_temperature() -> None:
    hidden, weight = randn(600, 8, seed=3), randn(5, 8, seed=4)
    draw = lambda fn, seed: (
        fn(  # noqa: E731
            hidden, weight, temperature=1.0, generator=torch.Generator().manual_seed(seed)
        ).token
    )
    tokens = draw(token_stats_triton, 9)
    assert torch.equal(tokens, draw(token_stats_torch, 9))
    assert torch.equal(tokens, draw(token_stats_unfused, 9))
    assert not torch.equal(tokens, draw(token_stats_triton, 10))
    expected = torch.softmax((hidden @ weight.T).double(), -1).mean(0)
    assert torch.allclose(torch.bincount(tokens, minlength=5).double() / 600, expected, atol=0.06)


@pytest.mark.parametrize("partial", [token_stats_partial_torch, token_stats_partial_triton])
def test_vocab_shards_combine_to_the_whole(partial) -> None:
    hidden, weight = randn(5, 16, seed=5), randn(301, 16, seed=6, scale=2)
    kw = dict(temperature=0.5, seed=11, want_entropy=True, want_margin=True)
    shards = [partial(hidden, weight[lo:hi], vocab_start=lo, **kw) for lo, hi in ((0, 128), (128, 301))]
    merged = combine(VocabPartial.cat(shards))
    whole = combine(token_stats_partial_torch(hidden, weight, **kw))
    assert torch.equal(merged.token, whole.token)
    for a, b in ((merged.prob, whole.prob), (merged.entropy, whole.entropy), (merged.margin, whole.margin)):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-8)  # fp32 logits: summation order


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_excluded_token_is_never_chosen_but_keeps_its_softmax_share(temperature: float) -> None:
    # Token 333 (in the second 128-column tile of the first split) is every row's favourite.
    hidden, weight = randn(21, 16, seed=12), randn(500, 16, seed=13)
    weight[333] = hidden.mean(0) * 8
    kw = dict(temperature=temperature, want_entropy=True, want_margin=True)
    free = token_stats_unfused(hidden, weight, generator=torch.Generator().manual_seed(3), **kw)
    assert (free.token == 333).sum() > 5
    results = [
        fn(hidden, weight, generator=torch.Generator().manual_seed(3), exclude_token=333, **kw)
        for fn in (token_stats_unfused, token_stats_triton, token_stats_torch)
    ]
    oracle = results[0]
    assert (oracle.token != 333).all()
    assert torch.allclose(oracle.entropy, free.entropy) and torch.allclose(oracle.margin, free.margin)
    logp = torch.log_softmax((hidden @ weight.T).double(), -1)  # MASK keeps its share
    assert torch.allclose(oracle.prob, logp.gather(1, oracle.token[:, None])[:, 0].exp())
    for stats in results[1:]:
        assert torch.equal(stats.token, oracle.token)
        assert torch.allclose(stats.prob, oracle.prob, rtol=1e-5, atol=1e-8)
    shards = [
        partial(hidden, weight[lo:hi], vocab_start=lo, seed=5, exclude_token=333, **kw)
        for partial in (token_stats_partial_torch, token_stats_partial_triton)
        for lo, hi in ((0, 300), (300, 500))
    ]
    merged_torch, merged_triton = (combine(VocabPartial.cat(shards[i : i + 2])) for i in (0, 2))
    whole = combine(token_stats_partial_torch(hidden, weight, seed=5, exclude_token=333, **kw))
    assert (whole.token != 333).all()
    assert torch.equal(merged_torch.token, whole.token) and torch.equal(merged_triton.token, whole.token)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("zero_centred", [False, True])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype: torch.dtype, zero_centred: bool, with_residual: bool) -> None:
    x = randn(3, 5, 48, seed=7, dtype=dtype)
    weight = (1 + randn(48, seed=8, scale=0.1)).to(dtype)
    residual = randn(3, 5, 48, seed=9, dtype=dtype) if with_residual else None
    kw = dict(residual=residual, zero_centred=zero_centred)
    out, summed = rms_norm_triton(x, weight, 1e-5, **kw)
    twin, twin_summed = rms_norm_torch(x, weight, 1e-5, **kw)
    assert out.dtype == twin.dtype and torch.equal(summed, twin_summed)
    # fp32: the mean of squares is summed in another order; a few ulps.
    assert ulps(out, twin) <= (4 if dtype == torch.float32 else 1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rotary_dim", [32, 12])
def test_rotary_in_place(dtype: torch.dtype, rotary_dim: int) -> None:
    b, t, d = 2, 7, 32
    positions = torch.randint(0, 500, (b, t), generator=torch.Generator().manual_seed(10))
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim)
    angles = torch.cat([positions[..., None].float() * inv_freq] * 2, dim=-1)
    cos, sin = angles.cos(), angles.sin()

    def heads(qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # GQA views: 4 q, 2 kv heads
        return qkv[..., : 4 * d].view(b, t, 4, d).transpose(1, 2), qkv[..., 4 * d :].view(b, t, 2, d).transpose(1, 2)

    qkv = randn(b, t, 6 * d, seed=11, dtype=dtype)
    ours, twin = qkv.clone(), qkv.clone()
    rotary_triton(*heads(ours), cos, sin)
    rotary_torch(*heads(twin), cos, sin)
    assert ulps(ours, twin) <= 1
    assert torch.equal(ours.view(b, t, 6, d)[..., rotary_dim:], qkv.view(b, t, 6, d)[..., rotary_dim:])
    # The rotation is the rotate-half formula on the first rotary_dim dims.
    x = qkv.view(b, t, 6, d)[..., :rotary_dim].float()
    half = rotary_dim // 2
    expected = x * cos[:, :, None] + torch.cat((-x[..., half:], x[..., :half]), -1) * sin[:, :, None]
    assert ulps(twin.view(b, t, 6, d)[..., :rotary_dim], expected.to(dtype)) <= 1
    q_only = qkv.clone()
    rotary_triton(heads(q_only)[0], None, cos, sin)
    assert torch.equal(q_only[..., : 4 * d], ours[..., : 4 * d]) and torch.equal(
        q_only[..., 4 * d :], qkv[..., 4 * d :]
    )


def naive_attention(q, k, v, kv_lens, q_positions, block_size) -> torch.Tensor:
    """float64, the mask written from its definition: same-or-earlier block, real keys."""
    b, hq, tq, d = q.shape
    group = hq // k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for i in range(b):
        for j in range(tq):
            keys = torch.arange(int(kv_lens[i]))
            if block_size is not None:
                keys = keys[keys // block_size <= q_positions[i, j] // block_size]
            for h in range(hq):
                kk, vv = k[i, h // group, keys].double(), v[i, h // group, keys].double()
                p = torch.softmax(kk @ q[i, h, j].double() / d**0.5, 0)
                out[i, h, j] = p @ vv
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [None, 1, 4, 32])
def test_attention_ragged_batch(dtype: torch.dtype, block_size: int | None) -> None:
    g = torch.Generator().manual_seed(12)
    kv_lens = torch.tensor([70, 33, 5])
    positions = torch.stack([torch.randint(0, int(n), (20,), generator=g) for n in kv_lens])
    q = randn(3, 4, 20, 24, seed=13, dtype=dtype)
    k, v = randn(3, 2, 70, 24, seed=14, dtype=dtype), randn(3, 2, 70, 24, seed=15, dtype=dtype)
    kw = dict(kv_lens=kv_lens, q_positions=positions, block_size=block_size)
    oracle = naive_attention(q, k, v, kv_lens, positions, block_size)
    twin = attention_torch(q, k, v, **kw)
    assert (twin.double() - oracle).abs().max() < 50 * torch.finfo(dtype).eps  # the twin's mask is right
    assert_as_accurate(attention_triton(q, k, v, **kw), twin, oracle)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_block_with_kv_cache_prefix(dtype: torch.dtype) -> None:
    # Rows hold 40 and 24 cached tokens, then the current 8-token block (queries).
    bs, prefix = 8, torch.tensor([40, 24])
    kv_lens = prefix + bs
    positions = prefix[:, None] + torch.arange(bs)
    q = randn(2, 4, bs, 32, seed=16, dtype=dtype)
    k, v = randn(2, 1, 48, 32, seed=17, dtype=dtype), randn(2, 1, 48, 32, seed=18, dtype=dtype)
    kw = dict(kv_lens=kv_lens, q_positions=positions, block_size=bs)
    oracle = naive_attention(q, k, v, kv_lens, positions, bs)
    assert_as_accurate(attention_triton(q, k, v, **kw), attention_torch(q, k, v, **kw), oracle)


def test_attention_without_lengths_is_dense_bidirectional() -> None:
    q, k, v = randn(2, 2, 9, 16, seed=19), randn(2, 2, 9, 16, seed=20), randn(2, 2, 9, 16, seed=21)
    oracle = naive_attention(q, k, v, torch.tensor([9, 9]), None, None)
    assert_as_accurate(attention_triton(q, k, v), attention_torch(q, k, v), oracle)


def naive_moe(x, w13, w2, ids, weights) -> torch.Tensor:
    """float64, one token and one expert at a time."""
    f = w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate_up = w13[e].double() @ x[t].double()
            act = torch.nn.functional.silu(gate_up[:f]) * gate_up[f:]
            out[t] += weights[t, j].double() * (w2[e].double() @ act)
    return out


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_moe(dtype: torch.dtype) -> None:
    t, k, e, d, f = 19, 3, 6, 40, 72
    x = randn(t, d, seed=22, dtype=dtype)
    w13 = randn(e, 2 * f, d, seed=23, dtype=dtype, scale=d**-0.5)
    w2 = randn(e, d, f, seed=24, dtype=dtype, scale=f**-0.5)
    logits = randn(t, e, seed=25)
    logits[:, 5] = -100  # expert 5 gets no token
    weights, ids = logits.softmax(-1).topk(k, -1)
    ours, twin = fused_moe_triton(x, w13, w2, ids, weights), fused_moe_torch(x, w13, w2, ids, weights)
    oracle = naive_moe(x, w13, w2, ids, weights)
    assert (twin.double() - oracle).abs().max() < 20 * torch.finfo(dtype).eps * oracle.abs().max()
    if dtype == torch.float32:
        assert_as_accurate(ours, twin, oracle)
    else:  # same roundings in the same places: equal up to one ulp
        assert ulps(ours, twin) <= 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_skips_experts_held_elsewhere(dtype: torch.dtype) -> None:
    """Expert parallelism: this device holds experts 2..4 of 6 as its local 0..2; slots of
    the others carry id 3 (= its expert count) and add nothing, so the devices' partial
    sums add up to the whole layer."""
    t, k, d, f = 21, 3, 40, 24
    x = randn(t, d, seed=30, dtype=dtype)
    w13 = randn(6, 2 * f, d, seed=31, dtype=dtype, scale=d**-0.5)
    w2 = randn(6, d, f, seed=32, dtype=dtype, scale=f**-0.5)
    weights, ids = randn(t, 6, seed=33).softmax(-1).topk(k, -1)
    local = ids - 2
    local = local.masked_fill((local < 0) | (local >= 3), 3)
    mine = torch.where(local < 3, weights, 0.0)
    ours = fused_moe_triton(x, w13[2:5], w2[2:5], local, weights)
    twin = fused_moe_torch(x, w13[2:5], w2[2:5], local, weights)
    oracle = naive_moe(x, w13, w2, ids, mine)  # the other experts weighted zero
    assert (twin.double() - oracle).abs().max() < 20 * torch.finfo(dtype).eps * oracle.abs().max()
    if dtype == torch.float32:
        assert_as_accurate(ours, twin, oracle)
    else:
        assert ulps(ours, twin) <= 1


def test_expert_tiles_upper_bound_only_adds_pad_tiles() -> None:
    """The GPU grid (an upper bound on the tile count, no read-back) is the exact grid the
    CPU tests run, followed by tiles of pad rows only (expert past E: no work)."""
    ids = torch.tensor([[0, 3], [3, 1], [4, 3], [3, 0], [2, 4]])  # 4 = held elsewhere
    exact_ids, exact_experts = expert_tiles(ids, 4, 2, exact=True)
    bound_ids, bound_experts = expert_tiles(ids, 4, 2, exact=False)
    tiles = exact_experts.numel()
    assert tiles == 1 + 1 + 1 + 2 + 1  # experts 0-3 (1, 1, 1, 2 tiles of 2 pairs), elsewhere
    assert torch.equal(bound_ids[: tiles * 2], exact_ids) and torch.equal(bound_experts[:tiles], exact_experts)
    assert (bound_ids[tiles * 2 :] == ids.numel()).all() and (bound_experts[tiles:] > 4).all()
    assert exact_experts.tolist() == [0, 1, 2, 3, 3, 4]
    assert exact_ids.tolist() == [0, 7, 3, 10, 8, 10, 1, 2, 5, 6, 4, 9]  # token * 2 + slot; 10 = pad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masked_attention_twin_computes_each_row_over_its_visible_keys(dtype: torch.dtype) -> None:
    """A row whose visible keys have a gap (a short cache, padding, then its fed keys) and a
    row seeing a prefix: each equals SDPA over only those keys, bit for bit (what the row
    gives decoded alone), and the masked attention over the whole padded row in value."""
    import torch.nn.functional as F

    from dlm.kernels.attention import masked_attention_torch

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 5, 16, generator=g).to(dtype)
    k, v = (torch.randn(2, 2, 12, 16, generator=g).to(dtype) for _ in range(2))
    k[:, :, 3:6] = v[:, :, 3:6] = 1e4  # padding: must not matter
    mask = torch.zeros(2, 1, 5, 12, dtype=torch.bool)
    mask[0, :, :, :3] = True  # cached keys 0-2, padding 3-5, fed keys 6-9
    mask[0, :, :, 6:10] = torch.ones(5, 4, dtype=torch.bool).tril(1)
    mask[1, :, :, :8] = True
    out = masked_attention_torch(q, k, v, mask)
    for b, keys in ((0, torch.tensor([0, 1, 2, 6, 7, 8, 9])), (1, torch.arange(8))):
        alone = F.scaled_dot_product_attention(
            q[b : b + 1],
            k[b : b + 1, :, keys],
            v[b : b + 1, :, keys],
            attn_mask=mask[b : b + 1, ..., keys],
            enable_gqa=True,
        )
        assert torch.equal(out[b : b + 1], alone)
    whole = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(out.float(), whole, rtol=2e-2, atol=2e-2)
