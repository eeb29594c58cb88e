"""Cross-request prefix reuse (dlm/engine/runtime/prefix_cache.py) on block-causal tiny models.

Outputs with the prefix cache equal outputs without it (fp32 ids, exact comparison): for every
block-causal family, block diffusion and AR mode, batched requests sharing prefixes, and under
a budget so small that pages are evicted while requests run. A request whose prompt shares a
cached prefix feeds fewer tokens to its forwards (behaviour, not time: benchmarks/prefix_reuse.py
measures the time to first token).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dlm.engine.block_checkpoints import write_tiny
from dlm.engine.llm import LLM
from dlm.engine.params import GenerationParams
from dlm.engine.runtime.prefix_cache import PAGE_TOKENS, PrefixCache, PrefixCacheStats

FAMILIES = ["llada2_moe", "sdar", "pangu"]
SHARED = [(7 * i + 3) % 90 + 5 for i in range(70)]  # a 70-token "system prompt"
TAILS = [[11, 12, 13], [40, 41, 42, 43, 44, 45, 46, 47, 48], []]
ENOUGH = 1 << 30


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {f: write_tiny(tmp_path_factory.mktemp(f), f) for f in FAMILIES}


def _llm(path: Path, budget: int) -> LLM:
    llm = LLM(path, dtype="float32", device="cpu")
    assert llm.engine.enable_prefix_cache(budget) == (budget > 0)
    return llm


def _ids(llm: LLM, prompts: list[list[int]], **kw: object) -> list[tuple[list[int], list[int]]]:
    """Run `prompts` one after another (each can reuse the ones before): ids and tokens fed."""
    out = []
    for prompt in prompts:
        seq = llm.engine.generate([prompt], GenerationParams(gen_length=32, **kw))[0]  # type: ignore[arg-type]
        out.append((seq.generated_ids, seq.query_lengths))
    return out


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode", ["diffusion", "ar"])
def test_reuse_gives_the_same_ids_and_feeds_fewer_tokens(dirs: dict[str, Path], family: str, mode: str) -> None:
    prompts = [SHARED + t for t in TAILS]
    plain = _ids(_llm(dirs[family], 0), prompts, mode=mode)
    llm = _llm(dirs[family], ENOUGH)
    reused = _ids(llm, prompts, mode=mode)
    assert [ids for ids, _ in reused] == [ids for ids, _ in plain]
    assert sum(reused[0][1]) == sum(plain[0][1])  # the first request finds nothing
    for (_, fed), (_, fed_plain) in zip(reused[1:], plain[1:]):
        assert sum(fed) < sum(fed_plain) and fed[0] < fed_plain[0]  # its prefill skips the shared pages
    stats = llm.engine.prefix_cache_stats()
    assert 0 < stats.hits < stats.queries and 0 < stats.bytes <= ENOUGH and stats.evictions == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_requests_sharing_prefixes(dirs: dict[str, Path], family: str) -> None:
    """Requests decoded together, some of them reusing pages published by an earlier batch."""
    first = [SHARED + TAILS[0], SHARED[:40] + [9, 9, 9]]
    second = [SHARED + TAILS[1], SHARED[:50], [3, 4, 5] + SHARED]
    params = GenerationParams(gen_length=32, threshold=0.5)
    plain, llm = _llm(dirs[family], 0), _llm(dirs[family], ENOUGH)
    want = [s.generated_ids for s in plain.engine.generate(first + second, params)]
    got = [s.generated_ids for s in llm.engine.generate(first, params)]
    later = llm.engine.generate(second, params)
    assert got + [s.generated_ids for s in later] == want
    assert llm.engine.prefix_cache_stats().hits > 0


@pytest.mark.parametrize("family", ["llada2_moe", "pangu"])
def test_eviction_under_a_tiny_budget_keeps_outputs_exact(dirs: dict[str, Path], family: str) -> None:
    llm = _llm(dirs[family], ENOUGH)
    _ids(llm, [SHARED])
    page_bytes = llm.engine.prefix_cache_stats().bytes // llm.engine.prefix_cache_stats().pages
    prompts = [SHARED + t for t in TAILS] + [[60 + i for i in range(40)] + SHARED, SHARED + TAILS[1]]
    plain = _ids(_llm(dirs[family], 0), prompts)
    small = _llm(dirs[family], 2 * page_bytes)  # two pages: eviction at every publish
    reused = _ids(small, prompts)
    assert [ids for ids, _ in reused] == [ids for ids, _ in plain]
    stats = small.engine.prefix_cache_stats()
    assert stats.evictions > 0 and stats.bytes <= 2 * page_bytes and stats.pages <= 2


def test_bidirectional_families_keep_it_off(tiny_llada: Path) -> None:
    llm = LLM(tiny_llada, dtype="float32", device="cpu")
    assert not llm.engine.enable_prefix_cache(ENOUGH)
    assert llm.engine.prefix_cache_stats().budget == 0


def _page(value: float, layers: int = 2, page: int = PAGE_TOKENS) -> torch.Tensor:
    return torch.full((layers, 1, page, 4), float(value))


def test_lookup_follows_exact_tokens_and_visibility_units() -> None:
    cache = PrefixCache(ENOUGH)
    tokens = list(range(3 * PAGE_TOKENS))
    parent: int | None = cache.root(1)
    for i in range(3):
        assert parent is not None
        parent = cache.publish(parent, tokens[i * PAGE_TOKENS : (i + 1) * PAGE_TOKENS], _page(i), _page(-i))
    hit = cache.lookup(tokens + [1, 2], 1, len(tokens) + 2)
    assert hit.length == 3 * PAGE_TOKENS and hit.last == parent
    assert torch.equal(hit.k[1][:, PAGE_TOKENS : 2 * PAGE_TOKENS], torch.ones(1, PAGE_TOKENS, 4))
    assert cache.lookup(tokens, 1, 2 * PAGE_TOKENS + 5).length == 2 * PAGE_TOKENS  # bounded by the limit
    changed = tokens.copy()
    changed[PAGE_TOKENS + 3] = 999
    assert cache.lookup(changed, 1, len(changed)).length == PAGE_TOKENS  # stops at the first differing page
    assert cache.lookup(tokens, 4, len(tokens)).length == 0  # block-causal pages are another tree


def test_eviction_takes_leaves_least_recently_used_first() -> None:
    one = _page(0).numel() * 4 * 2
    cache = PrefixCache(3 * one)
    a = list(range(PAGE_TOKENS))
    b, c = [1] * PAGE_TOKENS, [2] * PAGE_TOKENS
    root = cache.root(1)
    pa = cache.publish(root, a, _page(0), _page(0))
    assert pa is not None
    cache.publish(pa, b, _page(1), _page(1))
    cache.publish(root, c, _page(2), _page(2))
    assert cache.lookup(a + b, 1, 2 * PAGE_TOKENS).length == 2 * PAGE_TOKENS  # a, b now recent
    cache.publish(root, [3] * PAGE_TOKENS, _page(3), _page(3))  # evicts c, the LRU leaf
    assert cache.lookup(c, 1, PAGE_TOKENS).length == 0
    assert cache.lookup(a + b, 1, 2 * PAGE_TOKENS).length == 2 * PAGE_TOKENS
    assert cache.stats().evictions == 1 and cache.stats().bytes == 3 * one
    assert cache.publish(root, [4] * PAGE_TOKENS, _page(0, layers=8), _page(0, layers=8)) is None  # over budget


def test_metrics_export_the_engine_counters() -> None:
    from dlm.cli.server.metrics import ServerMetrics

    metrics = ServerMetrics()
    metrics.watch_prefix_cache(lambda: PrefixCacheStats(queries=40, hits=30, evictions=2, bytes=4096, budget=8192))
    text = metrics.render().decode()
    for line in (
        "dlm_prefix_cache_queries_total 40.0",
        "dlm_prefix_cache_hits_total 30.0",
        "dlm_prefix_cache_evictions_total 2.0",
        "dlm_prefix_cache_hit_rate 0.75",
        "dlm_prefix_cache_bytes 4096.0",
        "dlm_prefix_cache_budget_bytes 8192.0",
    ):
        assert line in text


def test_the_serve_setting_sets_the_budget_and_zero_turns_it_off() -> None:
    from dlm.cli.server.config import load_config
    from dlm.engine.errors import UsageError

    assert load_config(None, {"prefix_cache_mib": 0}).prefix_cache_mib == 0
    assert load_config(None, {"prefix_cache_mib": 2.5}).prefix_cache_mib == 2.5
    with pytest.raises(UsageError, match="prefix_cache_mib"):
        load_config(None, {"prefix_cache_mib": -1})


@pytest.mark.slow
def test_a_server_reuses_prefixes_and_answers_the_same(tmp_path_factory: pytest.TempPathFactory) -> None:
    """`dlm serve tiny:sdar`: a prompt answered again after a request sharing its prefix (so
    from cached pages) gets the answer it got cold; /metrics counts the hits and the budget."""
    import httpx

    from tests.conftest import session_home
    from tests.serving import ready_server

    system = "You are a careful assistant. Answer briefly and cite the rules you used. " * 6
    with ready_server(["tiny:sdar", "--prefix-cache-mib", "64"], session_home(tmp_path_factory)) as server:

        def ask(prompt: str) -> str:
            body = {"prompt": prompt, "max_tokens": 16, "temperature": 0}
            reply = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
            assert reply.status_code == 200, reply.text
            return str(reply.json()["choices"][0]["text"])

        cold = ask(system + "Question two?")
        ask(system + "Question one?")
        assert ask(system + "Question two?") == cold
        m = server.metrics()
        health = httpx.get(server.url + "/health").json()
    assert health["prefix_cache_bytes"] == 64 * 2**20 and health["step_graphs"] == "off"  # CPU, block-causal
    assert m["dlm_prefix_cache_hits_total"] > 0 and m["dlm_prefix_cache_bytes"] > 0
    assert m["dlm_prefix_cache_budget_bytes"] == 64 * 2**20
