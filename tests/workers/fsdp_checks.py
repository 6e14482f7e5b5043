"""FSDP (FSDP2 over the loss's parameters) checks in one 2-rank launch (forked from tests/zygote.py;
plain ``python`` runs it too).

Usage: python fsdp_checks.py OUT_DIR
Writes OUT_DIR/rank{r}.pt with what the tests compare against LocalLearner.
"""

from __future__ import annotations

import functools
import os
import sys
from datetime import timedelta

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch
from lightning.fabric.strategies import DDPStrategy, ModelParallelStrategy
from rl_cases import CASES, CLIP, LR, group_timeouts, halves, make_batch, make_loss, run_steps

from fabric_learner import FabricLearner, LocalLearner, shard_loss

TIMEOUT = timedelta(seconds=90)


USER_SHARDED = []  # what user_parallelize saw, one entry per learner built with it


def user_parallelize(module, mesh):
    """A parallelize_fn written as a user would (README, FSDP): fully_shard over whole_world(mesh)."""
    from torch.distributed.fsdp import fully_shard

    from fabric_learner import whole_world

    USER_SHARDED.append((type(module).__name__, whole_world(mesh).size()))
    fully_shard(module, mesh=whole_world(mesh))
    return module


EVERY_LAYER = functools.partial(shard_loss, min_unit_numel=1)  # these networks are small: unit them all


def fsdp(parallelize_fn=EVERY_LAYER, **kwargs):
    strategy = ModelParallelStrategy(parallelize_fn=parallelize_fn, timeout=TIMEOUT)
    return FabricLearner(accelerator="cpu", devices=2, strategy=strategy, **kwargs)


def opt():
    return functools.partial(torch.optim.Adam, lr=LR)


def train(case, rank, grad_accum_steps=1, policy=False):
    loss, actor = make_loss(case)
    learner = fsdp(loss_module=loss, optimizer=opt(), clip_grad_norm=CLIP, grad_accum_steps=grad_accum_steps,
                   policy=actor if policy else None)
    norms = run_steps(learner, case, rank, 2, grad_accum_steps)
    return learner, {"model": learner.checkpoint()["model"], "grad_norm": norms, "num_updates": learner.num_updates}


def shard_fraction(learner):
    local = total = 0
    for p in learner.optimizer.param_groups[0]["params"]:
        local += p.to_local().numel()
        total += p.numel()
    return local / total


def local_fraction(tensors):
    """Elements this rank holds over the elements of the full tensors (DTensors: their local shard)."""
    from torch.distributed.tensor import DTensor

    tensors = [t for t in tensors if t is not None and t.dim() > 0]
    local = sum(t.to_local().numel() if isinstance(t, DTensor) else t.numel() for t in tensors)
    return local / sum(t.numel() for t in tensors)


