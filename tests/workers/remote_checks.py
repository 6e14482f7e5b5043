"""Collectors apart from the learner ranks: ``RemoteCollectors`` fed by ``python -m fabric_learner.collect`` processes.

Usage: torchrun --max-restarts=1 ... remote_checks.py OUT_DIR faults PORT
           2 DDP ranks, one collector each: the test kills the node of rank 1's collector after rank 1's 4th batch
           (its supervisor restarts it); once rank 1 has 3 batches from the restarted collector and a checkpoint
           exists, rank 1 SIGKILLs itself; torchrun restarts both ranks, which resume from the checkpoint; rank 0
           stops the run after 20 batches
       (2 ranks forked by tests/zygote.py) remote_checks.py OUT_DIR continue PORT
           2 DDP ranks, 3 collectors (2 serve rank 0, 1 serves rank 1), on_failure="continue", max_restarts=1,
           timeout_s=15: the test kills one of rank 0's collectors and rank 1's whole, waits past timeout_s, then
           starts a new collector for rank 1; rank 1 stops the run once it has 3 batches from the new one
       (2 ranks forked by tests/zygote.py) remote_checks.py OUT_DIR wrongport PORT
           2 DDP ranks, timeout_s=12: the test starts a collector for rank 0 and rank 1's at another port; the run
           ends (the program closes its learner in ``finally``, as docs/remote.md's does)

The collectors are started by the test (one command each, as on other hosts); this program only builds
the learner, ``RemoteCollectors`` and the Trainer. Each rank appends its progress to OUT_DIR/progress_rank{r}
(one line per batch) and OUT_DIR/rounds_rank{r} (one line per round that ran the steps: updates, replay buffer
length, group builds, restarts) so the test knows when to strike, and writes OUT_DIR/{mode}_rank{r}.pt at the end.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from datetime import timedelta

sys.path.insert(0, os.path.dirname(__file__))

import async_common as ac
import torch
from lightning.fabric.strategies import DDPStrategy

from fabric_learner import FabricLearner
from fabric_learner.remote import RemoteCollectors

DELAYS = {"faults": 0.03, "continue": 0.03, "wrongport": 0.0}  # seconds per environment step in the collectors
LAG = 12
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
RESUMED_BATCHES = 20  # "faults": rank 0's batches after the resume, before it stops the run
SETTINGS = {  # RemoteCollectors arguments of each mode
    "faults": dict(collectors=2, on_failure="restart", rejoin_s=3.0, timeout_s=60.0),
    "continue": dict(collectors=3, on_failure="continue", rejoin_s=3.0, timeout_s=15.0, max_restarts=1),
    "wrongport": dict(collectors=2, timeout_s=12.0),
}


def learner_factory(mode):
    # the new checks keep the default process-group timeout (300 s): a rank that ends must not leave the others in it
    strategy = DDPStrategy(timeout=timedelta(seconds=60)) if mode == "faults" else DDPStrategy()

    def make(loss, optimizer, policy):
        return FabricLearner(loss, optimizer, policy=policy, clip_grad_norm=1.0, accelerator="cpu", devices=2,
                             strategy=strategy)
    return make


class Progress:
    """A ``batch_process`` hook: one line per admitted batch (frames, lag) in this rank's progress file."""

    def __init__(self, path, trainer):
        self.path, self.trainer, self.batches = path, trainer, 0

    def __call__(self, batch):
        self.batches += 1
        with open(self.path, "a") as f:
            f.write(f"{self.trainer.collected_frames} {batch.numel()} {ATTEMPT}\n")


class Rounds:
    """A ``post_steps`` hook: one line per round that ran the steps (updates, replay buffer length, builds, restarts)."""

    def __init__(self, path, learner, rb, remote):
        self.path, self.learner, self.rb, self.remote = path, learner, rb, remote

    def __call__(self, *_):
        stats = self.remote.stats()
        with open(self.path, "a") as f:
            f.write(f"{self.learner.num_updates} {len(self.rb)} {stats['builds']} {stats['restarts']}\n")


def main(out_dir: str, mode: str, port: str) -> None:
    remote = {}

    def collector(make_env, acting):
        remote["c"] = RemoteCollectors(make_env, acting, frames_per_batch=ac.FRAMES_PER_BATCH, address=f"127.0.0.1:{port}",
                                       **SETTINGS[mode])
        return remote["c"]

    save = os.path.join(out_dir, "ckpt") if mode == "faults" else None
    # no frame budget: every run ends when its events happened, however fast a rank collects meanwhile
    trainer, learner, admissions, rb = ac.build(learner_factory(mode), total_frames=10**9, delay=DELAYS[mode],
                                                max_policy_lag=LAG, collector_factory=collector, save_file=save,
                                                save_interval=8 * 2 * ac.FRAMES_PER_BATCH)
    rank = learner.global_rank
    progress = Progress(os.path.join(out_dir, f"progress_rank{rank}"), trainer)
    trainer.register_op("batch_process", progress)
    trainer.register_op("post_steps", Rounds(os.path.join(out_dir, f"rounds_rank{rank}"), learner, rb, remote["c"]))
    if mode == "continue" and rank == 1:
        since = {}  # rank 1's batch count when its second build began delivering

        def stop_once_fed_again(*_):
            if remote["c"].stats()["builds"] >= 2:
                since.setdefault("batches", progress.batches)
                if progress.batches >= since["batches"] + 3:
                    trainer.request_stop("rank 1 has 3 batches from its new collector")
        trainer.register_op("post_steps", stop_once_fed_again)
    if mode == "faults" and ATTEMPT == 1 and rank == 0:
        def stop_after_resuming(*_):
            if progress.batches >= RESUMED_BATCHES:
                trainer.request_stop(f"rank 0 has {RESUMED_BATCHES} batches after the resume")
        trainer.register_op("post_steps", stop_after_resuming)
    if mode == "faults" and ATTEMPT == 0 and rank == 1:
        at_restart = []  # rank 1's batch count when it first saw its collectors' group rebuilt

        def die_once_restarted_and_saved(*_):
            if remote["c"].stats()["restarts"] >= 1 and not at_restart:
                at_restart.append(progress.batches)
            if at_restart and progress.batches >= at_restart[0] + 3 and os.path.exists(os.path.join(save, "meta.json")):
                with open(os.path.join(out_dir, "attempt0_rank1.json"), "w") as f:
                    json.dump({"remote": remote["c"].stats(), "batches": progress.batches}, f)
                os.kill(os.getpid(), signal.SIGKILL)
        trainer.register_op("post_steps", die_once_restarted_and_saved)
    if mode == "wrongport":
        return train_closing_in_finally(trainer, learner)
    trainer.train()
    ckpt = learner.checkpoint()
    torch.save({"params": {k: v.detach().clone() for k, v in ckpt["model"].items()}, "num_updates": learner.num_updates,
                "collected_frames": trainer.collected_frames, "stats": trainer.async_stats, "remote": remote["c"].stats(),
                "hook_frames": admissions.frames, "hook_max_lag": admissions.max_lag, "rb_len": len(rb),
                "attempt": ATTEMPT}, os.path.join(out_dir, f"{mode}_rank{rank}.pt"))
    learner.close()


def train_closing_in_finally(trainer, learner) -> None:
    """docs/remote.md's program: the learner closed in ``finally``, so also while the run's error propagates."""
    try:
        trainer.train()
    finally:
        learner.close()


if __name__ == "__main__":
    main(*sys.argv[1:4])
