"""The GPU tier in one command: every CUDA check of tests/gpu/cuda_checks.py, one report file.

    python benchmarks/gpu_tier.py                 # on a machine with a CUDA GPU (`make test-gpu`)
    python benchmarks/gpu_tier.py --dry-run       # the same checks with the CPU as the device
    python benchmarks/gpu_tier.py --pack-ray RAY_WHEEL OUT.tar.xz   # Ray's runtime, small enough to travel there

The report (``--report``, rewritten after each check's every phase) and the refusal without CUDA: docs/gpu.md.
"""
from __future__ import annotations

import argparse
import io
import os
import sys
import tarfile
import time
import zipfile

import harness

CHECKS = os.path.join(harness.ROOT, "tests", "gpu", "cuda_checks.py")
# what RemoteLearner does not use of Ray's wheel (76 MiB, over what travels to the GPU machine): left out by pack_ray
RAY_UNUSED = ("ray/jars/", "ray/rllib/", "ray/data/", "ray/serve/", "ray/llm/", "ray/tune/", "ray/train/",
              "ray/dashboard/client/")


def pack_ray(wheel: str, out: str) -> int:
    """Writes ``out`` (a .tar.xz, about 20 MiB) from the wheel's files less ``RAY_UNUSED``, their modes kept (the
    binaries stay executable); returns the bytes written. `make gpu-site` unpacks it beside the wheels."""
    import lzma

    with zipfile.ZipFile(wheel) as zf, lzma.open(out, "wb", preset=9) as xz, tarfile.open(fileobj=xz, mode="w") as tar:
        for entry in zf.infolist():
            if entry.is_dir() or entry.filename.startswith(RAY_UNUSED):
                continue
            data = zf.read(entry)
            info = tarfile.TarInfo(entry.filename)
            info.size, info.mode = len(data), (entry.external_attr >> 16) & 0o777 or 0o644
            info.mtime = time.mktime(entry.date_time + (0, 0, -1))
            tar.addfile(info, io.BytesIO(data))
    return os.path.getsize(out)


class Report:
    """A pytest plugin gathering each check's outcome, seconds and ``record_property`` figures, calling
    ``on_change`` after each."""

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
             "cuda_available": torch.cuda.is_available(), "device_count": torch.cuda.device_count(),
             "name": "cpu (dry run)"}
    if device == "cuda":
        block.update(name=torch.cuda.get_device_name(0), capability=list(torch.cuda.get_device_capability(0)),
                     memory_gib=round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1))
    return block


def parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true", help="run every check with the CPU as the device")
    p.add_argument("--report", default=os.path.join(harness.RESULTS, "gpu_tier.json"))
    p.add_argument("-k", default=None, help="only the checks matching this pytest -k expression")
    p.add_argument("--check-timeout", type=int, default=300, help="seconds one check may take (pytest-timeout)")
    p.add_argument("--pack-ray", nargs=2, metavar=("WHEEL", "OUT"), help="pack Ray's runtime (make gpu-wheels)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.pack_ray:
        print(f"{args.pack_ray[1]}: {pack_ray(*args.pack_ray) / 2**20:.1f} MiB")
        return 0
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
