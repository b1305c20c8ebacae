"""The one bridge from the click commands into the async device layer."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

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
    async def main() -> T:
        asyncio.get_running_loop().set_exception_handler(_quiet_lost_links)
        return await coro

    return asyncio.run(main())
