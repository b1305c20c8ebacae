"""The one bridge from the click commands into the async device layer.

SIGTERM (a CI job cancelled, a lab worker told to stop) cancels the running coroutine as Ctrl-C does, so its
clean-up runs (the soak stops the app it launched), then raises Terminated.

A cancel is a request that can be lost: Python 3.11's `asyncio.wait_for` returns the inner result and drops a
cancel that arrives as the inner call completes (a phone's reply and the signal in one turn of the loop), and
so kvrig's own calls to the phone are bounded with `bounded` (asyncio.timeout, which keeps a cancel), and the
clean-up that must finish (stopping the app) runs `to_the_end`, within its own deadline, whatever cancels arrive
meanwhile."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from collections.abc import Awaitable, Coroutine
from typing import Any, TypeVar

from kvrig.exceptions import Terminated

T = TypeVar("T")
log = logging.getLogger("kvrig.device")


async def bounded(awaitable: Awaitable[T], seconds: float) -> T:
    """`awaitable` within `seconds` (TimeoutError after), never dropping a cancel of the caller (as 3.11's
    `asyncio.wait_for` does when the awaitable completes in the same turn)."""
    async with asyncio.timeout(seconds):
        return await awaitable


async def to_the_end(awaitable: Awaitable[T]) -> T:
    """Runs `awaitable` to its end even if the caller is cancelled meanwhile (the cancels are absorbed: use it only
    for clean-up on a path that raises anyway, and only for work with its own deadline)."""
    task = asyncio.ensure_future(awaitable)
    while True:
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.done():
                return task.result()


def _quiet_lost_links(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    # When a phone is unplugged, pymobiledevice3's background readers end with connection errors nobody
    # awaits; the operation that needed the link already raised DeviceLostError, so these are noise.
    from pymobiledevice3.exceptions import ConnectionTerminatedError  # loaded by then: the exception is its

    exc = context.get("exception")
    if isinstance(exc, ConnectionError | EOFError | asyncio.IncompleteReadError | ConnectionTerminatedError):
        log.debug("ignored after the link dropped: %r", exc)
        return
    loop.default_exception_handler(context)


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    terminated = False

    async def main() -> T:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(_quiet_lost_links)
        task = asyncio.current_task()
        assert task is not None

        def on_sigterm() -> None:
            nonlocal terminated
            terminated = True
            task.cancel()

        with contextlib.suppress(ValueError, NotImplementedError, RuntimeError):  # not the main thread, Windows
            loop.add_signal_handler(signal.SIGTERM, on_sigterm)
        return await coro

    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if main_thread else None
    try:
        result = asyncio.run(main())
    except asyncio.CancelledError:
        if terminated:
            raise Terminated("stopped by SIGTERM") from None
        raise
    finally:
        if previous is not None:  # the loop leaves SIGTERM at its default; the caller's handler comes back
            signal.signal(signal.SIGTERM, previous)
    if terminated:
        raise Terminated("stopped by SIGTERM")
    return result
