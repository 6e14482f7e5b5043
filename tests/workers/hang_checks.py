"""Ranks that fall out of step, on 2 gloo ranks with a 5-second process-group timeout.

Usage: python hang_checks.py SCENARIO [STRATEGY]

Rank 0 calls ``update`` three times; rank 1 calls it twice and then, by SCENARIO:
``returns`` (ends its program), ``busy`` (works on for longer than the timeout) or ``dies``
(is SIGKILLed before its second update). No scenario may leave a process waiting forever.

Ranks that disagree on a collective method of the learner (``launch.call_order``), after two updates:
``mismatch``: rank 0 calls ``get_weights`` (under DDP, where that is no collective, ``checkpoint``)
while rank 1 calls ``save``; both catch the error, then train on together and end cleanly.
``closed``: rank 1 closes its learner; rank 0 calls the same method, catches the error, closes.
``loop``: rank 0 calls the same method where rank 1 calls its third ``update``.
"""

from __future__ import annotations

import os
import signal
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from rl_cases import group_timeouts, halves, make_batch, make_loss

from fabric_learner import FabricLearner


def main(scenario, strategy):
    if strategy == "fabric=":  # an existing Fabric keeps its own timeout; the learner's is ignored
        from datetime import timedelta

        from lightning.fabric import Fabric
        from lightning.fabric.strategies import DDPStrategy

        # A Fabric's own timeout also bounds its rendezvous: under torchrun both ranks start together,
        # so 10 s is enough on a loaded machine (5 s under the python launcher, where rank 1 starts
        # only once rank 0 has imported everything, was not); still far below the learner's 1 h
        fabric = Fabric(accelerator="cpu", devices=2, strategy=DDPStrategy(timeout=timedelta(seconds=10)))
        learner = FabricLearner(make_loss("dqn")[0], fabric=fabric, timeout=3600)
    else:
        learner = FabricLearner(make_loss("dqn")[0], accelerator="cpu", devices=2, strategy=strategy, timeout=5)
    rank = learner.global_rank
    print(f"rank {rank} group timeouts {group_timeouts()}", flush=True)
    if scenario in ("mismatch", "closed", "loop", "trainer"):
        return out_of_order(learner, rank, scenario, strategy)
    calls = 3 if rank == 0 else 2
    for step in range(calls):
        if rank == 1 and scenario == "dies" and step == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        learner.update(halves(make_batch("dqn", n=16, seed=step), rank))
        print(f"rank {rank} finished update {step + 1}", flush=True)
    if rank == 1 and scenario == "busy":
        time.sleep(120)


def out_of_order(learner, rank, scenario, strategy):
    from fabric_learner.launch.call_order import CallOrderError

    for step in range(2):
        learner.update(halves(make_batch("dqn", n=16, seed=step), rank))
    gather = learner.get_weights if strategy == "fsdp" else learner.checkpoint
    if scenario == "mismatch":
        try:
            gather() if rank == 0 else learner.save(os.path.join(sys.argv[3], "never.pt"))
        except CallOrderError as err:
            print(f"rank {rank} raised: {err}", flush=True)
        gather()  # the same call on both ranks: it works, nothing was left half done
        learner.update(halves(make_batch("dqn", n=16, seed=2), rank))
        print(f"rank {rank} trained on", flush=True)
    elif scenario == "closed":
        if rank == 1:
            learner.close()
            return
        try:
            gather()
        except CallOrderError as err:
            print(f"rank {rank} raised: {err}", flush=True)
        learner.close()
    elif scenario == "trainer":  # the Trainer's checkpoint against the learner's own collective
        from fabric_learner import Trainer

        trainer = Trainer(learner=learner, collector=None, total_frames=0, optim_steps_per_batch=1, progress_bar=False)
        folder = os.path.join(sys.argv[3], "trainer")
        try:
            trainer.save_checkpoint(folder) if rank == 0 else gather()
        except CallOrderError as err:
            print(f"rank {rank} raised: {err}", flush=True)
        trainer.save_checkpoint(folder)  # the same call on both ranks: it works
        print(f"rank {rank} trained on", flush=True)
    else:  # loop
        if rank == 0:
            gather()
        else:
            learner.update(halves(make_batch("dqn", n=16, seed=2), rank))
        print(f"rank {rank} passed the third call", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "ddp")  # argv[3]: a folder, for "mismatch"
