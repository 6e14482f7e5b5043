"""``python -m fabric_learner.collect --connect HOST:PORT``: a collector process for a run's learner ranks.

It finds the run in the directory that learner rank 0 serves at ``HOST:PORT``, takes its turn (the learner
rank it serves), joins that rank's current group build and runs torchrl's collector node in a child
process (torchrl's own entry for a node its main process launches later, the "delayed" launcher). The
environment and the policy come from the learner rank; nothing is configured here.

It supervises the node: when the node dies, it reports the fault (the learner rank rebuilds its group),
starts a new one, and joins the next build, up to ``--max-restarts`` times; when the learner rank rebuilds for
another reason, or the run restarts (a new run in the directory, after ``torchrun --max-restarts``), it
stops its node and joins again. It ends when its learner rank's collection has ended, or when no
directory answers for ``--wait`` seconds.
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing as mp
import os
import socket
import sys
import time

from fabric_learner.remote.directory import Directory, split_address
from fabric_learner.utils.lines import say

POLL_S = 0.1


def _preload() -> None:
    """What a node runs, imported once here: nodes forked from this process start with it loaded."""
    import torchrl.collectors.distributed  # noqa: F401

    import fabric_learner.utils.compat  # noqa: F401


def _start_method() -> str:
    """Nodes are forked where the platform forks safely: a node, and every restart, then starts in a fraction
    of a second instead of repeating seconds of imports (this process computes nothing and starts no thread
    of its own, so a fork copies no lock held mid-use)."""
    return "fork" if sys.platform.startswith("linux") else "spawn"


def _node(conn) -> None:
    """A collector node: imports first (before its collector joins a build), says so, then runs when told where."""
    import torch

    from fabric_learner.utils.compat import run_collector_node

    torch.set_num_threads(1)
    import torchrl.collectors.distributed  # noqa: F401 - loaded before the group is known, not after

    conn.send("ready")
    rank, world, host, port = conn.recv()
    conn.close()
    run_collector_node(rank, world, host, port)
    os._exit(0)  # told to shut down: skip the interpreter's teardown of torchrl's store and group threads


def _listening(address: str) -> bool:
    """Whether something accepts connections at ``address`` (asked first: a store client that cannot connect
    logs a C++ trace on every try)."""
    try:
        with socket.create_connection(split_address(address), timeout=1.0):
            return True
    except OSError:
        return False


def _connect(address: str, wait_s: float) -> Directory | None:
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if _listening(address):
            try:
                return Directory.connect(address, timeout_s=10.0)
            except Exception:  # noqa: BLE001 - served but not ready (or going away): try again until --wait runs out
                pass
        time.sleep(0.5)
    return None


class _Supervisor:
    """One collector: its turn in the current run, its node, and how often the node died."""

    def __init__(self, address: str, learner_rank: int | None, max_restarts: int, wait_s: float, log) -> None:
        self.address, self.learner_rank, self.max_restarts, self.wait_s, self.log = (
            address, learner_rank, max_restarts, wait_s, log)
        self.ctx = mp.get_context(_start_method())
        self.restarts = 0
        self.run = self.rank = None
        self.spare = None  # (process, connection): a node that does its imports, then waits for a group
        self.spare_ready = False  # it has said it is ready

    def serve(self) -> int:
        try:
            if self.ctx.get_start_method() == "fork":
                _preload()
            self.spare_node()  # its imports (where it is spawned) overlap the wait for the directory
            self.log(f"looking for the learner's directory at {self.address} (for up to {self.wait_s:.0f} s)")
            while True:
                directory = _connect(self.address, self.wait_s)
                if directory is None:
                    hint = ("" if self.run is not None else " (check that --connect is the address the learner passes "
                            "to RemoteCollectors, and that its rank 0 runs)")
                    self.log(f"no directory at {self.address} for {self.wait_s:.0f} s: ending{hint}")
                    return 0 if self.run is not None else 1
                try:
                    ended = self.serve_build(directory)
                except Exception as err:  # noqa: BLE001 - the directory went away (learner rank 0 ended or restarts)
                    self.log(f"lost the directory ({type(err).__name__}); reconnecting")
                    continue
                if ended is not None:
                    return ended
        finally:
            if self.spare is not None:
                _stop(self.spare[0])

    def serve_build(self, directory: Directory) -> int | None:
        """Join the current build of this collector's learner rank and run a node in it until it is over."""
        if directory.run != self.run:  # a new run (or the first): take a turn
            self.run, world = directory.run, directory.world()
            self.rank = self.learner_rank if self.learner_rank is not None else (directory.count("assign", add=1) - 1) % world
            directory.count(f"rank{self.rank}", "connected", add=1)  # the learner rank knows it is not alone
            self.log(f"run {self.run}: serving learner rank {self.rank} of {world}")
        rank = self.rank
        if directory.has(f"rank{rank}", "done"):
            self.log(f"learner rank {rank}'s collection ended")
            return 0
        node, conn = self.ready_node()  # joins only once it can collect at once: a build's first batch is prompt
        epoch = directory.count(f"rank{rank}", "epochs") - 1
        if epoch < 0:
            time.sleep(POLL_S)
            return None
        slot = directory.count(f"rank{rank}", f"e{epoch}", "join", add=1) - 1
        # as long as this build is the rank's current one: its driver may take long to start on a loaded host, and
        # a collector that left it would leave the driver waiting for a node that never comes
        group = directory.wait_for(f"rank{rank}", f"e{epoch}", "group", timeout_s=float("inf"),
                                   alive=lambda: (directory.count(f"rank{rank}", "epochs") - 1 == epoch
                                                  and not directory.has(f"rank{rank}", "done")))
        if group is None:
            return None  # a newer build started meanwhile (join that one), or the rank's collection ended
        host, port, nodes = group.decode().split()
        if slot >= int(nodes):  # came back too late for this build
            _wait_for_next_build(directory, rank, epoch)
            return None
        self.spare, self.spare_ready = None, False
        conn.send((slot + 1, int(nodes) + 1, host, int(port)))
        self.log(f"build {epoch} of learner rank {rank}: node {node.pid}, collector {slot + 1} of {nodes}")
        outcome = _watch(directory, rank, epoch, node, slot)
        _stop(node, grace_s=5.0 if outcome == "ended" else 0.0)
        if outcome != "died":
            return None
        self.restarts += 1
        directory.store.set(directory.key(f"rank{rank}", f"e{epoch}", "fault"), str(slot))
        if self.restarts > self.max_restarts:
            self.log(f"the node died {self.restarts} times (--max-restarts {self.max_restarts}): ending")
            return 1
        self.log(f"the node died (build {epoch}); restart {self.restarts} of {self.max_restarts}")
        return None

    def spare_node(self):
        if self.spare is None or not self.spare[0].is_alive():
            parent, child = self.ctx.Pipe()
            node = self.ctx.Process(target=_node, args=(child,), name="fabric_learner-node", daemon=False)
            node.start()
            child.close()
            self.spare, self.spare_ready = (node, parent), False
        return self.spare

    def ready_node(self):
        """The spare node once it has done its imports (a new one if it died meanwhile)."""
        while not self.spare_ready:
            node, conn = self.spare_node()
            try:
                self.spare_ready = conn.poll(POLL_S) and conn.recv() == "ready"
            except (EOFError, OSError):  # it died importing: spare_node starts another
                node.join(1)
        return self.spare


