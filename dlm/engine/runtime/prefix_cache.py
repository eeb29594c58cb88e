"""PrefixCache: prompt K/V shared across requests of a block-causal family, exact and bounded.

Chat traffic repeats long system prompts and conversation histories. In a block-causal model
(LLaDA2, SDAR, openPangu, and any of them in `--mode ar`) the keys and values of a context
position depend only on the tokens up to the end of its visibility unit (its block, or the
position itself when the context is causal), so two requests whose token prefixes agree have
the same K/V there, up to floating-point rounding of differently shaped forwards. The cache
keeps those K/V in *pages* of `page` positions, one node per page in a tree keyed by
(parent node, the page's token ids): a lookup walks the tree along a new prompt and returns
the longest run of pages it already holds, compared token by token (no hashes, so no
collisions can make a hit inexact).

Pages are whole visibility units (a multiple of the block length, or any length for causal
context), so a page holds K/V that no later token can change. Nodes of different visibility
(block lengths) live under different roots: `--mode ar` (causal) never reads a block-mode page.
So do nodes of different partitions (a server's API keys): a hit reveals that a prompt was
seen before, and how fast a request starts reveals a hit, so tenants must never share pages
unless they trust each other (`dlm serve --prefix-cache-shared`). The byte budget and its LRU
are shared by all partitions.

Memory is bounded: each page's K/V is a copy owned by the cache (made when the request that
computed it publishes it), and the least recently used page is evicted when the bytes held
would exceed the budget. A node is touched after its children, so the least recently used
node is always a leaf and eviction never orphans a page.

Bidirectional families (LLaDA, Dream) get no prefix cache: every prompt position attends to
the answer's positions, whose tokens change at every step, so no prompt K/V is exact beyond a
single forward (Fast-dLLM's approximate caches are per request: docs/dream-caches-batching.md).
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from dataclasses import astuple, dataclass, field

import torch

PAGE_TOKENS = 16  # positions per page at least: fewer nodes for small blocks and causal context


@dataclass(frozen=True)
class PrefixCacheStats:
    """Counters since the cache was made (tokens, not requests) and what it holds now."""

    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of which found in the cache (and not recomputed)
    evictions: int = 0  # pages evicted to stay within the budget
    bytes: int = 0  # K/V bytes held now
    pages: int = 0  # pages held now
    budget: int = 0  # the byte budget (0: the cache is off)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def __add__(self, other: PrefixCacheStats) -> PrefixCacheStats:
        """Summed over engines (a model and the versions a hot swap is retiring)."""
        return PrefixCacheStats(*(a + b for a, b in zip(astuple(self), astuple(other))))


@dataclass(eq=False)
class _Page:
    id: int
    key: tuple[int, tuple[int, ...]]  # (parent id, the page's token ids)
    parent: _Page | None
    k: torch.Tensor  # [layers, heads, page, head_dim]
    v: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()


@dataclass
class Reuse:
    """What a sequence took from the cache: `length` positions (whole pages), their K/V per
    layer, and where it continues publishing (`last`: the node of its last page)."""

    length: int
    k: list[torch.Tensor] = field(default_factory=list)  # per layer [heads, length, head_dim]
    v: list[torch.Tensor] = field(default_factory=list)
    last: int = 0  # node id of the last page (0: the root of its unit)


class PrefixCache:
    """Pages of prompt K/V shared by every request of one engine (one model, one dtype)."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget = budget_bytes
        self._pages: OrderedDict[tuple[int, tuple[int, ...]], _Page] = OrderedDict()  # LRU first
        self._by_id: dict[int, _Page] = {}
        self._ids = itertools.count(1)
        self._roots: dict[tuple[str | None, int], int] = {}  # (partition, unit) -> root id (negative, never a page)
        self._bytes = 0
        self._queries = self._hits = self._evictions = 0
        self._lock = threading.Lock()  # metrics read the counters from another thread

    @staticmethod
    def page_size(unit: int) -> int:
        """Positions per page for a visibility unit (block length; 1: causal context)."""
        return -(-PAGE_TOKENS // unit) * unit

    def root(self, unit: int, partition: str | None = None) -> int:
        """The root node id of pages made under visibility `unit` in `partition`."""
        return self._roots.setdefault((partition, unit), -len(self._roots) - 1)

    def lookup(self, tokens: list[int], unit: int, limit: int, partition: str | None = None) -> Reuse:
        """The longest run of cached pages of `partition` that `tokens` start with, covering
        at most `limit` positions; counts `limit` queried tokens and the hit."""
        page = self.page_size(unit)
        found: list[_Page] = []
        with self._lock:
            parent = self.root(unit, partition)
            for start in range(0, limit - page + 1, page):
                node = self._pages.get((parent, tuple(tokens[start : start + page])))
                if node is None:
                    break
                found.append(node)
                parent = node.id
            for node in reversed(found):  # children first: parents stay more recent
                self._pages.move_to_end(node.key)
            self._queries += limit
            self._hits += len(found) * page
        if not found:
            return Reuse(0, last=parent)
        layers = found[0].k.shape[0]
        k = [torch.cat([n.k[i] for n in found], dim=1) for i in range(layers)]
        v = [torch.cat([n.v[i] for n in found], dim=1) for i in range(layers)]
        return Reuse(len(found) * page, k, v, last=parent)

    def publish(self, parent: int, tokens: list[int], k: torch.Tensor, v: torch.Tensor) -> int | None:
        """Add one page (`tokens`, K/V [layers, heads, page, head_dim], fresh tensors the cache
        keeps as they are) under node `parent`; returns the page's node id to publish the next
        page under, or None when the parent was evicted meanwhile (the rest of that prefix is
        not published)."""
        with self._lock:
            if parent > 0 and parent not in self._by_id:
                return None
            key = (parent, tuple(tokens))
            node = self._pages.get(key)
            if node is None:
                node = _Page(next(self._ids), key, self._by_id.get(parent), k, v)
                if node.nbytes > self.budget:
                    return None
                self._pages[key] = node
                self._by_id[node.id] = node
                self._bytes += node.nbytes
            up: _Page | None = node
            while up is not None:  # the page, then its ancestors: the LRU front is a leaf
                self._pages.move_to_end(up.key)
                up = up.parent
            while self._bytes > self.budget:
                self._evict()
            return node.id if node.id in self._by_id else None

    def _evict(self) -> None:
        _, node = self._pages.popitem(last=False)
        del self._by_id[node.id]
        self._bytes -= node.nbytes
        self._evictions += 1

    def stats(self) -> PrefixCacheStats:
        with self._lock:
            return PrefixCacheStats(
                self._queries, self._hits, self._evictions, self._bytes, len(self._pages), self.budget
            )
