"""SIGTERM ends what `run_async` runs at its next call to the phone, and the clean-up that must finish does.

The lab worker's stop (issue 24, defect 5) depended on one cancel landing: Python 3.11's `asyncio.wait_for`, which
bounded every call of the soak's poll, drops a cancel that arrives in the turn its inner call completes (a phone's
reply and the signal together), so a worker told to stop polled on until it was ended by force, its app running.
These cases hold `bounded` (what the poll uses now) and `to_the_end` to it, with no phone."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from kvrig.device.loop import bounded, run_async, to_the_end
from kvrig.exceptions import Terminated


def _sigterm_soon(delay: float = 0.05) -> None:
    asyncio.get_running_loop().call_later(delay, os.kill, os.getpid(), signal.SIGTERM)


def test_a_cancel_arriving_as_a_poll_completes_is_not_lost() -> None:
    """The race that left lab apps running: the reply and SIGTERM in the same turn of the loop."""
    polls = 0

    async def polling() -> None:
        nonlocal polls
        loop = asyncio.get_running_loop()
        while polls < 30:  # 6 s of polls: a lost SIGTERM lets them all run
            reply = loop.create_future()
            loop.call_soon(reply.set_result, None)
            if polls == 3:
                os.kill(os.getpid(), signal.SIGTERM)  # its handler runs in the turn the reply completes
            await bounded(reply, 5)  # the soak's poll (`_call`): asyncio.wait_for here lost the cancel on 3.11
            polls += 1
            await asyncio.sleep(0.2)

    start = time.monotonic()
    with pytest.raises(Terminated):
        run_async(polling())
    assert polls == 4 and time.monotonic() - start < 3, polls  # the poll in flight ends, the next await stops


def test_bounded_keeps_a_cancel_that_arrives_as_its_call_completes() -> None:
    async def main() -> str:
        loop = asyncio.get_running_loop()
        inner = loop.create_future()

        async def call() -> str:
            await bounded(inner, 5)
            await asyncio.sleep(1)
            return "went on"

        task = asyncio.create_task(call())
        await asyncio.sleep(0)
        inner.set_result(None)
        task.cancel()
        try:
            return await task
        except asyncio.CancelledError:
            return "cancelled"

    assert asyncio.run(main()) == "cancelled"
    with pytest.raises(TimeoutError):
        asyncio.run(bounded(asyncio.sleep(5), 0.05))


def test_clean_up_runs_to_its_end_through_a_second_sigterm() -> None:
    """A cancel arriving while the app is being stopped does not cut the stop short."""
    done: list[str] = []

    async def stop_the_app() -> str:
        await asyncio.sleep(1.5)
        done.append("stopped")
        return "stopped"

    async def interrupted() -> None:
        try:
            _sigterm_soon()
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            _sigterm_soon(0.3)  # a second SIGTERM (a CI runner's, a parent's) while the app is being stopped
            done.append(await to_the_end(stop_the_app()))
            raise

    with pytest.raises(Terminated):
        run_async(interrupted())
    assert done == ["stopped", "stopped"]
