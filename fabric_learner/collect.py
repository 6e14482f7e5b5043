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
import multiprocessing as mp
import os
import socket
import sys
import time

from fabric_learner.remote.directory import Directory, split_address

POLL_S = 0.1


def _node(rank: int, world: int, host: str, port: int) -> None:
    import torch

    from fabric_learner._compat import run_collector_node

    torch.set_num_threads(1)
    run_collector_node(rank, world, host, port)


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


def _stop(node) -> None:
    if node is not None and node.is_alive():
        node.kill()
    if node is not None:
        node.join(10)


def serve(address: str, learner_rank: int | None = None, max_restarts: int = 3, wait_s: float = 120.0,
          log=lambda msg: None) -> int:
    """Collect for the run at ``address`` until it ends (returns 0) or this collector gives up (returns 1)."""
    ctx = mp.get_context("spawn")
    restarts = 0
    run = rank = None
    while True:
        directory = _connect(address, wait_s)
        if directory is None:
            log(f"no directory at {address} for {wait_s:.0f} s: ending")
            return 0 if run is not None else 1
        if directory.run != run:  # a new run (or the first): take a turn
            run = directory.run
            world = directory.world()
            rank = learner_rank if learner_rank is not None else (directory.count("assign", add=1) - 1) % world
            log(f"run {run}: serving learner rank {rank} of {world}")
        if directory.has(f"rank{rank}", "done"):
            log(f"learner rank {rank}'s collection ended")
            return 0
        epoch = directory.count(f"rank{rank}", "epochs") - 1
        if epoch < 0:
            time.sleep(POLL_S)
            continue
        slot = directory.count(f"rank{rank}", f"e{epoch}", "join", add=1) - 1
        group = directory.wait_for(f"rank{rank}", f"e{epoch}", "group", timeout_s=wait_s,
                                   alive=lambda e=epoch: directory.count(f"rank{rank}", "epochs") - 1 == e)
        if group is None:
            continue  # a newer build started meanwhile: join that one
        host, port, nodes = group.decode().split()
        if slot >= int(nodes):
            _wait_for_next_build(directory, rank, epoch)
            continue
        node = ctx.Process(target=_node, args=(slot + 1, int(nodes) + 1, host, int(port)), name="fabric_learner-node")
        node.start()
        log(f"build {epoch} of learner rank {rank}: node {node.pid}, collector {slot + 1} of {nodes}")
        outcome = _watch(directory, rank, epoch, node)
        _stop(node)
        if outcome == "died":
            restarts += 1
            try:
                directory.store.set(directory.key(f"rank{rank}", f"e{epoch}", "fault"), str(slot))
            except Exception:  # noqa: BLE001 - the directory went with it: the run restarts, join the next
                pass
            if restarts > max_restarts:
                log(f"the node died {restarts} times (--max-restarts {max_restarts}): ending")
                return 1
            log(f"the node died (build {epoch}); restart {restarts} of {max_restarts}")


def _watch(directory: Directory, rank: int, epoch: int, node) -> str:
    """Until the node ends or its build is over: ``"died"``, ``"ended"`` or ``"rebuilt"``."""
    while True:
        node.join(POLL_S)
        try:
            over = (directory.count(f"rank{rank}", "epochs") - 1 != epoch or directory.has(f"rank{rank}", "done")
                    or directory.current_run() != directory.run)
            faulted = directory.has(f"rank{rank}", f"e{epoch}", "fault")
        except Exception:  # noqa: BLE001 - the directory is gone: learner rank 0 ended or restarts
            return "rebuilt"
        if not node.is_alive():
            return "ended" if node.exitcode == 0 or over or faulted else "died"
        if over or faulted:
            return "rebuilt"


def _wait_for_next_build(directory: Directory, rank: int, epoch: int) -> None:
    while True:
        try:
            if directory.count(f"rank{rank}", "epochs") - 1 != epoch or directory.has(f"rank{rank}", "done"):
                return
        except Exception:  # noqa: BLE001 - the directory is gone
            return
        time.sleep(POLL_S)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fabric_learner.collect", description=__doc__.split("\n\n")[0])
    parser.add_argument("--connect", required=True, metavar="HOST:PORT", help="the directory learner rank 0 serves")
    parser.add_argument("--learner-rank", type=int, default=None, help="serve this learner rank (default: take a turn)")
    parser.add_argument("--max-restarts", type=int, default=3, help="node deaths survived before this collector ends")
    parser.add_argument("--wait", type=float, default=120.0, help="seconds to wait for a directory before ending")
    args = parser.parse_args(argv)
    pid = os.getpid()
    return serve(args.connect, args.learner_rank, args.max_restarts, args.wait,
                 log=lambda msg: print(f"[collector {pid}] {msg}", file=sys.stderr, flush=True))


if __name__ == "__main__":
    sys.exit(main())
