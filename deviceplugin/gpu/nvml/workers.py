"""One worker thread per GPU, which makes every NVML call on that GPU.

`NvmlBackend.poll` asks each idle worker for a read and waits at most `call_timeout_s` for all of
them together, then reports what it has: a worker that is late keeps its last reading, which is
reported again, so one slow or hung GPU delays the others by at most one timeout, once. The call
in progress and when it began are kept here, so that the backend can see a hung call (see
`health`). Threads stuck in the driver cannot be interrupted; they are daemon threads.

The worker also holds the call helpers that turn an NVML error into a decision: an optional
measurement that the GPU does not support is turned off, with one log line; any other error is a
`GpuFaultError` that makes the GPU unhealthy.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from deviceplugin.gpu.nvml.library import NvmlLibrary
from deviceplugin.model import GpuInfo

logger = logging.getLogger(__name__)


class GpuFaultError(Exception):
    """An NVML call failed in a way that makes its GPU unhealthy."""


class TransientError(Exception):
    """An NVML call failed in a way that the next poll retries (the last values are kept)."""


class GpuWorker:
    """One GPU's worker thread and its NVML calls; only that thread touches the handle and what
    the subclasses cache (`inventory.GpuInventory`, `sampling.Gpu`)."""

    def __init__(self, lib: NvmlLibrary, index: int, clock: Callable[[], float]) -> None:
        self.index = index
        # Set by the backend once the inventory is complete; until then the GPU is not reported.
        self.info: GpuInfo | None = None
        self.uuid: str | None = None
        self.handle: Any = None
        # The NVML call in progress on the worker, and when it began (for hang detection).
        self.call_name: str | None = None
        self.call_started_s = 0.0
        self._lib = lib
        self._nvml = lib.nvml
        self._clock = clock
        self._disabled: set[str] = set()
        self._jobs: queue.SimpleQueue[
            tuple[Callable[[], None], concurrent.futures.Future[None]] | None
        ] = queue.SimpleQueue()
        self._future: concurrent.futures.Future[None] | None = None
        self.thread = threading.Thread(target=self._run, name=f"nvml-gpu{index}", daemon=True)
        self.thread.start()

    # -- the worker ---------------------------------------------------------------------------

    @property
    def idle(self) -> bool:
        return self._future is None or self._future.done()

    def submit(self, job: Callable[[], None]) -> concurrent.futures.Future[None]:
        future: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._future = future
        self._jobs.put((job, future))
        return future

    def stop(self) -> None:
        self._jobs.put(None)

    def _run(self) -> None:
        while (item := self._jobs.get()) is not None:
            job, future = item
            future.set_running_or_notify_cancel()
            try:
                job()
            except Exception as e:
                logger.exception("nvml worker job failed index=%d", self.index)
                future.set_exception(e)
            else:
                future.set_result(None)

    # -- NVML calls (worker thread only) ------------------------------------------------------

    def call(self, name: str, *args: object) -> Any:
        function = getattr(self._nvml, name)
        self.call_started_s = self._clock()
        self.call_name = name
        try:
            return function(*args)
        finally:
            self.call_name = None

    def label(self) -> str:
        return f"index={self.index} uuid={self.uuid or '?'}"

    def _disable(self, measurement: str, why: str) -> None:
        """Turn a measurement off (callers check that it is on), with its one log line."""
        self._disabled.add(measurement)
        logger.warning(
            "gpu measurement turned off %s measurement=%r reason=%r; reported as unknown",
            self.label(),
            measurement,
            why,
        )

    def _fault(self, call: str, error: Exception) -> GpuFaultError:
        return GpuFaultError(f"{call} failed with {self._lib.describe_error(error)}")

    def _optional(self, measurement: str, name: str, *args: object) -> Any:
        """An NVML call whose NOT_SUPPORTED turns the measurement off: None then and after."""
        if measurement in self._disabled:
            return None
        try:
            return self.call(name, *args)
        except self._lib.nvml_error as e:
            if self._lib.is_unsupported(e):
                self._disable(measurement, f"{name}: {self._lib.describe_error(e)}")
                return None
            raise self._fault(name, e) from e

    def _required(self, name: str, *args: object) -> Any:
        try:
            return self.call(name, *args)
        except self._lib.nvml_error as e:
            raise self._fault(name, e) from e
