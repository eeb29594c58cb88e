"""On a CUDA machine: compile every Triton kernel for real, check it against its torch twin at
serving shapes, check the engine's ids through Triton equal the twins' for every family
(and, with two or more GPUs, tensor parallel over NCCL equals one GPU), check the memory
ceiling, check every quantization method CUDA runs (int8, int4, fp8) per family against its
dequantized twin and `dlm estimate`'s bytes, time the kernels (benchmarks/kernel_speed.py), then
time the denoising step of an 8B-shaped random LLaDA (d 4096, 32 layers, 12288 MLP, 126464
vocabulary) eagerly and through the step graphs (CUDA graphs,
dlm/engine/runtime/step_graphs.py): forwards/s and tokens/s per batch size against the
memory-bandwidth and compute rooflines. Not run in CI (there is no GPU there); prepared so
one short session on an accelerator gives the figures for docs/benchmarks.md.

    python benchmarks/gpu_check.py [--json gpu.json]     # exits 1 if a check fails
    python benchmarks/gpu_check.py --step-only           # CUDA: the step section only
    python benchmarks/gpu_check.py --dry-run             # CPU, tiny shapes: the step section only
    python benchmarks/gpu_check.py --only quantization   # CUDA: one section (comma-separated)

Sections, in order: kernels, engine, memory, quantization, bench (benchmarks/kernel_speed.py), step.
A lent device's minutes are few: run each section as its own process under `timeout`, so a
hang or crash in one leaves the others' figures. The checks of a run go to `<json>_checks.json`
(name, pass, detail), the step table to `<json>_step.json`.

`--dry-run` runs the step section on the CPU with a tiny model: the same engine, bucketing,
padding and static buffers as the CUDA-graph path ("static" mode: a CPU has no graphs), its
ids checked against the eager forward, and the same table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def kernel_checks(dtype: torch.dtype) -> list[tuple[str, bool, str]]:
    from dlm.kernels.attention import attention_torch
    from dlm.kernels.attention_triton import attention_triton
    from dlm.kernels.moe import fused_moe_torch
    from dlm.kernels.moe_triton import fused_moe_triton
    from dlm.kernels.rms_norm import rms_norm_torch
    from dlm.kernels.rms_norm_triton import rms_norm_triton
    from dlm.kernels.rotary import rotary_torch
    from dlm.kernels.rotary_triton import rotary_triton
    from dlm.kernels.token_stats import token_stats_torch
    from dlm.kernels.token_stats_triton import token_stats_triton

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    rand = lambda *s, scale=1.0: (torch.randn(*s, generator=g, device=dev) * scale).to(dtype)  # noqa: E731
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    out = []
    h, w = rand(32, 1024), rand(157184, 1024, scale=1024**-0.5)
    for temp in (0.0, 0.9):
        a = token_stats_triton(
            h,
            w,
            temperature=temp,
            generator=torch.Generator(device=dev).manual_seed(1),
            want_entropy=True,
            want_margin=True,
        )
        b = token_stats_torch(
            h,
            w,
            temperature=temp,
            generator=torch.Generator(device=dev).manual_seed(1),
            want_entropy=True,
            want_margin=True,
        )
        agree = (a.token == b.token).float().mean().item()
        err = max(rel_err(a.prob, b.prob), rel_err(a.entropy, b.entropy))
        out.append((f"token_stats T={temp}", agree >= 0.97 and err < 1e-3, f"ids agree {agree:.3f}, err {err:.2e}"))
    x, r, nw = rand(4096, 4096), rand(4096, 4096), 1 + rand(4096, scale=0.1)
    for zc in (False, True):
        a, sa = rms_norm_triton(x, nw, 1e-5, residual=r, zero_centred=zc)
        b, sb = rms_norm_torch(x, nw, 1e-5, residual=r, zero_centred=zc)
        e = rel_err(a, b)
        out.append((f"rms_norm zero_centred={zc}", e < tol and torch.equal(sa, sb), f"err {e:.2e}"))
    cos_sin = torch.rand(4, 512, 64, device=dev) * 50
    for rd in (128, 64):
        q, k = rand(4, 32, 512, 128), rand(4, 8, 512, 128)
        q2, k2 = q.clone(), k.clone()
        rotary_triton(q, k, cos_sin[..., :rd].cos(), cos_sin[..., :rd].sin())
        rotary_torch(q2, k2, cos_sin[..., :rd].cos(), cos_sin[..., :rd].sin())
        e = max(rel_err(q, q2), rel_err(k, k2))
        out.append((f"rotary dims={rd}", e < tol, f"err {e:.2e}"))
    q, k, v = rand(8, 32, 512, 128), rand(8, 8, 512, 128), rand(8, 8, 512, 128)
    lens = torch.linspace(100, 512, 8, device=dev).long()
    pos = torch.arange(512, device=dev).expand(8, 512)
    for bs in (None, 1, 4, 32):
        kw = dict(kv_lens=lens, q_positions=pos, block_size=bs)
        ref = attention_torch(q.double(), k.double(), v.double(), **kw)
        ea, eb = rel_err(attention_triton(q, k, v, **kw), ref), rel_err(attention_torch(q, k, v, **kw), ref)
        out.append((f"attention block={bs}", ea <= 2 * eb + tol, f"triton err {ea:.2e}, twin err {eb:.2e}"))
    mx = rand(256, 2048)
    w13, w2 = rand(64, 2048, 2048, scale=2048**-0.5), rand(64, 2048, 1024, scale=1024**-0.5)
    wt, ids = torch.randn(256, 64, generator=g, device=dev).softmax(-1).topk(8, -1)
    e = rel_err(fused_moe_triton(mx, w13, w2, ids, wt), fused_moe_torch(mx, w13, w2, ids, wt))
    out.append(("fused_moe", e < tol, f"err {e:.2e}"))
    return out


def engine_checks() -> list[tuple[str, bool, str]]:
    """Per family (MoE ones through the fused MoE kernel): the same ids with the torch twins
    and with the Triton kernels; with two or more GPUs, also tensor parallel over NCCL."""
    from dlm.engine.llm import LLM
    from dlm.engine.parallel.distributed import ParallelConfig
    from tests.tp_checkpoints import PARAMS, PROMPT, write_family

    out = []
    for family, params in PARAMS.items():
        llm = LLM(write_family(Path(tempfile.mkdtemp()), family), dtype="float32", device="cuda")
        ids = {}
        for choice in ("torch", "auto"):
            os.environ["DLM_KERNELS"] = choice
            ids[choice] = [o.output_ids for o in llm.generate([PROMPT, PROMPT[:7]], **params)]
        os.environ.pop("DLM_KERNELS")
        out.append((f"{family} ids torch == triton", ids["torch"] == ids["auto"], ""))
        if torch.cuda.device_count() >= 2:
            with LLM(
                llm.model_dir, dtype="float32", device="cuda", parallel=ParallelConfig(tensor_parallel_size=2)
            ) as tp:
                split = [o.output_ids for o in tp.generate([PROMPT, PROMPT[:7]], **params)]
            out.append((f"{family} ids TP 2 (NCCL) == 1 GPU", split == ids["auto"], ""))
        del llm
    return out


def quantization_checks(device: str = "cuda", families: list[str] | None = None) -> list[tuple[str, bool, str]]:
    """Every `--quantization` method the device runs (fp8 from compute capability 8.9), per
    decoded family: the model loads quantized on the device and decodes its dequantized twin's
    ids, and its weights take the bytes `dlm estimate` plans (within 5%). CI checks this on
    the CPU for int8 and int4 (tests/test_quantization.py); here the CUDA kernels (int8,
    tinygemm int4, fp8) run. Dtype: fp32 where the method takes it (ids compared exactly),
    else the method's own (int4 on CUDA: bf16, where twin and kernel may round apart: the
    share of equal ids is printed)."""
    from dlm.cli.estimate.plan import Serving, architecture_from_config, parameter_components, plan_memory
    from dlm.engine.config import read_config_json
    from dlm.engine.errors import DlmError
    from dlm.engine.llm import LLM
    from dlm.engine.quantization import METHODS
    from dlm.engine.quantized_weights import weight_bytes
    from dlm.engine.resolve import resolve_model
    from tests.quantization_checkpoints import DECODED, PARAMS, PROMPT, densify, int4_checkpoint

    directory = Path(tempfile.mkdtemp())
    capability = torch.cuda.get_device_capability() if device == "cuda" else None
    out = []
    for name, method in METHODS.items():
        if device not in method.devices:
            continue
        if capability is not None and method.min_capability is not None and capability < method.min_capability:
            out.append((f"{name}: compute capability {capability}", True, f"not run (needs {method.min_capability})"))
            continue
        dtype = method.dtypes.get(device, ("float32",))[0]
        for family in families or DECODED:
            label = f"{family} {name} ({dtype})"
            try:
                model = resolve_model(int4_checkpoint(family, directory))
                quantized = LLM(model, dtype=dtype, device=device, quantization=name)
                ids = quantized.generate(PROMPT, **PARAMS[family])[0].output_ids
                held = weight_bytes(quantized.engine.loaded.model)
                arch = architecture_from_config(read_config_json(model))
                serving = Serving(dtype=dtype, quantization=name, device=device)  # --dtype's spellings
                plan = plan_memory(arch, parameter_components(arch), serving)
                planned = sum(r.bytes for r in plan.rows if r.name.startswith("weights:"))
                del quantized
                twin = LLM(model, dtype=dtype, device=device, quantization=name)
                densify(twin.engine.loaded.model)
                twin_ids = twin.generate(PROMPT, **PARAMS[family])[0].output_ids
                del twin
            except (DlmError, RuntimeError, NotImplementedError) as exc:
                out.append((label, False, f"{type(exc).__name__}: {exc}"[:200]))
                continue
            equal = sum(a == b for a, b in zip(ids, twin_ids, strict=True)) / len(ids)
            exact = dtype == "float32"
            out.append((f"{label} ids == dequantized twin", equal == 1.0 or not exact, f"{equal:.0%} equal"))
            out.append(
                (f"{label} bytes as planned", abs(planned - held) <= 0.05 * held, f"{held} held, {planned} planned")
            )
    return out


def memory_cap_check() -> tuple[str, bool, str]:
    """--gpu-memory-utilization: beyond the share, allocation fails."""
    from dlm.engine.runtime.engine import cap_device_memory

    device = torch.device("cuda", 0)
    total = torch.cuda.get_device_properties(device).total_memory
    cap_device_memory(device, 0.25)
    try:
        torch.empty(int(total * 0.5), dtype=torch.uint8, device=device)
        refused = False
    except torch.OutOfMemoryError:
        refused = True
    finally:
        cap_device_memory(device, 1.0)
        torch.cuda.empty_cache()
    return ("memory cap refuses 50% under a 25% cap", refused, "")


# Peak HBM bandwidth (bytes/s) and dense bf16 tensor throughput (FLOP/s) from the vendors'
# data sheets, by device name; other devices: pass --bandwidth / --flops.
PEAKS = {"H200": (4.8e12, 989e12), "H100": (3.35e12, 989e12), "A100": (2.0e12, 312e12), "L40S": (0.864e12, 362e12)}
SHAPES = {
    "8b": {"d_model": 4096, "n_layers": 32, "n_heads": 32, "n_kv_heads": 32, "mlp_hidden_size": 12288},
    "tiny": {"d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 4, "mlp_hidden_size": 128},
}
VOCAB = {"8b": 126464, "tiny": 300}


def random_engine(shape: str, dtype: torch.dtype, device: torch.device):  # noqa: ANN201
    """The native engine over a random LLaDA of `shape`, made on the device (no checkpoint)."""
    from dlm.engine.checkpoint_writer import llada_config
    from dlm.engine.config import load_config
    from dlm.engine.runtime.engine import LLMEngine, LoadedModel, build_on_meta

    vocab = VOCAB[shape]
    directory = Path(tempfile.mkdtemp(prefix="dlm-gpu-check-"))
    config = llada_config(vocab, vocab - 1, vocab - 2, max_sequence_length=4096, **SHAPES[shape])
    (directory / "config.json").write_text(json.dumps(config))
    model_config = load_config(directory)
    model = build_on_meta(model_config).to(dtype).to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.fill_(1.0)  # norm weights
            else:
                p.normal_(0.0, p.shape[-1] ** -0.5, generator=g)
    return LLMEngine(LoadedModel(model_config, model.eval(), dtype, device))


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Measured device memory bandwidth (bytes read + written per second) of one large copy."""
    import time

    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(3):
        sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(engine, prompts: list[list[int]], params, steps: int, device: torch.device) -> tuple[float, int, list]:  # noqa: ANN001
    """Seconds for `steps` denoising steps of `prompts` decoded together (after two warm-up
    steps, which capture the graphs), tokens committed in them, and the sequences."""
    import time

    seqs = [engine.add_request(p, params) for p in prompts]
    for _ in range(2):
        engine.step()
    sync(device)
    before = sum(len(s.answer()) - s.masks_left for s in seqs)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync(device)
    seconds = time.perf_counter() - start
    committed = sum(len(s.answer()) - s.masks_left for s in seqs) - before
    while any(not s.finished for s in seqs):
        engine.step()
    return seconds, committed, seqs


