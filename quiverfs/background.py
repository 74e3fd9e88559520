"""Background tasks of an object that is built before its daemon's nursery exists."""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import trio


class BackgroundTasks:
    """A nursery held open by ``run`` (a task of the daemon's nursery); ``start_soon``
    starts a task in it, or none before ``run`` has started or after it ended."""

    def __init__(self) -> None:
        self._nursery: trio.Nursery | None = None

    async def run(self, *, task_status: trio.TaskStatus = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                self._nursery = None

    @property
    def running(self) -> bool:
        return self._nursery is not None

    def start_soon(self, fn: Callable[..., Awaitable[Any]], *args: Any,
                   name: str | None = None) -> None:
        if self._nursery is not None:
            self._nursery.start_soon(fn, *args, name=name)
