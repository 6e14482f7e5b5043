"""The Trainer on a 2 x 2 mesh (PPO, examples/ppo_tensor_parallel.py's plan), in one 4-rank launch;
and the 2-rank FSDP2/DDP saves of mesh_reshard_checks.py loaded into the mesh.

Usage: python mesh_trainer_checks.py OUT_DIR [TWO_RANK_DIR] [DEVICES]
DEVICES (default 4): 4 is the 2 x 2 mesh; 2 runs the Trainer part alone on a 1 x 2 mesh (tensor
parallel only), a quick check by hand. Writes OUT_DIR/rank{r}.pt, compared by tests/test_meshes.py.
"""

from __future__ import annotations

import functools
import os
import sys
from datetime import timedelta

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))

import torch
import torch.distributed as dist
from ppo_pendulum import make_env
from ppo_tensor_parallel import make_loss, strategy
from torch.distributed.tensor import DTensor
from torchrl.collectors import Collector
from torchrl.objectives.value import GAE
from trainer_common import RecordingLogger

from fabric_learner import FabricLearner
from fabric_learner.onpolicy import EpochPartitionSampler, GlobalAdvantageNormalization, LearnerValueEstimator
from fabric_learner.sharding import data_parallel_rank
from fabric_learner.sharding.agreement import batch_digest
from fabric_learner.trainer import Trainer

TIMEOUT = timedelta(seconds=60)
ENVS, STEPS = 4, 8  # per rank and batch: 32 frames
FRAMES_PER_BATCH = ENVS * STEPS
BATCHES, STOP_AFTER = 4, 3  # total_frames allows 4 batches; global rank 1 asks to stop after the 3rd
MINIBATCH, EPOCHS = 16, 2


def ppo_trainer(devices: int, dp_size: int, total_frames: int, mesh: bool = True, logger=None):
    """PPO through the Trainer: collector, GAE, epoch partitions, global advantage normalisation.

    ``mesh``: the example's 2-D plan with ``dp_size`` data-parallel ranks; else DDP on ``devices`` ranks."""
    from lightning.fabric.strategies import DDPStrategy

    loss, actor = make_loss(seed=0, obs=3, act=1)
    gae = GAE(gamma=0.9, lmbda=0.95, value_network=loss.critic_network, average_gae=False)
    chosen = strategy(data_parallel_size=dp_size, timeout=TIMEOUT) if mesh else DDPStrategy(timeout=TIMEOUT)
    learner = FabricLearner(loss, functools.partial(torch.optim.Adam, lr=1e-2), policy=actor, accelerator="cpu",
                            devices=devices, strategy=chosen)
    collector = Collector(make_env(ENVS), actor, frames_per_batch=FRAMES_PER_BATCH, total_frames=-1,
                          auto_register_policy_transforms=False)
    trainer = Trainer(learner=learner, collector=collector, total_frames=total_frames,
                      optim_steps_per_batch=FRAMES_PER_BATCH // MINIBATCH, num_epochs=EPOCHS, seed=3,
                      progress_bar=False, logger=logger, log_interval=0, log_throughput=False)
    LearnerValueEstimator(learner, gae).register(trainer)
    EpochPartitionSampler(MINIBATCH).register(trainer)
    GlobalAdvantageNormalization().register(trainer)
    return trainer, learner, actor


def recording(trainer, learner):
    """Lists that receive the digest of every collected batch and of every update's minibatch (with its outputs)."""
    batches, updates = [], []
    update = learner.update

    def recorded(sub_batch):
        out = update(sub_batch)
        updates.append({"digest": batch_digest(sub_batch), "frames": trainer.collected_frames,
                        **{k: out.get(k).detach().clone() for k in out.keys() if out.get(k).numel() == 1}})
        return out

    learner.update = recorded
    trainer.register_op("batch_process", lambda b: (batches.append(batch_digest(b.exclude("collector"))), b)[1])
    return batches, updates


