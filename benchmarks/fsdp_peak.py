"""Peak memory per rank of one PPO training run: learner FSDP vs hand-written per-layer FSDP2 vs learner DDP.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/fsdp_peak.py            # ~3 min on 2 busy cores (--repeats 2: ~6 min)
    .venv/bin/python benchmarks/fsdp_peak.py --width 1024 --repeats 1      # a quick smoke

Each contender is its own 2-rank torchrun launch (gloo, CPU), so each process's high-water mark is its own;
contenders take turns, ``--repeats`` times, rotated. A rank trains two Adam updates on its own 64 samples and
reports its peak resident memory (``VmHWM``) over its resident memory before the model; a launch counts its worst
rank. ``ClipPPOLoss`` with a 6-layer ``--width``-wide actor (4096: 84.0M parameters): ``learner_fsdp``
(``FabricLearner(strategy="fsdp")``), ``hand_fsdp2`` (``fully_shard`` on each ``Linear``, then each network, by
hand) and ``learner_ddp``; ratios ``learner_fsdp / hand_fsdp2`` (goal <= 1.1) and ``learner_fsdp / learner_ddp``
(<= 0.55), in ``results/fsdp_peak.json``. ``--case sac``: SAC with a large critic ensemble (2 critics of 4
``--width`` layers, 2048: 25.2M parameters), ``learner_fsdp``, ``learner_fsdp_ensemble_whole`` (the ensemble left
in the root unit) and ``learner_ddp``, in ``results/fsdp_peak_sac.json``.
"""

from __future__ import annotations

import os
import statistics

import harness

CONTENDERS = ("learner_fsdp", "hand_fsdp2", "learner_ddp")
SAC_CONTENDERS = ("learner_fsdp", "learner_fsdp_ensemble_whole", "learner_ddp")


def shard_all_but_ensembles(module, mesh):
    """``shard_loss`` with every layer its own unit except a critic ensemble's, left in the root unit."""
    from torch.distributed.fsdp import fully_shard

    from fabric_learner import whole_world

    for unit in module.layer_units():
        if unit.members is None and sum(p.numel() for p in unit.parameters()) >= 1 << 20:
            fully_shard(unit, mesh=whole_world(mesh))
    fully_shard(module, mesh=whole_world(mesh))
    return module


def worker(kind: str, width: int, out: str, case: str = "ppo") -> None:
    import functools
    from datetime import timedelta

    import common
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard  # noqa: F401
    from torchrl.objectives import ClipPPOLoss  # noqa: F401

    from fabric_learner import FabricLearner  # every contender imports the same before its baseline

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    baseline = harness.status_mib("VmRSS")  # imports done, model not built yet
    workload = "ppo_big_actor" if case == "ppo" else "sac_big_critic"
    cells = (width,) * (6 if case == "ppo" else 4)
    batches = [common.make_batch(workload[:3], n=64, seed=step + 10 * rank) for step in range(2)]
    if kind == "hand_fsdp2":
        loss, n_params = hand_fsdp2(cells, timedelta(minutes=5))
        opt = torch.optim.Adam([p for p in loss.parameters() if p.requires_grad], lr=1e-4)
        for batch in batches:
            losses = loss(batch)
            total = sum(v for k, v in losses.items() if k.startswith("loss_"))
            total.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        done = dist
    else:
        from lightning.fabric.strategies import ModelParallelStrategy

        loss, _ = common.make_loss(workload, cells=cells)
        n_params = sum(p.numel() for p in loss.parameters())
        strategy = {"learner_fsdp": "fsdp", "learner_ddp": "ddp"}.get(kind) or ModelParallelStrategy(
            parallelize_fn=shard_all_but_ensembles, timeout=timedelta(minutes=5))
        learner = FabricLearner(loss, functools.partial(torch.optim.Adam, lr=1e-4), accelerator="cpu", devices=2,
                                strategy=strategy, timeout=timedelta(minutes=5))
        for batch in batches:
            learner.update(batch)
        done = learner
    result = {"rank": rank, "baseline_mib": baseline, "peak_over_baseline_mib": harness.status_mib("VmHWM") - baseline,
              "n_params": n_params}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    if rank == 0:
        harness.write_json(out, gathered, indent=None)
    if done is dist:
        dist.barrier()
        dist.destroy_process_group()
    else:
        done.close()


def hand_fsdp2(cells, timeout):
    """ClipPPOLoss over networks sharded by hand, one FSDP2 unit per Linear, then per network."""
    import common
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torchrl.objectives import ClipPPOLoss

    torch.manual_seed(0)
    functional, _ = common.make_loss("ppo_big_actor", cells=cells)  # the same networks and weights
    policy, critic = functional.actor_network, functional.critic_network
    n_params = sum(p.numel() for p in functional.parameters())
    # a functional loss keeps the weights in its TensorDictParams: hand them back to the networks
    functional.actor_network_params.to_module(policy)
    functional.critic_network_params.to_module(critic)
    del functional
    dist.init_process_group("gloo", timeout=timeout)
    for network in (policy, critic):
        sequentials = [m for m in network.modules() if isinstance(m, torch.nn.Sequential)
                       and any(isinstance(c, torch.nn.Linear) for c in m.children())]
        for seq in sequentials:
            for layer in seq:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer)
            fully_shard(seq)
    loss = ClipPPOLoss(policy, critic, entropy_coeff=0.01, normalize_advantage=False, functional=False)
    from torch.distributed.tensor import DTensor

    assert all(isinstance(p, DTensor) for p in loss.parameters()), "hand FSDP2: unsharded parameters left"
    return loss, n_params


