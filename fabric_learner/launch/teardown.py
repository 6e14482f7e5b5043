"""Ending distributed runs cleanly: every rank exits 0 when done, promptly non-zero on failure.

Why teardown needs care on gloo (torch 2.13): a gloo worker thread (``pt_gloo_runloop``)
drops its reference to a finished collective *after* waking the caller, and freeing the
collective's Python-owned tensors needs the GIL. If the main thread meanwhile starts
interpreter finalization, the worker is unwound off ``take_gil`` inside a noexcept destructor:
``terminate called without an active exception`` (SIGABRT). If instead the main thread holds
the GIL while destroying the last process-group reference (DDP's ``Reducer``, freed when the
wrapped module dies), ``~ProcessGroupGloo`` joins a worker that waits for that GIL: a hang.

So teardown (``close()``, or the exit hook for scripts that simply return) runs: a wait on the
group's store until every rank has closed (a rank that announced its failure, or the store gone
with rank 0, ends it at once with an error naming it), a monitored barrier, release of DDP's
references to the group, a drain that sleeps with the GIL released until every gloo worker is
parked, then ``destroy_process_group()``. A rank that closes while it raises (``finally:
learner.close()``) waits for nobody: its peers may be in a collective waiting for it. A rank
that dies of an uncaught exception exits at once with status 1 after printing its traceback
(and kills the ranks it launched, giving one that announced its own failure a moment to end by
itself), so peers see the closed connection and fail fast instead of waiting for the group timeout. Under plain ``python``,
rank 0 ends the run with status 1 naming a rank it launched that failed, also when it learns of
it through Lightning's watch over its children (``_take_over_child_observer``).
"""

from __future__ import annotations

import atexit
import gc
import os
import sys
import threading
import time
import weakref

import torch.distributed as dist

from fabric_learner.launch import call_order as _call_order
from fabric_learner.launch.build import DEFAULT_TIMEOUT
from fabric_learner.utils import compat as _compat
from fabric_learner.utils.compat import release_ddp_group, wrapped_forward
from fabric_learner.utils.lines import say

_open: weakref.WeakSet = weakref.WeakSet()
_state = {"installed": False, "owns_group": False, "crashed": False, "fabrics": [], "done": False}
_lock = threading.Lock()
_dying = threading.Lock()


def register(learner, group_existed: bool) -> None:
    """Track a distributed learner; install the exit hooks once per process."""
    with _lock:
        _open.add(learner)
        _state.setdefault("rank", learner.fabric.global_rank)  # named on failure, even with the group gone
        if not group_existed and not _state["installed"]:
            _state["owns_group"] = True
        if learner.fabric not in _state["fabrics"]:
            _state["fabrics"].append(learner.fabric)
        if not _state["installed"]:
            _state["installed"] = True
            atexit.register(_at_exit)
            previous = sys.excepthook

            def excepthook(kind, value, tb):
                _state["crashed"] = True
                previous(kind, value, tb)
                _call_order.announce_failure(kind.__name__)  # peers waiting in a collective call learn it
                rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else _state["rank"]
                say(f"fabric_learner: rank {rank} failed ({kind.__name__}); exiting with status 1 without "
                    "waiting for the other ranks.")
                _die(1)

            sys.excepthook = excepthook
        _take_over_child_observer()


def close(learner) -> None:
    """Release ``learner``'s hold on the process group; end the group with the last learner.

    Collective when it ends a group this package created: every rank must close.
    """
    with _lock:
        was_open = learner in _open
        _open.discard(learner)
        last = was_open and not _open
    _release_ddp(getattr(learner, "_module", None))
    if last and _state["owns_group"]:
        teardown_group()
    elif was_open:
        drain_gloo_workers()


