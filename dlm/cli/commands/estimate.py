"""`dlm estimate`: the per-GPU memory plan of a deployment, before anything is loaded."""

from __future__ import annotations

from typing import Any

import typer

from dlm.cli.output import cli_errors, emit_json, err_console
from dlm.engine.quantization import CHOICES


def _size(n: float) -> str:
    for unit, scale in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n:,.0f} B"


def _params(n: int) -> str:
    return f"{n / 1e9:.3f} B" if n >= 1e8 else f"{n / 1e6:.3f} M" if n >= 1e5 else f"{n:,}"


def _quantized(serving: dict[str, Any]) -> str:
    return f" ({serving['quantization']} linear layers)" if serving["quantization"] else ""


def _difference(difference: int) -> str:
    """What a count of the headers unlike config.json's means."""
    if difference > 0:
        return "tensors the plan does not model"
    return "the weights lack tensors config.json describes, or hold them packed (pre-quantized)"


def _render(report: dict[str, Any]) -> None:
    from rich.markup import escape
    from rich.table import Table

    m, p, s = report["model"], report["parameters"], report["serving"]
    err_console.print(
        f"[bold]{escape(m['source'])}[/]: {m['family']} ({m['model_type']}), {m['attention']} attention, "
        f"{m['layers']} layers, hidden {m['hidden_size']}, {m['heads']}/{m['kv_heads']} heads"
    )
    params = Table(title="parameters", title_justify="left")
    for col in ("component", "params", "active / token", "assumption"):
        params.add_column(col, justify="right" if col in ("params", "active / token") else "left")
    for c in p["components"]:
        params.add_row(c["name"], _params(c["params"]), _params(c["active"]), escape(c["assumption"]))
    params.add_row(
        "[bold]total[/]", f"[bold]{_params(p['total'])}[/]", f"[bold]{_params(p['active'])}[/]", p["active_convention"]
    )
    err_console.print(params)
    err_console.print(
        f"non-embedding: {_params(p['non_embedding'])} total, {_params(p['active_non_embedding'])} active; "
        f"active without the input-embedding lookup: {_params(p['active_without_input_embedding'])}"
    )
    ck = report["checkpoint"]
    if ck is not None:
        verdict = (
            "[green]matches config.json[/]"
            if ck["matches_config"]
            else f"[yellow]differs from config.json by {ck['difference']:+,}[/] ({_difference(ck['difference'])})"
        )
        dtypes = ", ".join(f"{k} {_params(v)}" for k, v in ck["params_by_dtype"].items())
        err_console.print(f"checkpoint headers: {ck['params_in_headers']:,} params ({dtypes}), {verdict}")
    elif report["checkpoint_note"]:
        err_console.print(f"[dim]checkpoint headers: not read ({report['checkpoint_note']})[/]")

    mem = Table(
        title=f"memory per GPU: {s['dtype']} weights{_quantized(s)}, TP {s['tp']}, batch {s['batch']}, context "
        f"{s['context']} (gen {s['gen_length']}, block {s['block_length']}), cache {s['cache']}",
        title_justify="left",
    )
    mem.add_column("item")
    mem.add_column("bytes", justify="right")
    mem.add_column("assumption")
    for r in report["memory_per_gpu"]["rows"]:
        mem.add_row(r["name"], _size(r["bytes"]), escape(r["assumption"]))
    mem.add_row(
        "[bold]total (peak)[/]",
        f"[bold]{_size(report['memory_per_gpu']['total_bytes'])}[/]",
        "weights + caches + the larger transient + overhead + margin",
    )
    err_console.print(mem)
    seq = report["memory_per_gpu"]["per_sequence"]
    fixed = (
        f", linear-attention state {_size(seq['linear_state_bytes'])} whatever its length"
        if seq["linear_state_bytes"]
        else ""
    )
    err_console.print(f"per sequence and rank: KV cache {_size(seq['kv_bytes_per_token'])} per cached token{fixed}")

    verdicts = Table(title=f"verdicts at TP {s['tp']}, context {s['context']}", title_justify="left")
    for col in ("GPU", "memory", f"fits (batch {s['batch']})", "headroom", "smallest TP", "max batch"):
        verdicts.add_column(col, justify="left" if col == "GPU" else "right")
    for v in report["verdicts"]:
        verdicts.add_row(
            v["gpu"],
            _size(v["memory_bytes"]),
            "[green]yes[/]" if v["fits"] else "[red]no[/]",
            _size(v["headroom_bytes"]),
            str(v["smallest_tp"] or "none"),
            str(v["max_batch"]),
        )
    if report["verdicts"]:
        err_console.print(verdicts)
    for note in report["notes"]:
        err_console.print(f"[yellow]note:[/] {escape(note)}")


