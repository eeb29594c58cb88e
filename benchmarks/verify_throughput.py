"""How fast `dlm verify` hashes: files of random bytes in the safetensors format, fetched into
a scratch store by hard link, then verified twice (the second pass reads the page cache,
which is the issue's target: >= 400 MB/s).

    python benchmarks/verify_throughput.py [--gb 2] [--files 4] [--workers N]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from dlm.cli.store.fetch import fetch  # noqa: E402
from dlm.cli.store.hashing import NoProgress  # noqa: E402
from dlm.cli.store.store import Store  # noqa: E402
from dlm.cli.store.verify import VerifyReport, check_hashes  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gb", type=float, default=2.0)
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--workers", type=int, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="dlm-verify-bench-") as tmp:
        src = Path(tmp) / "src"
        src.mkdir()
        per = int(args.gb * 1e9 / args.files / 4)
        g = torch.Generator().manual_seed(0)
        for i in range(args.files):
            save_file({f"t{i}": torch.rand(per, generator=g)}, str(src / f"shard-{i}.safetensors"))
        store = Store(Path(tmp) / "store")
        result = fetch(str(src), store, name="bench", link=True)
        files = store.files_dir("bench", result.manifest.version)
        for attempt in ("first pass", "page cache"):
            report = VerifyReport(path=str(files))
            start = time.perf_counter()
            check_hashes(files, result.manifest, report, NoProgress(), args.workers)
            seconds = time.perf_counter() - start
            assert report.ok, report.failures
            print(
                f"{attempt}: {report.bytes_hashed / 1e6:.0f} MB in {seconds:.2f}s = "
                f"{report.bytes_hashed / seconds / 1e6:.0f} MB/s ({args.files} files, "
                f"{args.workers or os.cpu_count()} workers)"
            )


if __name__ == "__main__":
    main()