def teardown_group() -> None:
    """End the group with every rank; a failing rank, or one whose peer failed, waits for nobody.

    A rank that closes while it raises (``close()`` in a ``finally`` or ``except`` block) announces its
    failure and leaves the group to its exit: its peers may be waiting in a collective for it, and learn its
    end from the closed connection, or, in their own ``close()``, from the announcement. Otherwise the rank
    waits, on the store, until every peer has closed too; a peer that announced a failure, or the store gone
    with rank 0, ends the wait at once with a ``RuntimeError`` naming it.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    raising = sys.exc_info()[1]
    if raising is not None:
        _call_order.announce_failure(type(raising).__name__)
        gc.collect()
        drain_gloo_workers()  # parked, so the process can end (the exit hook, os._exit) without an abort
        return
    _call_order.announce("ended (closed its learner)")  # a peer still calling a collective fails at once
    rank = dist.get_rank()
    unreachable = _call_order.wait_for_peers_to_end(DEFAULT_TIMEOUT)
    if unreachable is not None:
        drain_gloo_workers()
        _call_order.note_failure("failed (in close(): a peer could not close with it)")
        raise RuntimeError(
            f"Rank {rank}: close() could not end the process group with every rank: {unreachable}. This rank's "
            "learner is closed; it did not wait for the others. See that rank's output for its own error."
        )
    if dist.get_backend() == "gloo":
        dist.monitored_barrier(timeout=DEFAULT_TIMEOUT, wait_all_ranks=True)  # every rank has ended: at once
    else:
        dist.barrier()
    gc.collect()
    drain_gloo_workers()
    dist.destroy_process_group()
    drain_gloo_workers()


def _at_exit() -> None:
    """A script that returned: close what is open, then (launching parent) wait for the ranks it started."""
    if _state["crashed"] or _state["done"]:
        return
    _state["done"] = True
    try:
        for learner in list(_open):
            learner.wait_for_save()  # a background checkpoint write (save(blocking=False)) completes first
            close(learner)
        if dist.is_available() and dist.is_initialized():
            drain_gloo_workers()  # a group owned by the user: leave it, but never abort on it
    except BaseException as err:  # noqa: BLE001 - report, then fail the process
        say(f"fabric_learner: teardown failed on this rank: {err!r}")
        _die(1)
    worst = _wait_for_children()
    if worst:
        sys.stdout.flush()
        _die(worst)


def _launched_children() -> list:
    procs = []
    for fabric in _state["fabrics"]:
        launcher = getattr(fabric.strategy, "launcher", None)  # under plain python, its procs are the other ranks
        procs.extend(getattr(launcher, "procs", None) or [])
    return procs


def _wait_for_children(timeout: float = DEFAULT_TIMEOUT.total_seconds()) -> int:
    """Rank 0 of a plain ``python`` launch: 0 when every child exited 0, else a failed child's status (each named).

    A child that failed by itself (status 1) decides over one ended by a signal (killed once a peer had failed).
    """
    codes = []
    for rank, proc in enumerate(_launched_children(), start=1):
        try:
            code = proc.wait(timeout=timeout)
        except Exception:  # noqa: BLE001 - a child that will not end is killed
            proc.kill()
            code = proc.wait()
        if code != 0:
            say(f"fabric_learner: rank {rank} exited with status {code}")
            codes.append(code)
    own = [c for c in codes if c > 0]
    return own[0] if own else (128 - codes[0] if codes else 0)


#: how long rank 0 is given to end by itself (its own traceback, its wait for the others) once a rank it
#: launched has failed, before it ends the run
CHILD_FAILURE_GRACE_S = 10.0


def _take_over_child_observer() -> None:
    """Rank 0 of a plain ``python`` launch: a rank it started that fails ends the run with status 1, naming it.

    Lightning's child-process observer (a thread looking at the children every 5 s) answers a child's
    non-zero exit by SIGKILLing every process, this one included ("Forcefully terminating all other
    processes"): the run then ends with status 137, names no rank, and cuts rank 0's own traceback when
    rank 0 is failing too but is slower (a busy host). The thread stays; each look is ``_look_at_children``.
    """
    _compat.take_over_child_observers(_look_at_children)


def _look_at_children(children) -> bool:
    """True once every child exited 0, or after ending the run on a failure (never returns then)."""
    codes = [proc.poll() for proc in children]
    failed = [(rank, code) for rank, code in enumerate(codes, start=1) if code]
    if not failed:
        return all(code == 0 for code in codes)
    rank, code = failed[0]
    say(f"fabric_learner: rank {rank} exited with status {code}; the run ends with status 1 (rank 0 stops "
        f"the other ranks within {CHILD_FAILURE_GRACE_S:.0f} s unless it ends first).")
    time.sleep(CHILD_FAILURE_GRACE_S)  # the main thread ends the process first if it can (excepthook, exit hook)
    _die(1)
    return True


def _die(code: int) -> None:
    """Exit now, skipping interpreter finalization (gloo work may be in flight), children first."""
    if not _dying.acquire(blocking=False):  # another thread is already ending this process
        while True:
            time.sleep(1.0)
    _end_children(_launched_children(), _call_order.announced)
    try:
        _compat.release_semaphores()  # else the resource tracker reports them leaked (and unlinks them)
    except Exception:  # noqa: BLE001 - a courtesy on the way out, never a reason not to exit
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


#: how long a launching rank that is ending waits for a rank it started that announced its own failure (it is
#: exiting by itself) before it kills it
FAILING_CHILD_GRACE_S = 5.0


def _end_children(children, announced) -> None:
    """Kill the ranks started here that still run, naming each; one that announced its failure (``announced(rank)``,
    its last announcement) is exiting by itself: it gets ``FAILING_CHILD_GRACE_S`` to end, then its status is named."""
    for rank, proc in enumerate(children, start=1):
        status = proc.poll()
        if status is None and (announced(rank) or "").startswith("failed"):
            try:
                status = proc.wait(timeout=FAILING_CHILD_GRACE_S)
            except Exception:  # noqa: BLE001 - still running: killed below
                status = None
        if status is None:
            proc.kill()
            say(f"fabric_learner: rank {rank} was still running and was killed")
        elif status != 0:
            say(f"fabric_learner: rank {rank} exited with status {status}")


def _release_ddp(module) -> None:
    """Drop DDP's references to the group, so its ``Reducer`` never ends the group later."""
    from torch.nn.parallel import DistributedDataParallel

    inner = wrapped_forward(module) if hasattr(module, "_forward_module") else None
    for candidate in (module, inner, getattr(module, "module", None)):
        if isinstance(candidate, DistributedDataParallel):
            release_ddp_group(candidate)


def _gloo_workers() -> dict[int, tuple[str, int]]:
    """``{tid: (state, voluntary context switches)}`` of this process's gloo worker threads."""
    found = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return found
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() != "pt_gloo_runloop":
                    continue
            fields = {}
            with open(f"/proc/self/task/{tid}/status") as f:
                for line in f:
                    key, _, value = line.partition(":")
                    fields[key] = value.strip()
            found[int(tid)] = (fields["State"][0], int(fields["voluntary_ctxt_switches"]))
        except (OSError, KeyError, ValueError):
            continue
    return found


def drain_gloo_workers(timeout: float = 10.0, interval: float = 0.01, stable_samples: int = 3) -> bool:
    """Sleep, GIL released, until every gloo worker is parked (asleep, no wake-ups for a while).

    A worker still freeing a finished collective is runnable or wakes every 5 ms in the GIL's
    timed wait, so it never looks parked. Without /proc, sleeps briefly instead.
    """
    if not os.path.isdir("/proc/self/task"):
        time.sleep(0.2)
        return True
    deadline = time.monotonic() + timeout
    previous, stable = None, 0
    while time.monotonic() < deadline:
        time.sleep(interval)
        current = _gloo_workers()
        if all(state == "S" for state, _ in current.values()) and current == previous:
            stable += 1
            if stable >= stable_samples:
                return True
        else:
            stable = 0
        previous = current
    return False
