"""GRPO on a transformers model over a 2 x 2 mesh: tensor parallel inside each decoder layer, FSDP2 across.

The partition rules are this file's, not the library's (as in torchtitan's ``apply_tp``): in each
decoder layer the query, key and value projections and the MLP's gate and up projections are cut by
output features (``ColwiseParallel``: each rank computes half of the heads and half of the MLP's
hidden features), the attention output and MLP down projections by input features
(``RowwiseParallel``: their partial outputs summed over the tensor-parallel ranks). Then each decoder
layer is one FSDP2 unit over the data-parallel ranks, the embeddings, final norm and LM head sharded
with the root (``apply_fsdp``). The model's heads and key/value heads must divide by the
tensor-parallel size (the tiny Qwen2 has 4 and 2).

Run (4 CPU ranks, the learner starts the other three)::

    python examples/grpo_tensor_parallel.py --updates 2
"""

from __future__ import annotations

import argparse
import functools

import torch
from lightning.fabric.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from fabric_learner import FabricLearner
from fabric_learner.cli import DefaultsHelpFormatter
from fabric_learner.sharding import apply_fsdp, data_parallel_rank, parallelize_layers
from fabric_learner.testing import grpo_batch, grpo_example

#: The loss's names for each decoder layer's projections (``fnmatch`` patterns) -> how they are cut.
TP_PLAN = {
    "*.layers.*.self_attn.[qkv]_proj": ColwiseParallel(),
    "*.layers.*.self_attn.o_proj": RowwiseParallel(),
    "*.layers.*.mlp.gate_proj": ColwiseParallel(),
    "*.layers.*.mlp.up_proj": ColwiseParallel(),
    "*.layers.*.mlp.down_proj": RowwiseParallel(),
}


def parallelize(module: nn.Module, mesh) -> nn.Module:
    """The ``parallelize_fn``: projections cut on ``"tensor_parallel"``, decoder layers sharded on ``"data_parallel"``."""
    parallelize_layers(module, mesh["tensor_parallel"], TP_PLAN)
    return apply_fsdp(module, mesh["data_parallel"])


def strategy(data_parallel_size: int = 2, tensor_parallel_size: int = 2, **kwargs) -> ModelParallelStrategy:
    return ModelParallelStrategy(parallelize, data_parallel_size=data_parallel_size,
                                 tensor_parallel_size=tensor_parallel_size, **kwargs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--updates", type=int, default=2, help="optimizer updates")
    args = parser.parse_args()
    replies = [3, 8, 5, 2]  # two samples per data-parallel rank
    loss, policy, _ = grpo_example(tuple(replies))
    learner = FabricLearner(loss, functools.partial(torch.optim.SGD, lr=0.1), policy=policy, strategy=strategy(),
                            accelerator="cpu", devices=4)
    rank = data_parallel_rank()  # the two ranks of a tensor-parallel group feed the same samples
    for step in range(args.updates):
        with learner.full_parameters(), torch.no_grad():  # samples scored by the current policy
            batch = grpo_batch(policy, replies, seed=step)
        out = learner.update(batch[2 * rank:2 * rank + 2])
    if learner.global_rank == 0:
        print(f"done: {learner.world_size} ranks, {args.updates} updates, loss_objective "
              f"{out['loss_objective'].item():.4f}")
    learner.close()


if __name__ == "__main__":
    main()
