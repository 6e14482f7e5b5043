"""Where the learner's time goes, beyond the loss itself (one process, one thread).

    python benchmarks/profile_update.py                 # stages and counts, all workloads
    python benchmarks/profile_update.py --part overhead --workloads ppo

Parts (printed; benchmarks/README.md, "Where the time goes"):
- ``stages``: thread CPU time of each stage of an update (forward, backward, clip, step, the learner's checks),
  medians over interleaved updates; the learners run their real ``update``, its calls wrapped by a
  ``harness.StageClock``, so no copy of its body can drift from it.
- ``overhead``: case a's contenders with a near-free loss (``NullLoss``): the loop's own cost plus what the learner
  adds, interleaved, in us per update.
- ``counts``: exact: Python calls (cProfile) and aten operations (a ``TorchDispatchMode``) per update, the hand
  loop against each learner, with the operations the learner adds by name.
(The ``pieces`` and ``cprofile`` parts behind the 2026-11-30 proposals were removed in #68: ``git show
ee9944b:benchmarks/profile_update.py`` has them.)
"""

from __future__ import annotations

import collections
import cProfile
import os
import pstats
import time

os.environ["OMP_NUM_THREADS"] = "1"
os.environ.setdefault("RL_WARNINGS", "False")

import common
import harness
import torch
from tensordict import TensorDictBase
from torch import nn

from fabric_learner import FabricLearner, LocalLearner


class NullLoss(nn.Module):
    """The real loss's parameters and output keys, with a near-free forward: every loss entry is
    ``c + 0 * sum(p.sum())``, so backward reaches every parameter (clip and Adam do their full work)."""

    def __init__(self, real: nn.Module, template: TensorDictBase):
        super().__init__()
        self.real, self.template = real, template.detach().clone()
        self.params = [p for p in real.parameters() if p.requires_grad]

    def forward(self, td):
        zero = torch.stack([p.sum() for p in self.params]).sum() * 0.0
        out = self.template.clone(recurse=False)
        for k in out.keys():
            if isinstance(k, str) and k.startswith("loss"):
                out.set(k, out.get(k) + zero)
        return out


def contenders(name: str, loss=lambda name: common.make_loss(name)[0]) -> dict:
    """Case a's contenders (hand torchrl loop, hand Fabric loop, both learners) on ``loss(name)``."""
    return {"hand torchrl loop": common.HandTorchrl(loss(name)), "hand Fabric loop": common.HandFabric(loss(name)),
            "LocalLearner": LocalLearner(loss(name), clip_grad_norm=common.CLIP),
            "FabricLearner(cpu,1)": FabricLearner(loss(name), clip_grad_norm=common.CLIP, accelerator="cpu", devices=1)}


def null_loss(name: str) -> NullLoss:
    real = common.make_loss(name)[0]
    return NullLoss(real, real(common.make_batch(name)))


def part_overhead(workloads, reps: int, inner: int) -> None:
    print(f"== overhead: near-free loss forward; us/update, median over {reps} interleaved repetitions of {inner} "
          "updates;\n   cpu = process CPU time, wall = perf_counter; min = least disturbed block")
    for name in workloads:
        batches, cpu = common.make_batches(name), {}
        steps = {label: (lambda i, c=c: c.update(batches[i % len(batches)]))
                 for label, c in contenders(name, null_loss).items()}
        wall = harness.interleaved(steps, reps=reps, inner=inner, warmup=20, cpu=cpu)
        print(f"-- {name}: {common.WORKLOAD_DESC[name]}")
        for clock, s in (("cpu", cpu), ("wall", wall)):
            for stat, agg in (("min", min), ("median", harness.median)):
                base, base_f = agg(s["hand torchrl loop"]) * 1e6, agg(s["hand Fabric loop"]) * 1e6
                for c, xs in s.items():
                    m = agg(xs) * 1e6
                    print(f"   {clock:4s} {stat:6s} {c:28s} {m:8.0f} us   vs hand torchrl {m - base:+6.0f} us"
                          + (f"   vs hand Fabric {m - base_f:+6.0f} us" if c.startswith("Fabric") else ""))


STAGES = ("batch checks", "forward", "sum losses", "backward", "detach output", "clip", "set grad_norm",
          "non-finite check", "optimizer step", "zero_grad", "rest + wrappers")
HAND_STAGES = ("forward", "sum losses", "backward", "clip", "optimizer step", "zero_grad")


