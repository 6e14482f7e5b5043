"""A pipeline stage that raises or dies is named on every stage at once, never after a timeout.

torch's schedules wait for each transfer between stages with ``work.wait()``, which for gloo's sends and
receives has no timeout at all (torch 2.13): a stage whose loss raises while its process lives on (the error
caught, the process busy elsewhere) leaves the stages waiting for it waiting forever, and a stage whose
process dies is reported as a closed connection to an address, naming no stage.

So while a ``PipelineLearner``'s schedule runs, its waits go through :class:`StageWatch`: a helper thread waits
for the transfers while the calling thread looks, at growing intervals (0.5 ms up to 50 ms), at one key of the
process group's store. A stage that fails writes what failed there (:meth:`StageWatch.announce`) before its error
leaves ``update``; the stages waiting for it raise at once, naming it. A connection closed by a stage that wrote
nothing means its process died (SIGKILL, the OOM killer, a lost node). A wait longer than the learner's timeout
raises too, naming the stages it waited for. The key is the learner's own (its transfer group's name), so a
learner built later in the same process group never reads an earlier one's failure.

:func:`stopped` turns what ended a schedule into the error each stage raises; after it, the learner refuses to
go on (the stages are mid-schedule, with transfers posted that will never be matched).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Iterator
from datetime import timedelta

from fabric_learner.utils.compat import default_store

_FIRST_LOOK, _LONGEST_LOOK = 0.0005, 0.05  # seconds between looks at the store while a transfer is pending
_AFTER = ("No stage stepped its optimizer. The stages are mid-schedule, so this learner cannot go on: close it on "
          "every rank and build a new one (load a checkpoint into it to resume).")


class StageFailed(RuntimeError):
    """A wait ended because another stage announced its failure; ``said`` is what it announced."""

    def __init__(self, said: str) -> None:
        super().__init__(said)
        self.said = said


class StageSilent(RuntimeError):
    """A wait outlasted the learner's timeout and no stage announced a failure."""


class StageWatch:
    """Waits for a schedule's transfers while watching for a stage's announced failure; see the module."""

    def __init__(self, name: str, timeout: timedelta | None) -> None:
        self._key = f"fabric_learner/pipeline/{name}/failed"
        self.timeout = timeout or timedelta(minutes=30)  # torch's own default for gloo
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def announce(self, text: str) -> None:
        """Tell every stage of this learner that this one failed; never raises (the store may be gone)."""
        with contextlib.suppress(Exception):
            default_store().set(self._key, text)

    def announced(self) -> str | None:
        """What a failed stage of this learner announced, or ``None``; never raises."""
        try:
            store = default_store()
            return store.get(self._key).decode() if store.check([self._key]) else None
        except Exception:  # noqa: BLE001 - the store lives with rank 0, which may be gone
            return None

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """Inside the block, torch's schedules wait through :meth:`wait` (their module's own wait function)."""
        from torch.distributed.pipelining import schedules

        original = getattr(schedules, "_wait_batch_p2p", None)
        if original is None:  # another torch: its own waits, unwatched
            yield
            return
        schedules._wait_batch_p2p = self.wait
        try:
            yield
        finally:
            schedules._wait_batch_p2p = original

    def wait(self, works) -> None:
        """Wait for ``works``; raise ``StageFailed`` once a stage announced a failure, ``StageSilent`` after the
        timeout, or the transfer's own error (a closed connection)."""
        works = list(works)
        if not works:
            return
        done, failure = threading.Event(), []
        self._serve()
        self._requests.put((works, done, failure))
        pause, deadline = _FIRST_LOOK, time.monotonic() + self.timeout.total_seconds()
        while not done.wait(pause):
            said = self.announced()
            if said is not None:
                raise StageFailed(said)
            if time.monotonic() > deadline:
                raise StageSilent(f"waited {self.timeout} (the learner's timeout) for a transfer")
            pause = min(2 * pause, _LONGEST_LOOK)
        if failure:
            raise failure[0]

    def close(self) -> None:
        """End the helper thread once it is idle (a thread stuck in a transfer stays, as a daemon)."""
        if self._thread is not None:
            self._requests.put(None)
            self._thread = None

    def _serve(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=_wait_for_requests, args=(self._requests,), daemon=True,
                                            name="fabric_learner-pipeline-transfers")
            self._thread.start()


