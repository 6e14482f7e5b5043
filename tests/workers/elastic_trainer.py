"""A DQN Trainer under ``torchrun --max-restarts``: ranks are SIGKILLed and the restarted workers resume.

Usage (under torchrun, 2 ranks): elastic_trainer.py OUT_DIR STRATEGIES KILLS

STRATEGIES: ``ddp``, ``fsdp`` or ``ddp,fsdp`` (one after the other, each with its own checkpoint).
KILLS=1 (one strategy): attempt 0 kills rank 1 during an update of the 3rd batch, attempt 1 kills
rank 0 while it collects the 5th batch, attempt 2 kills rank 1 half-way through writing its state in
the save after the 6th batch; attempt 3 runs to the end (8 batches). KILLS=once: only the first
kill, once per run (on several nodes the attempt count is per node: only the failed node's agent
counts a restart).
KILLS=0: no kill.
Nothing here loads a checkpoint by hand: each attempt only builds the trainer and calls train().
Every event is appended to OUT_DIR/events.jsonl; the end writes OUT_DIR/final_{strategy}_rank{r}.pt.
"""

from __future__ import annotations

import io
import json
import os
import signal
import sys
import time
from datetime import timedelta

sys.path.insert(0, os.path.dirname(__file__))

import torch
import trainer_common as tc
from lightning.fabric.strategies import DDPStrategy, ModelParallelStrategy

from fabric_learner import FabricLearner, shard_loss

TIMEOUT = timedelta(seconds=60)
BATCH = tc.FRAMES_PER_BATCH * 2  # global frames per batch (2 ranks)
TOTAL = 8 * BATCH
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def make(strategy):
    def build(loss, optimizer, policy):
        chosen = DDPStrategy(timeout=TIMEOUT) if strategy == "ddp" else \
            ModelParallelStrategy(parallelize_fn=shard_loss, timeout=TIMEOUT)
        return FabricLearner(loss, optimizer, policy=policy, clip_grad_norm=1.0, accelerator="cpu", strategy=chosen)
    return build


def main(out_dir: str, strategies: str, kills: str) -> None:
    def event(name, **extra):
        with open(os.path.join(out_dir, "events.jsonl"), "a") as f:
            f.write(json.dumps({"event": name, "attempt": ATTEMPT, "rank": rank, "t": time.time(), **extra}) + "\n")

    rank = int(os.environ["RANK"])
    event("start")
    learners = []
    for strategy in strategies.split(","):
        parts = tc.build_dqn(make(strategy), total_frames=TOTAL, save_file=os.path.join(out_dir, f"ckpt_{strategy}"),
                             save_interval=0)  # a checkpoint after every batch
        trainer, learner = parts[0], parts[1]
        save = trainer._save_trainer

        def saved(save=save, trainer=trainer):
            save()
            event("saved", frames=trainer.collected_frames)

        trainer._save_trainer = saved
        once = os.path.join(out_dir, "killed_once")
        if kills == "1" or (kills == "once" and not os.path.exists(once)):
            arm(trainer, learner, rank, event, once)
        trainer.register_op("pre_steps_log", lambda batch, trainer=trainer: event("batch", frames=trainer.collected_frames))
        trainer.train()
        snap = tc.snapshot(*parts)
        torch.save({k: snap[k] for k in ("params", "optimizer", "num_updates", "optim_count", "collected_frames",
                                         "rb_obs", "priorities", "rng")},
                   os.path.join(out_dir, f"final_{strategy}_rank{rank}.pt"))
        event("done", strategy=strategy, frames=trainer.collected_frames, updates=learner.num_updates)
        learners.append(learner)
    for learner in learners:  # closed at the end: a group destroyed and made again would reuse torchrun's store keys
        learner.close()


def arm(trainer, learner, rank, event, marker):
    """The kill this attempt makes, if any (see the module docstring); ``marker`` is created first."""
    def die(where):
        event("kill", where=where, frames=trainer.collected_frames)
        open(marker, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)

    if ATTEMPT == 0 and rank == 1:  # during the 2nd update of the 3rd batch, gradients already reduced
        steps = []

        def before_step(optimizer, args, kwargs):
            if trainer.collected_frames == 3 * BATCH:
                steps.append(1)
                if len(steps) == 2:
                    die("update")

        getattr(learner.optimizer, "optimizer", learner.optimizer).register_step_pre_hook(before_step)
    elif ATTEMPT == 1 and rank == 0:  # at the 3rd env step of the 5th batch
        env_step = tc.ChainEnv._step
        steps = []

        def step(self, td):
            if trainer.collected_frames == 4 * BATCH:
                steps.append(1)
                if len(steps) == 3:
                    die("collection")
            return env_step(self, td)

        tc.ChainEnv._step = step
    elif ATTEMPT == 2 and rank == 1:  # half of this rank's state written, in the save after the 6th batch
        real_save = torch.save

        def half_then_die(obj, f, *args, **kwargs):
            if not (isinstance(f, (str, os.PathLike)) and os.path.basename(f) == "rank1.pt"
                    and trainer.collected_frames == 6 * BATCH):
                return real_save(obj, f, *args, **kwargs)
            buffer = io.BytesIO()
            real_save(obj, buffer, *args, **kwargs)
            with open(f, "wb") as out:
                out.write(buffer.getvalue()[: buffer.tell() // 2])
                out.flush()
                os.fsync(out.fileno())
            die("save")

        torch.save = half_then_die


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
