"""Collectors apart from the learner ranks (fabric_learner.remote, docs/remote.md).

Every collector is a separate command, ``python -m fabric_learner.collect --connect 127.0.0.1:PORT``, as it
would be on another host; the learner program is tests/workers/remote_checks.py. Two runs: 2 DDP ranks under
``torchrun --max-restarts=1`` whose rank 1's collector node is killed mid-run (restarted, joins again) and then
rank 1 itself (the ranks resume from the checkpoint, the collectors reconnect); one process whose collector is
killed whole under ``on_failure="continue"`` (the run goes on with the other).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from multiproc import ROOT, WORKERS, env, free_port, run, torchrun

sys.path.insert(0, WORKERS)

import async_common as ac

from fabric_learner.remote import RemoteCollectors
from fabric_learner.remote.directory import split_address

SCRIPT = os.path.join(WORKERS, "remote_checks.py")
PATHS = os.pathsep.join([ROOT, WORKERS, os.path.join(ROOT, "tests")])  # the environment's module, on the collectors


class Collectors:
    """The test's collector commands, each in its own session, its log in ``folder``; all killed at the end."""

    def __init__(self, folder, port: int, n: int = 2) -> None:
        self.logs = [folder / f"collector{i}.log" for i in range(n)]
        self.procs = [subprocess.Popen([sys.executable, "-m", "fabric_learner.collect", "--connect", f"127.0.0.1:{port}",
                                        "--wait", "60"], cwd=ROOT, env=env(PYTHONPATH=PATHS), stdout=open(log, "w"),
                                       stderr=subprocess.STDOUT, start_new_session=True) for log in self.logs]

    def log(self, i: int) -> str:
        return self.logs[i].read_text()

    def node_pid(self, i: int) -> int:
        found = re.findall(r"node (\d+)", self.log(i))
        assert found, self.log(i)
        return int(found[-1])

    def serving(self, i: int) -> int:
        return int(re.findall(r"serving learner rank (\d+)", self.log(i))[-1])

    def wait(self, timeout: float = 60) -> list[int]:
        return [p.wait(timeout) for p in self.procs]

    def kill_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)


def wait_for_batches(path, n: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and len(path.read_text().splitlines()) >= n:
            return
        time.sleep(0.1)
    raise AssertionError(f"{path} did not reach {n} batches in {timeout} s")


def batch_sizes(path) -> list[int]:
    return [int(line.split()[1]) for line in path.read_text().splitlines()]


def test_bad_settings_are_refused_before_anything_starts():
    from fabric_learner import VersionedPolicy

    policy = VersionedPolicy(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="VersionedPolicy"):
        RemoteCollectors(lambda: None, torch.nn.Linear(2, 2), frames_per_batch=8, collectors=1, address="127.0.0.1:1")
    with pytest.raises(ValueError, match="on_failure"):
        RemoteCollectors(lambda: None, policy, frames_per_batch=8, collectors=1, address="127.0.0.1:1", on_failure="x")
    with pytest.raises(ValueError, match="HOST:PORT"):
        split_address("localhost")
    with pytest.raises(ValueError, match="collectors must be a positive int"):
        RemoteCollectors(lambda: None, policy, frames_per_batch=8, collectors=0, address="127.0.0.1:1")


@pytest.fixture(scope="module")
def faults(tmp_path_factory):
    """2 DDP ranks under torchrun --max-restarts=1, one collector each: a collector's node, then rank 1, are killed."""
    out = tmp_path_factory.mktemp("remote_faults")
    port = free_port()
    collectors = Collectors(out, port)
    try:
        with ThreadPoolExecutor(1) as pool:
            done = pool.submit(run, torchrun("--max-restarts=1", SCRIPT, str(out), "faults", str(port)), timeout=300,
                               TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
            wait_for_batches(out / "progress_rank1", 4)
            victim = next(i for i in range(2) if collectors.serving(i) == 1)
            os.kill(collectors.node_pid(victim), signal.SIGKILL)
            proc = done.result()
        codes = collectors.wait()
    finally:
        collectors.kill_all()
    assert proc.returncode == 0 and proc.leftovers == 0, proc.stdout[-6000:]
    return {"ranks": [torch.load(out / f"faults_rank{r}.pt", weights_only=False) for r in (0, 1)], "codes": codes,
            "logs": [collectors.log(i) for i in range(2)], "victim": victim, "out": out,
            "attempt0": json.loads((out / "attempt0_rank1.json").read_text())}


def test_a_killed_collector_is_restarted_and_its_learner_rank_goes_on(faults):
    before = faults["attempt0"]  # rank 1, just before it was killed in its turn
    assert before["remote"]["restarts"] == 1 and before["remote"]["builds"] == 2
    assert before["batches"] >= 4 + 3  # 4 from the first collector node, 3 from the restarted one
    assert "restart 1 of 3" in faults["logs"][faults["victim"]]


def test_a_learner_rank_killed_under_torchrun_resumes_and_the_collectors_reconnect(faults):
    r0, r1 = faults["ranks"]
    assert r0["attempt"] == r1["attempt"] == 1
    assert r0["num_updates"] == r1["num_updates"] > 0
    for k in r0["params"]:
        assert torch.equal(r0["params"][k], r1["params"][k]), k
    lines = (faults["out"] / "progress_rank0").read_text().splitlines()
    resumed_at = next(int(a.split()[0]) for a in lines if a.split()[2] == "1")
    assert resumed_at > 8 * 2 * ac.FRAMES_PER_BATCH  # attempt 1 started from the checkpoint, not from zero
    for i in range(2):  # the same collector processes served both runs, and ended with the second
        assert len(re.findall(r"serving learner rank", faults["logs"][i])) == 2, faults["logs"][i]
    assert faults["codes"] == [0, 0], faults["logs"]


def test_what_was_admitted_is_trained_on_and_versions_respect_the_lag(faults):
    for r in faults["ranks"]:
        s = r["stats"]  # attempt 1's own counters
        assert r["hook_frames"] == s["admitted_frames"] and s["max_admitted_lag"] <= 12 and r["hook_max_lag"] <= 12
        assert r["rb_len"] >= s["admitted_frames"]  # the replay buffer also holds what the checkpoint restored
    assert faults["ranks"][0]["collected_frames"] >= 60 * 2 * ac.FRAMES_PER_BATCH


def test_on_failure_continue_goes_on_with_the_collectors_left(tmp_path):
    port = free_port()
    collectors = Collectors(tmp_path, port)
    try:
        with ThreadPoolExecutor(1) as pool:
            done = pool.submit(run, [sys.executable, SCRIPT, str(tmp_path), "continue", str(port)], timeout=240)
            wait_for_batches(tmp_path / "progress_rank0", 3)
            os.killpg(collectors.procs[1].pid, signal.SIGKILL)  # the whole collector: nobody restarts it
            proc = done.result()
        assert collectors.procs[0].wait(60) == 0, collectors.log(0)
    finally:
        collectors.kill_all()
    assert proc.returncode == 0 and proc.leftovers == 0, proc.stdout[-6000:]
    r = torch.load(tmp_path / "continue_rank0.pt", weights_only=False)
    assert r["remote"]["restarts"] == 1 and r["remote"]["builds"] == 2
    sizes = batch_sizes(tmp_path / "progress_rank0")
    assert sizes[0] == 2 * ac.FRAMES_PER_BATCH and sizes[-1] == ac.FRAMES_PER_BATCH  # two collectors, then one
    assert r["rb_len"] == r["stats"]["admitted_frames"] and r["collected_frames"] >= 30 * 2 * ac.FRAMES_PER_BATCH
