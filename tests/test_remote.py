"""Collectors apart from the learner ranks (fabric_learner.remote, docs/remote.md).

Every collector is a separate command, ``python -m fabric_learner.collect --connect 127.0.0.1:PORT``, as it
would be on another host; the learner program is tests/workers/remote_checks.py. Four runs: 2 DDP ranks under
``torchrun --max-restarts=1`` whose rank 1's collector node is killed mid-run (restarted, joins again) and then
rank 1 itself (the ranks resume from the checkpoint, the collectors reconnect); 2 ranks under
``on_failure="continue"`` that lose collectors killed whole (rank 0 one of its two, rank 1 its only one, which
comes back later); 2 ranks whose only collector was started with the wrong port (the run ends on both ranks); a
collector whose learner rank's driver is slow to start. The four run side by side (mostly they wait).
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
from multiproc import RELAY, ROOT, WORKERS, env, finished, forked_ranks, free_port, launch, run, side_by_side, torchrun

sys.path.insert(0, WORKERS)

import async_common as ac
from remote_checks import RESUMED_BATCHES, SETTINGS

from fabric_learner.remote import RemoteCollectors
from fabric_learner.remote.directory import split_address

SCRIPT = os.path.join(WORKERS, "remote_checks.py")
PATHS = os.pathsep.join([ROOT, WORKERS, os.path.join(ROOT, "tests")])  # the environment's module, on the collectors


class Collectors:
    """The test's collector commands, each in its own session, its log in ``folder``; all killed at the end."""

    def __init__(self, folder, port: int, n: int = 2, wait: int = 60) -> None:
        self.folder, self.port, self.wait_s = folder, port, wait
        self.logs, self.procs = [], []
        for _ in range(n):
            self.add()

    def add(self, *args: str, port: int | None = None, wait: int | None = None) -> None:
        """Start one more collector (``args``: more options of ``python -m fabric_learner.collect``)."""
        log = self.folder / f"collector{len(self.logs)}.log"
        self.logs.append(log)
        self.procs.append(subprocess.Popen(
            [sys.executable, "-m", "fabric_learner.collect", "--connect", f"127.0.0.1:{port or self.port}", "--wait",
             str(wait or self.wait_s), *args], cwd=ROOT, env=env(PYTHONPATH=PATHS), stdout=open(log, "w"),
            stderr=subprocess.STDOUT, start_new_session=True))

    def log(self, i: int) -> str:
        return self.logs[i].read_text()

    def node_pid(self, i: int) -> int:
        found = re.findall(r"node (\d+)", self.log(i))
        assert found, self.log(i)
        return int(found[-1])

    def serving(self, i: int) -> int:
        return int(re.findall(r"serving learner rank (\d+)", self.log(i))[-1])

    def looking(self, timeout: float = 120) -> None:
        """Wait until every collector has done its imports and looks for the directory."""
        wait_until(lambda: all("looking for the learner's directory" in self.log(i) for i in range(len(self.logs))),
                   "the collectors' start", timeout)

    def wait(self) -> list[int]:
        """Each collector's exit status. One that lost the directory before it saw the run end looks for it
        again for up to its ``--wait`` seconds (then ends with 0, having served): the bound is longer than that."""
        return [p.wait(self.wait_s + 30) for p in self.procs]

    def kill_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)


def wait_for_batches(path, n: int, timeout: float = 120, launched=None) -> None:
    """Until ``path`` lists ``n`` batches; a failure ends with what the launch (a future of it) printed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and len(path.read_text().splitlines()) >= n:
            return
        if launched is not None and launched.done():
            break
        time.sleep(0.1)
    said = ""
    if launched is not None:
        printed = launched.result().stdout
        (path.parent / "launch.log").write_text(printed)
        said = f"; the launch printed ({path.parent / 'launch.log'}):\n{printed[-6000:]}"
    raise AssertionError(f"{path} did not reach {n} batches in {timeout} s{said}")


def batch_sizes(path) -> list[int]:
    return [int(line.split()[1]) for line in path.read_text().splitlines()]


def rounds(path) -> list[tuple[int, ...]]:
    """A rank's rounds that ran the steps: (updates, replay buffer length, group builds, restarts)."""
    return [tuple(map(int, line.split())) for line in path.read_text().splitlines()] if path.exists() else []


def rebuilt_rounds(path) -> list[tuple[int, ...]]:
    """The rounds since the rank rebuilt its collectors' group."""
    rows = rounds(path)
    first = next((i for i, row in enumerate(rows) if row[3] == 1), len(rows))
    return rows[first:]