def serve(address: str, learner_rank: int | None = None, max_restarts: int = 3, wait_s: float = 120.0,
          verbose: bool = True) -> int:
    """Collect for the run at ``address`` until it ends (returns 0) or this collector gives up (returns 1)."""
    pid = os.getpid()

    def log(msg: str) -> None:
        if verbose:
            say(f"[collector {pid} {time.strftime('%H:%M:%S')}] {msg}")

    return _Supervisor(address, learner_rank, max_restarts, wait_s, log).serve()


def _stop(node, grace_s: float = 0.0) -> None:
    if node is not None and grace_s:
        node.join(grace_s)
    if node is not None and node.is_alive():
        node.kill()
    if node is not None:
        node.join(10)


def _watch(directory: Directory, rank: int, epoch: int, node, slot: int) -> str:
    """Until the node ends or its build is over: ``"died"``, ``"ended"`` or ``"rebuilt"``.

    Beats meanwhile (a counter in the directory): a collector killed whole reports nothing, and its
    learner rank's driver learns it from the silence."""
    for tick in itertools.count():
        node.join(POLL_S)
        try:
            if tick % 5 == 0:
                directory.count(f"rank{rank}", f"e{epoch}", f"beat{slot}", add=1)
            over = (directory.count(f"rank{rank}", "epochs") - 1 != epoch or directory.has(f"rank{rank}", "done")
                    or directory.current_run() != directory.run)
            faulted = directory.has(f"rank{rank}", f"e{epoch}", "fault")
        except Exception:  # noqa: BLE001 - the directory is gone: learner rank 0 ended or restarts
            return "rebuilt"
        if not node.is_alive():
            return "ended" if node.exitcode == 0 or over or faulted else "died"
        if over or faulted:
            return "ended" if directory.has(f"rank{rank}", "done") else "rebuilt"


def _wait_for_next_build(directory: Directory, rank: int, epoch: int) -> None:
    while directory.count(f"rank{rank}", "epochs") - 1 == epoch and not directory.has(f"rank{rank}", "done"):
        time.sleep(POLL_S)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fabric_learner.collect", description=__doc__.split("\n\n")[0])
    parser.add_argument("--connect", required=True, metavar="HOST:PORT", help="the directory learner rank 0 serves")
    parser.add_argument("--learner-rank", type=int, default=None, help="serve this learner rank (default: take a turn)")
    parser.add_argument("--max-restarts", type=int, default=3, help="node deaths survived before this collector ends")
    parser.add_argument("--wait", type=float, default=120.0, help="seconds to wait for a directory before ending")
    args = parser.parse_args(argv)
    return serve(args.connect, args.learner_rank, args.max_restarts, args.wait)


if __name__ == "__main__":
    sys.exit(main())
