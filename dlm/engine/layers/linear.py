"""Tensor-parallel linear layers and vocabulary-parallel embedding / LM head.

Each layer is the plain torch layer (`nn.Linear`, `nn.Embedding`) holding only this rank's
shard, so model code keeps using `.weight`, `.bias` and `F.linear` as before; at one rank
the shard is the whole tensor, no collective runs and the arithmetic is exactly the
single-process one. Each sharded parameter carries a `loader.Shard`, so the loader reads
only its slice from safetensors.

- `ColumnParallelLinear`: output features split. Packed projections (q/k/v, gate/up) split
  each part on its own, so the local weight is [part_0 shard; part_1 shard; ...] and the
  model's `split(sizes)` still separates the parts (with local sizes).
- `QKVParallelLinear`: the column-parallel q/k/v of grouped-query attention: query heads
  split, KV heads split when the group size divides them, otherwise replicated (each rank
  holds the one KV head its query heads read).
- `RowParallelLinear`: input features split; partial outputs are summed over ranks (or
  left partial with `reduce=False`, when the caller sums several partials at once, as
  the MoE layer does). The bias is added once.
- `VocabParallelEmbedding` / `ParallelLMHead`: vocabulary rows split in contiguous ranges.
  The LM head is never applied here: `dlm.kernels.dispatch.token_stats` reduces each rank's
  range to a few statistics per decided row and combines them (`lm_head_shard`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from dlm.engine.loader import Shard
from dlm.engine.parallel import state as parallel_state
from dlm.kernels.token_stats import VocabPartial, VocabShard


def split(total: int, what: str) -> tuple[int, int]:
    """This rank's [start, stop) of `total` items divided evenly over the group."""
    tp = parallel_state.current()
    if total % tp.size:
        raise ValueError(f"{what} ({total}) is not divisible by the tensor-parallel size {tp.size}")
    per = total // tp.size
    return tp.rank * per, (tp.rank + 1) * per


def _rows(ranges: Sequence[tuple[int, int]]) -> Shard:
    """Shard reading rows ranges[i] of source i (packed parts concatenated on dim 0)."""
    return Shard(lambda i, shape: [(slice(*ranges[i]),)])


def mark_rows(param: torch.Tensor, ranges: Sequence[Sequence[tuple[int, int]]]) -> None:
    """Make `param` (dim 0 split) read, from checkpoint source i, the rows ranges[i]
    (several ranges of one source are concatenated in order). A no-op at one rank."""
    if parallel_state.current().size > 1:
        _mark(param, Shard(lambda i, shape: [(slice(a, b),) for a, b in ranges[i]]))


def _fused_rows(parts: Sequence[int], ranges: Sequence[tuple[int, int]]) -> Shard:
    """Shard reading, from one source holding every part (a fused checkpoint tensor such as
    LLaDA2's `query_key_value`), rows ranges[j] of each part j."""
    offsets = [sum(parts[:j]) for j in range(len(parts))]
    return Shard(lambda i, shape: [(slice(o + a, o + b),) for o, (a, b) in zip(offsets, ranges)])


def _mark(param: torch.Tensor | None, shard: Shard) -> None:
    if param is not None:
        param.shard = shard  # type: ignore[attr-defined]


class ColumnParallelLinear(nn.Linear):
    def __init__(
        self,
        in_features: int,
        parts: Sequence[int],
        bias: bool = False,
        *,
        ranges: Sequence[tuple[int, int]] | None = None,
        fused: bool = False,
    ) -> None:
        """`parts`: full output sizes of the packed parts; `ranges`: this rank's rows of
        each part (default: an even split of each); `fused`: the checkpoint stores all
        parts in one tensor rather than one tensor per part."""
        tp = parallel_state.current()
        ranges = list(ranges) if ranges is not None else [split(p, "output features") for p in parts]
        self.local_parts = [stop - start for start, stop in ranges]
        super().__init__(in_features, sum(self.local_parts), bias=bias)
        if tp.size > 1:
            shard = _fused_rows(parts, ranges) if fused else _rows(ranges)
            _mark(self.weight, shard)
            _mark(self.bias, shard)


def kv_head_range(num_heads: int, num_kv_heads: int) -> tuple[int, int]:
    """The KV heads this rank's query heads read: an even split when the group size divides
    the KV heads, else the one (replicated) KV head of this rank's query-head group."""
    tp = parallel_state.current()
    if num_kv_heads % tp.size == 0:
        return split(num_kv_heads, "KV heads")
    if tp.size % num_kv_heads or num_heads % tp.size:
        raise ValueError(f"{num_heads} query / {num_kv_heads} KV heads cannot be split over {tp.size} ranks")
    head = tp.rank // (tp.size // num_kv_heads)
    return head, head + 1


class QKVParallelLinear(ColumnParallelLinear):
    """Packed q/k/v rows ([q heads; k heads; v heads], `q_rows` rows per query head, e.g.
    2 * head_dim when each query head carries its output gate). `num_heads` and
    `num_kv_heads` are the local counts after construction."""

    def __init__(
        self,
        in_features: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        bias: bool,
        q_rows: int | None = None,
        fused: bool = False,
    ) -> None:
        q_rows = q_rows or head_dim
        q0, q1 = split(num_heads, "query heads")
        k0, k1 = kv_head_range(num_heads, num_kv_heads)
        self.num_heads, self.num_kv_heads = q1 - q0, k1 - k0
        super().__init__(
            in_features,
            [num_heads * q_rows, num_kv_heads * head_dim, num_kv_heads * head_dim],
            bias,
            ranges=[(q0 * q_rows, q1 * q_rows)] + [(k0 * head_dim, k1 * head_dim)] * 2,
            fused=fused,
        )


