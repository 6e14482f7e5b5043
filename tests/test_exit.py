"""Every multi-rank run exits cleanly: status 0, no hang, no leftover process, every time.

Each launcher runs the same short training script ten times; before the exit hook existed a
gloo run aborted or hung at exit in a fair share of runs (see README, "Ending a run").
"""

from __future__ import annotations

import os

import pytest
from multiproc import WORKERS, fabric_run, python, run, torchrun

SCRIPT = os.path.join(WORKERS, "launch_script.py")
RUNS = 10
PER_RUN_TIMEOUT = 150

MODES = {
    "python-ddp": (python(SCRIPT), {"FL_MODE": "plain-ddp"}),
    "fabric-run-ddp": (fabric_run(SCRIPT), {"FL_MODE": "external"}),
    "torchrun-ddp": (torchrun(SCRIPT), {"FL_MODE": "external"}),
    "python-fsdp": (python(SCRIPT), {"FL_MODE": "plain-fsdp"}),
    "fabric-run-fsdp": (fabric_run(SCRIPT, strategy="fsdp"), {"FL_MODE": "external"}),
    "torchrun-fsdp": (torchrun(SCRIPT), {"FL_MODE": "external", "FL_STRATEGY": "fsdp"}),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_ten_runs_all_exit_zero(mode):
    cmd, env = MODES[mode]
    failures = []
    for i in range(RUNS):
        # alternate the explicit close() and the exit hook for a script that simply returns
        proc = run(cmd, timeout=PER_RUN_TIMEOUT, FL_CLOSE=str(i % 2), **env)
        if proc.returncode != 0 or proc.leftovers or proc.stdout.count("RESULT ") != 2:
            failures.append(f"run {i}: status {proc.returncode}, {proc.leftovers} left over\n{proc.stdout[-2000:]}")
    assert not failures, "\n\n".join(failures)
