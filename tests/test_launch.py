"""One short training script under every launcher, repeatedly: it runs, ranks agree, and
every run exits 0 with no hang and no process left behind; a failing rank ends every process.

Launchers: plain ``python`` (the learner starts rank 1 itself), ``fabric run`` and ``torchrun``.
Every run trains a DDP and an FSDP learner and ends with both alive; runs alternate which comes
first (the first one takes its strategy from the launcher where it gives one) and whether the
script closes them or leaves it to the exit hook. Before the exit hook existed a gloo run
aborted or hung at exit in a fair share of runs (see docs/ending.md). Every rank is a fresh
interpreter but rank 0 of the failing runs under plain python, forked from the test zygote.
"""

from __future__ import annotations

import json
import os
import re
from concurrent.futures import ThreadPoolExecutor

import pytest
from multiproc import WORKERS, elastic_exit_codes, fabric_run, finished, plain_python, python, run, side_by_side, torchrun

SCRIPT = os.path.join(WORKERS, "launch_script.py")
# (first learner's strategy, timeout=None, the script closes its learners). `make test`: two runs
# per launcher that between them take each of these both ways; `make test-stress` (FL_STRESS=1):
# ten, the repeated launches that exit races need before a run can be believed (see docs/ending.md)
RUNS = [(("ddp", "fsdp")[i % 2], (i + i // 2) % 2 == 1, i // 2 % 2 == 1) for i in range(10)] \
    if os.environ.get("FL_STRESS") == "1" else [("ddp", True, True), ("fsdp", False, False)]
PER_RUN_TIMEOUT = 180



def command(mode, first):
    """The launch command and environment of one run whose first learner uses ``first``."""
    if mode == "python":
        return python(SCRIPT), {"FL_MODE": "plain"}
    if mode == "fabric-run":
        return fabric_run(SCRIPT, strategy=first), {"FL_MODE": "external"}
    return torchrun(SCRIPT), {"FL_MODE": "external", **({"FL_STRATEGY": "fsdp"} if first == "fsdp" else {})}


def results(stdout):
    # ranks share one pipe, so their lines may interleave
    return sorted((json.loads(m) for m in re.findall(r"RESULT (\{[^}]*\})", stdout)), key=lambda r: r["rank"])


def problems(proc, first, closes=False, timeout=300.0) -> str | None:
    if proc.returncode != 0:
        return f"exit status {proc.returncode}"
    if proc.leftovers:
        return f"{proc.leftovers} processes left running"
    ranks = results(proc.stdout)
    if sorted(r["rank"] for r in ranks) != [0, 0, 1, 1]:
        return "not both ranks reported both learners"
    if any(r["world_size"] != 2 or r["updates"] != 3 for r in ranks):
        return f"wrong world: {ranks}"
    if any(r["sharded"] != (first == "fsdp") for r in ranks[::2]):  # each rank reports its first learner first
        return f"the first learner did not use {first}: {ranks}"
    for sharded in (False, True):
        pair = [r for r in ranks if r["sharded"] == sharded]
        if len(pair) != 2 or pair[0]["checksum"] != pair[1]["checksum"] or pair[0]["acted"] != pair[1]["acted"]:
            return f"ranks disagree or a strategy is missing: {ranks}"
    ddp, fsdp = ([r["acted"] for r in ranks if r["sharded"] == s][0] for s in (False, True))
    if any(abs(a - b) > 1e-4 for a, b in zip(ddp, fsdp)) or len(set(ddp)) != 3:
        return f"the policy did not act with each step's weights under both strategies alike: {ddp} vs {fsdp}"
    # docs/reliability.md: the first learner's timeout (default 5 minutes; None: torch's 30) bounds the
    # real group under every launcher, and the second learner, a strategy object, leaves it alone
    if any(r["group_timeouts"] != [timeout] for r in ranks):
        return f"the process group's timeout is not {timeout} s: {[r['group_timeouts'] for r in ranks]}"
    if closes and sorted(re.findall(r"CLOSED rank (\d)", proc.stdout)) != ["0", "1"]:
        return "close() twice and the context manager did not leave both learners closed on both ranks"
    return None


@pytest.mark.parametrize("mode", ["python", "fabric-run", "torchrun"])
def test_repeated_runs_train_and_exit_cleanly(mode):
    def one(i):
        first, none, closes = RUNS[i]
        cmd, env = command(mode, first)
        try:
            proc = run(cmd, timeout=PER_RUN_TIMEOUT, FL_FIRST=first, FL_CLOSE=str(int(closes)),
                       FL_TIMEOUT="none" if none else "default", **env)
        except AssertionError as hang:
            return f"run {i}: {hang}"
        problem = problems(proc, first, closes=closes, timeout=1800.0 if none else 300.0)
        return None if problem is None else f"run {i} (first {first}): {problem}\n{proc.stdout[-2000:]}"

    # two launches at a time: they overlap their start-up, and the load widens exit races
    with ThreadPoolExecutor(max_workers=2) as pool:
        failures = [f for f in pool.map(one, range(len(RUNS))) if f]
    assert not failures, "\n\n".join(failures)


FAILING = [("python", 0), ("python", 1), ("torchrun", 0), ("torchrun", 1), ("fabric-run", 1)]
BUSY = ("python", "busy")  # rank 1 fails while rank 0 computes (in no collective) for 60 s, far longer than the
# observer's 5 s look and our 10 s grace


@pytest.fixture(scope="module")
def failing_runs():
    """Every run with a failing rank, three at a time, the busy one first (most of it is waiting out rank 0's grace);
    a run that hangs is its own test's failure. Under plain python rank 0 is forked from the test zygote through the
    relay (tests/zygote_rank.py), imports done, and starts rank 1, a fresh interpreter. Under torchrun and ``fabric
    run`` the ranks stay fresh interpreters: when both exit at once, which status the launcher sees first is what
    the test checks, and a relayed rank's status reaches the launcher later than its process's own exit would."""
    def one(case):
        if case == BUSY:
            return plain_python(SCRIPT, timeout=240, FL_MODE="plain", FL_FAIL_RANK="1", FL_BUSY_RANK0="60", FL_QUEUE="1")
        mode, fail_rank = case
        if mode == "python":
            return plain_python(SCRIPT, timeout=240, FL_FAIL_RANK=str(fail_rank), FL_MODE="plain")
        cmd, env = command(mode, "ddp")
        return run(cmd, timeout=240, FL_FAIL_RANK=str(fail_rank), **env)

    return side_by_side([BUSY, *FAILING], one, at_once=3)


def test_a_rank_that_fails_while_rank_0_computes_ends_the_run_with_status_1_naming_it(failing_runs):
    """Plain python: Lightning's observer would SIGKILL rank 0 (status 137, no rank named, issue #55's mesh runs)."""
    proc = finished(failing_runs[BUSY])
    assert proc.returncode == 1, (proc.returncode, proc.stdout[-3000:])
    assert proc.leftovers == 0
    assert "fabric_learner: rank 1 exited with status 1; the run ends with status 1" in proc.stdout, proc.stdout[-3000:]
    assert "rank 0 is done computing" not in proc.stdout and "Forcefully terminating" not in proc.stdout
    assert proc.stdout.index("RuntimeError: rank 1 fails on purpose") < proc.stdout.index("rank 1 exited with status 1")
    # the ranks' queues: their semaphores are released as the ranks end, not left to Python's resource tracker
    assert "leaked semaphore" not in proc.stdout, proc.stdout[-3000:]


@pytest.mark.parametrize("mode,fail_rank", FAILING)
def test_a_failing_rank_ends_every_process_promptly(failing_runs, mode, fail_rank):
    proc = finished(failing_runs[mode, fail_rank])
    # status 1 (the failing rank's, passed on by rank 0 or the launcher), before the 5-minute collective timeout
    # its peer would otherwise wait out: the run's own bound (240 s) is below it, however slowly the host runs
    assert proc.returncode == 1, (proc.returncode, proc.stdout[-3000:])
    assert proc.leftovers == 0, "processes were left running"
    assert f"rank {fail_rank} fails on purpose" in proc.stdout
    # docs/ending.md: the failing rank exits at once with status 1, after its traceback ...
    said = f"fabric_learner: rank {fail_rank} failed (RuntimeError); exiting with status 1 without waiting"
    assert said in proc.stdout, proc.stdout[-3000:]
    assert proc.stdout.index(f"RuntimeError: rank {fail_rank} fails on purpose") < proc.stdout.index(said)
    if mode == "python":  # ... and under plain python rank 0 names rank 1's end (it waited for it, or killed it)
        assert re.search(r"fabric_learner: rank 1 (exited with status 1|was still running and was killed)",
                         proc.stdout), proc.stdout[-3000:]
    else:  # the launcher's failure summary: every rank's status, the failing one's 1, none 0
        codes = elastic_exit_codes(proc.stdout)
        assert codes.keys() == {0, 1} and codes[fail_rank] == 1 and codes[1 - fail_rank] != 0, (codes, proc.stdout[-3000:])


def test_a_rank_ending_the_run_lets_a_rank_it_started_that_announced_its_failure_exit_and_kills_the_others(capfd):
    """A failed launch said ``rank 1 failed (ValueError); exiting`` and then ``rank 1 was still running and was
    killed``: rank 0 killed a rank on its way out by itself. Such a rank is now named by its exit status."""
    import subprocess
    import sys

    from fabric_learner.launch.teardown import _end_children

    # rank 1 exits with 1 once its standard input closes (as a failing rank ends after its traceback); rank 2 waits
    exiting = subprocess.Popen([sys.executable, "-c", "import os, sys, time; sys.stdin.read(); time.sleep(0.3); "
                                "os._exit(1)"], stdin=subprocess.PIPE)
    waiting = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        exiting.stdin.close()
        _end_children([exiting, waiting], {1: "failed (ValueError)", 2: "in update() (collective call 3)"}.get)
    finally:
        for proc in (exiting, waiting):
            proc.kill()
            proc.wait()
    said = capfd.readouterr().err
    assert "fabric_learner: rank 1 exited with status 1" in said and "rank 1 was still running" not in said, said
    assert "fabric_learner: rank 2 was still running and was killed" in said, said
    assert exiting.returncode == 1 and waiting.returncode == -9