def estimate(
    model: str = typer.Argument(
        ..., help="Checkpoint directory, store model (NAME[@VERSION]), a config.json file, or a hub repo id (org/name)."
    ),
    dtype: str = typer.Option(
        "auto", "--dtype", help="Activations and unquantized weights: auto (bf16), bf16, fp16, fp32."
    ),
    quantization: str | None = typer.Option(
        None,
        "--quantization",
        help=f"Linear layers and experts as `dlm serve --quantization` loads them: {', '.join(CHOICES)}. "
        "(--dtype int8/int4/fp8, the older spelling, means bf16 with that quantization.)",
        show_default="none",
    ),
    kv_dtype: str = typer.Option(
        "auto",
        "--kv-dtype",
        help="KV cache: auto (activation dtype), bf16, fp16, fp32, int8 (what --kv-cache-dtype int8 stores: "
        "block-causal families), fp8 (a what-if: no server stores it).",
    ),
    tp: int = typer.Option(
        1,
        "--tensor-parallel-size",
        "-tp",
        "--tp",  # the older spelling, kept
        help="Tensor-parallel ranks (GPUs per replica), as `dlm serve --tensor-parallel-size` takes them.",
    ),
    batch: int = typer.Option(1, "--batch", help="Sequences decoded together."),
    context: int | None = typer.Option(
        None,
        "--context",
        help="Tokens per sequence, prompt + generation.",
        show_default="min(max position, 4096)",
    ),
    gen_length: int = typer.Option(256, "--gen-length", help="Generated tokens per sequence."),
    block_length: int | None = typer.Option(
        None,
        "--block-length",
        help="Denoising block size.",
        show_default="the model's: its trained block or canvas length, else 32",
    ),
    cache: str = typer.Option(
        "auto", "--cache", help="auto|none|prefix|dual|block (auto: block for block-causal models, none otherwise)."
    ),
    logits: str = typer.Option(
        "fused", "--logits", help="fused (chunked LM-head statistics) or unfused (full logits)."
    ),
    prefill_chunk: int = typer.Option(
        8192, "--prefill-chunk", help="Tokens per prefill forward of block-causal models (0: whole prompts at once)."
    ),
    overhead_gb: float | None = typer.Option(
        None, "--overhead-gb", help="Runtime overhead per GPU in GiB.", show_default="1.0, +0.5 with TP>1"
    ),
    fragmentation: float = typer.Option(
        0.10, "--fragmentation", help="Share of cache and transient memory lost to fragmentation."
    ),
    group_size: int | None = typer.Option(
        None,
        "--group-size",
        help="int4 inputs per scale: 128, 64 or 32 (the groups the int4 kernels take).",
        show_default="the loader's: 128, or 64/32 where 128 does not divide",
    ),
    device: str = typer.Option(
        "cuda",
        "--device",
        help="Device type planned for, cuda or cpu: a quantized layout's padding differs "
        "(CUDA int4 pads every layer's inputs to 1024).",
    ),
    gpu: str | None = typer.Option(
        None, "--gpu", help="Judge one GPU from the catalogue.", show_default="every GPU of the catalogue"
    ),
    gpu_memory: float | None = typer.Option(
        None, "--gpu-memory", help="Judge a GPU with this many GiB instead.", show_default="none"
    ),
    revision: str | None = typer.Option(
        None, "--revision", help="Hub revision (hub repo ids only).", show_default="main"
    ),
    json_out: bool = typer.Option(False, "--json", help="Print the full plan as JSON on stdout."),
) -> None:
    """Plan GPU memory for serving MODEL: parameters, weights, caches, activations, verdicts."""
    with cli_errors():
        from dlm.cli.store.leases import holding

        with holding("dlm estimate"):  # a store version it resolves is leased while it runs
            from dlm.cli.estimate.plan import Serving
            from dlm.cli.estimate.plan import estimate as plan

            serving = Serving(
                dtype=dtype,
                kv_dtype=kv_dtype,
                tp=tp,
                batch=batch,
                context=context,
                gen_length=gen_length,
                block_length=block_length,
                cache=cache,
                logits=logits,
                prefill_chunk=prefill_chunk or None,
                overhead_gib=overhead_gb,
                fragmentation=fragmentation,
                quantization=quantization,
                group_size=group_size,
                device=device,
            )
            report = plan(model, serving, gpu=gpu, gpu_memory_gib=gpu_memory, revision=revision)
            if json_out:
                emit_json(report)
            else:
                _render(report)
