"""The admin endpoint: `POST /admin/swap`, on its own listener bound to 127.0.0.1 only.

It is a second HTTP server in the same process and event loop as the API, never reachable
from the network whatever `--host` the API binds, and it requires the admin key (a
`Bearer` token, compared like API keys: hashed, constant time, never logged). With
`--deployment NAME` the server registers the endpoint and key in the store
(dlm/cli/store/admin.py, file mode 0600), which is how `dlm release` and `dlm rollback`
find it; without an admin key configured, a random one is made for that purpose.
The contract is in docs/weights.md ("Hot swap").
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from dlm.cli.server import errors
from dlm.cli.server.auth import KeyRing, authorization
from dlm.cli.server.body import parse_json, read_body
from dlm.cli.server.hotswap import HotSwapper, SwapRequest
from dlm.cli.server.service import Service
from dlm.cli.store.admin import SWAP_PATH, unregister_server
from dlm.cli.store.releases import register
from dlm.cli.store.store import Store

log = logging.getLogger("dlm.server")

LOOPBACK = "127.0.0.1"
MAX_BODY = 64 * 1024


def create_admin_app(swapper: HotSwapper, key: str) -> FastAPI:
    app = FastAPI(title="dlm admin", docs_url=None, redoc_url=None, openapi_url=None, redirect_slashes=False)
    errors.install(app)
    keys = KeyRing([key])

    @app.post(SWAP_PATH)
    async def swap(request: Request) -> JSONResponse:
        keys.identify(authorization(request))  # 401 before the body is read
        # Read and parsed as the API's bodies are (dlm/cli/server/body.py): capped while it
        # arrives, and a key given twice refused, where pydantic's JSON parser kept the last.
        raw = await read_body(request, MAX_BODY, swapper.service.config.read_timeout)
        try:
            body = SwapRequest.model_validate(parse_json(raw))
        except ValidationError as exc:
            raise errors.validation_error(list(exc.errors())) from None
        return JSONResponse(await swapper.swap(body))

    return app


class _SharedLoopServer(uvicorn.Server):
    """A uvicorn server run as a task on the API server's loop: the API server owns the
    process signals (SIGTERM drains), so this one installs no handlers."""

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class AdminEndpoint:
    def __init__(self, service: Service) -> None:
        self.service = service
        config = service.config
        self.key = config.configured_admin_key() or secrets.token_urlsafe(32)
        self.swapper = HotSwapper(service)
        self.url: str | None = None
        self._server: _SharedLoopServer | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> str:
        """Listen on 127.0.0.1, then register in the store for a deployment; the URL."""
        config = self.service.config
        self._server = _SharedLoopServer(
            uvicorn.Config(
                create_admin_app(self.swapper, self.key),
                host=LOOPBACK,
                port=config.admin_port,
                log_config=None,
                log_level=config.log_level,
                access_log=False,
                lifespan="off",
                timeout_graceful_shutdown=5,
            )
        )
        self._task = asyncio.create_task(self._server.serve())
        while not self._server.started:
            if self._task.done():
                self._task.result()  # its error, if it raised one
                raise RuntimeError(f"the admin endpoint could not listen on {LOOPBACK}:{config.admin_port}")
            await asyncio.sleep(0.01)
        port = self._server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://{LOOPBACK}:{port}"
        if config.deployment is not None:  # what to load is read in the same store transaction
            store = Store(config.store)
            manifest, path = await asyncio.to_thread(register, store, config.deployment, self.url, self.key)
            self.service.pinned = (str(path), f"{manifest.name}@{manifest.version}")
        log.info("admin endpoint on %s%s (deployment %s)", self.url, SWAP_PATH, config.deployment or "-")
        return self.url

    async def stop(self) -> None:
        """Unregister first, so a release from now on switches only the store."""
        config = self.service.config
        if config.deployment is not None and self.url is not None:
            unregister_server(Store(config.store), config.deployment)
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            await self._task
