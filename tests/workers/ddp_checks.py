"""Many DDP checks in one 2-rank launch (forked from tests/zygote.py; plain ``python`` runs it too).

Usage: python ddp_checks.py OUT_DIR LOCAL_CKPT
Writes OUT_DIR/rank{r}.pt with everything the tests compare against LocalLearner.
"""

from __future__ import annotations

import functools
import os
import sys
from datetime import timedelta

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch
from lightning.fabric.strategies import DDPStrategy
from rl_cases import (
    CASES,
    CLIP,
    LR,
    WithConstantEntry,
    flat_params,
    group_timeouts,
    halves,
    make_batch,
    make_loss,
    run_steps,
)
from tensordict import LazyStackedTensorDict

from fabric_learner import FabricLearner


def ddp(**kwargs):
    return FabricLearner(
        accelerator="cpu", devices=2, strategy=DDPStrategy(timeout=timedelta(seconds=90)), **kwargs
    )


def train(case, rank, grad_accum_steps=1):
    loss, _ = make_loss(case)
    learner = ddp(loss_module=loss, optimizer=functools.partial(torch.optim.Adam, lr=LR), clip_grad_norm=CLIP,
                  grad_accum_steps=grad_accum_steps)
    norms = run_steps(learner, case, rank, 2, grad_accum_steps)
    return learner, {"params": flat_params(loss), "grad_norm": norms, "num_updates": learner.num_updates}


def integrity(rank, precision, build=None):
    """What the caller's batch looks like after an update at this precision (``build``: as in nonfinite_on_one_rank)."""
    loss, _ = make_loss("dqn")
    learner = (build or ddp)(loss_module=loss, precision=precision)
    batch = halves(make_batch("dqn", n=16, seed=5), rank).to("cpu")
    plain = batch.clone()
    learner.update(plain)
    lazy = LazyStackedTensorDict.lazy_stack(list(batch.clone().unbind(0)), 0)
    out = learner.update(lazy)
    return {
        "batch_size": tuple(plain.batch_size),
        "device": str(plain.device),
        "td_error": plain.get("td_error", None),
        "lazy_is_lazy": isinstance(lazy, LazyStackedTensorDict),
        "lazy_td_error": lazy.get("td_error", None),
        "lazy_batch_size": tuple(lazy.batch_size),
        "loss_dtype": out["loss"].dtype,
        "obs_dtype": plain["observation"].dtype,
    }


def nonfinite_on_one_rank(rank, build=None):
    """Only rank 1 feeds a NaN batch; with on_nonfinite="skip" every rank must skip together.

    ``build`` makes the learner (DDP by default; fsdp_checks.py passes its FSDP builder). The
    weights are read through ``checkpoint()``, which works under both strategies."""
    loss, _ = make_loss("ppo")
    learner = (build or ddp)(loss_module=loss, optimizer=functools.partial(torch.optim.Adam, lr=LR),
                             on_nonfinite="skip")

    def weights():
        return learner.checkpoint()["model"]

    learner.update(halves(make_batch("ppo", n=16, seed=30), rank))
    before = weights()
    batch = halves(make_batch("ppo", n=16, seed=31), rank)
    if rank == 1:
        batch["observation"] = torch.full_like(batch["observation"], float("nan"))
    out = learner.update(batch)
    res = {"before": before, "after_skip": weights(), "skipped_updates": learner.skipped_updates,
           "num_updates": learner.num_updates, "skip_grad_norm": out["grad_norm"]}
    out = learner.update(halves(make_batch("ppo", n=16, seed=32), rank))
    res.update(after_next=weights(), next_grad_norm=out["grad_norm"], final_num_updates=learner.num_updates)
    # the same with on_nonfinite="raise": every rank raises, and can go on
    learner.on_nonfinite = "raise"
    try:
        learner.update(batch)
    except FloatingPointError as err:
        res["raised"] = str(err)
    out = learner.update(halves(make_batch("ppo", n=16, seed=33), rank))
    res.update(after_raise=weights(), raise_num_updates=learner.num_updates)
    return res


def nonfinite_without_gradient(rank):
    """Rank 1's loss gets an inf entry that carries no gradient: its backward seed alone must make
    every rank skip (the gradients would otherwise be finite everywhere)."""
    loss = WithConstantEntry(make_loss("dqn")[0])
    learner = ddp(loss_module=loss, on_nonfinite="skip")
    batch = make_batch("dqn", n=16, seed=50)
    learner.update(halves(batch, rank))
    before = flat_params(loss)
    loss.value = float("inf") if rank == 1 else 0.0
    out = learner.update(halves(batch, rank))
    res = {"before": before, "after_skip": flat_params(loss), "skipped_updates": learner.skipped_updates,
           "num_updates": learner.num_updates, "skip_grad_norm": out["grad_norm"]}
    loss.value = 0.0
    learner.update(halves(batch, rank))
    res.update(after_next=flat_params(loss), final_num_updates=learner.num_updates)
    return res


