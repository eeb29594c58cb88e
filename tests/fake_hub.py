"""A tiny stand-in for the Hugging Face Hub's HTTP API, so huggingface_hub's real client code
runs against it through HF_ENDPOINT with no network.

Endpoints emulated (enough for `HfApi.repo_info`, `HfApi.list_repo_tree` and
`snapshot_download(local_dir=...)`):
- GET  /api/models/{org}/{name}/revision/{rev}   -> {"id", "sha"}; unknown rev: 404 RevisionNotFound
- GET  /api/models/{org}/{name}/tree/{rev}        -> [{"type": "file", "path", "size", "oid", "lfs"?}]
- HEAD /{org}/{name}/resolve/{rev}/{path}         -> X-Repo-Commit, ETag (LFS: the sha256), Content-Length
- GET  /{org}/{name}/resolve/{rev}/{path}         -> the bytes; honours `Range: bytes=N-` with 206
Files whose name ends in .safetensors are served as LFS files (sha256 oid), others as git blobs.
Other repos answer 404 with `X-Error-Code: RepoNotFound`, as the hub does. `stall = (file, n)`
makes the server send n bytes of that file and then hang, so a test can kill the client
mid-transfer; every request is logged with its method, path and headers.
"""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse


class FakeHub:
    def __init__(self, repo_id: str, files: dict[str, bytes], commit: str = "a" * 40, branch: str = "main") -> None:
        self.repo_id, self.files, self.commit, self.branch = repo_id, dict(files), commit, branch
        self.served: dict[str, bytes] = dict(files)  # what downloads return (tests may corrupt it)
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        self.stall: tuple[str, int] | None = None
        self.release_stall = threading.Event()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_HEAD(self) -> None:
                hub._handle(self, head=True)

            def do_GET(self) -> None:
                hub._handle(self, head=False)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.release_stall.set()
        self.server.shutdown()
        self.server.server_close()

    @staticmethod
    def write_dir(directory: Path, files: dict[str, bytes]) -> None:
        for rel, data in files.items():
            (directory / rel).parent.mkdir(parents=True, exist_ok=True)
            (directory / rel).write_bytes(data)

    def _entry(self, path: str) -> dict[str, object]:
        data = self.files[path]
        blob = hashlib.sha1(f"blob {len(data)}\0".encode() + data).hexdigest()
        entry: dict[str, object] = {"type": "file", "path": path, "size": len(data), "oid": blob}
        if path.endswith(".safetensors"):
            entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
        return entry

    def _reply(
        self,
        h: BaseHTTPRequestHandler,
        status: int,
        body: bytes = b"",
        headers: dict[str, str] | None = None,
        head: bool = False,
    ) -> None:
        h.send_response(status)
        for key, value in (headers or {}).items():
            h.send_header(key, value)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if not head:
            h.wfile.write(body)

    def _handle(self, h: BaseHTTPRequestHandler, head: bool) -> None:
        url = urlparse(h.path)
        path = unquote(url.path)
        self.requests.append((h.command, path, dict(h.headers)))
        api = f"/api/models/{self.repo_id}/"
        resolve = f"/{self.repo_id}/resolve/"
        if path.startswith(api + "revision/"):
            rev = path[len(api + "revision/") :]
            if rev not in (self.branch, self.commit):
                self._reply(h, 404, b'{"error": "Invalid rev id"}', {"X-Error-Code": "RevisionNotFound"})
                return
            self._reply(h, 200, json.dumps({"id": self.repo_id, "sha": self.commit}).encode())
        elif path.startswith(api + "tree/"):
            self._reply(h, 200, json.dumps([self._entry(p) for p in sorted(self.files)]).encode())
        elif path.startswith(resolve):
            rev, _, rel = path[len(resolve) :].partition("/")
            if rev not in (self.branch, self.commit) or rel not in self.files:
                self._reply(h, 404, b"not found", {"X-Error-Code": "EntryNotFound"}, head)
                return
            entry = self._entry(rel)
            etag = entry["lfs"]["oid"] if "lfs" in entry else entry["oid"]  # type: ignore[index]
            headers = {"X-Repo-Commit": self.commit, "ETag": f'"{etag}"', "Accept-Ranges": "bytes"}
            data = self.served[rel]
            start = 0
            if "Range" in h.headers and not head:
                start = int(h.headers["Range"].split("=")[1].split("-")[0])
                headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
            body = data[start:]
            h.send_response(206 if start else 200)
            for key, value in headers.items():
                h.send_header(key, value)
            h.send_header("Content-Length", str(len(body)))
            h.end_headers()
            if head:
                return
            try:
                if self.stall is not None and self.stall[0] == rel:
                    h.wfile.write(body[: self.stall[1]])
                    h.wfile.flush()
                    self.release_stall.wait(60)
                    return
                h.wfile.write(body)
            except (BrokenPipeError, ConnectionResetError):
                pass
        elif path.startswith("/api/models/"):
            self._reply(h, 404, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"})
        else:
            self._reply(h, 404, b"unknown endpoint")
