"""What can go wrong between the controller and its learner ranks, as named errors.

A lost rank (its process killed, its node gone) and a rank that stops answering both leave the
process group unusable: the other ranks sit in a collective that will never complete. So either
fault ends the whole group (its actors are killed) and the call raises at once, naming the rank,
instead of waiting for the process group's own timeout. The controller's state (its counters, the
caller's batch, whatever the script holds) is never changed by a failed call.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any


class LearnerLostError(RuntimeError):
    """A learner rank's process died (``rank`` names it); the group is ended.

    ``seconds``: how long the call waited before the death was known. With
    ``RemoteLearner(on_lost_rank="rebuild")`` also ``rebuilt_from`` (the checkpoint the new group
    loaded, ``None`` for the loss as first sent) and ``lost_updates`` (updates since it, not kept).

    Examples:
        >>> from fabric_learner import LearnerLostError
        >>> err = LearnerLostError("Learner rank 1 was lost during update()", rank=1)
        >>> err.rank, isinstance(err, RuntimeError)
        (1, True)
    """

    def __init__(self, message: str, rank: int, seconds: float = 0.0) -> None:
        super().__init__(message)
        self.rank = rank
        self.seconds = seconds  # from the start of the wait to the death being known


class LearnerTimeoutError(TimeoutError):
    """Ranks did not answer a call in time (``ranks`` names them, the message says where each was); the group is ended.

    Examples:
        >>> from fabric_learner import LearnerTimeoutError
        >>> err = LearnerTimeoutError("update() timed out after 4 s: rank(s) [1] did not answer", ranks=[1])
        >>> err.ranks, isinstance(err, TimeoutError)
        ([1], True)
    """

    def __init__(self, message: str, ranks: list[int]) -> None:
        super().__init__(message)
        self.ranks = ranks


# what a lost or silent rank's error says after the fault itself, unless the learner rebuilds the group (it says what it did)
CONTINUE = "Build a new RemoteLearner and load the last checkpoint (learner.load(path)) to continue."
RESTART = f"The group was ended; nothing in this process changed. {CONTINUE}"


class LearnerKeyError(KeyError):
    """A rank's ``KeyError`` as the controller raises it: ``except KeyError`` catches it, and it prints its message as
    written (a ``KeyError``'s own ``str()`` is the repr of its key, quotes escaped).

    Examples:
        >>> from fabric_learner.remote.faults import LearnerKeyError
        >>> print(LearnerKeyError("Learner rank 0: the batch lacks ['action']"))
        Learner rank 0: the batch lacks ['action']
    """

    def __str__(self) -> str:
        return str(self.args[0]) if len(self.args) == 1 else super().__str__()


def gather(refs: Sequence[Any], what: str, timeout: float | None, where=None, grace: float | None = None,
           then: str = RESTART) -> list[Any]:
    """Every rank's answer to one call, in rank order; a rank's death or silence raises at once.

    ``where(ranks)`` (optional) says what silent ranks are doing, for the timeout's message. A
    rank's own Python exception is re-raised as its original type (``FloatingPointError``,
    ``KeyError``, ...), prefixed by the rank, once every rank answered: the first rank's, or, when
    ranks refused a step over non-finite values, the first rank whose share holds them. If the
    others stay silent for ``grace`` seconds after it (waiting in a collective for the rank that
    failed), the group is stuck and a ``LearnerTimeoutError`` says so. ``then`` ends the message
    of a lost or silent rank (what the caller does next).
    """
    import ray
    from ray.exceptions import RayActorError, RayTaskError

    start = time.monotonic()
    deadline = None if timeout is None else start + timeout
    index = {ref: rank for rank, ref in enumerate(refs)}
    results: dict[int, Any] = {}
    errors: dict[int, BaseException] = {}
    failed_at = start
    pending = list(refs)
    while pending:
        limit = deadline
        if errors and grace is not None:
            limit = min(limit, failed_at + grace) if limit is not None else failed_at + grace
        left = None if limit is None else max(0.0, limit - time.monotonic())
        ready, pending = ray.wait(pending, num_returns=1, timeout=left)
        for ref in ready:
            rank = index[ref]
            try:
                results[rank] = ray.get(ref)
            except RayTaskError as err:
                cause = err.cause if isinstance(err.cause, BaseException) else err
                named = _from_rank(cause, rank)
                named.__cause__ = err
                if not errors:
                    failed_at = time.monotonic()
                errors[rank] = named
            except RayActorError as err:
                raise LearnerLostError(_joined(
                    f"Learner rank {rank} was lost during {what} (its process died: {_first_line(err)}). The other "
                    "ranks cannot go on without it.", then), rank, time.monotonic() - start) from err
        if pending and limit is not None and time.monotonic() >= limit:
            silent = sorted(index[ref] for ref in pending)
            doing = where(silent) if where is not None else {}
            detail = "; ".join(f"rank {r}: {doing.get(r, 'no answer')}" for r in silent)
            if errors:
                first = min(errors)
                raise LearnerTimeoutError(_joined(
                    f"During {what}, rank {first} raised {type(errors[first]).__name__}: {errors[first]}; rank(s) "
                    f"{silent} then stayed silent for {grace:g} s ({detail}), waiting for it in a collective.", then),
                    silent) from errors[first]
            raise LearnerTimeoutError(_joined(
                f"{what} timed out after {timeout:g} s: rank(s) {silent} did not answer ({detail}). Raise timeout= "
                "if the step is really that long, or look at the named rank's code path.", then), silent)
    if errors:
        holding = [r for r in sorted(errors) if getattr(errors[r], "nonfinite_rows", None)]
        raise errors[holding[0] if holding else min(errors)]
    return [results[r] for r in range(len(refs))]


def _joined(fault: str, then: str) -> str:
    return f"{fault} {then}" if then else fault


def _from_rank(cause: BaseException, rank: int) -> BaseException:
    """``cause`` as its own type (a ``KeyError`` as a ``LearnerKeyError``), its message prefixed by the rank;
    unchanged when the type cannot be rebuilt.

    The ranks are ``FabricLearner``s built from this learner's options: a hint naming
    ``FabricLearner(precision=...)`` names ``RemoteLearner``'s own ``precision=``.
    """
    text = str(cause)
    if type(cause) is KeyError and len(cause.args) == 1 and isinstance(cause.args[0], str) and " " in cause.args[0]:
        text = cause.args[0]  # a sentence, not a key: as written, not repr-quoted
    text = text.replace("FabricLearner(precision=", "RemoteLearner(precision=")
    try:
        named = (LearnerKeyError if type(cause) is KeyError else type(cause))(f"Learner rank {rank}: {text}")
    except Exception:  # noqa: BLE001 - exception types with other constructors keep their message
        return cause
    for attr in ("rank", "ranks", "nonfinite_rows"):
        if hasattr(cause, attr):
            setattr(named, attr, getattr(cause, attr))
    return named


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__
