"""Ranks that disagree on which collective they are in: named at once, not after an abort or a hang.

The hazard (gloo, torch 2.13): when one rank enters a collective the others do not (``get_weights``
under FSDP on rank 0 only), gloo either pairs it with whatever collective the peers run next and
aborts the process (``EnforceNotMet ... collective mismatch``, SIGABRT, nothing to catch), or waits
silently for the whole process-group timeout. Neither names the call that went wrong.

So each of the learner's collective entry points other than ``update`` first announces
``(sequence number, call name)`` in the process group's TCP store (the rendezvous store torch
built with the group; never a gloo collective, which is what aborts) and waits, polling in short
steps, until every other rank announced the same call at the same sequence number. It raises at
once, on this rank, when a peer announced a different call there, or announced that it ended or
failed; and, when no peer answers, after the process-group timeout plus a short grace (so that a
peer stuck in ``update()`` times out first and reads what this rank is doing). The k-th guarded
call of every rank must be the same call: calls nested in a guarded call are not counted.

Every rank also keeps a "last announcement" (``in get_weights() (collective call 3)``, ``left
...``, ``ended (...)``, ``failed (...)``), which ``update()``'s error for a lost peer reads to
name what the peers are doing. ``update()`` itself announces nothing: it stays off the store.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import torch.distributed as dist

from fabric_learner.utils.compat import default_store

_PREFIX = "fabric_learner/calls/"
_POLL = 0.01  # longest sleep between two looks at the store, seconds
_LINGER = 5.0  # how long a rank that found a disagreement waits for the peers to see it too, seconds
_RULE = ("Every rank must call the learner's collective methods (update, get_weights, checkpoint, save, load, "
         "full_parameters, serve, and the Trainer's logging and checkpoint hooks) the same number of times, in "
         "the same order.")

_local = threading.local()  # depth of guarded calls on this thread: nested ones are not counted
_state = {"store": None, "seq": 0}
_lock = threading.Lock()


class CallOrderError(RuntimeError):
    """Ranks disagree on which collective call comes next; raised before the collective starts."""


def _store():
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return default_store()


def _next_seq(store) -> int:
    with _lock:
        if _state["store"] is not store:  # a new process group starts counting again
            _state["store"], _state["seq"] = store, 0
        _state["seq"] += 1
        return _state["seq"]


def note_failure(text: str) -> None:
    """Remember how this rank failed, for ``announce_failure`` (not published yet)."""
    _state["failure"] = text


def announce_failure(kind: str) -> None:
    """Publish this rank's failure: the noted one, else ``failed (kind)``.

    Called by the exit hook once the traceback is printed: a peer that learns of it fails at once,
    and a peer that launched this rank then kills it, so announcing earlier could cut the output.
    """
    announce(_state.pop("failure", None) or f"failed ({kind})")


def announce(text: str) -> None:
    """Set this rank's last announcement; never raises (the store may be gone with its host, rank 0)."""
    try:
        store = _store()
        if store is not None:
            store.set(f"{_PREFIX}last/{dist.get_rank()}", text)
    except Exception:  # noqa: BLE001 - an announcement is a courtesy to the peers, never a new failure
        pass


def announced(rank: int) -> str | None:
    """What ``rank`` last announced, ``None`` when nothing or when the store cannot be read; never raises."""
    try:
        store = _store()
        return None if store is None else _read(store, f"{_PREFIX}last/{rank}")
    except Exception:  # noqa: BLE001 - read on the way out of a failing process
        return None


def peer_announcements() -> str:
    """What every other rank last announced, in words (for an error message); never raises."""
    try:
        store = _store()
        if store is None:
            return ""
        rank, world = dist.get_rank(), dist.get_world_size()
        parts = []
        for peer in range(world):
            if peer != rank:
                said = _read(store, f"{_PREFIX}last/{peer}")
                parts.append(f"rank {peer} {_present(said)}")
        return "; ".join(parts)
    except Exception as err:  # noqa: BLE001 - the store lives on rank 0, which may have ended
        return f"the other ranks' announcements could not be read ({type(err).__name__}: {err})"


def wait_for_peers_to_end(timeout: timedelta) -> str | None:
    """Wait until every other rank has announced that it ended (closed its learner); then ``None``.

    Returns at once, in words, what makes waiting pointless: a rank that announced a failure, or the store
    gone (rank 0 hosts it); after ``timeout``, the ranks that have not ended and what they last announced.
    """
    try:
        store = _store()
        if store is None:
            return None
        rank, world = dist.get_rank(), dist.get_world_size()
        pending = [peer for peer in range(world) if peer != rank]
        deadline = time.monotonic() + timeout.total_seconds()
        pause = 0.0005
        while pending:
            for peer in list(pending):
                said = _read(store, f"{_PREFIX}last/{peer}")
                if said is not None and said.startswith("failed"):
                    return f"rank {peer} {_present(said)}"
                if said is not None and said.startswith("ended"):
                    pending.remove(peer)
            if pending and time.monotonic() > deadline:
                return ", ".join(f"rank {p} {_present(_read(store, f'{_PREFIX}last/{p}'))}" for p in pending) + \
                    f" and did not close its learner within {timeout}"
            time.sleep(pause)
            pause = min(2 * pause, _POLL)
        return None
    except Exception as err:  # noqa: BLE001 - the store lives on rank 0, which may have ended
        return f"the group's store, hosted by rank 0, is gone ({type(err).__name__}: {err}): rank 0 has ended"


