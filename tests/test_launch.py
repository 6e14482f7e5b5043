"""The same script under each launcher: plain python (the learner spawns rank 1), fabric run, torchrun."""

from __future__ import annotations

import json
import os

import pytest
from multiproc import WORKERS, fabric_run, python, run, torchrun

SCRIPT = os.path.join(WORKERS, "launch_script.py")

MODES = {
    "python-ddp": (python(SCRIPT), {"FL_MODE": "plain-ddp"}, False),
    "python-fsdp": (python(SCRIPT), {"FL_MODE": "plain-fsdp"}, True),
    "fabric-run-ddp": (fabric_run(SCRIPT), {"FL_MODE": "external"}, False),
    "fabric-run-fsdp": (fabric_run(SCRIPT, strategy="fsdp"), {"FL_MODE": "external"}, True),
    "torchrun-ddp": (torchrun(SCRIPT), {"FL_MODE": "external"}, False),
}


def results(stdout):
    return sorted((json.loads(line.split("RESULT ", 1)[1]) for line in stdout.splitlines() if "RESULT " in line),
                  key=lambda r: r["rank"])


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