def trainer_run(devices: int, out_dir: str) -> dict:
    """The Trainer on the mesh; global rank 1 requests the stop. The run is saved at its end."""
    dp_size = devices // 2
    logger = RecordingLogger()
    trainer, learner, actor = ppo_trainer(devices, dp_size, BATCHES * FRAMES_PER_BATCH * dp_size, logger=logger)
    batches, updates = recording(trainer, learner)

    def stop():
        if learner.global_rank == 1 and len(batches) == STOP_AFTER:  # a rank that does not count frames
            trainer.request_stop("enough")

    trainer.register_op("post_steps", stop)
    trainer.train()
    trainer.save_checkpoint(os.path.join(out_dir, "mesh_trainer"))
    local = {n: (p.to_local().detach().clone(), [str(x) for x in p.placements])
             for n, p in learner.sharded_module.named_loss_parameters() if isinstance(p, DTensor)}
    return {"batches": batches, "updates": updates, "collected_frames": trainer.collected_frames,
            "num_updates": learner.num_updates, "dp_rank": data_parallel_rank(), "local": local,
            "weights": dict(learner.get_weights(cpu_offload=False).items(True, True)),
            "actor": {k: v.detach().clone() for k, v in actor.state_dict().items()},
            "logged": [c for c in logger.calls if c[0].startswith("loss_")]}, learner


def relaid(out_dir: str, devices: int) -> dict:
    """The mesh's trainer checkpoint resumed by DDP on the same 4 ranks (4 data-parallel ranks now), one
    batch, saved; that resumed on the mesh again (2 data-parallel ranks), one batch."""
    import warnings

    res = {}
    for name, mesh, source in (("ddp", False, "mesh_trainer"), ("mesh", True, "ddp_trainer")):
        dp_size = devices // 2 if mesh else devices
        frames = res["ddp"]["collected_frames"] if mesh else STOP_AFTER * FRAMES_PER_BATCH * devices // 2
        trainer, learner, _ = ppo_trainer(devices, devices // 2, frames + FRAMES_PER_BATCH * dp_size, mesh=mesh)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.load_from_file(os.path.join(out_dir, source))
        loaded = dict(learner.get_weights(cpu_offload=False).items(True, True))
        batches, updates = recording(trainer, learner)
        trainer.train()
        res[name] = {"warnings": [str(w.message) for w in caught if "written by" in str(w.message)],
                     "loaded": loaded, "batches": batches, "updates": updates,
                     "collected_frames": trainer.collected_frames,
                     "weights": dict(learner.get_weights(cpu_offload=False).items(True, True))}
        if not mesh:
            trainer.save_checkpoint(os.path.join(out_dir, "ddp_trainer"))
    return res


def two_rank_saves(two_rank_dir: str, rank: int) -> dict:
    """The 2-rank FSDP2 and DDP saves, loaded into the mesh; then one momentum-SGD step on it."""
    import mesh_checks

    res = {}
    for name, path in (("fsdp2", "fsdp2"), ("ddp2", "ddp2.pt")):
        learner = FabricLearner(make_loss(seed=9)[0], mesh_checks.momentum(), accelerator="cpu", devices=4,
                                strategy=strategy(timeout=TIMEOUT))
        learner.load(os.path.join(two_rank_dir, path))
        res[f"{name}_loaded"] = mesh_checks.weights(learner)
        learner.update(mesh_checks.make_batch(mesh_checks.N, seed=50 + data_parallel_rank()))
        res[f"{name}_stepped"] = mesh_checks.weights(learner)
    return res


def main(out_dir: str, two_rank_dir: str | None = None, devices: int = 4) -> None:
    import time

    rank, start = int(os.environ.get("LOCAL_RANK", 0)), time.perf_counter()

    def lap(what):
        if rank == 0:
            print(f"mesh_trainer_checks: {what} done at {time.perf_counter() - start:.1f}s", flush=True)

    results, learner = trainer_run(devices, out_dir)
    lap("trainer run")
    results["relaid"] = relaid(out_dir, devices)
    lap("checkpoint to DDP and back")
    if two_rank_dir:
        results["two_rank_saves"] = two_rank_saves(two_rank_dir, rank)
        lap("2-rank saves")
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    learner.fabric.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    args = sys.argv[1:]
    main(args[0], (args[1] or None) if len(args) > 1 else None, int(args[2]) if len(args) > 2 else 4)
