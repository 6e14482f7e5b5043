"""Asynchronous sharded saves (``save(path, blocking=False)``) on 2 gloo ranks (plain ``python``).

Usage: python async_save_checks.py main|kill OUT_DIR

``main`` writes OUT_DIR/rank{r}.pt with what the tests check: an async save equals a sync save of
the same state although training went on while it was written; ``load``, the next ``save`` and
``close()`` wait for a pending one; a DDP learner's ``blocking=False`` saves at once. It ends with
an async save left pending when the script returns: the exit hook must complete it.

``kill`` completes one save, takes another step, then starts an async save during whose
background write rank 1 is SIGKILLed (right after its shards are written, before the version can be
published); rank 0 records what ``wait_for_save`` raised and exits.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
from datetime import timedelta

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch
from lightning.fabric.strategies import DDPStrategy, ModelParallelStrategy
from rl_cases import CLIP, LR, halves, make_batch, make_loss

from fabric_learner import FabricLearner, shard_loss
from fabric_learner.checkpoint import dcp_folder

TIMEOUT = timedelta(seconds=90)


def fsdp(seed=3):
    strategy = ModelParallelStrategy(parallelize_fn=shard_loss, timeout=TIMEOUT)
    return FabricLearner(make_loss("sac", seed=seed)[0], functools.partial(torch.optim.Adam, lr=LR),
                         clip_grad_norm=CLIP, accelerator="cpu", devices=2, strategy=strategy)


def step(learner, s):
    torch.manual_seed(10 * s + learner.global_rank)
    learner.update(halves(make_batch("sac", n=16, seed=600 + s), learner.global_rank))


def published(path):
    """The version ``LATEST`` names and its update count, as any process would read them now."""
    folder = dcp_folder.latest_version(path)
    return folder.name, dcp_folder.read_meta(folder)["num_updates"]


def main(out_dir):
    out = {}
    a = fsdp()
    rank = a.global_rank
    for s in range(2):
        step(a, s)
    # an async save holds the state of the moment save() returned, whatever training does after
    a.save(os.path.join(out_dir, "sync"))
    out["at_save"] = a.checkpoint()
    handle = a.save(os.path.join(out_dir, "async"), blocking=False)
    out["handle_type"] = type(handle).__name__
    step(a, 2)
    step(a, 3)
    a.wait_for_save()
    out["done_after_wait"] = handle.done() and handle.exception() is None
    out["after_steps"] = a.checkpoint()
    b = fsdp(seed=11)
    b.load(os.path.join(out_dir, "async"))
    out["loaded"] = b.checkpoint()
    # load waits for the learner's own pending save: it reads the version that save writes
    before = a.checkpoint()
    handle = a.save(os.path.join(out_dir, "load_waits"), blocking=False)
    step(a, 4)
    a.load(os.path.join(out_dir, "load_waits"))
    out["load_waits"] = {"handle_done": handle.done(), "before": before, "after_load": a.checkpoint()}
    # the next save waits for the pending one: versions never overlap, one is left
    path = os.path.join(out_dir, "save_waits")
    first = a.save(path, blocking=False)
    step(a, 5)
    second = a.save(path, blocking=False)
    out["save_waits"] = {"first_done_when_second_returned": first.done()}
    a.wait_for_save()
    out["save_waits"].update(second_done=second.done(), published=published(path), updates=a.num_updates,
                             versions=sorted(p for p in os.listdir(path) if p.startswith("v")))
    # close() waits for the pending save (b stays open, so a's close does not end the group)
    path = os.path.join(out_dir, "close_waits")
    step(a, 6)
    handle = a.save(path, blocking=False)
    a.close()
    out["close_waits"] = {"handle_done": handle.done(), "published": published(path), "updates": a.num_updates}
    # unsharded: blocking=False saves synchronously and hands back a finished future
    ddp = FabricLearner(make_loss("sac", seed=3)[0], functools.partial(torch.optim.Adam, lr=LR), clip_grad_norm=CLIP,
                        accelerator="cpu", devices=2, strategy=DDPStrategy(timeout=TIMEOUT))
    handle = ddp.save(os.path.join(out_dir, "ddp.pt"), blocking=False)
    out["ddp"] = {"done": handle.done(), "exists": os.path.isfile(os.path.join(out_dir, "ddp.pt"))}
    ddp.close()
    for s in range(7, 9):
        step(b, s)
    out["exit_state"] = b.checkpoint()
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    b.save(os.path.join(out_dir, "exit_waits"), blocking=False)
    # returns with the save pending: the exit hook waits for it, then tears the group down


def kill(out_dir):
    a = fsdp()
    rank = a.global_rank
    path = os.path.join(out_dir, "ckpt")
    for s in range(2):
        step(a, s)
    a.save(path, blocking=False)
    a.wait_for_save()
    previous = {"state": a.checkpoint(), "published": published(path)}
    step(a, 2)
    if rank == 1:
        import torch.distributed.checkpoint.filesystem as fs

        write = fs.FileSystemWriter.write_data

        def write_then_die(self, plan, planner):  # runs in the background writer thread
            done = write(self, plan, planner)
            done.wait()
            os.kill(os.getpid(), signal.SIGKILL)

        fs.FileSystemWriter.write_data = write_then_die
    a.save(path, blocking=False)
    try:
        a.wait_for_save()
        error = None
    except RuntimeError as err:
        error = str(err)
    torch.save({"previous": previous, "error": error}, os.path.join(out_dir, f"kill_rank{rank}.pt"))
    sys.stdout.flush()
    os._exit(0)  # the peer is gone: no teardown


if __name__ == "__main__":
    {"main": main, "kill": kill}[sys.argv[1]](sys.argv[2])
