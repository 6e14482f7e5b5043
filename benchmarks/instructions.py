"""Where case a's update goes: instructions per update under callgrind, or (``--profile``) stages, calls and ops.

    python benchmarks/instructions.py                          # PPO, DQN, SAC under valgrind: ~30 min on 2 cores
    python benchmarks/instructions.py --profile stages,counts  # thread CPU per stage; Python calls and aten ops
    python benchmarks/instructions.py --profile overhead       # the learners' fixed cost with a near-free loss

Needs valgrind and gcc unless ``--profile``; writes ``results/instructions.json``. Method and reading:
benchmarks/README.md, "Instructions per update" and "Where the time goes".
"""
from __future__ import annotations

import collections
import cProfile
import ctypes
import gc
import glob
import os
import pstats
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

os.environ["OMP_NUM_THREADS"] = "1"
os.environ.setdefault("RL_WARNINGS", "False")

import common
import harness
import torch

HELPER = r"""
#include <valgrind/callgrind.h>
void block_start(void) { CALLGRIND_ZERO_STATS; CALLGRIND_START_INSTRUMENTATION; }
void block_end(const char *name) { CALLGRIND_STOP_INSTRUMENTATION; CALLGRIND_DUMP_STATS_AT(name); }
"""
# key in the dump's name -> (row label, baseline key, goal): the goals of case a
CONTENDERS = {
    "hand": ("hand torchrl loop", None, None),
    "twin": ("hand torchrl loop (twin)", "hand", None),
    "local": ("LocalLearner.update", "hand", 1.03),
    "fabric": ("FabricLearner(cpu,1).update", "hand", 1.02),
}
_TRIGGER = "desc: Trigger: Client Request: "


def _child(lib: str, name: str, reps: int, updates: int, warmup: int) -> None:
    """Under valgrind: build the contenders of one workload and count each block of updates."""
    harness.set_one_thread(quiet=True)
    helper = ctypes.CDLL(lib)
    batches = common.make_batches(name)
    builders = common.case_a_contenders(name)
    steps = {key: harness.rotating(builders[label], batches) for key, (label, _, _) in CONTENDERS.items()}
    calls = dict.fromkeys(steps, 0)
    for key, step in steps.items():
        for _ in range(warmup * harness.INSTANCES):
            step(calls[key])
            calls[key] += 1
    gc.collect()
    gc.freeze()  # as harness.interleaved: collections between repetitions, never inside a block
    for rep in range(reps):
        gc.collect()
        gc.disable()
        for key in harness.order_for(rep, list(steps)):
            step, i0 = steps[key], calls[key]
            block = f"{key}:{rep}".encode()
            helper.block_start()
            for i in range(i0, i0 + updates):
                step(i)
            helper.block_end(block)
            calls[key] = i0 + updates
        gc.enable()


def measure(name: str, reps: int, updates: int, warmup: int, lib: str, timeout_s: int) -> dict[str, list[float]]:
    """Instructions per update of each contender on workload ``name``, one sample per repetition."""
    found: dict[str, dict[int, int]] = {}
    with tempfile.TemporaryDirectory() as folder:
        cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={folder}/callgrind.out.%p",
               sys.executable, os.path.abspath(__file__), "--child", lib, "--workloads", name,
               "--reps", str(reps), "--updates", str(updates), "--warmup", str(warmup)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        if done.returncode != 0:
            raise RuntimeError(f"the callgrind run of {name} failed ({done.returncode}):\n{done.stderr[-4000:]}")
        for path in glob.glob(os.path.join(folder, "callgrind.out.*")):
            block = total = None
            with open(path) as f:
                for line in f:
                    if line.startswith(_TRIGGER):
                        block = line[len(_TRIGGER):].strip()
                    elif line.startswith("totals:"):
                        total = int(line.split()[1])
            if block is not None and total is not None:  # the dump at exit has another trigger
                key, rep = block.rsplit(":", 1)
                found.setdefault(key, {})[int(rep)] = total
    counts = {key: [by_rep[r] for r in sorted(by_rep)] for key, by_rep in found.items()}
    if sorted(counts) != sorted(CONTENDERS) or any(len(v) != reps for v in counts.values()):
        raise RuntimeError(f"expected {reps} blocks of each of {sorted(CONTENDERS)}, found "
                           f"{ {k: len(v) for k, v in counts.items()} }")
    return {key: [total / updates for total in totals] for key, totals in counts.items()}


