"""Case c of run.py: per-rank memory of parameters + gradients + optimizer state, FSDP vs DDP, 2 CPU ranks.

    python benchmarks/fsdp_memory.py --strategy fsdp --out fsdp.json   # the learner starts rank 1

After a few Adam updates of the 21M-parameter PPO loss: the bytes each rank holds in tensors (local shards under
FSDP, replicated buffers; gradients counted just before the step, since the learner frees them after it; DDP's
gradient buckets), its peak resident memory and that peak over its memory before the model.
``MALLOC_MMAP_THRESHOLD_=1048576`` keeps glibc from holding FSDP's freed gather buffers in its heap (run.py's
case c reports both).
"""
from __future__ import annotations

import functools
from datetime import timedelta

import common
import harness
import torch
from lightning.fabric.strategies import DDPStrategy, ModelParallelStrategy
from torch.distributed.tensor import DTensor

from fabric_learner import FabricLearner, shard_loss


def local_bytes(t: torch.Tensor) -> int:
    t = t.to_local() if isinstance(t, DTensor) else t
    return t.numel() * t.element_size()


def ddp_bucket_bytes(learner) -> int:
    """Bytes of DDP's gradient buckets (flat copies of the gradients used by the all-reduce, apart
    from the gradients unless ``gradient_as_bucket_view``), from DDP's own logging data."""
    module = learner._module
    ddp = getattr(module, "_forward_module", module)
    data = ddp._get_ddp_logging_data() if hasattr(ddp, "_get_ddp_logging_data") else {}
    if data.get("gradient_as_bucket_view"):
        return 0
    sizes = data.get("bucket_sizes", "")
    return sum(int(x) for x in str(sizes).split(",") if x.strip().isdigit())


def parser():
    p = harness.parser(__doc__)
    p.add_argument("--strategy", choices=["ddp", "fsdp"], required=True)
    p.add_argument("--steps", type=int, default=3)
    return p


def main(argv=None):
    args = parser().parse_args(argv)
    timeout = timedelta(minutes=5)
    strategy = DDPStrategy(timeout=timeout) if args.strategy == "ddp" else \
        ModelParallelStrategy(parallelize_fn=shard_loss, timeout=timeout)
    baseline = harness.status_mib("VmRSS")  # imports done, no model yet
    torch.manual_seed(0)
    loss, _ = common.make_loss("ppo_big_actor")
    n_params = sum(p.numel() for p in loss.parameters())
    learner = FabricLearner(loss, functools.partial(torch.optim.Adam, lr=1e-4), accelerator="cpu", devices=2,
                            strategy=strategy)
    rank = learner.global_rank
    params = [p for g in learner.optimizer.param_groups for p in g["params"]]
    # Gradients live from the backward to the learner's zero_grad(set_to_none=True) after the step:
    # count them where they are largest, just before the optimizer steps.
    at_step = {}
    torch_optimizer = getattr(learner.optimizer, "optimizer", learner.optimizer)
    torch_optimizer.register_step_pre_hook(
        lambda *_: at_step.update(gradients=sum(local_bytes(p.grad) for p in params if p.grad is not None)))
    for step in range(args.steps):
        learner.update(common.make_batch("ppo_big_actor", n=64, seed=step + 10 * rank))
    held = {
        "parameters": sum(local_bytes(p) for p in params),
        "gradients": at_step["gradients"],
        "ddp_gradient_buckets": ddp_bucket_bytes(learner) if args.strategy == "ddp" else 0,
        "optimizer": sum(local_bytes(v) for s in learner.optimizer.state.values() for v in s.values()
                         if isinstance(v, torch.Tensor)),
        "buffers": sum(local_bytes(b) for b in loss.buffers()),
        "loss_own_parameters": sum(local_bytes(p) for p in loss.parameters()) if args.strategy == "fsdp" else 0,
    }
    result = {"strategy": args.strategy, "rank": rank, "n_params": n_params, "bytes": held,
              "total_mib": sum(held.values()) / 2**20, "peak_rss_mib": harness.status_mib("VmHWM"),
              "peak_over_baseline_mib": harness.status_mib("VmHWM") - baseline}
    gathered = [None, None]
    torch.distributed.all_gather_object(gathered, result)
    if rank == 0:
        harness.write_json(args.out, gathered)
    learner.close()


if __name__ == "__main__":
    main()