def _wait_for_requests(requests: queue.SimpleQueue) -> None:
    while True:
        request = requests.get()
        if request is None:
            return
        works, done, failure = request
        try:
            for work in works:
                work.wait()  # gloo releases the GIL here
        except BaseException as err:  # noqa: BLE001 - handed to the waiting thread
            failure.append(err)
        finally:
            done.set()


def _stages(stages: list[int]) -> str:
    return " or ".join(f"stage {s} (rank {s})" for s in stages)


def neighbours(stage: int, num_stages: int) -> list[int]:
    """The stages ``stage`` exchanges tensors with."""
    return [s for s in (stage - 1, stage + 1) if 0 <= s < num_stages]


def stopped(err: BaseException, watch: StageWatch, stage: int, num_stages: int, call: int,
            own: tuple[str, BaseException] | None) -> BaseException:
    """The error stage ``stage`` raises for ``err``, which ended its schedule in ``update()`` call ``call``.

    ``own``: where this stage's own code failed and its error (the loss in a forward), when it did. Announces
    this stage's own failures to the others first. An interrupt (``KeyboardInterrupt``, ``SystemExit``) is
    announced and returned as it is.
    """
    head = f"Rank {stage} (stage {stage}): update() call {call}"
    if isinstance(err, StageFailed):
        return _caused(RuntimeError(f"{head} stopped: {err.said}. {_AFTER} See that rank's output for its own "
                                    "error."), err)
    peers = _stages(neighbours(stage, num_stages))
    if isinstance(err, StageSilent):
        return _caused(RuntimeError(f"{head} {err} with {peers}, and no stage announced a failure: it is hung, or "
                                    f"slower than the timeout (PipelineStrategy's learner takes timeout=). {_AFTER}"),
                       err)
    lost = _lost_peer(err)
    if lost is not None:
        said = watch.announced()  # announced just before its process ended: the message says what failed
        if said is not None:
            return _caused(RuntimeError(f"{head} stopped: {said}. {_AFTER} See that rank's output for its own "
                                        "error."), err)
        return _caused(RuntimeError(f"{head} lost its connection to {peers} ({lost}), and no stage announced a "
                                    f"failure: a stage's process died or was killed. {_AFTER}"), err)
    where, cause = own if own is not None else ("part of the schedule (a backward or a transfer)", err)
    what = f"{type(cause).__name__}: {cause}"
    watch.announce(f"stage {stage} (rank {stage}) failed in its {where} ({what})")
    if not isinstance(err, Exception):
        return err
    return _caused(RuntimeError(f"{head} failed in this stage's {where}: {what}. The other stages were told at "
                                f"once and stop, naming this stage. {_AFTER}"), cause)


def lost_in_collective(err: BaseException, watch: StageWatch, stage: int, call: int) -> BaseException | None:
    """The error for a collective of ``update()`` outside the schedule that failed because of another rank,
    or ``None`` when ``err`` is not about another rank."""
    lost = _lost_peer(err)
    if lost is None:
        return None
    said = watch.announced()
    who = f"{said}" if said is not None else "no stage announced a failure: a stage's process died or was killed"
    return _caused(RuntimeError(f"Rank {stage} (stage {stage}): update() call {call} could not complete a collective "
                                f"with the other stages ({lost}); {who}. The optimizer step may not have been "
                                "taken on every stage, so this learner cannot go on: close it on every rank and build "
                                "a new one (load a checkpoint into it to resume)."), err)


def _lost_peer(err: BaseException) -> str | None:
    if not isinstance(err, RuntimeError):
        return None
    from fabric_learner.fabric import _lost_peer as what_it_says  # FabricLearner's reading of gloo's errors

    return what_it_says(err)


def _caused(error: BaseException, cause: BaseException) -> BaseException:
    error.__cause__ = cause
    return error
