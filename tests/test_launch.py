"""The same script under each launcher: plain python (the learner spawns rank 1), fabric run, torchrun."""

from __future__ import annotations

import json
import os
import re

import pytest
from multiproc import WORKERS, fabric_run, python, run, torchrun

SCRIPT = os.path.join(WORKERS, "launch_script.py")

MODES = {
    "python-ddp": (python(SCRIPT), {"FL_MODE": "plain-ddp"}, False),
    "python-fsdp": (python(SCRIPT), {"FL_MODE": "plain-fsdp"}, True),
    "fabric-run-ddp": (fabric_run(SCRIPT), {"FL_MODE": "external"}, False),
    "fabric-run-fsdp": (fabric_run(SCRIPT, strategy="fsdp"), {"FL_MODE": "external"}, True),
    "torchrun-ddp": (torchrun(SCRIPT), {"FL_MODE": "external"}, False),
    "torchrun-fsdp": (torchrun(SCRIPT), {"FL_MODE": "external", "FL_STRATEGY": "fsdp"}, True),
}


def results(stdout):
    # ranks share one pipe, so their lines may interleave
    return sorted((json.loads(m) for m in re.findall(r"RESULT (\{[^}]*\})", stdout)), key=lambda r: r["rank"])


@pytest.mark.parametrize("mode", list(MODES))
def test_script_runs_under_each_launcher(mode):
    cmd, env, sharded = MODES[mode]
    proc = run(cmd, timeout=240, **env)
    assert proc.returncode == 0, proc.stdout[-5000:]
    assert proc.leftovers == 0, "processes were left running"
    ranks = results(proc.stdout)
    assert [r["rank"] for r in ranks] == [0, 1], proc.stdout[-3000:]
    for r in ranks:
        assert r["world_size"] == 2 and r["sharded"] == sharded and r["updates"] == 3
    assert ranks[0]["checksum"] == ranks[1]["checksum"]  # ranks agree


@pytest.mark.parametrize("mode", ["python-ddp", "torchrun-ddp"])
@pytest.mark.parametrize("fail_rank", [0, 1])
def test_a_failing_rank_ends_every_process_promptly(mode, fail_rank):
    cmd, env, _ = MODES[mode]
    proc = run(cmd, timeout=240, FL_FAIL_RANK=str(fail_rank), **env)
    assert proc.returncode != 0, proc.stdout[-3000:]
    assert proc.leftovers == 0, "processes were left running"
    assert f"rank {fail_rank} fails on purpose" in proc.stdout
    assert f"rank {fail_rank} failed" in proc.stdout or f"rank {fail_rank} exited" in proc.stdout \
        or "Root Cause" in proc.stdout, proc.stdout[-3000:]