def held_fractions(learner, case, rank):
    """docs/fsdp.md: gradients (at the optimizer step, the only time they are all alive) and Adam
    state per rank, as fractions of the full tensors, over one more update."""
    params = learner.optimizer.param_groups[0]["params"]
    seen = {}
    torch_optimizer = getattr(learner.optimizer, "optimizer", learner.optimizer)
    hook = torch_optimizer.register_step_pre_hook(
        lambda *_: seen.update(gradients=local_fraction([p.grad for p in params])))
    rng = torch.get_rng_state()
    learner.update(halves(make_batch(case, n=16, seed=99), rank))
    torch.set_rng_state(rng)
    hook.remove()
    state = [t for s in learner.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return {**seen, "optimizer_state": local_fraction(state)}


def round_trip(out_dir, rank):
    """FSDP -> DDP -> one process -> FSDP, one DQN step in each, from checkpoints on disk."""
    def batch(step):
        return make_batch("dqn", n=16, seed=300 + step)

    a = fsdp(loss_module=make_loss("dqn")[0], optimizer=opt(), clip_grad_norm=CLIP)
    for step in range(2):
        a.update(halves(batch(step), rank))
    a.save(os.path.join(out_dir, "fsdp_a"))
    a.save(os.path.join(out_dir, "fsdp_a"))  # overwriting a sharded checkpoint keeps one version
    b = FabricLearner(make_loss("dqn", seed=5)[0], opt(), clip_grad_norm=CLIP, accelerator="cpu", devices=2,
                      strategy=DDPStrategy(timeout=TIMEOUT))
    b.load(os.path.join(out_dir, "fsdp_a"))
    b.update(halves(batch(2), rank))
    b.save(os.path.join(out_dir, "ddp_b.pt"))
    if rank == 0:
        c = LocalLearner(make_loss("dqn", seed=6)[0], opt(), clip_grad_norm=CLIP)
        c.load(os.path.join(out_dir, "ddp_b.pt"))
        c.update(batch(3))
        c.save(os.path.join(out_dir, "local_c.pt"))
    b.fabric.barrier()
    d = fsdp(loss_module=make_loss("dqn", seed=7)[0], optimizer=opt(), clip_grad_norm=CLIP)
    d.load(os.path.join(out_dir, "local_c.pt"))
    d.update(halves(batch(4), rank))
    return {"model": d.checkpoint()["model"], "optimizer": d.checkpoint()["optimizer"], "num_updates": d.num_updates,
            "versions": sorted(os.listdir(os.path.join(out_dir, "fsdp_a")))}


def resume(out_dir, rank):
    """A sharded save/load mid-run continues exactly as the uninterrupted run (SAC, seeded)."""
    def step(learner, s):
        torch.manual_seed(10 * s + rank)
        return learner.update(halves(make_batch("sac", n=16, seed=400 + s), rank))

    a = fsdp(loss_module=make_loss("sac")[0], optimizer=opt(), clip_grad_norm=CLIP)
    for s in range(2):
        step(a, s)
    a.save(os.path.join(out_dir, "sac_resume"))
    saved = a.checkpoint()
    step(a, 2)
    b = fsdp(loss_module=make_loss("sac", seed=9)[0], optimizer=opt(), clip_grad_norm=CLIP)
    b.load(os.path.join(out_dir, "sac_resume"))
    loaded_updates = b.num_updates
    step(b, 2)
    return {"a": a.checkpoint(), "b": b.checkpoint(), "loaded_updates": loaded_updates, "saved": saved}


def served(rank):
    """PPO with policy=actor: the actor runs outside update on every rank with the last step's weights;
    the critic, which the learner cannot know about, refuses until served or inside full_parameters()."""
    from tensordict import TensorDict

    loss, actor = make_loss("ppo")
    learner = fsdp(loss_module=loss, optimizer=opt(), clip_grad_norm=CLIP, policy=actor)
    probe = make_batch("ppo", n=4, seed=9)
    out = {}
    for step in range(2):
        learner.update(halves(make_batch("ppo", seed=500 + step), rank))
        out[f"loc_{step}"] = actor(probe.clone())["loc"].detach()
    out["actor"] = TensorDict.from_module(actor).apply(lambda t: t.detach().clone())
    out["weights"] = learner.get_weights(cpu_offload=False)
    critic = loss.critic_network
    try:
        critic(probe.clone())
    except RuntimeError as err:
        out["critic_error"] = str(err)
    with learner.full_parameters(), torch.no_grad():
        out["critic_inside"] = critic(probe.clone())["state_value"]
    out["critic_served"] = learner.serve(critic)
    with torch.no_grad():
        out["critic_value"] = critic(probe.clone())["state_value"]
    learner.update(halves(make_batch("ppo", seed=502), rank))
    with torch.no_grad():
        out["critic_after_step"] = critic(probe.clone())["state_value"]
        out["loc_2"] = actor(probe.clone())["loc"]
    out["model"] = learner.checkpoint()["model"]
    return out


def ensemble_loss(case, loop=False):
    """SAC's / TD3's loss; ``loop``: torchrl's ``deactivate_vmap=True`` path (one call per critic)."""
    loss, _ = make_loss(case)
    if loop:
        loss.deactivate_vmap = True
        loss._make_vmap()
    return loss


def per_layer(rank):
    """Which layers hold full weights while each layer runs: functional and non-functional PPO, DQN
    (target network), SAC and TD3 (a critic ensemble vmap'ed over stacked weights, and SAC's
    loop over the critics). Each forward probe runs just after FSDP2 gathered the layer's unit,
    inside the loss's forward; each backward probe just after FSDP2 re-gathered it for its
    backward. The stochastic losses also train under DDP on the same seeds, for comparison."""
    from torch.distributed.tensor import DTensor

    out = {}
    for kind, case, functional in (("ppo", "ppo", True), ("ppo_nonfunctional", "ppo", False),
                                   ("dqn", "dqn", True), ("sac", "sac", True), ("sac_loop", "sac", True),
                                   ("td3", "td3", True)):
        loss = ensemble_loss(case, loop=kind.endswith("_loop")) if case in ("sac", "td3") else \
            make_loss(case, functional=functional)[0]
        learner = fsdp(loss_module=loss, optimizer=opt(), clip_grad_norm=CLIP)
        wrapper = learner.sharded_module
        units = wrapper.layer_units()
        seen, backward = [], []

        def full_units():
            return [u.path for u in units if not any(isinstance(p, DTensor) for p in u.parameters())]

        def probe(unit, args):
            seen.append((unit.path, full_units()))

        def on_pre_backward(unit, original, *args, **kwargs):
            result = original(*args, **kwargs)
            backward.append((unit.path, full_units()))
            return result

        handles = [u.register_forward_pre_hook(probe) for u in units]
        for u in units:
            group = u._get_fsdp_state()._fsdp_param_group
            group.pre_backward = functools.partial(on_pre_backward, u, group.pre_backward)
        norms = run_steps(learner, case, rank, 2)
        for h in handles:
            h.remove()
        for u in units:
            del u._get_fsdp_state()._fsdp_param_group.pre_backward
        out[kind] = {"units": [u.path for u in units], "whole": list(wrapper._whole), "seen": seen,
                     "backward": backward, "loss_params": [n for n, _ in loss.named_parameters()],
                     "members": {u.path: u.members for u in units},
                     "model": learner.checkpoint()["model"], "grad_norm": norms,
                     "at_rest_sharded": all(isinstance(p, DTensor) for u in units for p in u.parameters())}
        if case in ("sac", "td3"):
            ddp = FabricLearner(ensemble_loss(case, loop=kind.endswith("_loop")), opt(), clip_grad_norm=CLIP,
                                accelerator="cpu", devices=2, strategy=DDPStrategy(timeout=TIMEOUT))
            out[kind]["ddp"] = {"grad_norm": run_steps(ddp, case, rank, 2), "model": ddp.checkpoint()["model"]}
    # shard_loss's size threshold: layers under it share the ShardedLoss's unit
    from torch.distributed.fsdp import FSDPModule

    for kind, parallelize_fn in (("default", shard_loss), ("threshold_70", functools.partial(shard_loss, min_unit_numel=70))):
        loss, _ = make_loss("ppo")
        learner = fsdp(parallelize_fn=parallelize_fn, loss_module=loss, optimizer=opt(), clip_grad_norm=CLIP)
        units = learner.sharded_module.layer_units()
        norms = run_steps(learner, "ppo", rank, 2)
        out[kind] = {"own_unit": {u.path: isinstance(u, FSDPModule) for u in units},
                     "numel": {u.path: sum(p.numel() for p in u.parameters()) for u in units},
                     "loss_params": [n for n, _ in loss.named_parameters()],
                     "model": learner.checkpoint()["model"], "grad_norm": norms,
                     "at_rest_sharded": all(isinstance(p, DTensor) for u in units for p in u.parameters())}
    return out


def tampered(out_dir, rank):
    """Damaged copies of real checkpoints (prepared by the test, see tests/tamper.py), loaded on 2 ranks.

    For each case and strategy: the error every rank raised, and whether its learner's state
    (weights, targets, optimizer state, counters, random state) is exactly what it was.
    """
    import json

    cases = json.loads(open(os.path.join(out_dir, "tampered", "cases.json")).read())
    learners = {"fsdp": fsdp(loss_module=make_loss("dqn", seed=3)[0], optimizer=opt(), clip_grad_norm=CLIP),
                "ddp": FabricLearner(make_loss("dqn", seed=3)[0], opt(), clip_grad_norm=CLIP, accelerator="cpu",
                                     devices=2, strategy=DDPStrategy(timeout=TIMEOUT))}
    for learner in learners.values():
        learner.update(halves(make_batch("dqn", n=16, seed=7), rank))
    out = {}
    for name, learner in learners.items():
        for case, path in cases.items():
            before = (learner.checkpoint(), torch.get_rng_state())
            try:
                learner.load(path)
                error = None
            except Exception as err:  # noqa: BLE001 - the test inspects what was raised
                error = (type(err).__name__, str(err))
            after = (learner.checkpoint(), torch.get_rng_state())
            out[(name, case)] = {"error": error, "path": path, "unchanged": _same(before, after)}
    return out


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def main(out_dir):
    results = {"cases": {}, "accum": {}}
    rank = int(os.environ.get("LOCAL_RANK", 0))
    import warnings

    for case in CASES:
        with warnings.catch_warnings(record=True) as caught:  # FSDP2's view-output warning fired on DDPG
            warnings.simplefilter("always")
            learner, res = train(case, rank)
        res["warnings"] = [str(w.message) for w in caught]
        results["cases"][case] = res
        results["world_size"] = learner.world_size
        results.setdefault("group_timeouts", group_timeouts())  # ModelParallelStrategy(timeout=90 s), kept
        results["sharded"] = learner.capabilities.sharded
        results.setdefault("shard_fraction", {})[case] = shard_fraction(learner)
        results.setdefault("held_fraction", {})[case] = held_fractions(learner, case, rank)
    for case in ("dqn", "ppo", "ddpg"):
        results["accum"][case] = train(case, rank, grad_accum_steps=2)[1]
    # the DDP launch's checks, under FSDP, with a user's parallelize_fn (README, FSDP and Reliability)
    import ddp_checks

    user_fsdp = functools.partial(fsdp, parallelize_fn=user_parallelize)
    results["nonfinite"] = ddp_checks.nonfinite_on_one_rank(rank, build=user_fsdp)
    results["unequal_first_step"] = ddp_checks.unequal_first_step(rank, build=user_fsdp)
    results["unequal"] = ddp_checks.unequal_samples(rank, build=fsdp)
    results["integrity"] = {precision: ddp_checks.integrity(rank, precision, build=fsdp)  # DQN's target buffers too
                            for precision in ("bf16-mixed", "bf16-true")}
    results["user_sharded"] = list(USER_SHARDED)
    for scaler in ("sharded scaler", "plain scaler"):
        results.setdefault("mixed16", {})[scaler] = ddp_checks.mixed16_on_one_rank(rank, sharded=scaler)
    learner, _ = train("sac", rank, policy=True)
    results["weights_offload"] = learner.get_weights(cpu_offload=True)
    results["weights_full"] = learner.get_weights(cpu_offload=False)
    results["weights_model"] = learner.checkpoint()["model"]
    with learner.full_parameters(), torch.no_grad():  # rollouts and value estimates run in here
        results["actor_loc"] = learner.policy(make_batch("sac", n=4, seed=9))["loc"]
    results["actor_numel_after"] = sum(p.numel() for p in learner.policy.parameters())
    results["qvalue_numel_after"] = sum(p.numel() for n, p in learner.loss_module.named_parameters()
                                        if n.startswith("qvalue_network_params"))
    results["round_trip"] = round_trip(out_dir, rank)
    results["resume"] = resume(out_dir, rank)
    results["tampered"] = tampered(out_dir, rank)
    results["served"] = served(rank)
    results["per_layer"] = per_layer(rank)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    learner.fabric.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
