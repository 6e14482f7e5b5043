"""The checks that need spare cores (`make test-cores`), one report: where 2 shared cores cannot answer them.

    python benchmarks/cores.py                        # every part, report benchmarks/results/cores.json
    python benchmarks/cores.py --parts async_save     # one part; a later call adds the other to the report

Parts, the ``--budget`` and what fails the command: docs/gpu.md, "`make test-cores`". Refuses under 4 cores.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

import harness

MIN_CORES = 4
PARTS = ("async_save", "remote_learner", "suite")
_GOALS = ("remote_over_spmd", "remote_over_spmd_in_actors", "pipelined_updates_per_s_over_spmd_in_actors",
          "remote_over_its_ranks_own_time", "remote_over_torchrl_ray", "transfer_per_update")
# (name, workload, flags, figures kept): the compiled graph runs apart, since its channels stay open (and its actors'
# loops polling) for the whole run, beside every other contender
RUNS = (("ppo", "ppo", ("--torchrl",), _GOALS), ("dqn", "dqn", ("--torchrl",), _GOALS),
        ("ppo_compiled", "ppo", ("--compiled",), ("remote_compiled_over_spmd_in_actors", "remote_compiled_over_remote")))
MIN_PART_S = 60  # a part that finds less of the budget left is not started
SUITE = ["-m", "pytest", "-q", "-n", "2", "--dist", "loadfile", "--no-loadscope-reorder", "-p", "no:cacheprovider"]


def refusal(cores: int | None) -> str | None:
    """The line refusing the run where this machine has too few cores, else ``None``."""
    if cores is not None and cores >= MIN_CORES:
        return None
    return (f"make test-cores: this machine has {cores} cores; these checks need at least {MIN_CORES} (2 ranks and "
            "their 2 background writers, each on a core of its own). Nothing was run or written: run it where "
            "os.cpu_count() allows, e.g. on the lent GPU machine (16 cores, docs/gpu.md).")


def bounded(cmd: list[str], timeout_s: float, what: str) -> dict | None:
    """Runs ``cmd`` within ``timeout_s``: ``None`` when it succeeded, else what the report records instead."""
    try:
        harness.run_bounded(cmd, timeout_s, what)
    except RuntimeError as err:
        if "did not finish in" in str(err):
            return {"timed_out_after_s": round(timeout_s, 1), "tail": str(err)[-3000:]}
        return {"failed": str(err)[-3000:]}
    return None


def figures(script: str, args: list[str], keys: tuple[str, ...], timeout_s: float) -> dict:
    """``keys`` of what ``benchmarks/SCRIPT ARGS --out PATH`` writes, or what ``bounded`` records."""
    with harness.scratch_path() as out:
        problem = bounded([sys.executable, os.path.join(harness.HERE, script), *args, "--out", out], timeout_s,
                          f"benchmarks/{script} {' '.join(args)}")
        result = {} if problem else harness.read_json(out)
    return problem or {key: result[key] for key in keys if key in result}


def remote_learner(timeout_s: float) -> dict:
    try:
        import ray  # noqa: F401
    except ImportError:
        return {"skipped": "Ray is not installed here (make gpu-wheels packs it for the GPU machine: docs/gpu.md)"}
    deadline, result = time.perf_counter() + timeout_s, {}
    for name, workload, flags, keys in RUNS:
        left = deadline - time.perf_counter()
        result[name] = {"not_run": f"{max(left, 0):.0f} s of the part's {timeout_s:.0f} s left"} if left < MIN_PART_S / 2 \
            else figures("remote_learner.py", ["--workload", workload, "--quick", *flags], keys, left)
    return result


def suite(timeout_s: float) -> dict:
    start = time.perf_counter()
    try:
        done = harness.run_bounded([sys.executable, *SUITE], timeout_s, "make test's pytest command", check=False)
    except RuntimeError as err:  # past timeout_s: that bound is the figure
        return {"seconds": None, "timed_out_after_s": timeout_s, "goal_s": 480, "tail": str(err)[-4000:]}
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    counts = {kind: int(n) for n, kind in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed)", summary)}
    return {"seconds": round(time.perf_counter() - start, 1), "exit_status": done.returncode, "summary": summary,
            "counts": counts, "goal_s": 480, "tail": done.stdout[-4000:] if done.returncode else ""}


def failed(result: dict) -> bool:
    """Whether a part's result holds a failure (one not run for the budget, cut off at its bound, or skipped, is not)."""
    nested = [v for v in result.values() if isinstance(v, dict)]
    return "failed" in result or bool(result.get("exit_status")) or any(failed(v) for v in nested)


def parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--parts", default=",".join(PARTS), help="comma-separated, of: " + ", ".join(PARTS))
    p.add_argument("--report", default=os.path.join(harness.RESULTS, "cores.json"))
    p.add_argument("--reps", type=int, default=15, help="async_save's repetitions")
    p.add_argument("--suite-timeout", type=float, default=540, help="seconds (a device call has 600 in all)")
    p.add_argument("--budget", type=float, default=None, help="seconds for the whole command (default: none)")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    parts = [x for x in args.parts.split(",") if x]
    if set(parts) - set(PARTS):
        p.error(f"unknown parts {sorted(set(parts) - set(PARTS))}: choose from {', '.join(PARTS)}")
    line = refusal(os.cpu_count())
    if line:
        print(line, file=sys.stderr)
        return 2
    report = harness.read_json(args.report) if os.path.exists(args.report) else {}
    report.update({"command": harness.command_line(), "what": "make test-cores: the checks that need spare cores",
                   "machine": harness.machine()})
    deadline = time.perf_counter() + (args.budget if args.budget is not None else float("inf"))
    for part in parts:
        start = time.perf_counter()
        left = deadline - start
        bound = min({"async_save": 420, "remote_learner": 360, "suite": args.suite_timeout}[part], left)
        if left < MIN_PART_S:
            report[part] = {"not_run": f"{max(left, 0):.0f} s of the --budget {args.budget:.0f} s left"}
        elif part == "async_save":
            report[part] = figures("async_save.py", ["--reps", str(args.reps)],
                                   ("stall_over_sync", "ci95", "goal", "verdict", "median_s", "reps"), bound)
        else:
            report[part] = remote_learner(bound) if part == "remote_learner" else suite(bound)
        report[part].update(command=report["command"], when=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                            part_seconds=round(time.perf_counter() - start, 1))
        harness.write_json(args.report, report)
        print(f"{part}: {json.dumps({k: v for k, v in report[part].items() if k != 'tail'})}")
    return 1 if any(failed(report[part]) for part in parts) else 0


if __name__ == "__main__":
    sys.exit(main())
