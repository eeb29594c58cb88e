"""Hot swap: serve another checkpoint version without failing a request.

The steps, one swap at a time (a second one is refused with 409 while one runs):

1. Load the new version beside the serving one, in a worker thread, and warm it up with a
   real request: a checkpoint that cannot load or run is found here, while traffic still
   flows to the old version untouched (the caller gets an error and nothing changes).
2. Switch: one assignment of `Service.served`, made on the event loop. Request handlers run
   on the same loop and never await between encoding a prompt and submitting it, so each
   request is wholly on the old version or wholly on the new one.
3. Drain the old engine: its in-flight requests finish on the old model (up to
   `request_timeout`, after which they would have timed out anyway), then its loop stops
   and its weights are released: the swap waits (briefly) until the old engine object is
   garbage, so its memory is back before the next version is released.

Only then is the swap answered, so `dlm release` records success only once no request can
reach the old version any more.

For a store deployment the swap must carry the intent id the release wrote in the store's swap
journal (dlm/cli/store/releases.py): the server checks it before loading, notes in its record
that it is switching, and notes what it serves once it has switched (or given up), so a
release killed meanwhile is settled from what the server really did.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from typing import Any

from pydantic import BaseModel, ConfigDict

from dlm.cli.server import heap
from dlm.cli.server.errors import APIError
from dlm.cli.server.loaded import LoadedModel
from dlm.cli.server.service import Service

log = logging.getLogger("dlm.server")


class SwapRequest(BaseModel):
    """The body `dlm release` / `dlm rollback` send (dlm/cli/store/admin.py)."""

    model_config = ConfigDict(extra="ignore", protected_namespaces=())  # newer clients may send more

    deployment: str | None = None
    model: str
    version: str
    path: str
    content_sha256: str | None = None
    intent: str | None = None  # the store's journal entry (required for a deployment)

    @property
    def ref(self) -> str:
        return f"{self.model}@{self.version}"


class HotSwapper:
    def __init__(self, service: Service) -> None:
        self.service = service
        self._lock = asyncio.Lock()

    @property
    def busy(self) -> bool:
        return self._lock.locked()

    async def swap(self, request: SwapRequest) -> dict[str, Any]:
        if self.busy:
            raise APIError(409, "another swap is in progress; retry when it has finished", code="swap_in_progress")
        async with self._lock:
            old = await self._serving(request)
            await self._journal(request, old)
            self.service.swapping = True
            try:
                candidate = await self._load(request, old)
                self._switch(old, candidate)
            finally:
                self.service.swapping = False
                await self._journal_end()
            old_engine = await self._retire(old)
            del old, candidate  # the last references this swap holds
            await _released(old_engine)
        return {"status": "ok", "model": request.model, "version": request.version}

    async def _serving(self, request: SwapRequest) -> LoadedModel:
        """The model served now, once the start-up load has finished."""
        service = self.service
        deployment = service.config.deployment
        if request.deployment is not None and deployment is not None and request.deployment != deployment:
            raise APIError(
                400,
                f"this server serves deployment {deployment!r}, not {request.deployment!r}",
                param="deployment",
                code="wrong_deployment",
            )
        while service.served is None and service.load_error is None and not service.draining:
            await asyncio.sleep(0.05)  # a release arrived while the first version was loading
        if service.draining:
            raise APIError(503, "the server is shutting down", type="unavailable", code="draining")
        if service.served is None:
            raise APIError(
                503, f"the server failed to load its model: {service.load_error}", type="unavailable", code="not_ready"
            )
        return service.served

    async def _journal(self, request: SwapRequest, old: LoadedModel) -> None:
        """Act only on the release pending in the store, and say so in the server record."""
        config = self.service.config
        if config.deployment is None:
            return
        from dlm.cli.store.releases import claim_swap
        from dlm.cli.store.store import Store
        from dlm.engine.errors import DlmError

        try:
            await asyncio.to_thread(
                claim_swap, Store(config.store), config.deployment, request.intent, request.ref, old.ref
            )
        except DlmError as exc:
            raise APIError(409, str(exc), param="intent", code="no_pending_release") from None

    async def _journal_end(self) -> None:
        config = self.service.config
        if config.deployment is None:
            return
        from dlm.cli.store.releases import swap_ended
        from dlm.cli.store.store import Store

        served = self.service.served
        await asyncio.to_thread(swap_ended, Store(config.store), config.deployment, served.ref if served else None)

    async def _load(self, request: SwapRequest, old: LoadedModel) -> LoadedModel:
        log.info(
            "hot swap: loading %s from %s (content sha256 %s) beside %s",
            request.ref,
            request.path,
            request.content_sha256 or "-",
            old.describe(),
        )
        failure = None
        try:
            candidate = await asyncio.to_thread(self.service.open, request.path, request.ref, warmup=True)
        except Exception as exc:  # any failure leaves the old version serving
            failure = f"{type(exc).__name__}: {exc}"
        if failure is not None:
            log.error("hot swap to %s failed, still serving %s: %s", request.ref, old.describe(), failure)
            _free_memory()  # what the failed load allocated
            raise APIError(
                500,
                f"loading or warming up {request.ref} failed, still serving {old.describe()}: {failure}",
                type="server_error",
                code="swap_failed",
            )
        if self.service.draining:  # the server began shutting down while the new one loaded
            candidate.engine.stop()
            raise APIError(503, "the server is shutting down", type="unavailable", code="draining")
        return candidate

    def _switch(self, old: LoadedModel, new: LoadedModel) -> None:
        service = self.service
        service.retiring.append(old)
        service.served = new
        service.metrics.serving(service.model_name, new.version, service.config.deployment)
        log.info(
            "hot swap: new requests go to %s; draining %s (%d running, %d waiting)",
            new.describe(),
            old.describe(),
            old.engine.num_running,
            old.engine.num_waiting,
        )

    async def _retire(self, old: LoadedModel) -> weakref.ref[Any]:
        """Drain and stop the old engine; a weak reference to the engine that held its weights."""
        try:
            ended = await old.engine.drain(self.service.config.request_timeout)
            if ended:
                log.warning("hot swap: ended %d requests of %s that outlived request_timeout", ended, old.describe())
        finally:
            await asyncio.to_thread(old.engine.stop)
            self.service.retiring.remove(old)
        log.info("hot swap: %s drained", old.describe())
        return weakref.ref(old.engine.engine)


async def _released(engine: weakref.ref[Any], patience: float = 10.0) -> None:
    """Wait until the old engine is garbage: the handlers of its last requests still hold it
    while they write their responses, which the drain let them finish. Reference counting
    frees it then; a collection over frozen objects runs only if reference cycles keep it
    alive. Then one full collection (a fraction of a second with torch loaded, and it stalls
    the event loop) precedes freezing the new version's objects (dlm/cli/server/heap.py)."""
    start = time.monotonic()
    collected = False
    while engine() is not None and time.monotonic() < start + patience:
        await asyncio.sleep(0.02)
        if engine() is not None and not collected and time.monotonic() > start + 1.0:
            heap.collect()  # frozen objects too: the old version was loaded before the last freeze
            collected = True
    heap.freeze()  # the new version's objects join the rest out of full collections
    _free_memory()
    if engine() is None:
        log.info("hot swap: the old version's weights are released")
    else:
        log.warning(
            "hot swap: the old version is still referenced after %gs; its memory returns when its last response ends",
            patience,
        )


def _free_memory() -> None:
    """Give the memory of dropped tensors back to the device now (CUDA's allocator keeps it
    cached otherwise, and the next version would load beside the ghost of the old one)."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