def launch(kind: str, width: int, case: str = "ppo") -> dict:
    """One 2-rank launch of contender ``kind``: every rank's figures and the worst rank's peak."""
    ranks = harness.launch([__file__, "--worker", kind, "--width", str(width), "--case", case], ranks=2, what=kind)
    return {"ranks": ranks, "worst_peak_mib": max(r["peak_over_baseline_mib"] for r in ranks),
            "n_params": ranks[0]["n_params"]}


def parser():
    p = harness.parser(__doc__)
    p.add_argument("--worker", choices=CONTENDERS + SAC_CONTENDERS, help="one rank of a contender's launch")
    p.add_argument("--case", choices=("ppo", "sac"), default="ppo")
    p.add_argument("--width", type=int)
    p.add_argument("--repeats", type=int, default=1)
    return p


def main(argv=None) -> None:
    args = parser().parse_args(argv)
    args.width = args.width or (4096 if args.case == "ppo" else 2048)
    args.out = args.out or os.path.join(harness.RESULTS,
                                        "fsdp_peak.json" if args.case == "ppo" else "fsdp_peak_sac.json")
    if args.worker:
        return worker(args.worker, args.width, args.out, args.case)
    if args.case == "sac":
        return main_sac(args)
    runs, median = interleaved(args, CONTENDERS)
    result = summary(args, runs, median, "PPO", fsdp_vs_hand_fsdp2=median["learner_fsdp"] / median["hand_fsdp2"],
                     fsdp_vs_ddp=median["learner_fsdp"] / median["learner_ddp"],
                     goals={"fsdp_vs_hand_fsdp2": 1.1, "fsdp_vs_ddp": 0.55})
    n_params, copy_mib = result["n_params"], result["copy_mib"]
    print(f"{n_params / 1e6:.1f}M parameters, {copy_mib:.0f} MiB a copy")
    for k in CONTENDERS:
        print(f"  {k:13s} {median[k]:8.1f} MiB  ({median[k] / copy_mib:.1f} copies)")
    print(f"learner fsdp / hand FSDP2 = {result['fsdp_vs_hand_fsdp2']:.2f} (goal <= 1.1); "
          f"learner fsdp / ddp = {result['fsdp_vs_ddp']:.2f} (goal <= 0.55)")


def interleaved(args, contenders, *case) -> tuple[list[dict], dict[str, float]]:
    """``args.repeats`` launches of each contender, in rotated order; every run and each one's median peak."""
    runs = harness.rotated(contenders, args.repeats, lambda kind: launch(kind, args.width, *case),
                           lambda r: f"worst-rank peak {r['worst_peak_mib']:8.1f} MiB")
    return runs, {k: statistics.median(r["worst_peak_mib"] for r in runs if r["kind"] == k) for k in contenders}


def summary(args, runs: list[dict], median: dict[str, float], algorithm: str, **ratios) -> dict:
    """The result written to ``args.out``: the medians, in copies of the parameters too, and ``ratios``."""
    n_params = runs[0]["n_params"]
    copy_mib = n_params * 4 / 2**20
    result = {
        "what": f"peak resident memory over the pre-model baseline, worst of 2 CPU ranks, 2 {algorithm} updates",
        "width": args.width, "n_params": n_params, "copy_mib": copy_mib, "repeats": args.repeats,
        "median_peak_mib": median, "copies": {k: v / copy_mib for k, v in median.items()}, **ratios, "runs": runs,
    }
    harness.write_result(args.out, result)
    return result


def main_sac(args) -> None:
    runs, median = interleaved(args, SAC_CONTENDERS, "sac")
    result = summary(args, runs, median, "SAC", fsdp_vs_ddp=median["learner_fsdp"] / median["learner_ddp"],
                     fsdp_vs_ensemble_whole=median["learner_fsdp"] / median["learner_fsdp_ensemble_whole"])
    n_params, copy_mib = result["n_params"], result["copy_mib"]
    print(f"{n_params / 1e6:.1f}M trained parameters, {copy_mib:.0f} MiB a copy")
    for k in SAC_CONTENDERS:
        print(f"  {k:27s} {median[k]:8.1f} MiB  ({median[k] / copy_mib:.1f} copies)")
    print(f"learner fsdp / ddp = {result['fsdp_vs_ddp']:.2f}; "
          f"learner fsdp / ensemble gathered whole = {result['fsdp_vs_ensemble_whole']:.2f}")


if __name__ == "__main__":
    main()
