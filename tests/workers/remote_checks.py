"""Collectors apart from the learner ranks: ``RemoteCollectors`` fed by ``python -m fabric_learner.collect`` processes.

Usage: torchrun --max-restarts=1 ... remote_checks.py OUT_DIR faults PORT
           2 DDP ranks, one collector each: the test kills the node of rank 1's collector after rank 1's 4th batch
           (its supervisor restarts it); once rank 1 has 3 batches from the restarted collector and a checkpoint
           exists, rank 1 SIGKILLs itself; torchrun restarts both ranks, which resume from the checkpoint
       python remote_checks.py OUT_DIR continue PORT
           1 process, 2 collectors, on_failure="continue": the test kills a whole collector mid-run

The collectors are started by the test (one command each, as on other hosts); this program only builds
the learner, ``RemoteCollectors`` and the Trainer. Each rank appends its progress to OUT_DIR/progress_rank{r}
(one line per batch) so the test knows when to strike, and writes OUT_DIR/{mode}_rank{r}.pt at the end.
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

from fabric_learner import FabricLearner, LocalLearner
from fabric_learner.remote import RemoteCollectors

DELAYS = {"faults": 0.03, "continue": 0.01}  # seconds per environment step in the collectors
LAG = 12
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
TOTALS = {"faults": 60 * 2 * ac.FRAMES_PER_BATCH, "continue": 30 * 2 * ac.FRAMES_PER_BATCH}


def learner_factory(mode):
    def make(loss, optimizer, policy):
        if mode == "continue":
            return LocalLearner(loss, optimizer, policy=policy, clip_grad_norm=1.0)
        return FabricLearner(loss, optimizer, policy=policy, clip_grad_norm=1.0, accelerator="cpu", devices=2,
                             strategy=DDPStrategy(timeout=timedelta(seconds=60)))
    return make


class Progress:
    """A ``batch_process`` hook: one line per admitted batch (frames, lag) in this rank's progress file."""

    def __init__(self, path, trainer):
        self.path, self.trainer, self.batches = path, trainer, 0

    def __call__(self, batch):
        self.batches += 1
        with open(self.path, "a") as f:
            f.write(f"{self.trainer.collected_frames} {batch.numel()} {ATTEMPT}\n")


def main(out_dir: str, mode: str, port: str) -> None:
    collectors = 2
    remote = {}

    def collector(make_env, acting):
        remote["c"] = RemoteCollectors(make_env, acting, frames_per_batch=ac.FRAMES_PER_BATCH, collectors=collectors,
                                       address=f"127.0.0.1:{port}", on_failure="continue" if mode == "continue" else "restart",
                                       rejoin_s=3.0, timeout_s=60.0)
        return remote["c"]

    save = os.path.join(out_dir, "ckpt") if mode == "faults" else None
    trainer, learner, admissions, rb = ac.build(learner_factory(mode), total_frames=TOTALS[mode], delay=DELAYS[mode],
                                                max_policy_lag=LAG, collector_factory=collector, save_file=save,
                                                save_interval=8 * 2 * ac.FRAMES_PER_BATCH)
    rank = learner.global_rank
    progress = Progress(os.path.join(out_dir, f"progress_rank{rank}"), trainer)
    trainer.register_op("batch_process", progress)
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
    trainer.train()
    ckpt = learner.checkpoint()
    torch.save({"params": {k: v.detach().clone() for k, v in ckpt["model"].items()}, "num_updates": learner.num_updates,
                "collected_frames": trainer.collected_frames, "stats": trainer.async_stats, "remote": remote["c"].stats(),
                "hook_frames": admissions.frames, "hook_max_lag": admissions.max_lag, "rb_len": len(rb),
                "attempt": ATTEMPT}, os.path.join(out_dir, f"{mode}_rank{rank}.pt"))
    learner.close()


if __name__ == "__main__":
    main(*sys.argv[1:4])