def rows_for(name: str, per_update: dict[str, list[float]]) -> list[dict]:
    """Each contender against its baseline: the median ratio over paired blocks and their range (a few nearly
    deterministic blocks make a bootstrap interval no more than it); ``within_goal``: all of it within case a's
    goal, a statement about instructions, not about time."""
    rows = []
    for key, (label, base, goal) in CONTENDERS.items():
        if base is None:
            continue
        num, den = per_update[key], per_update[base]
        ratios = [a / b for a, b in zip(num, den, strict=True)]
        rows.append({
            "workload": name, "contender": label, "baseline": CONTENDERS[base][0],
            "instructions_per_update": statistics.median(num), "baseline_per_update": statistics.median(den),
            "extra_per_update": statistics.median(num) - statistics.median(den),
            "ratio": harness.paired_ratio(num, den), "range": [min(ratios), max(ratios)], "goal": goal,
            "within_goal": None if goal is None else max(ratios) <= goal,
        })
    return rows


def count(args) -> int:
    """Every workload counted under valgrind (one process each, ``os.cpu_count()`` at once)."""
    missing = [tool for tool in ("valgrind", "gcc") if shutil.which(tool) is None]
    if missing:
        print(f"benchmarks/instructions.py needs {' and '.join(missing)} (Debian: apt install valgrind gcc); "
              "nothing was measured.", file=sys.stderr)
        return 2
    started, machine = time.time(), harness.machine()  # the code as it is when the counting starts
    names = args.workloads.split(",")
    with tempfile.TemporaryDirectory() as build:
        lib, source = os.path.join(build, "callgrind_blocks.so"), os.path.join(build, "callgrind_blocks.c")
        with open(source, "w") as f:
            f.write(HELPER)
        subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", lib, source], check=True)

        def one(name: str) -> dict[str, list[float]] | Exception:
            try:
                per_update = measure(name, args.reps, args.updates, args.warmup, lib, 2400)
            except (RuntimeError, subprocess.TimeoutExpired) as err:  # the other workloads still count
                print(f"-- {name}: failed: {err}", flush=True)
                return err
            harness.show(rows_for(name, per_update))
            return per_update

        with ThreadPoolExecutor(os.cpu_count() or 1) as pool:  # one valgrind process per workload
            measured = dict(zip(names, pool.map(one, names), strict=True))
    counted = {name: value for name, value in measured.items() if not isinstance(value, Exception)}
    result = {"rows": [row for name, value in counted.items() for row in rows_for(name, value)],
              "per_update": counted, "failed": [name for name in names if name not in counted],
              "reps": args.reps, "updates": args.updates, "warmup": args.warmup,
              "seconds": round(time.time() - started), "machine": machine,
              "valgrind": subprocess.run(["valgrind", "--version"], capture_output=True, text=True).stdout.strip()}
    harness.write_result(args.out, result)
    return 1 if result["failed"] else 0


# ---- the profile (--profile): printed, not stored ----------------------------------------------------


class NullLoss(torch.nn.Module):
    """The real loss's parameters and output keys, with a near-free forward: every loss entry is
    ``c + 0 * sum(p.sum())``, so backward reaches every parameter (clip and Adam do their full work)."""

    def __init__(self, real: torch.nn.Module, name: str):
        super().__init__()
        self.real, self.template = real, real(common.make_batch(name)).detach().clone()
        self.params = [p for p in real.parameters() if p.requires_grad]

    def forward(self, td):
        zero = torch.stack([p.sum() for p in self.params]).sum() * 0.0
        out = self.template.clone(recurse=False)
        for k in out.keys():
            if isinstance(k, str) and k.startswith("loss"):
                out.set(k, out.get(k) + zero)
        return out


def contenders(name: str, null: bool = False) -> dict:
    """Case a's contenders but the twin, one copy each, on the real loss or (``null``) on ``NullLoss``."""
    loss = (lambda n: NullLoss(common.make_loss(n)[0], n)) if null else (lambda n: common.make_loss(n)[0])
    built = common.case_a_contenders(name, loss)
    return {label.removesuffix(".update"): built[label]() for label in built if "twin" not in label}


STAGES = ("batch checks", "forward", "sum losses", "backward", "detach output", "clip", "set grad_norm",
          "non-finite check", "optimizer step", "zero_grad", "rest + wrappers")
HAND_STAGES = ("forward", "sum losses", "backward", "clip", "optimizer step", "zero_grad")


