"""GRPO on a Qwen2-architecture model: the 2 x 2 mesh (tensor parallel x FSDP2) against FSDP2 on 4 ranks and one process.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/meshes.py            # ~5 min on 2 busy cores
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/meshes.py --quick    # ~1.5 min: does it run? (numbers say nothing)

Contenders, figures and when tensor parallelism pays: docs/meshes.md. Writes ``results/meshes.json``.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import statistics
import sys
import time
from datetime import timedelta

import harness
import torch
import torch.distributed as dist
import torchrl.modules.llm  # every import done before a worker's baseline
import torchrl.objectives.llm  # noqa: F401
from common import grpo_loss, grpo_params
from tensordict import lazy_stack
from transformers import Qwen2ForCausalLM  # noqa: F401

from fabric_learner import FabricLearner, LocalLearner
from fabric_learner.sharding import data_parallel_rank
from fabric_learner.testing import grpo_batch, tiny_tokenizer

LR, CLIP = 1e-5, 1.0
CONTENDERS = ("one_process", "fsdp4", "mesh")
MALLOC = {"MALLOC_MMAP_THRESHOLD_": "1048576"}  # glibc returns freed tensors of 1 MiB and more (docs/fsdp.md)


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


def share(mode: Mode, policy, step: int, first: int, count: int):
    """Chats ``first .. first + count - 1`` of step ``step``'s global batch, each built alone (seeded by its index)."""
    words = torch.randint(*mode.reply_words, (mode.chats,), generator=torch.Generator().manual_seed(1000 + step)).tolist()
    return lazy_stack([grpo_batch(policy, [words[i]], seed=100 * step + i).tensordicts[0]
                       for i in range(first, first + count)])


def worker(kind: str, mode: Mode, out: str) -> None:
    """One rank (or the one process): its chats of every step, its peak memory and its steps' wall and CPU time."""
    harness.set_one_thread()
    tiny_tokenizer()
    baseline = harness.status_mib("VmRSS")  # imports done, model not built yet
    loss, _ = grpo_loss(mode.hidden, mode.layers)
    rank = int(os.environ.get("RANK", 0))
    # this rank's chats: all, a quarter (FSDP on 4 ranks), or its data-parallel rank's half on the mesh (Lightning's
    # mesh is (data_parallel, tensor_parallel), row-major: data-parallel rank = rank // 2)
    parts, index = {"one_process": (1, 0), "fsdp4": (4, rank), "mesh": (2, rank // 2)}[kind]
    count = mode.chats // parts
    with torch.no_grad():  # scored by the model before it is sharded, as every contender's
        batches = [share(mode, loss.actor_network, step, index * count, count) for step in range(mode.warmup + mode.steps)]
    optimizer = functools.partial(torch.optim.AdamW, lr=LR)
    if kind == "one_process":
        learner = LocalLearner(loss, optimizer, clip_grad_norm=CLIP)
    else:
        strategy = "fsdp"
        if kind == "mesh":
            sys.path.insert(0, os.path.join(harness.ROOT, "examples"))
            from grpo_tensor_parallel import strategy as mesh_strategy

            strategy = mesh_strategy(timeout=timedelta(minutes=5))
        learner = FabricLearner(loss, optimizer, strategy=strategy, devices=4, accelerator="cpu", clip_grad_norm=CLIP,
                                timeout=timedelta(minutes=5))
        if kind == "mesh":
            assert data_parallel_rank() == index, (data_parallel_rank(), index)
    sync = dist.barrier if dist.is_available() and dist.is_initialized() else (lambda: None)
    walls, cpus, norms = [], [], []
    for step, batch in enumerate(batches):
        sync()
        wall, cpu = time.perf_counter(), time.process_time()
        out_td = learner.update(batch)
        sync()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        norms.append(float(out_td.get("grad_norm")))
        if step >= mode.warmup:
            walls.append(wall)
            cpus.append(cpu)
    harness.write_gathered(out, {
        "kind": kind, **harness.peak(baseline), "step_wall_s": walls, "step_cpu_s": cpus, "grad_norms": norms,
        "params": sum(p.numel() for p in loss.parameters()) if kind == "one_process" else None})
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def summarise(launches: list[list[dict]]) -> dict:
    worst = [max(r["peak_over_baseline_mib"] for r in ranks) for ranks in launches]
    cpus = [statistics.median([sum(r["step_cpu_s"][i] for r in ranks) for i in range(len(ranks[0]["step_cpu_s"]))])
            for ranks in launches]
    return {"ranks": len(launches[0]), "peak_mib_worst_rank": statistics.median(worst),
            "peak_mib_per_rank": [r["peak_over_baseline_mib"] for r in launches[0]],
            "step_wall_s": statistics.median(statistics.median(ranks[0]["step_wall_s"]) for ranks in launches),
            "step_cpu_s_all_ranks": statistics.median(cpus), "grad_norms": launches[0][0]["grad_norms"]}


def parser():
    p = harness.parser(__doc__)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--worker", choices=CONTENDERS, help="one rank of a contender's launch")
    return p


def main(argv=None) -> None:
    args = parser().parse_args(argv)
    mode = QUICK if args.quick else FULL
    if args.worker:
        return worker(args.worker, mode, args.out)
    harness.set_one_thread()
    start, load = time.perf_counter(), os.getloadavg()
    runs = harness.rotated(CONTENDERS, mode.repeats, lambda kind: {"ranks": harness.launch(
        [__file__, "--worker", kind, *(["--quick"] if args.quick else [])], ranks=None if kind == "one_process" else 4,
        timeout_s=900, what=f"{kind} launch", **MALLOC)}, lambda r: "")
    launches = {k: [r["ranks"] for r in runs if r["kind"] == k] for k in CONTENDERS}
    results = {k: summarise(v) for k, v in launches.items()}
    n_params = grpo_params(mode.hidden, mode.layers)
    print(harness.table(("contender", "ranks", "peak MiB/rank (worst)", "step wall s", "step CPU s (all ranks)"),
                        [(k, r["ranks"], f"{r['peak_mib_worst_rank']:.0f}", f"{r['step_wall_s']:.3f}",
                          f"{r['step_cpu_s_all_ranks']:.3f}") for k, r in results.items()]))
    harness.write_result(args.out or os.path.join(harness.RESULTS, "meshes_quick.json" if args.quick else "meshes.json"),
                         {"settings": dataclasses.asdict(mode), "n_params": n_params, "results": results,
                          "launches": launches, "load_average_before": load, "seconds": time.perf_counter() - start,
                          "machine": harness.machine()})


if __name__ == "__main__":
    main()
