"""Bounded waits for blocking calls that have no timeout of their own (C-level rendezvous)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def call_with_deadline(
    fn: Callable[[], T], deadline: float, what: str, check: Callable[[], None] | None = None
) -> T:
    """Run ``fn`` on a daemon thread and wait for it until ``deadline`` (``time.monotonic()`` seconds).

    ``check`` runs every 10 ms while waiting and may raise (e.g. the server already answered with an
    error, so the peer will never arrive). A call that never returns is left on its daemon thread; the
    caller gets ``TimeoutError`` naming ``what`` instead of a hang.
    """
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # re-raised on the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=run, name=f"weight-sync-{what}", daemon=True)
    thread.start()
    while thread.is_alive():
        if check is not None:
            check()
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not complete in time")
        thread.join(0.01)
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]  # type: ignore[return-value]
