"""dlm against the peer server dlmserve (PyPI) on the same checkpoints, prompts and settings,
both at their default server settings, alternated in one run.

Models: dlm's default model (the embedded checkpoint) and a random 8-layer, 1024-wide LLaDA
checkpoint with the default model's tokenizer (104M parameters, written here with
dlm.engine.checkpoint_writer). Requests: the default model's suite prompts (chat), greedy,
`--gen-length` tokens in one block of as many steps (one token per forward; dlmserve's
schedule). Each round runs, for each server in turn (the order alternates between rounds,
and the idle server is paused with SIGSTOP so it takes no CPU), every prompt at concurrency
1, 4 and 8 and records the latency of each request and the requests per second. The
answers of the two servers are compared prompt by prompt; RSS is read from
/proc/PID/smaps_rollup at the end. Ratios are dlm / peer per round; the table shows their
median and range over the rounds. `--also "ARGS"` (repeatable) adds a `dlm serve ARGS` that
takes its turn in every round, with its ratios to the peer and to the plain dlm (settings
that are not the defaults, to see what a flag would buy: `--also="--dtype bfloat16"`);
`--governor` is `--also=--thread-governor` (dlm/engine/runtime/thread_governor.py). The
load average is printed per round.

The peer's environment and the workarounds it needs: benchmarks/peers.py, docs/benchmarks.md.

    python benchmarks/vs_peers.py [--rounds 3] [--gen-length 64] [--prompts 16] [--governor]
        [--also=ARGS] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.peers import DlmServer, DlmserveServer, Server  # noqa: E402

LEVELS = (1, 4, 8)
GOVERNOR = "--thread-governor"  # --governor's variant (dlm/engine/runtime/thread_governor.py)
# The 104M checkpoint: LLaDA-8B's proportions at 1024 hidden, 8 layers.
SHAPE = {"d_model": 1024, "n_layers": 8, "n_heads": 16, "n_kv_heads": 16, "mlp_hidden_size": 2816}


def default_model() -> Path:
    from dlm.engine.resolve import resolve_model

    return Path(resolve_model(None))


def _write_shaped(directory: Path, vocab_size: int, mask_token_id: int, eos_token_id: int, **extra: Any) -> bool:
    """SHAPE with random weights (seed 0) at this vocabulary; False when already written."""
    from dlm.engine.checkpoint_writer import llada_config, random_llada_tensors, save_checkpoint

    if (directory / "model.safetensors").exists():
        return False
    config = llada_config(vocab_size, mask_token_id, eos_token_id, **SHAPE, **extra)
    save_checkpoint(directory, config, random_llada_tensors(config, seed=0))
    return True


def write_104m(directory: Path) -> Path:
    """The 104M random LLaDA with the default model's tokenizer (its ids, mask and EOS)."""
    base = json.loads((default_model() / "config.json").read_text())
    if _write_shaped(directory, base["vocab_size"], base["mask_token_id"], base["eos_token_id"]):
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (directory / name).write_bytes((default_model() / name).read_bytes())
    return directory


def write_llada_shaped(directory: Path) -> Path:
    """SHAPE at a 32K vocabulary, without a tokenizer (prompts are ids): 102.8M parameters in
    its layers plus 2 x 33.6M of embedding and LM head, the checkpoint benchmarks/quantization.py
    and benchmarks/decode_vs_reference.py measure (their tables were made on it)."""
    vocab = 32768
    _write_shaped(directory, vocab, vocab - 2, vocab - 1, max_sequence_length=4096)
    return directory


def prompts(count: int) -> list[list[dict[str, str]]]:
    import yaml

    suite = yaml.safe_load((default_model() / "suite.yaml").read_text())
    cases = [case["messages"] for case in suite["cases"]]
    return [cases[i % len(cases)] for i in range(count)]


def mask_token(model_dir: Path) -> tuple[str, int]:
    config = json.loads((model_dir / "config.json").read_text())
    tokenizer = json.loads((model_dir / "tokenizer_config.json").read_text())
    return str(tokenizer["mask_token"]), int(config["mask_token_id"])


def run_level(server: Server, requests: list[list[dict[str, str]]], gen_length: int, c: int) -> dict[str, Any]:
    """Every request at concurrency c: latencies, requests per second, answers."""

    def one(messages: list[dict[str, str]]) -> tuple[float, str]:
        start = time.perf_counter()
        answer = server.answer(messages, gen_length)  # type: ignore[attr-defined]
        return time.perf_counter() - start, answer

    start = time.perf_counter()
    with ThreadPoolExecutor(c) as pool:
        results = list(pool.map(one, requests))
    wall = time.perf_counter() - start
    return {
        "latency": statistics.median(r[0] for r in results),
        "rps": len(requests) / wall,
        "answers": [r[1].strip() for r in results],
    }


