"""Collectors apart from the learner ranks (fabric_learner.remote, docs/remote.md).

Every collector is a separate command, ``python -m fabric_learner.collect --connect 127.0.0.1:PORT``, as it
would be on another host; the learner program is tests/workers/remote_checks.py. Three runs: 2 DDP ranks
whose collector node is killed mid-run (restarted, joins again); one process whose collector is killed
whole under ``on_failure="continue"`` (the run goes on with the other); 2 ranks under ``torchrun
--max-restarts=1`` whose rank 1 is SIGKILLed after a checkpoint (the ranks resume, the collectors reconnect).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from multiproc import ROOT, WORKERS, env, free_port, launch, run, torchrun

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
    """2 DDP ranks, one collector each; the node of rank 1's collector is SIGKILLed after rank 1's 4th batch."""
    out = tmp_path_factory.mktemp("remote_faults")
    port = free_port()
    collectors = Collectors(out, port)
    try:
        with ThreadPoolExecutor(1) as pool:
            done = pool.submit(launch, SCRIPT, out, "faults", port, timeout=300)
            wait_for_batches(out / "progress_rank1", 4)
            victim = next(i for i in range(2) if collectors.serving(i) == 1)
            os.kill(collectors.node_pid(victim), signal.SIGKILL)
            proc = done.result()
        codes = collectors.wait()
    finally:
        collectors.kill_all()
    assert proc.returncode == 0 and proc.leftovers == 0, proc.stdout[-6000:]
    return {"ranks": [torch.load(out / f"faults_rank{r}.pt", weights_only=False) for r in (0, 1)], "codes": codes,
            "logs": [collectors.log(i) for i in range(2)], "victim": victim, "out": out}


def test_a_killed_collector_is_restarted_and_the_ranks_go_on_in_step(faults):
    r0, r1 = faults["ranks"]
    assert r0["num_updates"] == r1["num_updates"] > 0
    for k in r0["params"]:
        assert torch.equal(r0["params"][k], r1["params"][k]), k
    assert r1["remote"]["restarts"] == 1 and r1["remote"]["builds"] == 2
    assert r0["remote"]["restarts"] == 0 and r0["remote"]["builds"] == 1
    assert "restart 1 of 3" in faults["logs"][faults["victim"]]
    assert faults["codes"] == [0, 0], faults["logs"]  # both collectors end with the run
    # rank 1 kept receiving batches after the kill (its 4th): the restarted collector delivered them
    assert len(batch_sizes(faults["out"] / "progress_rank1")) > 6


def test_what_was_admitted_is_trained_on_and_versions_respect_the_lag(faults):
    for r in faults["ranks"]:
        s = r["stats"]
        assert r["hook_frames"] == s["admitted_frames"] == r["rb_len"]
        assert s["max_admitted_lag"] <= 12 and r["hook_max_lag"] <= 12
    total = sum(r["stats"]["admitted_frames"] + r["stats"]["dropped_frames"] for r in faults["ranks"])
    assert total == faults["ranks"][0]["collected_frames"] >= 40 * 2 * ac.FRAMES_PER_BATCH


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


def test_a_learner_rank_killed_under_torchrun_resumes_and_the_collectors_reconnect(tmp_path):
    port = free_port()
    collectors = Collectors(tmp_path, port)
    try:
        proc = run(torchrun("--max-restarts=1", SCRIPT, str(tmp_path), "elastic", str(port)), timeout=300,
                   TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
        codes = collectors.wait()
    finally:
        collectors.kill_all()
    assert proc.returncode == 0 and proc.leftovers == 0, proc.stdout[-6000:]
    ranks = [torch.load(tmp_path / f"elastic_rank{r}.pt", weights_only=False) for r in (0, 1)]
    assert [r["attempt"] for r in ranks] == [1, 1]
    for k in ranks[0]["params"]:
        assert torch.equal(ranks[0]["params"][k], ranks[1]["params"][k]), k
    lines = (tmp_path / "progress_rank0").read_text().splitlines()
    resumed_at = next(int(a.split()[0]) for a in lines if a.split()[2] == "1")
    assert resumed_at > 8 * 2 * ac.FRAMES_PER_BATCH  # attempt 1 started from the checkpoint, not from zero
    assert ranks[0]["collected_frames"] >= 30 * 2 * ac.FRAMES_PER_BATCH
    for i in range(2):  # the same collector processes served both runs
        assert len(re.findall(r"serving learner rank", collectors.log(i))) == 2, collectors.log(i)
    assert codes == [0, 0]