def unequal_first_step(rank, build=None):
    """Rank 0 feeds 10 samples and rank 1 feeds 6 on the first step, where ranks always compare:
    the warnings each rank saw."""
    import warnings

    learner = (build or ddp)(loss_module=make_loss("dqn")[0])
    batch = make_batch("dqn", n=16, seed=40)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        learner.update(batch[:10] if rank == 0 else batch[10:])
    return [str(w.message) for w in caught if "different numbers of samples" in str(w.message)]


def unequal_samples(rank, build=None):
    """Ranks compare counts on step 1 and every 100th after (``step.sample_counts.CHECK_EVERY``).

    Step 1: 8 samples each; steps 2-3: 10 on rank 0, 6 on rank 1; steps 4-101: 8 each. The
    warnings each rank saw after step 1, after step 100 (before the period's comparison) and
    after step 101 (the comparison covering steps 2-101).
    """
    import warnings

    from fabric_learner.step.sample_counts import CHECK_EVERY

    learner = (build or ddp)(loss_module=make_loss("dqn")[0])
    batch = make_batch("dqn", n=16, seed=40)
    seen = {}

    def unequal():
        return [str(w.message) for w in caught if "different numbers of samples" in str(w.message)]

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        learner.update(halves(batch, rank))
        seen["step 1"] = unequal()
        for _ in range(2):
            learner.update(batch[:10] if rank == 0 else batch[10:])
        while learner.num_updates < CHECK_EVERY:
            learner.update(halves(batch, rank))
        seen["step 100"] = unequal()
        learner.update(halves(batch, rank))
        seen["step 101"] = unequal()
    return seen


INIT_SCALE = 2.0**8  # the default 2**16 overflows these fp16 gradients on its own: only the injected inf may


def mixed16_on_one_rank(rank, sharded=None):
    """16-mixed under DDP: fp16 autocast and a grad scaler, given through ``fabric=`` (Fabric turns the
    name into bf16 on CPU). Rank 1 alone overflows its gradients, then alone feeds a NaN batch.

    ``sharded`` (fsdp_checks.py): the same under FSDP2, with torch's ``ShardedGradScaler`` (the scaler
    Fabric's FSDP precision plugin builds; ``"sharded scaler"``) or ``torch.amp.GradScaler``
    (``"plain scaler"``). Rank 1's overflow is then one output unit of the first layer, so after the
    reduce-scatter only rank 1's gradient shard holds it: rank 0 skips only if the scaler's verdict
    is reduced over the ranks. ``local_nonfinite``: what this rank's own gradients held when the
    scaler checked them.
    """
    from lightning.fabric import Fabric
    from lightning.fabric.plugins.precision import MixedPrecision

    loss, _ = make_loss("dqn")
    if sharded:
        from lightning.fabric.strategies import ModelParallelStrategy
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        from fabric_learner import shard_loss

        scaler_class = ShardedGradScaler if sharded == "sharded scaler" else torch.amp.GradScaler
        scaler = scaler_class("cpu", init_scale=INIT_SCALE)
        strategy = ModelParallelStrategy(parallelize_fn=functools.partial(shard_loss, min_unit_numel=1),
                                         timeout=timedelta(seconds=90))
    else:
        scaler, strategy = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE), DDPStrategy(timeout=timedelta(seconds=90))
    plugin = MixedPrecision("16-mixed", "cpu", scaler=scaler)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy, plugins=[plugin])
    learner = FabricLearner(loss, functools.partial(torch.optim.Adam, lr=LR) if sharded else None, fabric=fabric,
                            on_nonfinite="skip")
    scaler = learner.fabric.strategy.precision.scaler

    def weights():
        return learner.checkpoint()["model"] if sharded else flat_params(loss)

    def step(seed, nan=False):
        batch = halves(make_batch("dqn", n=16, seed=seed), rank)
        if nan and rank == 1:
            batch["observation"] = torch.full_like(batch["observation"], float("nan"))
        return learner.update(batch)

    step(60)
    res = {"scale_before": scaler.get_scale(), "before": weights(), "scaler_type": type(scaler).__name__}
    hook = None
    if rank == 1 and sharded:  # the first layer's last output unit: its weight row and bias, in rank 1's shard
        def one_unit(grad):
            return grad.index_fill(-1, torch.tensor([grad.shape[-1] - 1]), float("inf"))

        unit = learner.sharded_module.layer_units()[0]
        hook = unit.register_forward_hook(lambda module, args, out: out.register_hook(one_unit) and None)
    elif rank == 1:  # before DDP's gradient sync: the all-reduce carries the inf to rank 0
        first = next(iter(loss.value_network_params.values(True, True)))
        hook = first.register_hook(lambda g: torch.full_like(g, float("inf")))
    local_nonfinite = []
    unscale = scaler.unscale_

    def counting_unscale(optimizer):
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
        local_nonfinite.append(sum(int((~torch.isfinite(g)).sum()) for g in local))
        return unscale(optimizer)

    scaler.unscale_ = counting_unscale
    out = step(61)
    del scaler.unscale_
    if hook is not None:
        hook.remove()
    res.update(overflow_grad_norm=out["grad_norm"], after_overflow=weights(), scale_after=scaler.get_scale(),
               overflow_counts=(learner.num_updates, learner.skipped_updates), local_nonfinite=local_nonfinite)
    out = step(62, nan=True)
    res.update(after_nan=weights(), nan_counts=(learner.num_updates, learner.skipped_updates))
    learner.on_nonfinite = "raise"
    try:
        step(63, nan=True)
    except FloatingPointError as err:
        res["raised"] = str(err)
    out = step(64)
    res.update(after_next=weights(), next_grad_norm=out["grad_norm"], final_counts=(learner.num_updates,
                                                                                   learner.skipped_updates),
               scale_final=scaler.get_scale())
    return res


