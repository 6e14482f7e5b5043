"""Instructions per update, counted by valgrind's callgrind: the learner's own work against the
hand-written loop's, in a measure that nothing else running on the machine can change.

    python benchmarks/instructions.py                          # PPO, DQN, SAC: ~15 min on 2 cores
    python benchmarks/instructions.py --workloads ppo --reps 2

Why: case a of ``run.py`` times the learner against the hand loop to about ±1%, but on a shared
host two identical copies of one contender differ by 1-3% in time for their whole life, so a
learner that adds 1.5% cannot be told from one that adds 2.5% there. The number of instructions a
block of updates executes does not depend on the host's load: the hand loop's A/A twin lands
within a few tenths of a percent of it.

What it does not see: instructions are not time. Cache misses, branch mispredictions and stalls
cost cycles that are not counted, and the learner's extra Python calls need not run at the
loss's instructions per cycle. Read these ratios as the work the learner adds, beside case a's
time ratios, not instead of them.

How: the script starts itself again under ``valgrind --tool=callgrind --instr-atstart=no``, so
imports and set-up run uninstrumented (an update still takes about a second there, several
hundred times native, as every one under valgrind does). A four-line C helper,
compiled at run time with gcc against valgrind's ``callgrind.h``, switches instrumentation on
around each block of ``--updates`` updates and dumps that block's count under its name. The
contenders are case a's (same losses, seeds, batches, clipping, five copies each taking turns)
with the hand loop's A/A twin; each copy takes a warm-up update, then the blocks take turns in a
random order drawn anew each repetition (``common.order_for``), the garbage collector running
between repetitions and never inside a block, as in case a. Needs valgrind with its headers
(Debian's ``valgrind`` package) and gcc. Results: ``benchmarks/results/instructions.json``.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

os.environ["OMP_NUM_THREADS"] = "1"
os.environ.setdefault("RL_WARNINGS", "False")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

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
WARMUP = 1  # updates per copy before counting: the first creates Adam's state
_TRIGGER = "desc: Trigger: Client Request: "


def _child(lib: str, name: str, reps: int, updates: int) -> None:
    """Under valgrind: build the contenders of one workload and count each block of updates."""
    import warnings

    warnings.filterwarnings("ignore")
    import common
    from fabric_learner import FabricLearner, LocalLearner

    common.set_one_thread()
    helper = ctypes.CDLL(lib)
    batches = common.make_batches(name)

    def loss():
        return common.make_loss(name)[0]

    steps = {
        "hand": common.rotating(lambda: common.HandTorchrl(loss()), batches),
        "twin": common.rotating(lambda: common.HandTorchrl(loss()), batches),
        "local": common.rotating(lambda: LocalLearner(loss(), clip_grad_norm=common.CLIP), batches),
        "fabric": common.rotating(
            lambda: FabricLearner(loss(), clip_grad_norm=common.CLIP, accelerator="cpu", devices=1), batches),
    }
    calls = dict.fromkeys(steps, 0)
    for key, step in steps.items():
        for _ in range(WARMUP * common.INSTANCES):
            step(calls[key])
            calls[key] += 1
    gc.collect()
    gc.freeze()  # as common.interleaved: collections between repetitions, never inside a block
    for rep in range(reps):
        gc.collect()
        gc.disable()
        for key in common.order_for(rep, list(steps)):
            step, i0 = steps[key], calls[key]
            helper.block_start()
            for i in range(i0, i0 + updates):
                step(i)
            helper.block_end(f"{key}:{rep}".encode())
            calls[key] = i0 + updates
        gc.enable()


def _counts(folder: str) -> dict[str, list[int]]:
    """Instructions of each dumped block, by contender key, in repetition order."""
    found: dict[str, dict[int, int]] = {}
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
    return {key: [by_rep[r] for r in sorted(by_rep)] for key, by_rep in found.items()}


def measure(name: str, reps: int, updates: int, lib: str, timeout_s: int) -> dict[str, list[float]]:
    """Instructions per update of each contender on workload ``name``, one sample per repetition."""
    with tempfile.TemporaryDirectory() as folder:
        cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={folder}/callgrind.out.%p",
               sys.executable, os.path.abspath(__file__), "--child", lib, "--workloads", name,
               "--reps", str(reps), "--updates", str(updates)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        if done.returncode != 0:
            raise RuntimeError(f"the callgrind run of {name} failed ({done.returncode}):\n{done.stderr[-4000:]}")
        counts = _counts(folder)
    if sorted(counts) != sorted(CONTENDERS) or any(len(v) != reps for v in counts.values()):
        raise RuntimeError(f"expected {reps} blocks of each of {sorted(CONTENDERS)}, found "
                           f"{ {k: len(v) for k, v in counts.items()} }")
    return {key: [total / updates for total in totals] for key, totals in counts.items()}


def rows_for(name: str, per_update: dict[str, list[float]]) -> list[dict]:
    import common
    from run import decide

    rows = []
    for key, (label, base, goal) in CONTENDERS.items():
        if base is None:
            continue
        num, den = per_update[key], per_update[base]
        ratios = [a / b for a, b in zip(num, den, strict=True)]
        ci = common.bootstrap_ci(num, den)
        met = decide(ci, goal)
        rows.append({
            "workload": name, "contender": CONTENDERS[key][0], "baseline": CONTENDERS[base][0],
            "instructions_per_update": statistics.median(num), "baseline_per_update": statistics.median(den),
            "extra_per_update": statistics.median(num) - statistics.median(den),
            "ratio": statistics.median(ratios), "ci95": list(ci), "range": [min(ratios), max(ratios)], "goal": goal,
            "verdict": "-" if goal is None else {True: "met", False: "NOT met", None: "undecided"}[met],
        })
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="ppo,dqn,sac")
    parser.add_argument("--reps", type=int, default=3, help="blocks per contender (default 3)")
    parser.add_argument("--updates", type=int, default=5, help="updates per block (default 5: one per copy)")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "instructions.json"))
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="workloads counted at once")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds allowed per workload's run")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(args.child, args.workloads, args.reps, args.updates)
        return 0
    missing = [tool for tool in ("valgrind", "gcc") if shutil.which(tool) is None]
    if missing:
        print(f"benchmarks/instructions.py needs {' and '.join(missing)} (Debian: apt install valgrind gcc); "
              "nothing was measured.", file=sys.stderr)
        return 2
    import run

    started = time.time()
    rows = []
    with tempfile.TemporaryDirectory() as build:
        lib = os.path.join(build, "callgrind_blocks.so")
        source = os.path.join(build, "callgrind_blocks.c")
        with open(source, "w") as f:
            f.write(HELPER)
        subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", lib, source], check=True)
        names = args.workloads.split(",")

        def one(name: str) -> tuple[dict, list[dict]]:
            per_update = measure(name, args.reps, args.updates, lib, args.timeout)
            found = rows_for(name, per_update)
            lines = [f"-- {name}: instructions per update (median of {args.reps} blocks of {args.updates})"]
            lines += [f"   {CONTENDERS[key][0]:30s} {statistics.median(per_update[key]) / 1e6:9.3f} M" for key in CONTENDERS]
            for row in found:
                lo, hi = row["ci95"]
                lines.append(f"   {row['contender']:30s} / hand: {row['ratio']:.4f} [{lo:.4f}, {hi:.4f}] "
                             f"({row['extra_per_update'] / 1e3:+.0f} k)  goal {row['goal']}  {row['verdict']}")
            print("\n".join(lines), flush=True)
            return per_update, found

        with ThreadPoolExecutor(args.jobs) as pool:  # one valgrind process per workload
            measured = dict(zip(names, pool.map(one, names), strict=True))
        for name in names:
            rows += measured[name][1]
    result = {"rows": rows, "per_update": {name: measured[name][0] for name in names}, "reps": args.reps, "updates": args.updates, "warmup": WARMUP,
              "seconds": round(time.time() - started), "machine": run.machine(),
              "valgrind": subprocess.run(["valgrind", "--version"], capture_output=True, text=True).stdout.strip()}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out} ({result['seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
