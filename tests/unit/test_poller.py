"""The poll worker hands each poll's outcome straight back to the event loop: its result, or the
error the poll raised, in submission order; a poll nobody waits for any more is not run."""

from __future__ import annotations

import asyncio
import threading

import pytest

from deviceplugin.errors import BackendError
from deviceplugin.poller import DaemonWorker


async def test_results_and_errors_come_back_to_the_loop_in_order() -> None:
    worker = DaemonWorker("test-poll")
    loop = asyncio.get_running_loop()
    try:
        calls: list[str] = []

        def first_call() -> int:
            calls.append("first")
            return 1

        def third_call() -> int:
            calls.append("third")
            return threading.get_ident()

        def fail() -> int:
            calls.append("fail")
            raise BackendError("the GPU driver did not answer")

        first = worker.run_for(loop, first_call)
        second = worker.run_for(loop, fail)
        third = worker.run_for(loop, third_call)
        assert await first == 1
        with pytest.raises(BackendError, match="did not answer"):
            await second
        # Run on the worker's thread, never on the loop's.
        assert await third != threading.get_ident()
        assert calls == ["first", "fail", "third"]
    finally:
        worker.shutdown()


async def test_a_call_cancelled_before_it_starts_is_not_run() -> None:
    worker = DaemonWorker("test-poll")
    loop = asyncio.get_running_loop()
    try:
        release = threading.Event()
        ran: list[str] = []
        busy = worker.run_for(loop, lambda: release.wait(5))
        dropped = worker.run_for(loop, lambda: ran.append("dropped"))
        dropped.cancel()
        after = worker.run_for(loop, lambda: ran.append("after"))
        release.set()
        assert await busy is True
        await after
        assert ran == ["after"]
    finally:
        worker.shutdown()


def test_an_outcome_for_a_closed_loop_is_dropped_and_the_worker_carries_on() -> None:
    worker = DaemonWorker("test-poll")
    loop = asyncio.new_event_loop()
    try:
        release = threading.Event()
        worker.run_for(loop, lambda: release.wait(5))
        loop.close()
        release.set()
        # The worker still runs what comes next.
        assert worker.submit(lambda: 7).result(timeout=5) == 7
    finally:
        worker.shutdown()