def mesh_dimensions(rank):
    """global_sum over each named dimension of a (dp=1, tp=2) mesh, and over "dp" with no mesh registered."""
    from torch.distributed.device_mesh import init_device_mesh

    from fabric_learner.collectives import global_sum
    from fabric_learner.sharding.mesh import use_mesh

    value = torch.tensor([float(rank + 1)])
    out = {"no_mesh": global_sum(value).item()}
    use_mesh(init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp")))
    try:
        out.update(dp=global_sum(value).item(), tp=global_sum(value, group="tp").item())
        try:
            global_sum(value, group="pp")
        except ValueError as err:
            out["unknown"] = str(err)
    finally:
        use_mesh(None)
    return out


def main(out_dir, local_ckpt):
    import warnings

    results = {"cases": {}, "accum": {}, "integrity": {}}
    rank = None
    for case in CASES:
        with warnings.catch_warnings(record=True) as caught:  # DDP's stride warning fired on SAC and TD3
            warnings.simplefilter("always")
            learner, res = train(case, rank=int(os.environ.get("LOCAL_RANK", 0)))
        res["warnings"] = [str(w.message) for w in caught]
        rank = learner.global_rank
        results["world_size"] = learner.world_size
        results.setdefault("group_timeouts", group_timeouts())  # the DDPStrategy object's 90 s, kept
        results["cases"][case] = res
        if case == "sac":
            learner.save(os.path.join(out_dir, "ddp_sac.pt"))
            results["saved_sac"] = learner.checkpoint()
    for case in ("dqn", "ppo", "ddpg"):
        results["accum"][case] = train(case, rank, grad_accum_steps=2)[1]
    results["nonfinite"] = nonfinite_on_one_rank(rank)
    results["nonfinite_nograd"] = nonfinite_without_gradient(rank)
    results["unequal"] = unequal_samples(rank)
    results["mixed16"] = mixed16_on_one_rank(rank)
    results["mesh"] = mesh_dimensions(rank)
    for precision in ("32-true", "bf16-mixed", "bf16-true", "64-true"):
        results["integrity"][precision] = integrity(rank, precision)
    # a checkpoint written by LocalLearner loads under DDP, and training continues in step
    loss, _ = make_loss("sac", seed=3)
    learner = ddp(loss_module=loss, clip_grad_norm=CLIP)
    learner.load(local_ckpt)
    results["loaded_local"] = {"params": flat_params(loss), "num_updates": learner.num_updates,
                               "optimizer": learner.checkpoint()["optimizer"]}
    # an error on every rank leaves DDP usable
    try:
        learner.update(halves(make_batch("sac", n=16, seed=8), rank).exclude("action"))
    except Exception as err:  # noqa: BLE001 - recorded for the test
        results["error_type"] = f"{type(err).__name__}: {err}"
    torch.manual_seed(7)
    learner.update(halves(make_batch("sac", n=16, seed=8), rank))
    results["after_error"] = flat_params(loss)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    learner.fabric.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
