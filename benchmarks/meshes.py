"""GRPO on a Qwen2-architecture model: the 2 x 2 mesh (tensor parallel x FSDP2) against FSDP2 on 4 ranks and one process.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/meshes.py            # ~5 min on 2 busy cores
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/meshes.py --quick    # ~1.5 min: does it run?

Three contenders train the same optimizer steps: torchrl's ``GRPOLoss`` (``masking_strategy="rlhf"``,
token mean) over a ``TransformersWrapper`` around :func:`fabric_learner.testing.tiny_causal_lm` at a
larger size (4 heads, 2 key/value heads, MLP 2x hidden, untied head; random weights, seed 0), AdamW
(lr 1e-5), gradients clipped at norm 1.0. A step's global batch is ``--chats`` chats of different
lengths (:func:`fabric_learner.testing.grpo_batch`, one chat at a time, so a rank builds only its share);
every contender trains the same global batches:

- ``one_process``: ``LocalLearner``, the whole batch.
- ``fsdp4``: ``FabricLearner(strategy="fsdp", devices=4)``, each rank a quarter of the chats.
- ``mesh``: ``FabricLearner(strategy=examples/grpo_tensor_parallel.strategy())``, 2 data-parallel x 2
  tensor-parallel ranks: each decoder layer's projections cut over the tensor-parallel pair, each
  layer one FSDP2 unit over the data-parallel pair; data-parallel rank ``d`` takes half of the chats,
  both ranks of its tensor-parallel group the same half.

Each contender runs in its own launch (``torchrun`` for the 4-rank ones), ``--repeats`` times, rotated.
Reported per contender: a rank's peak resident memory (``VmHWM``) over its resident memory before the
model is built, worst rank of a launch (the full model is built on every rank before it is sharded,
so this includes one full copy); the wall time of an optimizer step (median over the timed steps,
rank 0, barriers around each step); and the CPU seconds of a step summed over the ranks. One thread
per rank: 4 ranks on a machine with fewer cores share them, so wall times there measure the sharing as
much as the parallelism; the CPU time is the work done. Writes ``benchmarks/results/meshes.json``
(``--out``). ``--quick`` trains a tiny model with few steps (its numbers say nothing). No test asserts
on timing.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import statistics
import sys
import time

import harness

HERE = os.path.dirname(os.path.abspath(__file__))
LR, CLIP = 1e-5, 1.0
CONTENDERS = ("one_process", "fsdp4", "mesh")
# a fixed mmap threshold, so that glibc returns freed tensors of 1 MiB and more to the system (docs/fsdp.md)
MALLOC = {"MALLOC_MMAP_THRESHOLD_": "1048576"}


@dataclasses.dataclass(frozen=True)
class Mode:
    hidden: int = 768  # 6 layers: 32.3M parameters
    layers: int = 6
    chats: int = 8  # per optimizer step, over all ranks
    reply_words: tuple[int, int] = (12, 36)
    warmup: int = 1
    steps: int = 3  # timed optimizer steps
    repeats: int = 1


FULL = Mode()
QUICK = Mode(hidden=128, layers=2, chats=4, reply_words=(3, 10), warmup=1, steps=2, repeats=1)


# ---- in the ranks --------------------------------------------------------------------------------


def _tokenizer():
    from fabric_learner.testing import tiny_tokenizer

    return tiny_tokenizer()


def grpo_loss(mode: Mode):
    from torchrl.modules.llm import TransformersWrapper
    from torchrl.objectives.llm import GRPOLoss

    from fabric_learner.testing import tiny_causal_lm

    model = tiny_causal_lm(0, tokenizer=_tokenizer(), hidden_size=mode.hidden, num_layers=mode.layers)
    policy = TransformersWrapper(model, tokenizer=_tokenizer(), input_mode="history", generate=False,
                                 return_log_probs=True, pad_output=False)
    return GRPOLoss(policy, masking_strategy="rlhf"), policy


def reply_lengths(mode: Mode, step: int) -> list[int]:
    import torch

    generator = torch.Generator().manual_seed(1000 + step)
    return torch.randint(*mode.reply_words, (mode.chats,), generator=generator).tolist()


def share(mode: Mode, policy, step: int, first: int, count: int):
    """Chats ``first .. first + count - 1`` of step ``step``'s global batch, each built alone (seeded by its index)."""
    from tensordict import lazy_stack

    from fabric_learner.testing import grpo_batch

    words = reply_lengths(mode, step)
    return lazy_stack([grpo_batch(policy, [words[i]], seed=100 * step + i).tensordicts[0]
                       for i in range(first, first + count)])


def _import_everything() -> None:
    import torch  # noqa: F401
    import torchrl.modules.llm
    import torchrl.objectives.llm  # noqa: F401
    import transformers  # noqa: F401
    from transformers import Qwen2ForCausalLM  # noqa: F401

    import fabric_learner  # noqa: F401
    from fabric_learner.testing import grpo_batch  # noqa: F401

    _tokenizer()


