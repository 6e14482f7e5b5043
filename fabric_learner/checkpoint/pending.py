"""The one background save a learner may have in flight, and waiting for it."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any


class PendingSave:
    """The path and future of the last ``save(blocking=False)`` until it is waited for."""

    def __init__(self) -> None:
        self._pending: tuple[Any, Future] | None = None

    def track(self, path: Any, future: Future | None) -> Future:
        """The handle ``save(blocking=False)`` returns: ``future``, or a finished one for a synchronous save."""
        if future is None:
            future = Future()
            future.set_result(None)
        else:
            self._pending = (path, future)
        return future

    def wait(self, timeout: float | None = None) -> None:
        """Block until the pending save is complete; ``TimeoutError`` leaves it pending, a failure clears it."""
        if self._pending is None:
            return
        path, future = self._pending
        try:
            future.result(timeout)
        except TimeoutError:
            raise
        except BaseException as err:
            self._pending = None
            raise RuntimeError(f"The background save to {path} failed ({type(err).__name__}: {err}); the "
                               "checkpoint there is still the previous complete one. Save again.") from err
        self._pending = None
