"""PPO on a 2 x 2 mesh: tensor parallelism inside each MLP, FSDP2 across the data-parallel ranks.

The partition rules are this file's, not the library's: ``parallelize`` is the
``parallelize_fn`` Lightning's ``ModelParallelStrategy`` calls on every rank with the learner's
``ShardedLoss`` and its 2-D mesh ``("data_parallel", "tensor_parallel")``. It cuts each MLP's first
``Linear`` by output features (``ColwiseParallel``) and its second by input features
(``RowwiseParallel``, the partial outputs summed), so the hidden activations never leave their rank,
then shards every layer over the data-parallel ranks with ``fully_shard``. The learner finds the
mesh on the parameters: sample counts and global means reduce over ``"data_parallel"`` only, and
it checks that the two ranks of each tensor-parallel group feed the same batch.

Run (4 CPU ranks, the learner starts the other three)::

    python examples/ppo_tensor_parallel.py --updates 5
"""

from __future__ import annotations

import argparse
import functools

import torch
from lightning.fabric.strategies import ModelParallelStrategy
from tensordict import TensorDict
from tensordict.nn import NormalParamExtractor, TensorDictModule
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torchrl.modules import MLP, IndependentNormal, ProbabilisticActor, ValueOperator
from torchrl.objectives import ClipPPOLoss

from fabric_learner import FabricLearner
from fabric_learner.cli import DefaultsHelpFormatter
from fabric_learner.sharding import apply_fsdp, data_parallel_rank, parallelize_layers

OBS, ACT, HIDDEN = 4, 2, 16

#: Each MLP's first layer cut by outputs, its second by inputs: one all-reduce per MLP forward.
TP_PLAN = {
    "actor_network.module.0.module.0.0": ColwiseParallel(),
    "actor_network.module.0.module.0.2": RowwiseParallel(),
    "critic_network.module.0": ColwiseParallel(),
    "critic_network.module.2": RowwiseParallel(),
}


def parallelize(module: nn.Module, mesh) -> nn.Module:
    """The ``parallelize_fn``: tensor parallel on ``"tensor_parallel"``, then FSDP2 on ``"data_parallel"``."""
    parallelize_layers(module, mesh["tensor_parallel"], TP_PLAN)
    return apply_fsdp(module, mesh["data_parallel"], min_unit_numel=1)


def make_loss(seed: int = 0, obs: int = OBS, act: int = ACT) -> tuple[ClipPPOLoss, ProbabilisticActor]:
    """A PPO loss on two one-hidden-layer MLPs (the same weights on every rank for a given seed);
    ``obs`` observation and ``act`` action features (``TP_PLAN`` cuts only the hidden ones)."""
    torch.manual_seed(seed)
    net = nn.Sequential(MLP(in_features=obs, out_features=2 * act, num_cells=[HIDDEN]), NormalParamExtractor())
    actor = ProbabilisticActor(TensorDictModule(net, in_keys=["observation"], out_keys=["loc", "scale"]),
                               in_keys=["loc", "scale"], distribution_class=IndependentNormal, return_log_prob=True)
    critic = ValueOperator(MLP(in_features=obs, out_features=1, num_cells=[HIDDEN]), in_keys=["observation"])
    return ClipPPOLoss(actor, critic, entropy_coeff=0.01, normalize_advantage=False), actor


def make_batch(n: int, seed: int) -> TensorDict:
    """``n`` synthetic PPO transitions; equal seeds give equal batches."""
    g = torch.Generator().manual_seed(seed)
    return TensorDict({
        "observation": torch.randn(n, OBS, generator=g),
        "action": torch.rand(n, ACT, generator=g) * 1.8 - 0.9,
        "action_log_prob": -torch.rand(n, generator=g) - 1.0,
        "advantage": torch.randn(n, 1, generator=g),
        "value_target": torch.randn(n, 1, generator=g),
    }, [n])


def strategy(data_parallel_size: int = 2, tensor_parallel_size: int = 2, **kwargs) -> ModelParallelStrategy:
    return ModelParallelStrategy(parallelize, data_parallel_size=data_parallel_size,
                                 tensor_parallel_size=tensor_parallel_size, **kwargs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--updates", type=int, default=5, help="optimizer updates")
    parser.add_argument("--batch", type=int, default=64, help="samples per data-parallel rank and update")
    args = parser.parse_args()
    loss, _ = make_loss()
    learner = FabricLearner(loss, functools.partial(torch.optim.Adam, lr=1e-3), strategy=strategy(),
                            accelerator="cpu", devices=4)
    rank = data_parallel_rank()  # the two ranks of a tensor-parallel group feed the same data
    for step in range(args.updates):
        out = learner.update(make_batch(args.batch, seed=1000 * step + rank))
    if learner.global_rank == 0:
        print(f"done: {learner.world_size} ranks, {args.updates} updates, loss_objective "
              f"{out['loss_objective'].item():.4f}")
    learner.close()


if __name__ == "__main__":
    main()