def _stage_steps(name: str):
    """Per contender, ``run(td) -> {stage: CPU ns}`` for one update. The learners run their real ``update``, its
    methods and module functions wrapped by a ``StageClock``; "rest + wrappers" is the total beyond the timed
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


def profile(parts: set[str], workloads: list[str]) -> None:
    """``stages``: median thread CPU µs of each stage over 300 updates, the contenders alternating update by update;
    ``overhead``: µs per update with ``NullLoss``, 15 interleaved repetitions of 20; ``counts``: exact Python calls
    (cProfile) and aten operations per update over 50, with the operations the learner adds by name."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountOps(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[str(func)] += 1
            return func(*args, **(kwargs or {}))

    for name in workloads:
        batches = common.make_batches(name)
        print(f"-- {name}: {common.WORKLOAD_DESC[name]}")
        if "stages" in parts:
            steps = _stage_steps(name)
            samples = {c: {s: [] for s in STAGES} for c in steps}
            for i in range(310):
                for c in harness.order_for(i, list(steps)):
                    for stage, ns in steps[c](batches[i % len(batches)]).items():
                        if i >= 10:
                            samples[c][stage].append(ns / 1e3)
            med = {c: {s: harness.median(v) for s, v in st.items() if v} for c, st in samples.items()}
            totals = {c: sum(med[c].values()) for c in steps}
            print("stages, median CPU µs per call\n" + harness.table(
                ("stage", *steps), [(s, *(f"{med[c][s]:.1f}" if s in med[c] else "-" for c in steps)) for s in STAGES]
                + [("sum of stages", *(f"{totals[c]:.1f}" for c in steps)),
                   ("vs hand torchrl", *(f"{totals[c] - totals['hand torchrl loop']:+.1f}" for c in steps))]))
        if "overhead" in parts:
            cpu = {}
            wall = harness.interleaved({label: (lambda i, c=c: c.update(batches[i % len(batches)]))
                                        for label, c in contenders(name, null=True).items()},
                                       reps=15, inner=20, warmup=20, cpu=cpu)
            rows = []
            for clock, s in (("cpu", cpu), ("wall", wall)):
                for stat, agg in (("min", min), ("median", harness.median)):
                    hand = agg(s["hand torchrl loop"])
                    rows.append((clock, stat, *(f"{agg(xs) * 1e6:.0f} ({(agg(xs) - hand) * 1e6:+.0f})" for xs in s.values())))
            print("near-free loss: µs per update (against the hand torchrl loop), 15 blocks of 20\n"
                  + harness.table(("clock", "statistic", *wall), rows))
        if "counts" in parts:
            rows = {}
            for label, m in contenders(name).items():
                if label == "hand Fabric loop":
                    continue
                for i in range(5):
                    m.update(batches[i % 4])
                pr = cProfile.Profile()
                pr.enable()
                for i in range(50):
                    m.update(batches[i % 4])
                pr.disable()
                with CountOps() as counter:
                    for i in range(50):
                        m.update(batches[i % 4])
                rows[label] = (pstats.Stats(pr).total_calls / 50, counter.ops)
            hand_calls, hand_ops = rows["hand torchrl loop"]
            for label, (calls, ops) in rows.items():
                extra = {op: (ops[op] - hand_ops[op]) / 50 for op in set(ops) | set(hand_ops) if ops[op] != hand_ops[op]}
                print(f"   {label:28s} Python calls {calls:8.1f} ({calls - hand_calls:+6.1f})   aten ops "
                      f"{sum(ops.values()) / 50:6.1f} ({(sum(ops.values()) - sum(hand_ops.values())) / 50:+5.1f})"
                      + (f"   {dict(sorted(extra.items()))}" if extra else ""))


def parser():
    p = harness.parser(__doc__, "instructions.json")
    p.add_argument("--workloads", default="ppo,dqn,sac")
    p.add_argument("--reps", type=int, default=3, help="blocks per contender (default 3)")
    p.add_argument("--updates", type=int, default=harness.INSTANCES,
                   help="updates per block, a multiple of the copies (default: one per copy)")
    p.add_argument("--warmup", type=int, default=2, help="updates per copy before counting (default 2)")
    p.add_argument("--profile", help="instead of counting instructions, any of stages,overhead,counts (printed)")
    p.add_argument("--child", help="the helper library: count one workload, under valgrind")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.updates % harness.INSTANCES:
        p.error(f"--updates must be a multiple of the {harness.INSTANCES} copies, so that every block "
                "holds each copy equally often")
    if args.child:
        return _child(args.child, args.workloads, args.reps, args.updates, args.warmup) or 0
    if args.profile:
        harness.set_one_thread(quiet=True)
        return profile(set(args.profile.split(",")), args.workloads.split(",")) or 0
    return count(args)


if __name__ == "__main__":
    sys.exit(main())
