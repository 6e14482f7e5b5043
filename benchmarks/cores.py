"""The checks that need spare cores (`make test-cores`), one report: where 2 shared cores cannot answer them.

    python benchmarks/cores.py                        # both parts, report benchmarks/results/cores.json
    python benchmarks/cores.py --parts async_save     # one part; a later call adds the other to the report

- ``async_save``: the training loop's stall for an asynchronous sharded save against a blocking save
  (``benchmarks/async_save.py``: FSDP on 2 CPU ranks, goal at most 0.3). Its background writer needs a
  core beside each rank's: on 2 shared cores the figure measures waiting for a core.
- ``suite``: the wall seconds of ``make test``'s pytest command (2 xdist workers, the linter left out)
  on this machine, and its counts.

Refuses (exit 2, nothing run or written) where ``os.cpu_count()`` is under ``MIN_CORES``: 2 ranks and
their 2 writer threads, each with a core of its own.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import harness  # noqa: E402

MIN_CORES = 4
PARTS = ("async_save", "suite")
DEFAULT_REPORT = os.path.join(HERE, "results", "cores.json")
SUITE = ["-m", "pytest", "-q", "-n", "2", "--dist", "loadfile", "--no-loadscope-reorder", "-p", "no:cacheprovider"]


def refusal(cores: int | None) -> str | None:
    """The line refusing the run where this machine has too few cores, else ``None``."""
    if cores is not None and cores >= MIN_CORES:
        return None
    return (f"make test-cores: this machine has {cores} cores; these checks need at least {MIN_CORES} (2 ranks and "
            "their 2 background writers, each on a core of its own). Nothing was run or written: run it where "
            "os.cpu_count() allows, e.g. on the lent GPU machine (16 cores, docs/gpu.md).")


def async_save(reps: int) -> dict:
    with harness.scratch_path() as out:
        harness.run_bounded([sys.executable, os.path.join(HERE, "async_save.py"), "--out", out, "--reps", str(reps)],
                            420, "benchmarks/async_save.py")
        result = harness.read_json(out)
    return {key: result[key] for key in ("stall_over_sync", "ci95", "goal", "verdict", "median_s", "reps")
            if key in result}


def suite(timeout_s: float) -> dict:
    start = time.perf_counter()
    try:
        done = harness.run_bounded([sys.executable, *SUITE], timeout_s, "make test's pytest command", check=False)
    except RuntimeError as err:  # past timeout_s: that bound is the figure
        return {"seconds": None, "timed_out_after_s": timeout_s, "goal_s": 480, "tail": str(err)[-4000:]}
    seconds = time.perf_counter() - start
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    counts = {kind: int(n) for n, kind in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed)", summary)}
    return {"seconds": round(seconds, 1), "exit_status": done.returncode, "summary": summary, "counts": counts,
            "goal_s": 480, "tail": done.stdout[-4000:] if done.returncode else ""}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", default=",".join(PARTS), help="comma-separated, of: " + ", ".join(PARTS))
    parser.add_argument("--report", default=DEFAULT_REPORT)
    parser.add_argument("--reps", type=int, default=15, help="async_save's repetitions")
    parser.add_argument("--suite-timeout", type=float, default=540, help="seconds (a device call has 600 in all)")
    args = parser.parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.error(f"unknown parts {unknown}: choose from {', '.join(PARTS)}")
    line = refusal(os.cpu_count())
    if line:
        print(line, file=sys.stderr)
        return 2
    report = {}
    if os.path.exists(args.report):
        with open(args.report) as f:
            report = json.load(f)
    report.update({"what": "make test-cores: the checks that need spare cores", "machine": harness.machine()})
    for part in parts:
        start = time.perf_counter()
        report[part] = async_save(args.reps) if part == "async_save" else suite(args.suite_timeout)
        report[part]["when"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        report[part]["part_seconds"] = round(time.perf_counter() - start, 1)
        harness.write_json(args.report, report)
        print(f"{part}: {json.dumps({k: v for k, v in report[part].items() if k != 'tail'})}")
    failed = report.get("suite", {}).get("exit_status", 1) if "suite" in parts else 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
