"""A model that does not fit a per-process memory cap unsharded, trained under that cap by FSDP on 2 ranks.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/fsdp_capped.py      # ~3 min on 2 busy cores

PPO with an actor of 6 layers of ``--width`` (4096: 84.0M parameters, 321 MiB a copy); every process's address
space is capped (``harness.cap_address_space``) at its size before the model plus ``--cap-copies`` copies (3.5,
below the 4 that parameters, gradients and Adam's moments take). ``one_process`` (``LocalLearner``) is expected to
fail to allocate; ``fsdp_2_ranks`` (``FabricLearner(strategy="fsdp")``, 2 gloo ranks) to train;
``fsdp_2_ranks_one_unit`` is the same with the whole loss one FSDP2 unit (every parameter gathered for the whole
loss call, as before per-layer units). Writes ``results/fsdp_capped.json``.
"""
from __future__ import annotations

import os

import harness

KINDS = ("one_process", "fsdp_2_ranks", "fsdp_2_ranks_one_unit")


def worker(kind: str, width: int, cap_copies: float, updates: int, out: str) -> None:
    import functools
    from datetime import timedelta

    import common
    import torch

    from fabric_learner import FabricLearner, LocalLearner

    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", 0))
    cells = (width,) * 6
    baseline = harness.status_mib("VmSize")
    result = {"kind": kind, "rank": rank, "baseline_vmsize_mib": baseline}
    built = []

    def steps():
        # the exact size before the cap: the same MLPs on the meta device cost no memory
        from torchrl.modules import MLP

        with torch.device("meta"):
            nets = [MLP(in_features=common.OBS, out_features=2 * common.ACT, num_cells=list(cells)),
                    MLP(in_features=common.OBS, out_features=1, num_cells=[64, 64])]
        n_params = sum(p.numel() for net in nets for p in net.parameters())
        result.update(harness.cap_address_space(baseline, n_params, cap_copies))
        loss, _ = common.make_loss("ppo_big_actor", cells=cells)
        opt = functools.partial(torch.optim.Adam, lr=1e-4)
        if kind == "one_process":
            learner = LocalLearner(loss, opt)
        else:
            strategy = "fsdp"
            if kind == "fsdp_2_ranks_one_unit":
                from lightning.fabric.strategies import ModelParallelStrategy

                strategy = ModelParallelStrategy(parallelize_fn=one_unit, timeout=timedelta(minutes=5))
            learner = FabricLearner(loss, opt, accelerator="cpu", devices=2, strategy=strategy,
                                    timeout=None if kind == "fsdp_2_ranks_one_unit" else timedelta(minutes=5))
            built.append(learner)
        for step in range(updates):
            out_td = learner.update(common.make_batch("ppo_big_actor", n=64, seed=step + 10 * rank))
            yield float(sum(v for k, v in out_td.items() if k.startswith("loss_")))

    harness.train_under_cap(result, steps())
    harness.finish_capped(out, result)
    for learner in built:
        learner.close()


def one_unit(module, mesh):
    from torch.distributed.fsdp import fully_shard

    from fabric_learner import whole_world

    fully_shard(module, mesh=whole_world(mesh))
    return module


def parser():
    p = harness.parser(__doc__, "fsdp_capped.json")
    p.add_argument("--worker", choices=KINDS, help="one process or rank of a launch")
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--cap-copies", type=float, default=3.5, help="0: no cap (to calibrate)")
    p.add_argument("--updates", type=int, default=2)
    return p


def main(argv=None) -> None:
    args = parser().parse_args(argv)
    if args.worker:
        return worker(args.worker, args.width, args.cap_copies, args.updates, args.out)
    runs = [harness.launch_capped(kind, [__file__, "--worker", kind, "--width", str(args.width), "--cap-copies",
                                         str(args.cap_copies), "--updates", str(args.updates)],
                                  1 if kind == "one_process" else 2) for kind in KINDS]
    verdict = harness.capped_summary(runs, args.updates)
    result = {"what": f"RLIMIT_AS = VmSize before the model + {args.cap_copies} model copies, per process",
              "width": args.width, "cap_copies": args.cap_copies, "updates": args.updates,
              "trained_under_cap": verdict, "runs": runs}
    harness.write_result(args.out, result)
    print("trained under the cap:", verdict)


if __name__ == "__main__":
    main()
