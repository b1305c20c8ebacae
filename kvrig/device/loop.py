"""The one bridge from the click commands into the async device layer.

SIGTERM (a CI job cancelled, a lab worker told to stop) cancels the running coroutine as Ctrl-C does, so its
clean-up runs (the soak stops the app it launched), then raises Terminated."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from kvrig.exceptions import Terminated

T = TypeVar("T")
log = logging.getLogger("kvrig.device")


def _quiet_lost_links(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    # When a phone is unplugged, pymobiledevice3's background readers end with connection errors nobody
    # awaits; the operation that needed the link already raised DeviceLostError, so these are noise.
    exc = context.get("exception")
    if isinstance(exc, ConnectionError | EOFError | asyncio.IncompleteReadError) or (
        exc is not None and type(exc).__name__ in ("ConnectionTerminatedError", "StreamClosedError")
    ):
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
