"""2 x 2 mesh checks (tensor parallel x FSDP2, examples/ppo_tensor_parallel.py) in one 4-rank launch.

Usage: python mesh_checks.py OUT_DIR
Writes OUT_DIR/rank{r}.pt with what tests/test_meshes.py compares against LocalLearner.
"""

from __future__ import annotations

import functools
import os
import sys
from datetime import timedelta

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))

import torch
import torch.distributed as dist
from ppo_tensor_parallel import make_batch, make_loss, strategy
from torch.distributed.tensor import DTensor

from fabric_learner import FabricLearner
from fabric_learner.collectives import distributed_world_size, global_count, global_mean
from fabric_learner.sharding import data_parallel_rank, process_group

TIMEOUT = timedelta(seconds=60)
LR = 0.1
N = 8  # samples per data-parallel rank


def sgd():
    return functools.partial(torch.optim.SGD, lr=LR)


def mesh_learner(seed=0):
    return FabricLearner(make_loss(seed)[0], sgd(), strategy=strategy(timeout=TIMEOUT), accelerator="cpu", devices=4)


def one_step(rank):
    learner = mesh_learner()
    dp = data_parallel_rank()
    out = learner.update(make_batch(N, seed=dp))
    params = {}
    for name, p in learner.sharded_module.named_loss_parameters():
        assert isinstance(p, DTensor), name
        params[name] = {"mesh": tuple(p.device_mesh.mesh_dim_names), "placements": [str(x) for x in p.placements],
                        "local": p.to_local().detach().clone(), "grad_none": p.grad is None}
    reductions = {
        "dp_size": distributed_world_size("dp"), "tp_size": distributed_world_size("tp"),
        "tp_group": dist.get_process_group_ranks(process_group("tp")),
        "dp_group": dist.get_process_group_ranks(process_group("dp")),
        "count": global_count(1).item(), "mean": global_mean(torch.tensor([float(dp)])).item(),
        "dp_rank": dp,
    }
    weights = learner.get_weights(cpu_offload=False)
    weights = {k: v for k, v in weights.items(True, True)}
    plain = all(type(v) is torch.Tensor for v in weights.values())
    return learner, {"out": {k: v.detach().clone() for k, v in out.items(True, True)}, "params": params,
                     "reductions": reductions, "weights": weights, "weights_plain": plain}


def mismatched(rank):
    """The second rank of each tensor-parallel group feeds another batch: every rank refuses."""
    learner = mesh_learner()
    batch = make_batch(N, seed=data_parallel_rank() + (10 if rank % 2 else 0))
    try:
        learner.update(batch)
    except ValueError as err:
        # refused before anything changed: the right batches then train as a fresh learner's first step
        after = weights(learner)
        learner.update(make_batch(N, seed=data_parallel_rank()))
        return {"error": str(err), "weights_after_refusal": after, "weights": weights(learner)}
    return None


def momentum():
    return functools.partial(torch.optim.SGD, lr=LR, momentum=0.9)


def whole(seed):
    """The global batch of a step: the two data-parallel ranks' batches, in data-parallel order."""
    return torch.cat([make_batch(N, seed=seed + dp) for dp in range(2)])


