"""One short training script under every launcher, ten times each: it runs, ranks agree, and
every run exits 0 with no hang and no process left behind; a failing rank ends every process.

Launchers: plain ``python`` (the learner starts rank 1 itself), ``fabric run`` and ``torchrun``,
each with DDP and FSDP. Before the exit hook existed a gloo run aborted or hung at exit in a
fair share of runs (see README, "Ending a run").
"""

from __future__ import annotations

import json
import os
import re
from concurrent.futures import ThreadPoolExecutor

import pytest
from multiproc import WORKERS, fabric_run, python, run, torchrun

SCRIPT = os.path.join(WORKERS, "launch_script.py")
RUNS = 10
PER_RUN_TIMEOUT = 180

# mode -> (command factory, environment, sharded)
MODES = {
    "python-ddp": (lambda: python(SCRIPT), {"FL_MODE": "plain-ddp"}, False),
    "fabric-run-ddp": (lambda: fabric_run(SCRIPT), {"FL_MODE": "external"}, False),
    "torchrun-ddp": (lambda: torchrun(SCRIPT), {"FL_MODE": "external"}, False),
    "python-fsdp": (lambda: python(SCRIPT), {"FL_MODE": "plain-fsdp"}, True),
    "fabric-run-fsdp": (lambda: fabric_run(SCRIPT, strategy="fsdp"), {"FL_MODE": "external"}, True),
    "torchrun-fsdp": (lambda: torchrun(SCRIPT), {"FL_MODE": "external", "FL_STRATEGY": "fsdp"}, True),
}


def results(stdout):
    # ranks share one pipe, so their lines may interleave
    return sorted((json.loads(m) for m in re.findall(r"RESULT (\{[^}]*\})", stdout)), key=lambda r: r["rank"])


def problems(proc, sharded) -> str | None:
    if proc.returncode != 0:
        return f"exit status {proc.returncode}"
    if proc.leftovers:
        return f"{proc.leftovers} processes left running"
    ranks = results(proc.stdout)
    if [r["rank"] for r in ranks] != [0, 1]:
        return "not both ranks reported"
    if any(r["world_size"] != 2 or r["sharded"] != sharded or r["updates"] != 3 for r in ranks):
        return f"wrong world: {ranks}"
    if ranks[0]["checksum"] != ranks[1]["checksum"]:
        return f"ranks disagree: {ranks}"
    return None


@pytest.mark.parametrize("mode", list(MODES))
def test_ten_runs_train_and_exit_cleanly(mode):
    make_cmd, env, sharded = MODES[mode]

    def one(i):
        # alternate an explicit close() with the exit hook of a script that simply returns
        try:
            proc = run(make_cmd(), timeout=PER_RUN_TIMEOUT, FL_CLOSE=str(i % 2), **env)
        except AssertionError as hang:
            return f"run {i}: {hang}"
        problem = problems(proc, sharded)
        return None if problem is None else f"run {i}: {problem}\n{proc.stdout[-2000:]}"

    # two launches at a time: they overlap their start-up, and the load widens exit races
    with ThreadPoolExecutor(max_workers=2) as pool:
        failures = [f for f in pool.map(one, range(RUNS)) if f]
    assert not failures, "\n\n".join(failures)


@pytest.mark.parametrize("mode", ["python-ddp", "torchrun-ddp"])
@pytest.mark.parametrize("fail_rank", [0, 1])
def test_a_failing_rank_ends_every_process_promptly(mode, fail_rank):
    make_cmd, env, _ = MODES[mode]
    proc = run(make_cmd(), timeout=240, FL_FAIL_RANK=str(fail_rank), **env)
    assert proc.returncode != 0, proc.stdout[-3000:]
    assert proc.leftovers == 0, "processes were left running"
    assert f"rank {fail_rank} fails on purpose" in proc.stdout
    assert f"rank {fail_rank} failed" in proc.stdout or f"rank {fail_rank} exited" in proc.stdout \
        or "Root Cause" in proc.stdout, proc.stdout[-3000:]
