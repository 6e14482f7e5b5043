"""Instructions per update, counted by valgrind's callgrind: the learner's own work against the hand-written loop's.

    python benchmarks/instructions.py                          # PPO, DQN, SAC: ~30 min on 2 cores
    python benchmarks/instructions.py --workloads ppo --reps 2

Case a of ``run.py`` times the learner to about ±1%, but two identical copies of a contender differ by 1-3% in
time on a shared host; the instructions a block of updates executes do not depend on the host's load (the A/A twin
lands within a few tenths of a percent). Instructions are not time (cache misses, mispredictions and stalls are not
counted): read these ratios beside case a's, not instead of them. The script starts itself again under
``valgrind --tool=callgrind --instr-atstart=no``; a four-line C helper (compiled with gcc against
``callgrind.h``) switches instrumentation on around each block of ``--updates`` updates and dumps its count. The
contenders are case a's (five copies each, taking turns) with the hand loop's twin; after ``--warmup`` updates per
copy the blocks take turns in ``harness.order_for``'s order, the garbage collector running between repetitions.
Reported: the median ratio over paired blocks and their range. Needs valgrind (with its headers) and gcc; writes
``results/instructions.json``.
"""
from __future__ import annotations

import ctypes
import gc
import glob
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

import harness

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
    import warnings

    warnings.filterwarnings("ignore")
    import common

    harness.set_one_thread()
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


def measure(name: str, reps: int, updates: int, warmup: int, lib: str, timeout_s: int) -> dict[str, list[float]]:
    """Instructions per update of each contender on workload ``name``, one sample per repetition."""
    with tempfile.TemporaryDirectory() as folder:
        cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={folder}/callgrind.out.%p",
               sys.executable, os.path.abspath(__file__), "--child", lib, "--workloads", name,
               "--reps", str(reps), "--updates", str(updates), "--warmup", str(warmup)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        if done.returncode != 0:
            raise RuntimeError(f"the callgrind run of {name} failed ({done.returncode}):\n{done.stderr[-4000:]}")
        counts = _counts(folder)
    if sorted(counts) != sorted(CONTENDERS) or any(len(v) != reps for v in counts.values()):
        raise RuntimeError(f"expected {reps} blocks of each of {sorted(CONTENDERS)}, found "
                           f"{ {k: len(v) for k, v in counts.items()} }")
    return {key: [total / updates for total in totals] for key, totals in counts.items()}


def rows_for(name: str, per_update: dict[str, list[float]]) -> list[dict]:
    """Each contender against its baseline: the median ratio over paired blocks and their range.

    A few nearly deterministic blocks make a bootstrap interval no more than their range, so the
    range is what is reported, and ``within_goal`` says whether all of it lies within case a's
    goal: a statement about instructions, not about time.
    """
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


def _report(name: str, per_update: dict[str, list[float]], rows: list[dict], reps: int, updates: int) -> str:
    lines = [f"-- {name}: instructions per update (median of {reps} blocks of {updates})"]
    lines += [f"   {CONTENDERS[key][0]:30s} {statistics.median(per_update[key]) / 1e6:9.3f} M" for key in CONTENDERS]
    for row in rows:
        lo, hi = row["range"]
        lines.append(f"   {row['contender']:30s} / hand: {row['ratio']:.4f} (blocks {lo:.4f}-{hi:.4f}, "
                     f"{row['extra_per_update'] / 1e3:+.0f} k)  goal {row['goal']}  within: {row['within_goal']}")
    return "\n".join(lines)


def parser():
    p = harness.parser(__doc__, "instructions.json")
    p.add_argument("--workloads", default="ppo,dqn,sac")
    p.add_argument("--reps", type=int, default=3, help="blocks per contender (default 3)")
    p.add_argument("--updates", type=int, default=harness.INSTANCES,
                   help="updates per block, a multiple of the copies (default: one per copy)")
    p.add_argument("--warmup", type=int, default=2, help="updates per copy before counting (default 2)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="workloads counted at once")
    p.add_argument("--timeout", type=int, default=2400, help="seconds allowed per workload's run")
    p.add_argument("--child", help="the helper library: count one workload, under valgrind")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.updates % harness.INSTANCES:
        p.error(f"--updates must be a multiple of the {harness.INSTANCES} copies, so that every block "
                     "holds each copy equally often")
    if args.child:
        _child(args.child, args.workloads, args.reps, args.updates, args.warmup)
        return 0
    missing = [tool for tool in ("valgrind", "gcc") if shutil.which(tool) is None]
    if missing:
        print(f"benchmarks/instructions.py needs {' and '.join(missing)} (Debian: apt install valgrind gcc); "
              "nothing was measured.", file=sys.stderr)
        return 2
    started, machine = time.time(), harness.machine()  # the code as it is when the counting starts
    names = args.workloads.split(",")
    with tempfile.TemporaryDirectory() as build:
        lib = os.path.join(build, "callgrind_blocks.so")
        source = os.path.join(build, "callgrind_blocks.c")
        with open(source, "w") as f:
            f.write(HELPER)
        subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", lib, source], check=True)

        def one(name: str) -> dict[str, list[float]] | Exception:
            try:
                per_update = measure(name, args.reps, args.updates, args.warmup, lib, args.timeout)
            except (RuntimeError, subprocess.TimeoutExpired) as err:  # the other workloads still count
                print(f"-- {name}: failed: {err}", flush=True)
                return err
            print(_report(name, per_update, rows_for(name, per_update), args.reps, args.updates), flush=True)
            return per_update

        with ThreadPoolExecutor(args.jobs) as pool:  # one valgrind process per workload
            measured = dict(zip(names, pool.map(one, names), strict=True))
    counted = {name: value for name, value in measured.items() if not isinstance(value, Exception)}
    result = {"rows": [row for name, value in counted.items() for row in rows_for(name, value)],
              "per_update": counted, "failed": [name for name in names if name not in counted],
              "reps": args.reps, "updates": args.updates, "warmup": args.warmup,
              "seconds": round(time.time() - started), "machine": machine,
              "valgrind": subprocess.run(["valgrind", "--version"], capture_output=True, text=True).stdout.strip()}
    harness.write_result(args.out, result)
    print(f"wrote {args.out} ({result['seconds']} s)")
    return 1 if result["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
