"""FSDP on 2 CPU ranks: peak memory per rank, training under a memory cap, tensor state, serving the policy.

    python benchmarks/fsdp.py peak --repeats 2             # PPO, 84M actor: results/fsdp_peak.json (~3 min a repeat)
    python benchmarks/fsdp.py peak --case sac --repeats 2  # SAC, large critic ensemble: results/fsdp_peak_sac.json
    python benchmarks/fsdp.py capped                       # trained under a per-process cap: results/fsdp_capped.json
    python benchmarks/fsdp.py serve --out benchmarks/results/fsdp_serve.json   # starts rank 1 itself
    python benchmarks/fsdp.py memory --strategy fsdp --out x.json             # run.py's case c, one strategy

Contenders and figures of each mode: benchmarks/README.md, "FSDP memory and cost".
"""
from __future__ import annotations

import functools
import os
import statistics
import time
from datetime import timedelta

import common
import harness
import torch
import torch.distributed as dist
from lightning.fabric.strategies import DDPStrategy, ModelParallelStrategy
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torchrl.objectives import ClipPPOLoss

from fabric_learner import FabricLearner, LocalLearner, shard_loss, whole_world

TIMEOUT = timedelta(minutes=5)
ADAM = functools.partial(torch.optim.Adam, lr=1e-4)
PEAK = {"ppo": ("learner_fsdp", "hand_fsdp2", "learner_ddp"),
        "sac": ("learner_fsdp", "learner_fsdp_ensemble_whole", "learner_ddp")}
CAPPED = ("one_process", "fsdp_2_ranks", "fsdp_2_ranks_one_unit")


def one_unit(module, mesh):
    """The whole loss one FSDP2 unit: every parameter gathered for the whole loss call."""
    fully_shard(module, mesh=whole_world(mesh))
    return module


def shard_all_but_ensembles(module, mesh):
    """``shard_loss`` with every layer its own unit except a critic ensemble's, left in the root unit."""
    for unit in module.layer_units():
        if unit.members is None and sum(p.numel() for p in unit.parameters()) >= 1 << 20:
            fully_shard(unit, mesh=whole_world(mesh))
    return one_unit(module, mesh)


def hand_fsdp2(cells):
    """ClipPPOLoss over networks sharded by hand, one FSDP2 unit per Linear, then per network."""
    torch.manual_seed(0)
    functional, _ = common.make_loss("ppo_big_actor", cells=cells)  # the same networks and weights
    policy, critic = functional.actor_network, functional.critic_network
    n_params = common.count_params(functional)
    # a functional loss keeps the weights in its TensorDictParams: hand them back to the networks
    functional.actor_network_params.to_module(policy)
    functional.critic_network_params.to_module(critic)
    del functional
    dist.init_process_group("gloo", timeout=TIMEOUT)
    for network in (policy, critic):
        for seq in [m for m in network.modules() if isinstance(m, torch.nn.Sequential)
                    and any(isinstance(c, torch.nn.Linear) for c in m.children())]:
            for layer in seq:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer)
            fully_shard(seq)
    loss = ClipPPOLoss(policy, critic, entropy_coeff=0.01, normalize_advantage=False, functional=False)
    assert all(isinstance(p, DTensor) for p in loss.parameters()), "hand FSDP2: unsharded parameters left"
    return loss, n_params