def measure(model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    requests = prompts(args.prompts)
    token, mask_id = mask_token(model_dir)
    servers: dict[str, Server] = {}
    try:
        dtype = ["--dtype", args.dtype] if args.dtype else []
        servers["dlm"] = DlmServer(model_dir, *dtype)
        servers["dlm"].pause()
        for also in args.also:
            servers[variant(also)] = DlmServer(model_dir, *dtype, *shlex.split(also))
            servers[variant(also)].pause()
        servers["dlmserve"] = DlmserveServer(model_dir, token, mask_id, args.dtype or "bf16")
        servers["dlmserve"].pause()
        rounds: list[dict[str, dict[int, dict[str, Any]]]] = []
        for r in range(args.rounds):
            order = list(servers) if r % 2 == 0 else list(reversed(servers))
            result: dict[str, dict[int, dict[str, Any]]] = {}
            for name in order:
                server = servers[name]
                server.resume()
                run_level(server, requests[:2], args.gen_length, 1)  # warm: first-request costs
                result[name] = {c: run_level(server, requests, args.gen_length, c) for c in LEVELS}
                server.pause()
            rounds.append(result)
            print(f"  round {r + 1} (load {os.getloadavg()[0]:.2f}): " + summary_line(result), flush=True)
        for server in servers.values():
            server.resume()
        rss = {name: server.rss_mib() for name, server in servers.items()}
        dtype = servers["dlm"].health().get("dtype", {})  # type: ignore[attr-defined]
    finally:
        for server in servers.values():
            server.close()
    return {"model": model_dir.name, "rounds": rounds, "rss_mib": rss, "dlm_dtype": dtype}


def variant(args: str) -> str:
    """The name of the dlm server started with `args` beside the plain one."""
    return f"dlm {args}"


def pairs(result: dict[str, Any]) -> list[tuple[str, str]]:
    """(server, baseline) pairs whose ratios are reported: each dlm against the peer, and
    each variant (`--also`) against the plain dlm."""
    found = [("dlm", "dlmserve")]
    for name in result:
        if name.startswith("dlm "):
            found += [(name, "dlmserve"), (name, "dlm")]
    return found


def summary_line(result: dict[str, dict[int, dict[str, Any]]]) -> str:
    return "  |  ".join(
        f"{a}/{b} "
        + "  ".join(
            f"c={c}: lat {result[a][c]['latency'] / result[b][c]['latency']:.2f} "
            f"rps {result[a][c]['rps'] / result[b][c]['rps']:.2f}"
            for c in LEVELS
        )
        for a, b in pairs(result)
    )


def table(row: dict[str, Any], a: str = "dlm", b: str = "dlmserve") -> list[str]:
    """Markdown rows: per concurrency, medians and a/b ratios (median, range)."""
    lines = []
    for c in LEVELS:
        lat = {n: [r[n][c]["latency"] for r in row["rounds"]] for n in (a, b)}
        rps = {n: [r[n][c]["rps"] for r in row["rounds"]] for n in (a, b)}
        lat_ratio = [x / y for x, y in zip(lat[a], lat[b])]
        rps_ratio = [x / y for x, y in zip(rps[a], rps[b])]
        same = sum(x == y for r in row["rounds"] for x, y in zip(r[a][c]["answers"], r[b][c]["answers"]))
        total = sum(len(r[a][c]["answers"]) for r in row["rounds"])
        lines.append(
            f"| {row['model']} {a} / {b} | {c} | {statistics.median(lat[a]):.3f} / {statistics.median(lat[b]):.3f} "
            f"| **{statistics.median(lat_ratio):.2f}** ({min(lat_ratio):.2f}-{max(lat_ratio):.2f}) "
            f"| {statistics.median(rps[a]):.2f} / {statistics.median(rps[b]):.2f} "
            f"| **{statistics.median(rps_ratio):.2f}** ({min(rps_ratio):.2f}-{max(rps_ratio):.2f}) | {same}/{total} |"
        )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gen-length", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--models", default="default,104m")
    ap.add_argument(
        "--dtype",
        choices=("float32",),
        help="both servers in fp32 (an identity check of the decoding: not their defaults)",
    )
    ap.add_argument("--governor", action="store_true", help=f"the same as --also={GOVERNOR}")
    ap.add_argument(
        "--also",
        action="append",
        default=[],
        metavar="ARGS",
        help='also a dlm serve with these arguments (repeatable; --also="--dtype bfloat16")',
    )
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "dlm-vs-peers")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.governor and GOVERNOR not in args.also:
        args.also.append(GOVERNOR)
    paths = {"default": default_model(), "104m": write_104m(args.workdir / "llada-8x1024-104m")}
    print(f"load {os.getloadavg()[0]:.2f} at start", flush=True)
    rows = []
    for name in args.models.split(","):
        print(f"{name}:", flush=True)
        rows.append(measure(paths[name], args))
    print(f"load {os.getloadavg()[0]:.2f} at end\n")
    print("| model, a / b | c | latency s a / b | latency ratio | req/s a / b | req/s ratio | same answers |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        for a, b in pairs(row["rounds"][0]):
            print("\n".join(table(row, a, b)))
    for row in rows:
        rss = row["rss_mib"]
        print(
            f"{row['model']}: RSS dlm {rss['dlm']['rss']:.0f} MiB (peak {rss['dlm']['peak']:.0f}), "
            f"dlmserve {rss['dlmserve']['rss']:.0f} MiB (peak {rss['dlmserve']['peak']:.0f}); "
            f"dlm dtype {row['dlm_dtype'].get('dtype')}, {row['dlm_dtype'].get('threads')} thread(s)"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
