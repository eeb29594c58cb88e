"""What each tensor-parallel rank holds and computes, on 2 gloo CPU ranks spawned here:
the gathered logits of the sharded model equal one process's, every rank holds about 1/N
of the weights, and the loader reads only a rank's slices from safetensors."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from dlm.engine import loader
from dlm.engine.config import NO_MASK
from dlm.engine.parallel import distributed
from dlm.engine.parallel import state as parallel_state
from dlm.engine.runtime.engine import load_model
from tests.oracles.block_reference_loop import masked_logits
from tests.oracles.reference_loop import full_logits
from tests.tp_checkpoints import LAYOUTS, PARAMS, PROMPT, write_family

CHECKPOINTS = [*PARAMS, *LAYOUTS]

RANKS = 2
# Parameters every rank holds whole: norms, routers, biases added after a reduce.
REPLICATED = re.compile(
    r"(norm|ln_f)\.weight$|\.gate\.(weight|expert_bias)$|shared_expert_gate\.weight$"
    r"|(dense|o_proj|attn_out|down_proj|ff_out)\.bias$"
)


def _logits(model: torch.nn.Module, family: str, mask_id: int) -> torch.Tensor:
    """This rank's logits (its vocabulary columns) at every position of a prompt + MASK canvas
    (a family without a MASK, the autoregressive base, repeats token 0: logits are compared,
    nothing is decoded)."""
    x = torch.tensor(PROMPT + [0 if mask_id == NO_MASK else mask_id] * 16)
    if family in ("clover", "qwen3_5_moe_stacked"):
        hidden, _ = model.forward_tokens(x[None], torch.arange(len(x))[None], None)
        return model.logits(hidden[0])
    if family in ("llada", "dream"):
        return full_logits(model, x[None])[0]
    groups = torch.where(torch.arange(len(x)) < len(PROMPT), torch.arange(len(x)), len(PROMPT))
    return masked_logits(model, x, groups)


def _rank_job(dirs: dict[str, str]) -> dict[str, Any]:
    """On every rank: load each family's shard, gather its logits and every rank's
    parameter bytes (rank 0's return value is the test's)."""
    import torch.distributed as dist

    out = {}
    for family, directory in dirs.items():
        loaded = load_model(Path(directory), torch.float32, torch.device("cpu"))
        local = _logits(loaded.model, family, loaded.config.mask_token_id)
        logits = torch.cat(list(parallel_state.all_gather(local)), dim=-1)
        sizes = {n: p.numel() * p.element_size() for n, p in loaded.model.named_parameters()}
        every: list[Any] = [None] * RANKS
        dist.all_gather_object(every, sizes)
        out[family] = (logits, every)
    return out


def _entry(rank: int, port: int, dirs: dict[str, str], result: str) -> None:
    place = distributed.Place(rank, RANKS, rank, "127.0.0.1", port)
    group = distributed.join(place, distributed.ParallelConfig(RANKS, timeout_s=60), torch.device("cpu"))
    out = _rank_job(dirs)
    if rank == 0:
        torch.save(out, result)
    distributed.leave(group)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {f: write_family(tmp_path_factory.mktemp(f), f) for f in CHECKPOINTS}


@pytest.fixture(scope="module")
def ranks(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    result = tmp_path_factory.mktemp("tp") / "rank0.pt"
    dirs = {f: str(d) for f, d in checkpoints.items()}
    mp.spawn(_entry, args=(distributed._free_port(), dirs, str(result)), nprocs=RANKS, join=True)
    return torch.load(result)


@pytest.mark.parametrize("family", CHECKPOINTS)
@pytest.mark.slow
def test_sharded_logits_match_one_process(checkpoints: dict[str, Path], ranks: dict[str, Any], family: str) -> None:
    loaded = load_model(checkpoints[family], torch.float32, torch.device("cpu"))
    want = _logits(loaded.model, family, loaded.config.mask_token_id)
    got = ranks[family][0]
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= 1e-4 * want.std().item()


@pytest.mark.parametrize("family", CHECKPOINTS)
@pytest.mark.slow
def test_each_rank_holds_its_share_of_the_weights(
    checkpoints: dict[str, Path], ranks: dict[str, Any], family: str
) -> None:
    full = {
        n: p.numel() * p.element_size()
        for n, p in load_model(checkpoints[family], torch.float32, torch.device("meta")).model.named_parameters()
    }
    per_rank: list[dict[str, int]] = ranks[family][1]
    replicated = {n for n in full if all(r.get(n) == full[n] for r in per_rank)}
    assert all(REPLICATED.search(n) for n in replicated), sorted(n for n in replicated if not REPLICATED.search(n))
    for name in set(full) - replicated:  # split (or, under expert parallelism, on one rank)
        assert sum(r.get(name, 0) for r in per_rank) == full[name], name
    total, kept = sum(full.values()), sum(full[n] for n in replicated)
    assert kept < 0.02 * total  # what stays whole is small
    for r in per_rank:
        assert sum(r.values()) == pytest.approx((total - kept) / RANKS + kept, rel=0.01)


class Reads:
    """The tensors the loader reads, whole (`get_tensor`) or in part (an indexed `get_slice`)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.whole: list[str] = []
        self.sliced: list[str] = []
        reads, real_open = self, loader.safe_open

        class RecordingSlice:
            """A slice is read when indexed; its shape comes from the header (no data read)."""

            def __init__(self, name: str, view: Any) -> None:
                self.name, self.view = name, view

            def get_shape(self) -> list[int]:
                return self.view.get_shape()

            def __getitem__(self, index: Any) -> torch.Tensor:
                reads.sliced.append(self.name)
                return self.view[index]

        class Recording:
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                self.handle = real_open(*args, **kwargs)

            def __enter__(self) -> Recording:
                self.handle.__enter__()
                return self

            def __exit__(self, *exc: Any) -> None:
                self.handle.__exit__(*exc)

            def get_tensor(self, name: str) -> torch.Tensor:
                reads.whole.append(name)
                return self.handle.get_tensor(name)

            def get_slice(self, name: str) -> Any:
                return RecordingSlice(name, self.handle.get_slice(name))

            def __getattr__(self, name: str) -> Any:
                return getattr(self.handle, name)

        monkeypatch.setattr(loader, "safe_open", Recording)