def wait_until(check, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen in {timeout} s")
        time.sleep(0.1)


def said(output: str, rank: int, text: str) -> list[str]:
    """Lines of learner rank ``rank``'s own messages (``[learner rank R HH:MM:SS] ...``) that contain ``text``."""
    return re.findall(rf"^\[learner rank {rank} [0-9:]+\] .*{re.escape(text)}.*$", output, re.M)


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
def scenarios(tmp_path_factory):
    """The three runs below side by side: most of each is waiting (on a restart, past a timeout, for a collector),
    so together they take about as long as the longest; a run that failed is its own tests' failure."""
    runs = {"faults": run_faults, "lost": run_lost, "wrong_port": run_wrong_port, "slow_driver": run_slow_driver}
    folders = {name: tmp_path_factory.mktemp(name) for name in runs}  # here: the factory is not thread-safe
    forked_ranks()  # the zygote started and imported before any collector starts its own imports
    return side_by_side(list(runs), lambda name: runs[name](folders[name]), at_once=len(runs))


@pytest.fixture(scope="module")
def faults(scenarios):
    return finished(scenarios["faults"])


@pytest.fixture(scope="module")
def lost(scenarios):
    return finished(scenarios["lost"])


@pytest.fixture(scope="module")
def wrong_port(scenarios):
    return finished(scenarios["wrong_port"])


@pytest.fixture(scope="module")
def slow_driver(scenarios):
    return finished(scenarios["slow_driver"])


def run_faults(out):
    """2 DDP ranks under torchrun --max-restarts=1, one collector each: a collector's node, then rank 1, are killed."""
    port = free_port()
    collectors = Collectors(out, port)
    try:
        collectors.looking()  # as in run_lost
        with ThreadPoolExecutor(1) as pool:
            done = pool.submit(run, torchrun("--max-restarts=1", RELAY, SCRIPT, str(out), "faults", str(port)),
                               timeout=300, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", **forked_ranks())
            wait_for_batches(out / "progress_rank1", 4, launched=done)
            victim = next(i for i in range(2) if collectors.serving(i) == 1)
            os.kill(collectors.node_pid(victim), signal.SIGKILL)
            proc = done.result()
        codes = collectors.wait()
    finally:
        collectors.kill_all()
    assert proc.returncode == 0 and proc.leftovers == 0, proc.stdout[-6000:]
    assert (out / "attempt0_rank1.json").exists(), f"rank 1 did not end attempt 0 itself:\n{proc.stdout[-8000:]}"
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
    lines = (faults["out"] / "progress_rank0").read_text().splitlines()
    assert sum(line.split()[2] == "1" for line in lines) >= RESUMED_BATCHES  # then rank 0 stopped the run
    assert faults["ranks"][0]["collected_frames"] > int(lines[-1].split()[0])


def run_lost(out):
    """2 DDP ranks under "continue", max_restarts=1, timeout_s=15; 3 collectors (2 for rank 0, 1 for rank 1). One of
    rank 0's and rank 1's only one are killed whole; once rank 1 has rebuilt its group, the test waits past timeout_s
    and starts a new collector for rank 1, which stops the run after 3 batches from it."""
    port = free_port()
    collectors = Collectors(out, port, n=3, wait=20)  # rank 0 may end before a collector sees it did: 20 s later
    try:
        collectors.looking()  # imported: each connects within timeout_s of the directory, however busy the host
        with ThreadPoolExecutor(1) as pool:
            done = pool.submit(launch, SCRIPT, out, "continue", port, timeout=300)
            for r in (0, 1):
                wait_for_batches(out / f"progress_rank{r}", 4, launched=done)
            serving = [collectors.serving(i) for i in range(3)]
            killed = (serving.index(0), serving.index(1))
            for victim in killed:
                os.killpg(collectors.procs[victim].pid, signal.SIGKILL)  # supervisor and node: nobody restarts it
            wait_until(lambda: any(row[3] for row in rounds(out / "rounds_rank1")), "rank 1's rebuild")
            # past timeout_s (a wait counted as a restart would end the run here), and 5 rounds on the replay buffer
            # alone, however slowly a loaded host runs them
            past = time.monotonic() + SETTINGS["continue"]["timeout_s"] + 5
            wait_until(lambda: time.monotonic() > past and len(rebuilt_rounds(out / "rounds_rank1")) >= 5,
                       "rank 1's rounds on its replay buffer", timeout=180)
            collectors.add("--learner-rank", "1")
            proc = done.result()
            (out / "launch.log").write_text(proc.stdout)
        codes = {i: collectors.procs[i].wait(collectors.wait_s + 30) for i in range(4) if i not in killed}
    finally:
        collectors.kill_all()
    return {"proc": proc, "out": out, "port": port, "codes": codes, "logs": [collectors.log(i) for i in range(4)],
            "ranks": [torch.load(out / f"continue_rank{r}.pt", weights_only=False) for r in (0, 1)]}


def test_under_continue_a_rank_that_lost_every_collector_trains_on_its_replay_buffer_until_one_comes_back(lost):
    proc, out = lost["proc"], lost["out"]
    assert proc.returncode == 0 and proc.leftovers == 0, proc.stdout[-6000:]
    r0, r1 = lost["ranks"]
    assert r1["remote"]["restarts"] == 1 and r1["remote"]["builds"] == 2  # the kill; waiting rebuilt nothing
    rows = rebuilt_rounds(out / "rounds_rank1")
    without = [row for row in rows if row[1] == rows[0][1]]  # no new frame on rank 1
    assert len(without) >= 5 and without[-1][0] > without[0][0], rows  # ... but updates all the same
    assert rows[-1][1] > rows[0][1]  # frames from the collector that came back
    assert r0["num_updates"] == r1["num_updates"]
    for k in r0["params"]:
        assert torch.equal(r0["params"][k], r1["params"][k]), k
    assert all(code == 0 for code in lost["codes"].values()), lost["logs"]


def test_under_continue_a_rank_left_with_some_collectors_goes_on_with_them(lost):
    r0 = lost["ranks"][0]
    assert r0["remote"]["restarts"] == 1 and r0["remote"]["builds"] == 2
    sizes = batch_sizes(lost["out"] / "progress_rank0")
    assert sizes[0] == 2 * ac.FRAMES_PER_BATCH and sizes[-1] == ac.FRAMES_PER_BATCH  # two collectors, then one
    for r in lost["ranks"]:
        assert r["rb_len"] == r["stats"]["admitted_frames"] == r["hook_frames"] and r["hook_max_lag"] <= 12


def test_a_rank_without_collectors_says_it_waits_naming_the_address_until_one_comes(lost):
    out, address = lost["proc"].stdout, f"127.0.0.1:{lost['port']}"
    assert said(out, 1, "group failed ("), out[-6000:]  # the killed collector's node, silence, or no batch
    assert said(out, 1, "rebuilding it (restart 1 of 1)")
    waits = said(out, 1, f"waiting for collectors at {address} for ")
    gone = [line for line in waits if "it has 0 of 1; its collectors were lost; the run goes on (on_failure='continue')"
            in line]
    assert gone, out[-6000:]
    waited = max(int(re.search(r" for (\d+) s:", line).group(1)) for line in gone)
    assert waited > SETTINGS["continue"]["timeout_s"]  # longer than timeout_s: waiting never ends the run
    assert said(out, 1, f"collectors at {address}: 1 of 1 delivering"), out[-6000:]


def run_wrong_port(tmp_path):
    """2 DDP ranks, timeout_s=12: rank 0's collector connects, rank 1's was started with the wrong port."""
    port, wrong = free_port(), free_port()
    collectors = Collectors(tmp_path, port, n=0, wait=15)
    collectors.add("--learner-rank", "0", wait=60)  # rank 0 has its collector
    collectors.add(port=wrong)  # rank 1's was started with the wrong port
    try:
        collectors.looking()  # imported: rank 0's connects within timeout_s of the directory, however busy the host
        proc = launch(SCRIPT, tmp_path, "wrongport", port, timeout=150)
        code = collectors.procs[1].wait(60)
    finally:
        collectors.kill_all()
    return {"proc": proc, "port": port, "wrong": wrong, "code": code, "log": collectors.log(1)}


def test_a_rank_no_collector_connects_to_ends_the_run_on_every_rank_naming_the_address(wrong_port):
    """The program closes its learner in ``finally``: the rank that raises waits in close() for no peer (it waited
    there for a peer that was in a collective waiting for it, and the run hung past the launch's bound)."""
    proc, port, wrong, code = (wrong_port[k] for k in ("proc", "port", "wrong", "code"))
    out, address = proc.stdout, f"127.0.0.1:{port}"
    assert proc.returncode == 1 and proc.leftovers == 0, out[-6000:]
    timeout_s = SETTINGS["wrongport"]["timeout_s"]
    never = (f"no collector connected to {address} in {timeout_s:g} s (timeout_s). Check that the collectors were started "
             f"(python -m fabric_learner.collect --connect {address}; their output says what they reached), that their "
             f"--connect address and port are {address} exactly, and that no firewall blocks port {port}")
    assert said(out, 1, f"waiting for collectors at {address} for 1"), out[-6000:]
    assert said(out, 1, f"it has 0 of 1; none has connected yet; the run ends at {timeout_s:g} s (timeout_s) unless one "
                        f"does. Each is started with: python -m fabric_learner.collect --connect {address}")
    assert said(out, 1, f"ending the run on every rank. Learner rank 1: {never}"), out[-6000:]
    assert said(out, 0, f"ending the run on every rank. Learner rank 0: the run ends because learner rank 1 reports: "
                        f"{never}"), out[-6000:]
    assert "RuntimeError: Learner rank" in out and "rebuilding" not in out
    assert code == 1 and f"no directory at 127.0.0.1:{wrong} for 15 s: ending (check that --connect" in wrong_port["log"]


def run_slow_driver(out):
    """Learner rank 0's side of the directory, its driver slow to start: a collector joins build 0 and waits past its
    --wait (2 s) before the group is published."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    from fabric_learner.remote.directory import Directory

    # bound to a port the system picks as it binds: a port picked free earlier was once taken before the bind (twice)
    directory = Directory.serve(TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=30), wait_for_workers=False),
                                world=1)  # no driver yet: the test publishes its group by hand
    port = directory.store.port
    directory.count("rank0", "epochs", add=1)
    collectors = Collectors(out, port, n=0)
    collectors.add("--learner-rank", "0", wait=2)
    try:
        wait_until(lambda: directory.count("rank0", "e0", "join") == 1, "the collector's join")
        time.sleep(4)  # past the collector's --wait: the driver is still starting
        directory.store.set(directory.key("rank0", "e0", "group"), f"127.0.0.1 {free_port()} 1")
        wait_until(lambda: "build 0 of learner rank 0" in collectors.log(0), "the collector's taking its place")
        directory.store.set(directory.key("rank0", "done"), "1")
        code = collectors.procs[0].wait(60)
    finally:
        collectors.kill_all()
    return {"code": code, "log": collectors.log(0), "joins": directory.count("rank0", "e0", "join")}


def test_a_collector_waits_for_its_build_however_long_the_learner_rank_s_driver_takes_to_start(slow_driver):
    """A driver process starts slowly on a loaded host (a spawned interpreter's imports): a collector that had joined
    its build used to give up on it after its --wait seconds, and the build waited for a node that never came."""
    log = slow_driver["log"]
    assert "build 0 of learner rank 0" in log and "collector 1 of 1" in log, log
    assert slow_driver["joins"] == 1 and slow_driver["code"] == 0, log  # it joined once, and ended with the run


def test_the_port_a_driver_publishes_for_its_group_is_already_held_by_the_group_s_store(monkeypatch):
    """A driver used to pick a free port and bind it only later (torchrl's init_process_group): another process took
    it in between once (EADDRINUSE, a restart spent). Now the store binds first; the group joins it as a client."""
    import errno
    import socket
    from datetime import timedelta

    from torch.distributed import TCPStore

    from fabric_learner.remote.driver import _group_store

    # set by _group_store (in a driver's own process): restored after, or every rank this worker launched later would
    # wait for an agent's store that no launcher serves (monkeypatch.delenv of an unset name restores nothing)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    store, port = _group_store("127.0.0.1")
    with socket.socket() as other, pytest.raises(OSError) as taken:
        other.bind(("", port))
    assert taken.value.errno == errno.EADDRINUSE
    TCPStore("127.0.0.1", port, None, False, timedelta(seconds=30)).set("collector", "joined")
    assert store.get("collector") == b"joined"
    assert os.environ["TORCHELASTIC_USE_AGENT_STORE"] == "True"  # torch's tcp:// rendezvous joins it, binds nothing


def test_status_lines_reach_stderr_in_one_write_so_ranks_sharing_a_pipe_never_split_them(monkeypatch):
    """Under ``python -u`` each write reaches the pipe at once: print's separate newline let another rank's
    line land inside this one (``[learner rank 0 ...] waiting ...[learner rank 1 ...] waiting ...``)."""
    import io

    from fabric_learner.utils.lines import say

    writes = []

    class Unbuffered(io.TextIOBase):
        def write(self, text):
            writes.append(text)
            return len(text)

    monkeypatch.setattr(sys, "stderr", Unbuffered())
    say("[learner rank 1 12:00:00] waiting for collectors")
    assert writes == ["[learner rank 1 12:00:00] waiting for collectors\n"]