def step_benchmark(args: argparse.Namespace) -> tuple[list[dict], list[tuple[str, bool, str]]]:
    """forwards/s and tokens/s of the denoising step, eager and through the step graphs, per
    batch size, against the rooflines; checks: graph ids == eager ids, every shape captured."""
    from dlm.engine.params import GenerationParams

    device = torch.device("cpu" if args.dry_run else "cuda")
    shape = "tiny" if args.dry_run else "8b"
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    engines = {mode: random_engine(shape, dtype, device) for mode in ("off", "on")}
    used = engines["on"].enable_step_graphs("on", max(args.batches))
    weights = sum(p.numel() * p.element_size() for p in engines["off"].loaded.model.parameters())
    params_count = sum(p.numel() for p in engines["off"].loaded.model.parameters())
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak_bw, peak_flops = next((v for k, v in PEAKS.items() if k in name), (None, None))
    bandwidth = args.bandwidth or peak_bw or copy_bandwidth(device, 1 << (30 if device.type == "cuda" else 26))
    flops = args.flops or peak_flops
    params = GenerationParams(gen_length=args.gen, block_length=args.block, steps=args.gen)  # one token per step
    canvas = args.prompt + args.gen
    rows, checks = [], []
    for batch in args.batches:
        prompts = [[(17 * i + 7 * r) % (VOCAB[shape] - 8) + 1 for i in range(args.prompt)] for r in range(batch)]
        fed = batch * canvas
        bound = weights / bandwidth  # every forward reads every weight at least once
        if flops:
            bound = max(bound, 2 * params_count * fed / flops)  # matmul FLOPs of the fed tokens
        result: dict = {"batch": batch, "canvas": canvas, "device": name, "dtype": str(dtype).split(".")[-1]}
        ids = {}
        for mode, engine in engines.items():
            seconds, committed, seqs = time_steps(engine, prompts, params, args.steps, device)
            ids[mode] = [s.output_ids for s in seqs]
            result[f"forwards_per_s_{mode}"] = args.steps / seconds
            result[f"tokens_per_s_{mode}"] = committed / seconds
        result["roofline_forwards_per_s"] = 1 / bound
        result["graphs_speedup"] = result["forwards_per_s_on"] / result["forwards_per_s_off"]
        result["share_of_roofline_on"] = result["forwards_per_s_on"] * bound
        rows.append(result)
        checks.append((f"step graphs ids == eager, batch {batch}", ids["on"] == ids["off"], f"mode {used}"))
    runner = engines["on"].runner
    graphs = getattr(runner, "graphs", None)
    if used == "cuda" and graphs is not None:
        eager = [shape for shape, slot in graphs.slots.items() if slot.graph is None]
        checks.append(("every step shape captured (no host sync)", not eager, f"eager: {eager}"))
    print(
        f"step: {shape} random LLaDA, {weights / 2**30:.2f} GiB of weights, {name}, bandwidth "
        f"{bandwidth / 1e9:.0f} GB/s{'' if flops is None else f', {flops / 1e12:.0f} TFLOP/s'}, step graphs: {used}"
    )
    print(
        f"{'batch':>5} {'fwd/s eager':>12} {'fwd/s graphs':>13} {'tok/s graphs':>13} "
        f"{'roofline fwd/s':>15} {'share':>6}"
    )
    for r in rows:
        print(
            f"{r['batch']:>5} {r['forwards_per_s_off']:>12.1f} {r['forwards_per_s_on']:>13.1f} "
            f"{r['tokens_per_s_on']:>13.1f} {r['roofline_forwards_per_s']:>15.1f} {r['share_of_roofline_on']:>6.2f}"
        )
    return rows, checks


