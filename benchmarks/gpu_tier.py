"""The GPU tier in one command: every CUDA check of tests/gpu/cuda_checks.py, one report file.

    python benchmarks/gpu_tier.py                 # on a machine with a CUDA GPU (`make test-gpu`)
    python benchmarks/gpu_tier.py --dry-run       # the same checks with the CPU as the device

Writes ``results/gpu_tier.json`` (``--report``): per check its outcome (passed, failed with the error's tail, or
skipped with the reason), seconds and figures; the device, torch's and CUDA's versions, the machine. The NCCL
checks run where ``torch.cuda.device_count() >= 2``. Exits with pytest's status; without CUDA it refuses (exit 2,
nothing written) unless ``--dry-run``. Each check is bounded (``--check-timeout``), and the report is rewritten
after each phase of each check, so a run cut off at a device call's limit still sends back what it checked.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))

import harness  # noqa: E402

CHECKS = os.path.join(harness.ROOT, "tests", "gpu", "cuda_checks.py")
DEFAULT_REPORT = os.path.join(HERE, "results", "gpu_tier.json")


class Report:
    """A pytest plugin gathering each check's outcome, seconds and ``record_property`` figures, calling
    ``on_change`` after each, so a run cut off at a device call's limit still leaves what it checked."""

    def __init__(self, on_change=lambda: None) -> None:
        self.checks: dict[str, dict] = {}
        self.on_change = on_change

    def pytest_runtest_logreport(self, report) -> None:
        name = report.nodeid.split("::", 1)[-1]
        entry = self.checks.setdefault(name, {"outcome": "running", "seconds": 0.0, "figures": {}})
        entry["seconds"] = round(entry["seconds"] + report.duration, 3)
        entry["figures"].update(dict(report.user_properties))
        if report.when == "call" and report.passed:
            entry["outcome"] = "passed"
        elif report.skipped:
            entry["outcome"] = "skipped"
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            entry["reason"] = reason.removeprefix("Skipped: ")
        elif report.failed:
            entry["outcome"] = "failed"
            entry["error"] = str(report.longrepr)[-3000:]
        self.on_change()


def device_block(device: str) -> dict:
    import torch

    block = {"tier_device": device, "torch": torch.__version__, "cuda": torch.version.cuda,
             "cuda_available": torch.cuda.is_available(), "device_count": torch.cuda.device_count()}
    if device == "cuda":
        block["name"] = torch.cuda.get_device_name(0)
        block["capability"] = list(torch.cuda.get_device_capability(0))
        block["memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    else:
        block["name"] = "cpu (dry run)"
    return block


def parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true", help="run every check with the CPU as the device")
    p.add_argument("--report", default=DEFAULT_REPORT)
    p.add_argument("-k", default=None, help="only the checks matching this pytest -k expression")
    p.add_argument("--check-timeout", type=int, default=300, help="seconds one check may take (pytest-timeout)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    import pytest
    import torch

    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("make test-gpu: no CUDA device here (torch.cuda.is_available() is False); nothing was run or "
              "written. On a GPU machine run it there; here, `python benchmarks/gpu_tier.py --dry-run` runs the "
              "same checks on the CPU.", file=sys.stderr)
        return 2
    os.environ["FL_TIER_DEVICE"] = device
    os.environ.setdefault("RL_WARNINGS", "False")
    start = time.perf_counter()
    fixed = {"command": harness.command_line(),
             "what": "make test-gpu: the CUDA tier (tests/gpu/cuda_checks.py)" + (" as a CPU dry run" if args.dry_run else ""),
             "device": device_block(device), "machine": harness.machine()}

    def write(status: int | None) -> None:  # None: still running (the report so far)
        outcomes = [c["outcome"] for c in report.checks.values()]
        harness.write_json(args.report, {
            **fixed, "seconds": round(time.perf_counter() - start, 1), "exit_status": status,
            "counts": {k: outcomes.count(k) for k in ("passed", "failed", "skipped")}, "checks": report.checks})

    report = Report(on_change=lambda: write(None))
    status = int(pytest.main([CHECKS, "-q", "-p", "no:cacheprovider", "-o", f"timeout={args.check_timeout}",
                              *(["-k", args.k] if args.k else [])], plugins=[report]))
    write(status)
    outcomes = [c["outcome"] for c in report.checks.values()]
    print(f"gpu tier: {len(outcomes)} checks, {outcomes.count('passed')} passed, {outcomes.count('failed')} failed, "
          f"{outcomes.count('skipped')} skipped; report: {os.path.relpath(args.report, harness.ROOT)}")
    return status


if __name__ == "__main__":
    sys.exit(main())
