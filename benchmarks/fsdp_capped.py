"""A model that does not fit a per-process memory cap unsharded, trained under that cap by FSDP on 2 ranks.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/fsdp_capped.py      # ~3 min on 2 busy cores

The model is PPO with an actor MLP of 6 layers of ``--width`` (4096: 84.0M parameters, 321 MiB
a copy). Unsharded, its parameters, gradients and Adam's two moments are 4 copies. Every
process gets the same cap on its address space (``RLIMIT_AS``), set just before it builds the
model: its address space then (``VmSize``, imports done) plus ``--cap-copies`` copies of the
model (3.5 by default, below the 4 copies one process needs for the training state alone).

- ``one_process``: ``LocalLearner`` trains the model under the cap: expected to fail to allocate.
- ``fsdp_2_ranks``: ``FabricLearner(strategy="fsdp")`` on 2 gloo ranks, each under the same cap:
  expected to train its updates (each rank builds the full model once, then holds half of
  the training state and one layer gathered at a time).
- ``fsdp_2_ranks_one_unit``: the same, but with a ``parallelize_fn`` that shards the learner's
  ``ShardedLoss`` as one FSDP2 unit (``fully_shard(module, mesh=whole_world(mesh))``): every
  parameter is gathered for the whole loss call, so each rank holds the full model and its full
  gradients at once (what ``strategy="fsdp"`` did before per-layer units).

``MALLOC_ARENA_MAX=1`` (``harness.launch_capped``): glibc otherwise reserves a 64 MiB arena of
address space per thread that allocates (gloo's threads too), which counts against ``RLIMIT_AS``
without being used. The cap and the launches are ``harness``'s (memory cap), shared with
``llm_update.py``. Writes ``benchmarks/results/fsdp_capped.json``.
"""

from __future__ import annotations

import argparse
import os
import sys

import harness

KINDS = ("one_process", "fsdp_2_ranks", "fsdp_2_ranks_one_unit")
HERE = os.path.dirname(os.path.abspath(__file__))


def worker(kind: str, width: int, cap_copies: float, updates: int, out: str) -> None:
    sys.path.insert(0, HERE)
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", choices=KINDS)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--cap-copies", type=float, default=3.5, help="0: no cap (to calibrate)")
    parser.add_argument("--updates", type=int, default=2)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "fsdp_capped.json"))
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.width, args.cap_copies, args.updates, args.out)
    runs = [harness.launch_capped(kind, [__file__, "--worker", kind, "--width", str(args.width), "--cap-copies",
                                         str(args.cap_copies), "--updates", str(args.updates)],
                                  1 if kind == "one_process" else 2) for kind in KINDS]
    verdict = harness.capped_summary(runs, args.updates)
    result = {"what": f"RLIMIT_AS = VmSize before the model + {args.cap_copies} model copies, per process",
              "width": args.width, "cap_copies": args.cap_copies, "updates": args.updates,
              "trained_under_cap": verdict, "runs": runs}
    harness.write_json(args.out, result)
    print("trained under the cap:", verdict)


if __name__ == "__main__":
    main()