def _present(said: str | None) -> str:
    """A rank's last announcement as the predicate of "rank N ...": "is in save() ...", "has failed (...)"."""
    if said is None:
        return "has announced no collective call of the learner"
    if said.startswith("in "):
        return f"is {said}"
    if said.startswith("left "):
        return f"is past its last collective call ({said})"
    return f"has {said}"  # "ended (...)", "failed (...)"


def _read(store, key: str) -> str | None:
    return store.get(key).decode() if store.check([key]) else None


@contextlib.contextmanager
def collective_call(name: str, rank: int, world_size: int, timeout: timedelta | None) -> Iterator[None]:
    """Inside the block every rank is in call ``name`` (its k-th guarded call on every rank).

    Raises ``CallOrderError`` before the block, with nothing done, naming ``name`` and what the
    other ranks called instead. A call nested in another guarded call is not checked again.
    """
    if world_size <= 1 or getattr(_local, "depth", 0):
        yield
        return
    store = _store()
    if store is None:
        yield
        return
    seq = _next_seq(store)
    _agree(store, name, seq, rank, world_size, timeout)
    _local.depth = 1
    try:
        yield
    finally:
        _local.depth = 0
        announce(f"left {name}() (collective call {seq})")


def _agree(store, name: str, seq: int, rank: int, world_size: int, timeout: timedelta | None) -> None:
    label = f"{name}() (collective call {seq} of this process)"
    start = time.monotonic()
    limit = (timeout or timedelta(minutes=30)).total_seconds()
    deadline = start + limit + max(2.0, 0.1 * limit)
    try:
        store.set(f"{_PREFIX}call/{seq}/{rank}", name)
        store.set(f"{_PREFIX}last/{rank}", f"in {name}() (collective call {seq})")
        pending = [peer for peer in range(world_size) if peer != rank]
        pause = 0.0005
        while pending:
            for peer in list(pending):
                theirs = _read(store, f"{_PREFIX}call/{seq}/{peer}")
                if theirs is not None:
                    if theirs != name:
                        _disagree(store, rank, peer, seq, name, theirs, label)
                    pending.remove(peer)
                    continue
                said = _read(store, f"{_PREFIX}last/{peer}")
                if said is not None and said.startswith(("ended", "failed")):
                    note_failure(f"failed (in {name}(): rank {peer} had {said.split(' ', 1)[0]})")
                    fix = (f"Call {name}() before any rank closes its learner or returns." if said.startswith("ended")
                           else f"See rank {peer}'s output for its own error.")
                    raise CallOrderError(
                        f"Rank {rank}: {label} cannot complete: rank {peer} {_present(said)} and will not join it. "
                        f"Nothing was gathered, written or changed. {_RULE} {fix}"
                    )
            if not pending:
                return
            if time.monotonic() > deadline:
                store.set(f"{_PREFIX}call/{seq}/{rank}", f"!{name}")  # a late peer then learns it at once
                waited = ", ".join(f"rank {p} ({_present(_read(store, f'{_PREFIX}last/{p}'))})" for p in pending)
                note_failure(f"failed (gave up waiting in {name}())")
                raise CallOrderError(
                    f"Rank {rank}: {label} waited {time.monotonic() - start:.0f} s (the process-group timeout "
                    f"{timeout}, plus a grace) for ranks that never called a collective method of the learner: "
                    f"{waited}. They are probably in update() or elsewhere. Nothing was gathered, written or "
                    f"changed. {_RULE}"
                )
            time.sleep(pause)
            pause = min(2 * pause, _POLL)
    except CallOrderError:
        raise
    except Exception as err:
        raise CallOrderError(
            f"Rank {rank}: {label} lost the process group's store ({type(err).__name__}: {err}); the rank hosting it "
            f"(rank 0) has probably ended or died. Nothing was gathered, written or changed. See rank 0's output for "
            f"its own error. {_RULE}"
        ) from err


def _disagree(store, rank: int, peer: int, seq: int, name: str, theirs: str, label: str) -> None:
    """Raise naming both calls, once the peer has seen the disagreement too (or a few seconds passed)."""
    store.set(f"{_PREFIX}seen/{seq}/{rank}", name)
    until = time.monotonic() + _LINGER
    while not store.check([f"{_PREFIX}seen/{seq}/{peer}"]) and time.monotonic() < until:
        time.sleep(_POLL)  # rank 0 hosts the store: leaving at once could hide this call from the peer
    note_failure(f"failed (in {name}(): rank {peer} called {theirs.lstrip('!')}())")
    gave_up = theirs.startswith("!")
    what = f"gave up waiting in {theirs[1:]}()" if gave_up else f"called {theirs}()"
    raise CallOrderError(
        f"Rank {rank}: {label} does not match rank {peer}, which {what} at the same point. Nothing was gathered, "
        f"written or changed. {_RULE} Call {name}() on every rank, or on none."
    )