def peak_worker(kind: str, width: int, case: str, out: str) -> None:
    """One rank of a peak launch: two Adam updates on its own 64 samples; its peak over its pre-model memory."""
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    baseline = harness.status_mib("VmRSS")  # imports done, model not built yet
    workload = "ppo_big_actor" if case == "ppo" else "sac_big_critic"
    cells = (width,) * (6 if case == "ppo" else 4)
    batches = [common.make_batch(workload[:3], n=64, seed=step + 10 * rank) for step in range(2)]
    if kind == "hand_fsdp2":
        loss, n_params = hand_fsdp2(cells)
        opt = torch.optim.Adam([p for p in loss.parameters() if p.requires_grad], lr=1e-4)
        for batch in batches:
            common.summed_loss(loss(batch)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    else:
        loss, _ = common.make_loss(workload, cells=cells)
        n_params = common.count_params(loss)
        strategy = {"learner_fsdp": "fsdp", "learner_ddp": "ddp"}.get(kind) or ModelParallelStrategy(
            parallelize_fn=shard_all_but_ensembles, timeout=TIMEOUT)
        learner = FabricLearner(loss, ADAM, accelerator="cpu", devices=2, strategy=strategy, timeout=TIMEOUT)
        for batch in batches:
            learner.update(batch)
    harness.write_gathered(out, harness.peak(baseline, n_params=n_params))
    if kind == "hand_fsdp2":
        dist.barrier()
        dist.destroy_process_group()
    else:
        learner.close()


def peak(args) -> None:
    """Each contender its own 2-rank launch, ``--repeats`` times, rotated; medians of the worst rank's peak."""
    kinds = PEAK[args.case]
    runs, median = harness.peak_launches(kinds, args.repeats, lambda kind: [
        __file__, "peak", "--worker", kind, "--width", args.width, "--case", args.case], ranks=2)
    for run in runs:
        run["n_params"] = run["ranks"][0]["n_params"]
    copy_mib = runs[0]["n_params"] * 4 / 2**20
    ratios = {"fsdp_vs_hand_fsdp2": median["learner_fsdp"] / median["hand_fsdp2"],
              "fsdp_vs_ddp": median["learner_fsdp"] / median["learner_ddp"],
              "goals": {"fsdp_vs_hand_fsdp2": 1.1, "fsdp_vs_ddp": 0.55}} if args.case == "ppo" else {
        "fsdp_vs_ddp": median["learner_fsdp"] / median["learner_ddp"],
        "fsdp_vs_ensemble_whole": median["learner_fsdp"] / median["learner_fsdp_ensemble_whole"]}
    algorithm = "PPO" if args.case == "ppo" else "SAC"
    harness.write_result(args.out, {
        "what": f"peak resident memory over the pre-model baseline, worst of 2 CPU ranks, 2 {algorithm} updates",
        "width": args.width, "n_params": runs[0]["n_params"], "copy_mib": copy_mib, "repeats": args.repeats,
        "median_peak_mib": median, "copies": {k: v / copy_mib for k, v in median.items()}, **ratios, "runs": runs})
    harness.show({"median_peak_mib": median, **ratios})


def capped_worker(kind: str, width: int, cap_copies: float, updates: int, out: str) -> None:
    """One process or rank under the cap: 6-layer ``width`` actor, Adam, ``updates`` updates of 64 samples."""
    from torchrl.modules import MLP

    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", 0))
    cells = (width,) * 6
    result = {"kind": kind, "rank": rank, "baseline_vmsize_mib": harness.status_mib("VmSize")}
    built = []

    def steps():
        with torch.device("meta"):  # the exact size before the cap: the same MLPs on the meta device cost nothing
            nets = [MLP(in_features=common.OBS, out_features=2 * common.ACT, num_cells=list(cells)),
                    MLP(in_features=common.OBS, out_features=1, num_cells=[64, 64])]
        result.update(harness.cap_address_space(result["baseline_vmsize_mib"], sum(map(common.count_params, nets)),
                                                cap_copies))
        loss, _ = common.make_loss("ppo_big_actor", cells=cells)
        if kind == "one_process":
            learner = LocalLearner(loss, ADAM)
        else:
            whole = kind == "fsdp_2_ranks_one_unit"
            learner = FabricLearner(loss, ADAM, accelerator="cpu", devices=2, timeout=None if whole else TIMEOUT,
                                    strategy=ModelParallelStrategy(parallelize_fn=one_unit, timeout=TIMEOUT)
                                    if whole else "fsdp")
            built.append(learner)
        for step in range(updates):
            out_td = learner.update(common.make_batch("ppo_big_actor", n=64, seed=step + 10 * rank))
            yield float(sum(v for k, v in out_td.items() if k.startswith("loss_")))

    harness.train_capped(out, result, steps())
    for learner in built:
        learner.close()


def capped(args) -> None:
    """The PPO model of ``--width`` under a cap of ``--cap-copies`` copies: one process, FSDP, FSDP in one unit."""
    runs = [harness.launch_capped(kind, [__file__, "capped", "--worker", kind, "--width", str(args.width),
                                         "--cap-copies", str(args.cap_copies), "--updates", str(args.updates)],
                                  1 if kind == "one_process" else 2) for kind in CAPPED]
    trained = harness.capped_summary(runs, args.updates)
    harness.write_result(args.out, {
        "what": f"RLIMIT_AS = VmSize before the model + {args.cap_copies} model copies, per process",
        "width": args.width, "cap_copies": args.cap_copies, "updates": args.updates, "trained_under_cap": trained,
        "runs": runs})
    print("trained under the cap:", trained)


def local_bytes(t: torch.Tensor) -> int:
    t = t.to_local() if isinstance(t, DTensor) else t
    return t.numel() * t.element_size()


def ddp_bucket_bytes(learner) -> int:
    """Bytes of DDP's gradient buckets (flat copies of the gradients for the all-reduce, apart from them unless
    ``gradient_as_bucket_view``), from DDP's own logging data."""
    ddp = getattr(learner._module, "_forward_module", learner._module)
    data = ddp._get_ddp_logging_data() if hasattr(ddp, "_get_ddp_logging_data") else {}
    if data.get("gradient_as_bucket_view"):
        return 0
    return sum(int(x) for x in str(data.get("bucket_sizes", "")).split(",") if x.strip().isdigit())


def memory(args) -> None:
    """After ``--steps`` Adam updates of the 21M PPO loss: the bytes each rank holds in tensors (local shards,
    gradients just before the step, DDP's buckets), its peak resident memory and that peak over its pre-model size."""
    strategy = DDPStrategy(timeout=TIMEOUT) if args.strategy == "ddp" else \
        ModelParallelStrategy(parallelize_fn=shard_loss, timeout=TIMEOUT)
    baseline = harness.status_mib("VmRSS")  # imports done, no model yet
    torch.manual_seed(0)
    loss, _ = common.make_loss("ppo_big_actor")
    n_params = common.count_params(loss)
    learner = FabricLearner(loss, ADAM, accelerator="cpu", devices=2, strategy=strategy)
    rank = learner.global_rank
    params = [p for g in learner.optimizer.param_groups for p in g["params"]]
    at_step = {}  # gradients live from the backward to the zero_grad after the step: counted just before it
    torch_optimizer = getattr(learner.optimizer, "optimizer", learner.optimizer)
    torch_optimizer.register_step_pre_hook(
        lambda *_: at_step.update(gradients=sum(local_bytes(p.grad) for p in params if p.grad is not None)))
    for step in range(args.steps):
        learner.update(common.make_batch("ppo_big_actor", n=64, seed=step + 10 * rank))
    held = {"parameters": sum(local_bytes(p) for p in params), "gradients": at_step["gradients"],
            "ddp_gradient_buckets": ddp_bucket_bytes(learner) if args.strategy == "ddp" else 0,
            "optimizer": sum(local_bytes(v) for s in learner.optimizer.state.values() for v in s.values()
                             if isinstance(v, torch.Tensor)),
            "buffers": sum(local_bytes(b) for b in loss.buffers()),
            "loss_own_parameters": sum(local_bytes(p) for p in loss.parameters()) if args.strategy == "fsdp" else 0}
    result = {"strategy": args.strategy, "rank": rank, "n_params": n_params, "bytes": held,
              "total_mib": sum(held.values()) / 2**20, "peak_rss_mib": harness.status_mib("VmHWM"),
              "peak_over_baseline_mib": harness.status_mib("VmHWM") - baseline}
    every = harness.gathered(result)
    if rank == 0:
        harness.write_json(args.out, every)
    learner.close()


def serve(args) -> None:
    """Two FSDP learners on identical PPO losses, one serving its actor (``policy=actor``), in interleaved blocks of
    updates on the same batches: for the standard PPO workload and the 21M-parameter actor."""
    def learner(workload: str, served: bool):
        loss, actor = common.make_loss(workload)
        return FabricLearner(loss, ADAM, policy=actor if served else None, accelerator="cpu", devices=2,
                             strategy=ModelParallelStrategy(parallelize_fn=shard_loss, timeout=TIMEOUT)), actor

    rows = []
    for workload, block, batch in (("ppo", 8, common.BATCH), ("ppo_big_actor", 2, 64)):
        (served, actor), (plain, _) = learner(workload, True), learner(workload, False)
        learners = {"served": served, "plain": plain}
        rank = served.global_rank
        batches = [common.make_batch(workload, n=batch, seed=10 * rank + i) for i in range(block)]
        times = {"served": [], "plain": []}
        for rep in range(args.reps + 1):  # the first block warms up
            for name in harness.rotation(rep, ["plain", "served"]):
                served.fabric.barrier()
                start = time.perf_counter()
                for b in batches:
                    learners[name].update(b.clone())
                if rep:
                    times[name].append((time.perf_counter() - start) / block)
        median = {k: statistics.median(v) for k, v in times.items()}
        rows.append({"workload": workload, "rank": rank, "ms_per_update": {k: v * 1e3 for k, v in median.items()},
                     "ratio": median["served"] / median["plain"],
                     "served_mib": sum(p.numel() * p.element_size() for p in actor.parameters()) / 2**20,
                     "actor_params": common.count_params(actor), "reps": args.reps, "block": block})
    if rows[0]["rank"] == 0:
        harness.write_result(args.out, {"rows": rows, "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                        "git": harness.git_head()})
        harness.show(rows)


MODES = {"peak": peak, "capped": capped, "memory": memory, "serve": serve}


def parser():
    p = harness.parser(__doc__)
    p.add_argument("mode", choices=MODES)
    p.add_argument("--worker", choices=sorted({*PEAK["ppo"], *PEAK["sac"], *CAPPED}), help="one rank of a launch")
    p.add_argument("--case", choices=("ppo", "sac"), default="ppo", help="peak: the workload")
    p.add_argument("--width", type=int, help="peak and capped: the large network's width (default 4096, sac 2048)")
    p.add_argument("--repeats", type=int, default=1, help="peak: launches of each contender")
    p.add_argument("--cap-copies", type=float, default=3.5, help="capped: the cap in model copies (0: no cap)")
    p.add_argument("--updates", type=int, default=2, help="capped: updates")
    p.add_argument("--strategy", choices=["ddp", "fsdp"], help="memory: the learner's strategy")
    p.add_argument("--steps", type=int, default=3, help="memory: Adam updates before counting")
    p.add_argument("--reps", type=int, default=9, help="serve: blocks of each learner")
    return p


def main(argv=None) -> None:
    p = parser()
    args = p.parse_args(argv)
    if args.mode == "memory" and not args.strategy:
        p.error("memory needs --strategy")
    args.width = args.width or (2048 if args.case == "sac" else 4096)
    if args.mode == "peak":
        args.out = args.out or os.path.join(harness.RESULTS, "fsdp_peak.json" if args.case == "ppo" else "fsdp_peak_sac.json")
    elif args.mode == "capped":
        args.out = args.out or os.path.join(harness.RESULTS, "fsdp_capped.json")
    if args.worker:
        return peak_worker(args.worker, args.width, args.case, args.out) if args.mode == "peak" else \
            capped_worker(args.worker, args.width, args.cap_copies, args.updates, args.out)
    MODES[args.mode](args)


if __name__ == "__main__":
    main()