def quarter(batch, rank):
    return batch[rank * N // 2:(rank + 1) * N // 2]


def weights(learner):
    return dict(learner.get_weights(cpu_offload=False).items(True, True))


def checkpoints(out_dir, rank):
    """2 x 2 -> FSDP on 4 ranks, DDP on 4 ranks, one process; and each of those -> 2 x 2 (momentum SGD)."""
    from lightning.fabric.strategies import DDPStrategy, ModelParallelStrategy

    from fabric_learner import LocalLearner, shard_loss

    res = {}
    dp = data_parallel_rank()
    a = FabricLearner(make_loss()[0], momentum(), strategy=strategy(timeout=TIMEOUT), accelerator="cpu", devices=4)
    a.update(make_batch(N, seed=20 + dp))
    a.save(os.path.join(out_dir, "mesh"))
    a.update(make_batch(N, seed=30 + dp))
    res["mesh"] = weights(a)
    fsdp = FabricLearner(make_loss(seed=5)[0], momentum(), accelerator="cpu", devices=4,
                         strategy=ModelParallelStrategy(functools.partial(shard_loss, min_unit_numel=1), timeout=TIMEOUT))
    ddp = FabricLearner(make_loss(seed=6)[0], momentum(), accelerator="cpu", devices=4,
                        strategy=DDPStrategy(timeout=TIMEOUT))
    for name, learner in (("fsdp", fsdp), ("ddp", ddp)):
        learner.load(os.path.join(out_dir, "mesh"))
        learner.update(quarter(whole(30), rank))
        res[name] = weights(learner)
    if rank == 0:
        local = LocalLearner(make_loss(seed=7)[0], momentum())
        local.load(os.path.join(out_dir, "mesh"))
        local.update(whole(30))
        res["local"] = weights(local)
        local.save(os.path.join(out_dir, "local.pt"))
    fsdp.save(os.path.join(out_dir, "fsdp"))
    ddp.save(os.path.join(out_dir, "ddp.pt"))
    a.fabric.barrier()
    for name, path in (("fsdp", "fsdp"), ("ddp", "ddp.pt"), ("local", "local.pt")):
        back = FabricLearner(make_loss(seed=8)[0], momentum(), strategy=strategy(timeout=TIMEOUT), accelerator="cpu",
                             devices=4)
        back.load(os.path.join(out_dir, path))
        res[f"{name}_loaded"] = weights(back)
        back.update(make_batch(N, seed=40 + dp))
        res[f"{name}_back"] = weights(back)
    return res


REPLIES = (3, 8, 5, 2)  # GRPO samples: data-parallel rank d takes samples 2d and 2d+1


def llm(rank):
    """examples/grpo_tensor_parallel.py's plan: one SGD step (lr 1) of GRPO on the tiny Qwen2."""
    from grpo_tensor_parallel import strategy as llm_strategy

    from fabric_learner.testing import grpo_batch, grpo_example

    loss, policy, _ = grpo_example(REPLIES)
    full = grpo_batch(policy, list(REPLIES), seed=0)
    learner = FabricLearner(loss, functools.partial(torch.optim.SGD, lr=1.0), policy=policy, accelerator="cpu",
                            devices=4, strategy=llm_strategy(timeout=TIMEOUT))
    dp = data_parallel_rank()
    out = learner.update(full[2 * dp:2 * dp + 2])
    placements = {n: (tuple(p.device_mesh.mesh_dim_names), [str(x) for x in p.placements])
                  for n, p in learner.sharded_module.named_loss_parameters()}
    return {"out": {k: v.detach().clone() for k, v in out.items()}, "weights": weights(learner),
            "placements": placements}


def hsdp_over_lightnings_mesh():
    """fully_shard over Lightning's own 2-D mesh is HSDP, not tensor parallelism: refused at construction."""
    from lightning.fabric.strategies import ModelParallelStrategy

    from fabric_learner.sharding import apply_fsdp

    strategy = ModelParallelStrategy(lambda module, mesh: apply_fsdp(module, mesh, min_unit_numel=1),
                                     data_parallel_size=2, tensor_parallel_size=2, timeout=TIMEOUT)
    try:
        FabricLearner(make_loss()[0], sgd(), strategy=strategy, accelerator="cpu", devices=4)
    except RuntimeError as err:
        return str(err)
    return None


def main(out_dir):
    rank = int(os.environ.get("LOCAL_RANK", 0))
    results = {}
    learner, results["step"] = one_step(rank)
    results["mismatch"] = mismatched(rank)
    results["checkpoints"] = checkpoints(out_dir, rank)
    results["llm"] = llm(rank)
    results["hsdp_over_lightning"] = hsdp_over_lightnings_mesh()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    learner.fabric.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
