"""A save killed half-way on 2 gloo ranks.

Usage: python crash_save.py STRATEGY POINT OUT_DIR

Trains DQN one update, saves to OUT_DIR/ckpt (that state is written to OUT_DIR/expected.pt),
trains one more and saves again, dying during that second save at POINT:
``file`` (ddp: rank 0 SIGKILLed with half the file written), ``shard`` (fsdp: rank 1 SIGKILLed
while writing its shards) or ``publish`` (fsdp: rank 0 SIGKILLed after every shard is written,
before ``LATEST`` names the new version).
"""

from __future__ import annotations

import io
import os
import signal
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
from rl_cases import halves, make_batch, make_loss  # noqa: E402

from fabric_learner import FabricLearner, _dcp  # noqa: E402


def die():
    os.kill(os.getpid(), signal.SIGKILL)


def arm(point, rank):
    if point == "file" and rank == 0:
        real_save = torch.save

        def half_then_die(obj, f, *args, **kwargs):
            buffer = io.BytesIO()
            real_save(obj, buffer, *args, **kwargs)
            f.write(buffer.getvalue()[: buffer.tell() // 2])
            f.flush()
            os.fsync(f.fileno())
            die()

        torch.save = half_then_die
    elif point == "shard" and rank == 1:
        import torch.distributed.checkpoint.filesystem as fs

        fs.FileSystemWriter.write_data = lambda *args, **kwargs: die()
    elif point == "publish" and rank == 0:
        _dcp.publish = lambda *args, **kwargs: die()


def main(strategy, point, out_dir):
    learner = FabricLearner(make_loss("dqn", seed=2)[0], accelerator="cpu", devices=2, strategy=strategy, timeout=30)
    rank = learner.global_rank
    path = os.path.join(out_dir, "ckpt")
    learner.update(halves(make_batch("dqn", n=16, seed=1), rank))
    learner.save(path)
    expected = learner.checkpoint()
    if rank == 0:
        torch.save(expected, os.path.join(out_dir, "expected.pt"))
    learner.update(halves(make_batch("dqn", n=16, seed=2), rank))
    arm(point, rank)
    learner.save(path)
    print(f"rank {rank}: the save was not interrupted", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
