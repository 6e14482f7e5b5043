"""A pipeline stage that raises, then one that dies, on 2 gloo ranks (the faults' launch of tests/test_pipeline.py).

Usage: python pipeline_faults.py OUT_DIR
Both learners take a collective timeout of an hour (gloo's sends and receives have none at all): what each rank
reports here it learns from the failing stage's announcement or from its closed connection, within the launch's
own bound of minutes, never by waiting a timeout out.

``raises``: stage 1's loss raises (a KeyError from its decoder layer) in the forward of micro-batch 1 of update()
call 2; each rank catches its error, then calls update() once more.
``dies``: a second learner in the same process group; stage 1's process is SIGKILLed in the forward of micro-batch
1 of update() call 2. The launch ends every rank once one fails, so rank 1's process forks at the start and its
child is stage 1 (it dies; the parent waits for it and for rank 0's results, then exits 0): rank 0 lives on to
report what it saw, as it would under a launcher that lets it.
Writes OUT_DIR/rank0.pt (both scenarios), OUT_DIR/rank1.pt (``raises``) and OUT_DIR/stage1_status.txt (how the
child that was stage 1 ended).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))

import torch
from pipeline_checks import batches, build, sgd

from fabric_learner import FabricLearner
from fabric_learner.pipeline import PipelineStrategy

HOUR = 3600.0


def arm(learner, action):
    """Stage 1 calls ``action()`` in the forward of micro-batch 1 of this learner's next update()."""
    calls = [0]

    def hook(module, args):
        calls[0] += 1
        if calls[0] == 2:
            action()

    if learner.stage == 1:
        learner.policy.model.model.layers[1].register_forward_pre_hook(hook)


def boom():
    raise KeyError("boom on purpose")


def attempt(learner, batch):
    """``update(batch)``'s error as ``"Type: message"`` and how long it took to come, or ``(None, seconds)``."""
    start = time.monotonic()
    try:
        learner.update(batch)
    except Exception as err:  # noqa: BLE001 - the message is what the test reads
        return f"{type(err).__name__}: {err}", time.monotonic() - start
    return None, time.monotonic() - start


def snapshot(learner):
    return {k: v.detach().clone() for k, v in learner.loss_module.state_dict().items()}


def main(out_dir):
    out = Path(out_dir)
    rank = int(os.environ.get("LOCAL_RANK", 0))
    if rank == 1 and os.fork():  # the parent: waits for stage 1 (its child) to end, and for rank 0's results
        _, status = os.wait()
        (out / "stage1_status.txt").write_text(str(os.waitstatus_to_exitcode(status)))
        deadline = time.monotonic() + 120
        while not (out / "rank0.pt").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        os._exit(0)
    got = {}
    loss, policy = build("grpo")
    data = batches(policy)
    strategy = PipelineStrategy(microbatches=3)
    raises = FabricLearner(loss, sgd(), policy=policy, strategy=strategy, accelerator="cpu", devices=2, timeout=HOUR)
    raises.update(data[0])
    before = snapshot(raises)
    arm(raises, boom)
    got["raises"], got["raises_seconds"] = attempt(raises, data[1])
    got["unchanged"] = all(torch.equal(before[k], v) for k, v in snapshot(raises).items())
    got["num_updates"] = raises.num_updates
    got["again"], _ = attempt(raises, data[1])
    if rank == 1:
        torch.save(got, out / "rank1.pt")

    loss, policy = build("grpo")
    dies = FabricLearner(loss, sgd(), policy=policy, strategy=strategy, accelerator="cpu", devices=2, timeout=HOUR)
    dies.update(data[0])
    arm(dies, lambda: os.kill(os.getpid(), signal.SIGKILL))
    try:
        dies.update(data[1])
    except RuntimeError as err:  # rank 0: stage 1 is gone
        got["dies"] = f"{type(err).__name__}: {err}"
        torch.save(got, out / "rank0.pt")
        for learner in (raises, dies):  # while raising: waits for no peer (stage 1 will never close)
            learner.close()


if __name__ == "__main__":
    main(sys.argv[1])
