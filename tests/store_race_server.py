"""A stand-in for `dlm serve --deployment NAME` in the store race test: it speaks the store's
side of the hot-swap contract exactly as dlm/cli/server/hotswap.py does (register with the
store, claim the journal's intent, note what it serves) but "loads" a version by checking its
files exist, for a random fraction of a second, so kills land in the middle of swaps.

    python -m tests.store_race_server STORE DEPLOYMENT SEED

Prints `ready` once registered. It also answers `GET /served` with what it serves, and
records every problem it sees (a version it serves or loads whose files vanished) in
`<STORE>/race-problems.log`.
"""

from __future__ import annotations

import json
import random
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from dlm.cli.store.releases import claim_swap, register, swap_ended
from dlm.cli.store.store import Store
from dlm.engine.errors import DlmError


def main(root: str, deployment: str, seed: int) -> None:
    store = Store(Path(root))
    rng = random.Random(seed)
    state = {"serving": None}
    swap_lock = threading.Lock()
    problems = store.root / "race-problems.log"

    def problem(text: str) -> None:
        with open(problems, "a") as handle:
            handle.write(text + "\n")

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def _answer(self, status: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except OSError:  # the release was killed while waiting: nobody to answer
                pass

        def do_GET(self) -> None:  # noqa: N802 - the http.server API
            self._answer(200, {"serving": state["serving"]})

        def do_POST(self) -> None:  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            target = f"{body['model']}@{body['version']}"
            if not swap_lock.acquire(blocking=False):
                self._answer(409, {"error": {"message": "another swap is in progress"}})
                return
            try:
                try:
                    claim_swap(store, deployment, body.get("intent"), target, state["serving"])
                except DlmError as exc:
                    self._answer(409, {"error": {"message": str(exc)}})
                    return
                try:
                    time.sleep(rng.uniform(0.0, 0.4))  # loading and warming up
                    if not Path(body["path"]).is_dir():
                        problem(f"asked to load {target}, whose files are gone")
                        self._answer(500, {"error": {"message": "files gone"}})
                        return
                    state["serving"] = target
                finally:
                    swap_ended(store, deployment, state["serving"])
                self._answer(200, {"status": "ok", "model": body["model"], "version": body["version"]})
            finally:
                swap_lock.release()

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    url = f"http://127.0.0.1:{server.server_address[1]}"
    manifest, _ = register(store, deployment, url, "race-key")
    state["serving"] = f"{manifest.name}@{manifest.version}"
    threading.Thread(target=server.serve_forever, daemon=True).start()
    print("ready", flush=True)
    while True:  # what it serves must stay on disk for as long as it serves it
        serving = state["serving"]
        model, _, version = serving.partition("@")
        if not (store.files_dir(model, version)).is_dir() and state["serving"] == serving:
            problem(f"serving {serving}, whose files are gone")
        time.sleep(0.05)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