def report(checks: list[tuple[str, bool, str]]) -> None:
    for name, ok, detail in checks:
        print(f"{'PASS' if ok else 'FAIL'}  {name:40s} {detail}", flush=True)


SECTIONS = ("kernels", "engine", "memory", "quantization", "bench", "step")


def sections(value: str) -> list[str]:
    chosen = [v.strip() for v in value.split(",") if v.strip()]
    unknown = sorted(set(chosen) - set(SECTIONS))
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(f"sections are {', '.join(SECTIONS)}; got {value!r}")
    return chosen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, default=Path("gpu_benchmarks.json"))
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes: the step section only")
    ap.add_argument("--step-only", action="store_true", help="on CUDA, only the step section (= --only step)")
    ap.add_argument("--only", type=sections, default=None, help=f"on CUDA, these sections: {','.join(SECTIONS)}")
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=None)
    ap.add_argument("--prompt", type=int, default=None, help="prompt tokens [128; dry run 24]")
    ap.add_argument("--gen", type=int, default=None, help="generated tokens [128; dry run 16]")
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--steps", type=int, default=None, help="timed steps per batch [20; dry run 4]")
    ap.add_argument("--bandwidth", type=float, help="memory bandwidth in bytes/s [the data sheet's, else measured]")
    ap.add_argument("--flops", type=float, help="dense FLOP/s of the dtype [the data sheet's; none on CPU]")
    args = ap.parse_args()
    dry = args.dry_run
    args.batches = args.batches or ([1, 2] if dry else [1, 4, 8])
    args.prompt = args.prompt or (24 if dry else 128)
    args.gen = args.gen or (16 if dry else 128)
    args.block = min(args.block, args.gen)
    args.steps = args.steps or (4 if dry else 20)
    if not dry and not torch.cuda.is_available():
        sys.exit("gpu_check needs a CUDA device (--dry-run runs its step section on the CPU)")
    run = ["step"] if dry or args.step_only else (args.only or list(SECTIONS))
    checks: list[tuple[str, bool, str]] = []
    code = 0
    for section in run:
        found: list[tuple[str, bool, str]] = []
        if section == "kernels":
            found = kernel_checks(torch.float32) + kernel_checks(torch.bfloat16)
        elif section == "engine":
            found = engine_checks()
        elif section == "memory":
            found = [memory_cap_check()]
        elif section == "quantization":
            found = quantization_checks()
        elif section == "bench":
            kernels_py = ROOT / "benchmarks" / "kernel_speed.py"
            bench = subprocess.run([sys.executable, str(kernels_py), "--device", "cuda", "--json", str(args.json)])
            code = code or bench.returncode
        else:
            rows, found = step_benchmark(args)
            if not dry:
                args.json.with_name(args.json.stem + "_step.json").write_text(json.dumps(rows, indent=2))
        report(found)
        checks += found
    if not dry:
        table = [{"name": name, "pass": ok, "detail": detail} for name, ok, detail in checks]
        args.json.with_name(args.json.stem + "_checks.json").write_text(json.dumps(table, indent=2))
    code = code or int(not all(ok for _, ok, _ in checks))
    sys.exit(code)


if __name__ == "__main__":
    main()