def worker(kind: str, mode: Mode, out: str) -> None:
    harness.set_one_thread()
    _import_everything()
    import torch
    import torch.distributed as dist

    from fabric_learner import FabricLearner, LocalLearner

    baseline = harness.status_mib("VmRSS")  # imports done, model not built yet
    loss, policy = grpo_loss(mode)
    rank = int(os.environ.get("RANK", 0))
    # this rank's chats: all of them, a quarter (FSDP on 4 ranks), or its data-parallel rank's half on the
    # mesh (Lightning's mesh is (data_parallel, tensor_parallel), row-major: data-parallel rank = rank // 2)
    parts, index = {"one_process": (1, 0), "fsdp4": (4, rank), "mesh": (2, rank // 2)}[kind]
    count = mode.chats // parts
    with torch.no_grad():  # scored by the model before it is sharded, as every contender's
        batches = [share(mode, policy, step, index * count, count) for step in range(mode.warmup + mode.steps)]
    optimizer = functools.partial(torch.optim.AdamW, lr=LR)
    if kind == "one_process":
        learner = LocalLearner(loss, optimizer, clip_grad_norm=CLIP)
    else:
        from datetime import timedelta

        strategy = "fsdp"
        if kind == "mesh":
            sys.path.insert(0, os.path.join(harness.ROOT, "examples"))
            from grpo_tensor_parallel import strategy as mesh_strategy

            strategy = mesh_strategy(timeout=timedelta(minutes=5))
        learner = FabricLearner(loss, optimizer, strategy=strategy, devices=4, accelerator="cpu",
                                clip_grad_norm=CLIP, timeout=timedelta(minutes=5))
        if kind == "mesh":
            from fabric_learner.sharding import data_parallel_rank

            assert data_parallel_rank() == index, (data_parallel_rank(), index)
    distributed = dist.is_available() and dist.is_initialized()
    walls, cpus, norms = [], [], []
    for step, batch in enumerate(batches):
        if distributed:
            dist.barrier()
        wall, cpu = time.perf_counter(), time.process_time()
        out_td = learner.update(batch)
        if distributed:
            dist.barrier()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        norms.append(float(out_td.get("grad_norm")))
        if step >= mode.warmup:
            walls.append(wall)
            cpus.append(cpu)
    result = {"kind": kind, "rank": dist.get_rank() if distributed else 0, "baseline_mib": baseline,
              "peak_over_baseline_mib": harness.status_mib("VmHWM") - baseline, "step_wall_s": walls,
              "step_cpu_s": cpus, "grad_norms": norms,
              "params": sum(p.numel() for p in loss.parameters()) if kind == "one_process" else None}
    rank_out = f"{out}.rank{result['rank']}"
    harness.write_json(rank_out, result)
    if distributed:
        dist.barrier()
        dist.destroy_process_group()


# ---- the driver ----------------------------------------------------------------------------------


def n_params(mode: Mode) -> int:
    import torch
    from transformers import Qwen2ForCausalLM  # noqa: F401  (a first import under "meta" would run there)

    from fabric_learner.testing import tiny_causal_lm

    _tokenizer()
    with torch.device("meta"):
        return sum(p.numel() for p in tiny_causal_lm(0, tokenizer=_tokenizer(), hidden_size=mode.hidden,
                                                     num_layers=mode.layers).parameters())


def launch(kind: str, mode: Mode, args) -> list[dict]:
    argv = [os.path.join(HERE, "meshes.py"), "--worker", kind, *(["--quick"] if args.quick else [])]
    nproc = 1 if kind == "one_process" else 4
    with harness.scratch_path() as out:
        cmd = [sys.executable, *argv, "--worker-out", out] if nproc == 1 else \
            harness.torchrun(nproc, *argv, "--worker-out", out)
        harness.run_bounded(cmd, args.timeout, f"{kind} launch", **MALLOC)
        return [harness.read_json(f"{out}.rank{r}") for r in range(nproc)]


def summarise(launches: list[list[dict]]) -> dict:
    worst = [max(r["peak_over_baseline_mib"] for r in ranks) for ranks in launches]
    walls = [statistics.median(ranks[0]["step_wall_s"]) for ranks in launches]
    cpus = [statistics.median([sum(r["step_cpu_s"][i] for r in ranks) for i in range(len(ranks[0]["step_cpu_s"]))])
            for ranks in launches]
    return {"ranks": len(launches[0]), "peak_mib_worst_rank": statistics.median(worst),
            "peak_mib_per_rank": [r["peak_over_baseline_mib"] for r in launches[0]],
            "step_wall_s": statistics.median(walls), "step_cpu_s_all_ranks": statistics.median(cpus),
            "grad_norms": launches[0][0]["grad_norms"]}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=None, help="result file (default benchmarks/results/meshes[_quick].json)")
    p.add_argument("--only", default=",".join(CONTENDERS), help="contenders, comma-separated")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--worker", choices=CONTENDERS, help=argparse.SUPPRESS)
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    mode = QUICK if args.quick else FULL
    if args.worker:
        return worker(args.worker, mode, args.worker_out)
    harness.set_one_thread()
    kinds = [k for k in CONTENDERS if k in args.only.split(",")]
    launches = {k: [] for k in kinds}
    start = time.perf_counter()
    load = os.getloadavg()
    for repeat in range(mode.repeats):
        for kind in kinds[repeat % len(kinds):] + kinds[:repeat % len(kinds)]:
            launches[kind].append(launch(kind, mode, args))
    results = {k: summarise(v) for k, v in launches.items()}
    print(f"GRPO, tiny_causal_lm hidden {mode.hidden} x {mode.layers} layers ({n_params(mode) / 1e6:.1f}M "
          f"parameters), {mode.chats} chats a step, AdamW; load average before {load[0]:.1f}")
    print(f"{'contender':<12} {'ranks':>5} {'peak MiB/rank (worst)':>22} {'step wall s':>12} {'step CPU s (all ranks)':>23}")
    for kind, r in results.items():
        print(f"{kind:<12} {r['ranks']:>5} {r['peak_mib_worst_rank']:>22.0f} {r['step_wall_s']:>12.3f} "
              f"{r['step_cpu_s_all_ranks']:>23.3f}")
    out = args.out or os.path.join(HERE, "results", "meshes_quick.json" if args.quick else "meshes.json")
    harness.write_json(out, {"settings": dataclasses.asdict(mode), "n_params": n_params(mode), "results": results,
                             "launches": launches, "load_average_before": load,
                             "seconds": time.perf_counter() - start, "machine": harness.machine()})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