class RowParallelLinear(nn.Linear):
    def __init__(self, in_features: int, out_features: int, bias: bool = False, *, reduce: bool = True) -> None:
        tp = parallel_state.current()
        start, stop = split(in_features, "input features")
        super().__init__(stop - start, out_features, bias=bias)
        self.reduce = reduce
        if tp.size > 1:
            _mark(self.weight, Shard(lambda i, shape: [(slice(None), slice(start, stop))]))
            self.weight.split_inputs = in_features  # type: ignore[attr-defined]  # quantized as whole rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tp = parallel_state.current()
        if tp.size == 1:
            return F.linear(x, self.weight, self.bias)
        y = F.linear(x, self.weight, self.bias if tp.rank == 0 else None)
        return parallel_state.all_reduce(y) if self.reduce else y


def vocab_range(vocab: int) -> tuple[int, int]:
    """This rank's contiguous vocabulary rows (the last rank's range may be shorter)."""
    tp = parallel_state.current()
    per = -(-vocab // tp.size)
    if per * (tp.size - 1) >= vocab:
        raise ValueError(f"a vocabulary of {vocab} rows cannot be split over {tp.size} ranks")
    return tp.rank * per, min(vocab, (tp.rank + 1) * per)


class VocabParallelEmbedding(nn.Embedding):
    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        self.vocab_start, self.vocab_stop = vocab_range(num_embeddings)
        super().__init__(self.vocab_stop - self.vocab_start, embedding_dim)
        if parallel_state.current().size > 1:
            _mark(self.weight, _rows([(self.vocab_start, self.vocab_stop)]))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if parallel_state.current().size == 1:
            return super().forward(ids)
        # Rows of other ranks' ids are zero here; the sum over ranks is then exact.
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return parallel_state.all_reduce(out.masked_fill(outside[..., None], 0))


class ParallelLMHead(nn.Module):
    """The untied LM head's `weight` [local vocab rows, hidden] (no forward: see module doc)."""

    def __init__(self, hidden_size: int, vocab: int) -> None:
        super().__init__()
        start, stop = vocab_range(vocab)
        self.weight = nn.Parameter(torch.empty(stop - start, hidden_size))
        if parallel_state.current().size > 1:
            _mark(self.weight, _rows([(start, stop)]))


def _gather_partial(part: VocabPartial) -> VocabPartial:
    """Every rank's one-range partial, stacked in rank (= vocabulary) order. The fields are
    packed into one float64 [N, F] tensor (fp32 values and token ids < 2**53 are exact in
    float64), so one all-gather moves them."""
    n = part.max_logit.shape[1]
    columns = [part.max_logit[0], part.sum_exp[0], part.best_score[0], part.best_token[0], part.best_logit[0]]
    if part.sum_exp_logit is not None:
        columns.append(part.sum_exp_logit[0])
    if part.top2 is not None:
        columns += [part.top2[0, :, 0], part.top2[0, :, 1]]
    packed = torch.stack([c.to(torch.float64) for c in columns], dim=1).reshape(n, -1)
    every = parallel_state.all_gather(packed)  # [P, N, F]
    col = iter(range(every.shape[2]))
    take = lambda dtype: every[:, :, next(col)].to(dtype)  # noqa: E731
    max_logit, sum_exp = take(torch.float32), take(torch.float64)
    best_score, best_token, best_logit = take(torch.float64), take(torch.long), take(torch.float32)
    sum_exp_logit = take(torch.float64) if part.sum_exp_logit is not None else None
    top2 = torch.stack((take(torch.float32), take(torch.float32)), dim=-1) if part.top2 is not None else None
    return VocabPartial(max_logit, sum_exp, sum_exp_logit, top2, best_score, best_token, best_logit)


def lm_head_shard(vocab: int) -> VocabShard | None:
    """How `dlm.kernels.dispatch.token_stats` meets this rank's LM-head rows (None at one rank)."""
    if parallel_state.current().size == 1:
        return None
    return VocabShard(start=vocab_range(vocab)[0], size=vocab, gather=_gather_partial)


def gather_logits(local: torch.Tensor, vocab: int) -> torch.Tensor:
    """[N, local vocab] logits of every rank -> [N, vocab] (for samplers that need the whole
    sorted distribution; the LM-head statistics never do this)."""
    if parallel_state.current().size == 1:
        return local
    width = -(-vocab // parallel_state.current().size)  # every shard padded to the first's width
    padded = F.pad(local, (0, width - local.shape[-1]))
    every = parallel_state.all_gather(padded)  # [P, N, width]
    return every.permute(1, 0, 2).reshape(local.shape[0], -1)[:, :vocab]


def local_kv_heads(num_heads: int, num_kv_heads: int) -> int:
    """KV heads a rank holds (what its KV cache is sized for)."""
    start, stop = kv_head_range(num_heads, num_kv_heads)
    return stop - start