def _stage_steps(name: str):
    """Per contender, ``run(td) -> {stage: CPU ns}`` for one update. The learners run their real ``update`` with
    its methods and module functions wrapped by a ``StageClock``; "rest + wrappers" is the total beyond the timed
    stages (bookkeeping, freeing the update's locals on return, the clock's reads), for the hand loops too."""
    import fabric_learner.learner as learner_module

    def hand(h, backward, clip):
        forward = h.module if hasattr(h, "module") else h.loss

        def update(td, marks):  # its locals (the output, the graph) are freed on return, inside the total
            marks.append(time.thread_time_ns())
            out = forward(td)
            marks.append(time.thread_time_ns())
            loss = common.summed_loss(out)
            marks.append(time.thread_time_ns())
            backward(h, loss)
            marks.append(time.thread_time_ns())
            clip(h)
            marks.append(time.thread_time_ns())
            h.opt.step()
            marks.append(time.thread_time_ns())
            h.opt.zero_grad()
            marks.append(time.thread_time_ns())

        def run(td):
            marks, t = [], time.thread_time_ns()
            update(td, marks)
            total = time.thread_time_ns() - t
            stages = dict(zip(HAND_STAGES, (b - a for a, b in zip(marks, marks[1:]))))
            return {**stages, "rest + wrappers": total - sum(stages.values())}
        return run

    def learner(lr):
        for td in common.make_batches(name, count=2):
            lr.update(td)  # past the one-time coverage check
        clock = harness.StageClock(ns=time.thread_time_ns)
        for attr, stage in (("_forward", "forward"), ("_backward", "backward"), ("_clip_gradients", "clip"),
                            ("_refuse_step", "non-finite check"), ("_optimizer_step", "optimizer step")):
            object.__setattr__(lr, attr, clock.wrap(stage, getattr(lr, attr)))
        lr._torch_optimizer.zero_grad = clock.wrap("zero_grad", lr._torch_optimizer.zero_grad)
        functions = {"check_batch": "batch checks", "total_loss": "sum losses", "detached": "detach output",
                     "reported_norm": "set grad_norm", "set_entry": "set grad_norm"}

        def run(td):
            originals = {f: getattr(learner_module, f) for f in functions}
            for f, stage in functions.items():
                setattr(learner_module, f, clock.wrap(stage, originals[f]))
            clock.ns = {}
            t = time.thread_time_ns()
            try:
                lr.update(td)
            finally:
                total = time.thread_time_ns() - t
                for f, fn in originals.items():
                    setattr(learner_module, f, fn)
            return {**clock.ns, "rest + wrappers": total - sum(clock.ns.values())}
        return run

    c = contenders(name)
    return {"hand torchrl loop": hand(c["hand torchrl loop"], lambda h, loss: loss.backward(),
                                      lambda h: torch.nn.utils.clip_grad_norm_(h.params, h.clip)),
            "hand Fabric loop": hand(c["hand Fabric loop"], lambda h, loss: h.fabric.backward(loss),
                                     lambda h: h.fabric.clip_gradients(h.module, h.opt, max_norm=h.clip)),
            "LocalLearner": learner(c["LocalLearner"]), "FabricLearner(cpu,1)": learner(c["FabricLearner(cpu,1)"])}


def part_stages(workloads, n: int) -> None:
    """Median CPU time of each stage over ``n`` interleaved updates; robust to preemption spikes."""
    print(f"== stages: median CPU us per call over {n} updates (contenders alternate update by update)")
    for name in workloads:
        steps, batches = _stage_steps(name), common.make_batches(name)
        samples = {c: {s: [] for s in STAGES} for c in steps}
        for i in range(n + 10):
            for c in harness.order_for(i, list(steps)):
                stages = steps[c](batches[i % len(batches)])
                if i >= 10:
                    for stage, ns in stages.items():
                        samples[c][stage].append(ns / 1e3)
        med = {c: {s: harness.median(v) for s, v in st.items() if v} for c, st in samples.items()}
        totals = {c: sum(med[c].values()) for c in steps}
        print(f"-- {name}: {common.WORKLOAD_DESC[name]}\n" + harness.table(
            ("stage", *steps), [(s, *(f"{med[c][s]:.1f}" if s in med[c] else "-" for c in steps)) for s in STAGES]
            + [("sum of stages", *(f"{totals[c]:.1f}" for c in steps)),
               ("vs hand torchrl", *(f"{totals[c] - totals['hand torchrl loop']:+.1f}" for c in steps))]))


def part_counts(workloads, n: int) -> None:
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountOps(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[str(func)] += 1
            return func(*args, **(kwargs or {}))

    print(f"== counts: per update over {n} updates (exact)")
    for name in workloads:
        batches, rows = common.make_batches(name), {}
        for label, m in contenders(name).items():
            if label == "hand Fabric loop":
                continue
            for i in range(5):
                m.update(batches[i % 4])
            pr = cProfile.Profile()
            pr.enable()
            for i in range(n):
                m.update(batches[i % 4])
            pr.disable()
            with CountOps() as counter:
                for i in range(n):
                    m.update(batches[i % 4])
            rows[label] = (pstats.Stats(pr).total_calls / n, counter.ops)
        hand_calls, hand_ops = rows["hand torchrl loop"]
        print(f"-- {name}: {common.WORKLOAD_DESC[name]}")
        for label, (calls, ops) in rows.items():
            extra = {op: (ops[op] - hand_ops[op]) / n for op in set(ops) | set(hand_ops) if ops[op] != hand_ops[op]}
            print(f"   {label:28s} Python calls {calls:8.1f} ({calls - hand_calls:+6.1f})   aten ops "
                  f"{sum(ops.values()) / n:6.1f} ({(sum(ops.values()) - sum(hand_ops.values())) / n:+5.1f})"
                  + (f"   {dict(sorted(extra.items()))}" if extra else ""))


def parser():
    p = harness.parser(__doc__)
    p.add_argument("--part", default="stages,counts", help="any of stages,overhead,counts")
    p.add_argument("--workloads", default=",".join(common.WORKLOADS))
    p.add_argument("--reps", type=int, default=15, help="overhead: repetitions")
    p.add_argument("--inner", type=int, default=20, help="overhead: updates per repetition")
    p.add_argument("--n", type=int, default=50, help="counts: updates counted")
    p.add_argument("--stage-n", type=int, default=300, help="stages: updates per contender")
    return p


def main(argv=None) -> None:
    args = parser().parse_args(argv)
    harness.setup()
    workloads, parts = [w for w in args.workloads.split(",") if w], set(args.part.split(","))
    if "stages" in parts:
        part_stages(workloads, args.stage_n)
    if "overhead" in parts:
        part_overhead(workloads, args.reps, args.inner)
    if "counts" in parts:
        part_counts(workloads, args.n)


if __name__ == "__main__":
    main()
