"""Running multi-rank programs from tests: bounded in time, nothing left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKERS = os.path.join(ROOT, "tests", "workers")


def env(**extra):
    e = dict(os.environ)
    e.update({"OMP_NUM_THREADS": "1", "RL_WARNINGS": "False", "PYTHONPATH": ROOT, **extra})
    for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR", "LT_CLI_USED", "TORCHELASTIC_RUN_ID"):
        e.pop(key, None)
    return e


def run(cmd, timeout=300, **extra) -> subprocess.CompletedProcess:
    """Run ``cmd`` in its own session; on timeout kill the whole process group and fail."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env(**extra), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"{cmd} did not finish within {timeout}s:\n{out[-4000:]}") from None
    finally:
        _kill_group(proc.pid)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, None)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def python(*args):
    return [sys.executable, *args]


def torchrun(*args, nproc=2):
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--master-port=0", *args]


def fabric_run(*args, devices=2):
    fabric = os.path.join(os.path.dirname(sys.executable), "fabric")
    return [fabric, "run", "--accelerator=cpu", "--strategy=ddp", f"--devices={devices}", *args]