def test_a_rank_reads_only_its_slices(checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1 of 2, built in this process (no collective runs while loading): sharded
    tensors are read through get_slice and never whole, and hold the right rows."""
    whole = Reads(monkeypatch).whole
    with parallel_state.using(parallel_state.TPState(rank=1, size=2)):
        model = load_model(checkpoints["llada"], torch.float32, torch.device("cpu")).model
    assert whole and all(REPLICATED.search(n) for n in whole), whole
    from safetensors.torch import load_file

    ref = load_file(str(checkpoints["llada"] / "model.safetensors"))
    b = "model.transformer.blocks.0."
    qkv = model.get_parameter(b + "qkv_proj.weight")
    assert torch.equal(qkv[:32], ref[b + "q_proj.weight"][32:])  # query heads 2-3 of 4 (head_dim 16)
    assert torch.equal(qkv[32:48], ref[b + "k_proj.weight"][16:])  # KV head 1 of 2
    assert torch.equal(model.get_parameter(b + "attn_out.weight"), ref[b + "attn_out.weight"][:, 32:])
    assert torch.equal(model.get_parameter("model.transformer.wte.weight"), ref["model.transformer.wte.weight"][150:])


@pytest.mark.parametrize("moe", ["ep", "tp"])
@pytest.mark.parametrize("layout", ["clover", "qwen3_5_moe_stacked"])
def test_stacked_experts_load_their_share(checkpoints: dict[str, Path], layout: str, moe: str) -> None:
    """Rank 1 of 2 of the hybrid's stacked experts, from per-expert tensors (clover) and
    from tensors stacked on disk: its experts (ep), or its rows of every expert (tp)."""
    cpu = torch.device("cpu")
    whole = load_model(checkpoints[layout], torch.float32, cpu).model.model.layers[0].mlp.experts
    with parallel_state.using(parallel_state.TPState(rank=1, size=2, moe=moe)):
        part = load_model(checkpoints[layout], torch.float32, cpu).model.model.layers[0].mlp.experts
    full = whole.intermediate_size
    if moe == "ep":
        assert torch.equal(part.gate_up_proj, whole.gate_up_proj[4:])
        assert torch.equal(part.down_proj, whole.down_proj[4:])
    else:
        half = full // 2
        gate_up = torch.cat((whole.gate_up_proj[:, half:full], whole.gate_up_proj[:, full + half :]), dim=1)
        assert torch.equal(part.gate_up_proj, gate_up)
        assert torch.equal(part.down_proj, whole.down_proj[:, :, half:])


def test_expert_parallel_rank_reads_only_its_experts(
    checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1 of 2 under expert parallelism opens the per-expert tensors of experts 4-7
    only, and stacks them in order into the layer's fused-MoE weights."""
    from safetensors.torch import load_file

    reads = Reads(monkeypatch)
    with parallel_state.using(parallel_state.TPState(rank=1, size=2, moe="ep")):
        model = load_model(checkpoints["llada2_moe"], torch.float32, torch.device("cpu")).model
    opened = [n for n in reads.whole + reads.sliced if ".mlp.experts." in n]
    assert {int(n.split(".mlp.experts.")[1].split(".")[0]) for n in opened} == {4, 5, 6, 7}
    ref = load_file(str(checkpoints["llada2_moe"] / "model.safetensors"))
    stacked, p = model.model.layers[1].mlp.experts, "model.layers.1.mlp.experts."
    for local, e in enumerate(range(4, 8)):
        gate_up = torch.cat((ref[f"{p}{e}.gate_proj.weight"], ref[f"{p}{e}.up_proj.weight"]))
        assert torch.equal(stacked.gate_up_proj[local], gate_up)
        assert torch.equal(stacked.down_proj[local], ref[f"{p}{e}.down_proj.weight"])


def test_the_parallelism_doc_lists_every_family_tensor_parallelism_splits() -> None:
    """docs/parallelism.md names the families `-tp N` splits: every family the engine decodes
    natively (DiffusionGemma was left out though it splits, with the same ids). Each is named
    as its registry description begins (`openPangu-R-7B-Diffusion`: `openPangu`)."""
    from dlm.engine.registry import FAMILIES

    doc = (Path(__file__).parents[1] / "docs" / "parallelism.md").read_text()
    listed = " ".join(doc.split("decodes natively:", 1)[1].split(";", 1)[0].split())
    for family in FAMILIES:
        if family.engine:
            name = family.description.split(":")[0].split(" / ")[0]
            assert name in listed or name.split("-")[0] in listed, f"{family.name} ({name}) is not in the list"
