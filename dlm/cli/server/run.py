"""Run the app under uvicorn with dlm's shutdown: SIGTERM drains instead of dropping work.

First SIGTERM (or Ctrl-C): `/ready` turns 503 and new requests get 503, while in-flight
requests finish or time out for up to `shutdown_grace` seconds; the rest end with an error;
then uvicorn closes and the process exits 0. A second signal exits at once with code 1,
dropping what still runs: the logs are flushed and the process ends with `os._exit`, since
an interpreter shutdown beside running engine threads can abort in C++ (a signal status).
A model that fails to load ends the process with exit code 2 (unusable model) or 1; a port
that cannot be bound, with exit code 1 before the model loads.

An engine that fails while serving (a tensor-parallel rank died or hung) cannot recover:
its requests end with errors at once, `/health` and `/ready` answer 503 naming the cause for
`FAILED_EXIT_DELAY_S`, then the process exits 1 so a supervisor restarts it (as vLLM does).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from types import FrameType

import uvicorn

from dlm.cli import hangup
from dlm.cli.server.app import create_app
from dlm.cli.server.config import ServeConfig
from dlm.cli.server.connections import MAX_HEAD_BYTES, listen, protocol
from dlm.cli.server.logs import LOGGERS, set_log_level
from dlm.cli.server.metrics_push import server_instance
from dlm.cli.server.service import Service
from dlm.engine.errors import DlmError

log = logging.getLogger("dlm.server")

FAILED_EXIT_DELAY_S = 3.0  # after an engine failure: time to answer its requests and probes
FORCED_EXIT_CODE = 1  # a second signal: requests were dropped
# How long a thread holding the GIL keeps it while another waits (Python's default: 5 ms). The
# event loop waits behind the preparation thread (chat templates are pure Python) at most
# this long per wake-up, which keeps /health fast under abusive bodies.
GIL_SWITCH_INTERVAL_S = 0.001


class JsonFormatter(logging.Formatter):
    """One JSON object per line; request lines are JSON already."""

    def format(self, record: logging.LogRecord) -> str:
        if record.name == "dlm.requests":
            return record.getMessage()
        line = {
            "ts": round(time.time(), 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


def configure_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    for name in LOGGERS:
        logger = logging.getLogger(name)
        logger.handlers = [handler]
        logger.propagate = False
    set_log_level(level)


class DrainingServer(uvicorn.Server):
    def __init__(
        self, config: uvicorn.Config, service: Service, settings: Callable[[], ServeConfig] | None = None
    ) -> None:
        super().__init__(config)
        self.service = service
        self.settings = settings
        self._reloading: asyncio.Task[None] | None = None
        self._reload_asked = False  # a SIGHUP not yet answered by a read of the settings
        self.exit_code = 0
        self._drain_requested = False
        self._drain_task: asyncio.Task[None] | None = None
        self._failed_at: float | None = None
        self.urls: list[str] = []
        self.scheme = "https" if config.ssl_certfile else "http"
        self._announced = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Unlike uvicorn's handler, the signal is not re-raised after shutdown: a drained
        # server exits 0.
        if self._drain_requested or self.should_exit:
            log.warning("second signal: exiting now with code %d; unfinished requests are dropped", FORCED_EXIT_CODE)
            exit_now(FORCED_EXIT_CODE)
        self._drain_requested = True

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        if self.settings is not None:  # before the model loads: SIGHUP's default would end the process
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self._reload_requested)
            if hangup.take():  # one sent as the process started (dlm.cli.hangup)
                self._reload_requested()
        await super().startup(sockets)
        for server in getattr(self, "servers", []):
            for sock in server.sockets:
                host, port = sock.getsockname()[:2]
                self.urls.append(f"{self.scheme}://{host}:{port}")
                log.info("listening on %s:%d (requests wait while the model loads)", host, port)

    def _reload_requested(self) -> None:
        """SIGHUP: a reload, after the one running if any (it may have read the file before
        the write this signal announces); signals while one waits are that one. While a
        model loads (the first one, or a hot swap's next version), the reload waits for it
        (`on_tick`): the family that will serve checks the defaults."""
        self._reload_asked = True
        if not self.service.reloadable:
            return
        if self._reloading is None or self._reloading.done():
            self._reloading = asyncio.create_task(self._reload_while_asked())

    async def _reload_while_asked(self) -> None:
        while self._reload_asked and self.service.reloadable:
            self._reload_asked = False
            await self.reload()

    async def reload(self) -> None:
        """SIGHUP: read the settings again (the --config file, DLM_* variables, the flags given)
        and apply their live ones (`Service.reload`); a file that does not read is an error
        line, and nothing changes."""
        assert self.settings is not None
        try:
            new = await asyncio.to_thread(self.settings)
            if not self.service.reloadable:  # a hot swap began meanwhile: once it has switched
                self._reload_asked = True
                return
            applied, restart = self.service.reload(new)
        except DlmError as exc:
            log.error("settings not reloaded: %s", exc)
            return
        changes = ", ".join(f"{name} {old!r} -> {value!r}" for name, (old, value) in applied.items())
        log.info("settings reloaded: %s", changes or "no live setting changed")
        if restart:
            log.warning("settings changed that need a restart, not applied: %s", ", ".join(restart))

    def announce_ready(self) -> None:
        """One line with the URL, once the model answers: the moment to send requests (the
        port, chosen by the OS for --port 0, is the one bound)."""
        self._announced = True
        for url in self.urls:
            log.info("ready: serving %s at %s/v1", self.service.model_name, url)

    async def on_tick(self, counter: int) -> bool:
        if self.service.ready and not self._announced:
            self.announce_ready()
        if self._reload_asked and self.service.reloadable:  # a SIGHUP sent while a model loaded
            self._reload_requested()
        if self.service.load_error is not None:
            log.error("error: %s", self.service.load_error)
            self.exit_code = self.service.exit_code
            return True
        failure = self.service.engine_failure
        if failure is not None:
            now = time.monotonic()
            if self._failed_at is None:
                self._failed_at = now
                log.error("the engine failed; exiting with code 1 in %gs: %s", FAILED_EXIT_DELAY_S, failure)
            elif now - self._failed_at >= FAILED_EXIT_DELAY_S:
                self.exit_code = 1
                return True
        if self._drain_requested and self._drain_task is None:
            self._drain_task = asyncio.create_task(self._drain())
        return await super().on_tick(counter)

    async def _drain(self) -> None:
        service = self.service
        service.draining = True
        grace = service.config.shutdown_grace
        log.info("draining: no new requests; in-flight ones get up to %gs", grace)
        ended = sum(await asyncio.gather(*(m.engine.drain(grace) for m in service.loaded())))
        if ended:
            log.warning("grace period over: ended %d unfinished requests", ended)
        await asyncio.sleep(0.2)  # let the handlers write their final responses
        self.should_exit = True


def exit_now(code: int) -> None:
    """End the process at once, after flushing what it has logged and printed."""
    for handler in logging.getLogger("dlm").handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def serve(config: ServeConfig, settings: Callable[[], ServeConfig] | None = None) -> int:
    """Serve until drained or stopped; returns the process exit code. `settings`: the
    configuration as it reads now (its file, variables and flags), which SIGHUP applies."""
    sockets = listen(config.host, config.port)  # a busy port fails here, before the model loads
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    configure_logging(config.log_level)
    if not config.keys():
        log.warning("no API keys configured: every caller is accepted (use --api-key or --api-key-file)")
    app = create_app(config, push_instance=server_instance(sockets[0].getsockname()[1]))
    uv_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        http=protocol(config.read_timeout),
        timeout_keep_alive=config.keep_alive_timeout,
        # uvicorn refuses a request once this many connections are open, the asking one among
        # them: one more, so that max_connections open connections are served (1 served none).
        limit_concurrency=config.max_connections + 1,
        h11_max_incomplete_event_size=MAX_HEAD_BYTES,  # a head still arriving; whole ones: app.HeadLimit
        log_level=config.log_level,
        access_log=False,
        log_config=None,
        lifespan="on",
        timeout_graceful_shutdown=5,
        ssl_certfile=str(config.ssl_certfile) if config.ssl_certfile else None,
        ssl_keyfile=str(config.ssl_keyfile) if config.ssl_keyfile else None,
    )
    server = DrainingServer(uv_config, app.state.service, settings)
    server.run(sockets=sockets)
    if server.exit_code == 0 and not server.started:
        return 1  # uvicorn could not bind or start
    error = app.state.service.load_error
    if error is not None:  # logged as JSON above; its last line is the contract's, for scripts
        sys.stderr.write(f"error: {error}\n")
    return server.exit_code
