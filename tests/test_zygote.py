"""The launcher most multi-rank checks use (tests/zygote.py) starts real ranks as Fabric starts
the ranks it launches itself, reports what they left running, and ends a launch whose rank failed
or hung."""

from __future__ import annotations

import json
import os

import pytest
from multiproc import (
    RELAY,
    WORKERS,
    elastic_exit_codes,
    forked_ranks,
    free_port,
    launch,
    plain_python,
    proc_stat,
    run,
    tagged_pids,
    torchrun,
)

PROBE = os.path.join(WORKERS, "zygote_probe.py")


def test_ranks_are_separate_processes_with_a_launchers_environment_and_imports_done(tmp_path):
    proc = launch(PROBE, "report", tmp_path, nproc=2, FL_PROBE="given")
    assert (proc.returncode, proc.leftovers) == (0, 0), proc.stdout
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [(r["RANK"], r["LOCAL_RANK"], r["WORLD_SIZE"]) for r in ranks] == [("0", "0", "2"), ("1", "1", "2")]
    assert ranks[0]["MASTER_PORT"] == ranks[1]["MASTER_PORT"] and ranks[0]["pid"] != ranks[1]["pid"]
    assert all(r["FL_PROBE"] == "given" and r["preloaded"] and r["argv"] == [PROBE, "report", str(tmp_path)]
               for r in ranks)
    assert "rank 0 reported" in proc.stdout and "rank 1 reported" in proc.stdout
    # seeded afresh, as separate interpreters are: forked ranks would otherwise draw alike
    assert all(a != b for a, b in zip(ranks[0]["draws"], ranks[1]["draws"]))


def test_a_process_left_running_is_counted_and_killed_even_in_a_session_of_its_own(tmp_path):
    # the orphan sleeps 120 s holding the output pipe: within the 60-s bound, the launch ended with the ranks
    proc = launch(PROBE, "orphan", tmp_path, nproc=2, timeout=60)
    assert proc.returncode == 0 and proc.leftovers == 1, proc.stdout
    assert tagged_pids(proc.tag) == []


def test_a_variable_the_imports_already_read_cannot_be_changed_by_a_launch(tmp_path):
    proc = launch(PROBE, "report", tmp_path, nproc=1, OMP_NUM_THREADS="2")
    assert proc.returncode != 0 and "['OMP_NUM_THREADS'] differ from this zygote's" in proc.stdout, proc.stdout


def test_a_failed_rank_ends_its_peers_and_the_launch_fails(tmp_path):
    proc = launch(PROBE, "fail", tmp_path, nproc=2, timeout=60)  # the peer would sleep 120 s: it was ended
    assert proc.returncode == 1 and proc.leftovers == 0, proc.stdout
    assert "rank 1 fails on purpose" in proc.stdout


def test_a_hung_launch_fails_the_test_at_its_timeout(tmp_path):
    with pytest.raises(AssertionError, match="did not finish within 2s"):
        launch(PROBE, "hang", tmp_path, nproc=2, timeout=2)


def test_a_launchers_ranks_forked_through_the_relay_keep_its_environment_and_report_what_they_leave(tmp_path):
    """tests/zygote_rank.py: torchrun starts it as each rank; the rank is forked from the zygote with
    torchrun's variables. Of two processes it leaves running (forked, so untagged), the one that left its
    process group is counted; the one in it is ended, as torchrun ends a rank's group, and not counted."""
    proc = run(torchrun(RELAY, PROBE, "report", tmp_path), timeout=120, FL_PROBE="given", **forked_ranks())
    assert (proc.returncode, proc.leftovers) == (0, 0), proc.stdout
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [(r["RANK"], r["WORLD_SIZE"]) for r in ranks] == [("0", "2"), ("1", "2")]
    assert all(r["preloaded"] and r["TORCHELASTIC_RUN_ID"] and r["argv"] == [PROBE, "report", str(tmp_path)]
               for r in ranks)
    assert "rank 0 reported" in proc.stdout and "rank 1 reported" in proc.stdout
    proc = run(torchrun(RELAY, PROBE, "child", tmp_path), timeout=120, **forked_ranks())
    assert proc.returncode == 0 and proc.leftovers == 1, proc.stdout
    left = int((tmp_path / "child1.pid").read_text())
    assert f"left running after the launch: {left} " in proc.stdout, proc.stdout
    for i in (0, 1):  # both ended (gone, or a zombie not yet reaped by whoever inherited it)
        assert (proc_stat(int((tmp_path / f"child{i}.pid").read_text())) or ["gone"])[0] in ("Z", "X", "gone"), i


def test_a_plain_python_run_relayed_alone_starts_with_its_imports_done_and_counts_all_it_leaves(tmp_path):
    """multiproc.plain_python: ``python RELAY SCRIPT`` is the whole launch (the learner would start the other ranks);
    no launcher ends the rank's process group after it, so both processes it left running are counted."""
    proc = plain_python(PROBE, "report", tmp_path, timeout=120)
    assert (proc.returncode, proc.leftovers) == (0, 0), proc.stdout
    seen = json.loads((tmp_path / "rank0.json").read_text())
    assert seen["preloaded"] and seen["argv"] == [PROBE, "report", str(tmp_path)]  # forked, as the script was given
    proc = plain_python(PROBE, "child", tmp_path, timeout=120, FL_PROBE_RANK="1")
    assert proc.returncode == 0 and proc.leftovers == 2, proc.stdout
    for i in (0, 1):
        assert f"left running after the launch: {(tmp_path / f'child{i}.pid').read_text()} " in proc.stdout, proc.stdout


def test_a_relayed_rank_that_fails_fails_the_launch_and_its_peer_is_ended(tmp_path):
    proc = run(torchrun(RELAY, PROBE, "fail", tmp_path), timeout=90, **forked_ranks())  # its peer would sleep 120 s
    assert proc.returncode == 1 and proc.leftovers == 0, proc.stdout
    assert "rank 1 fails on purpose" in proc.stdout
    codes = elastic_exit_codes(proc.stdout)  # rank 1's status, and rank 0 ended by torchrun's signal through the relay
    assert codes[1] == 1 and codes[0] != 0, (codes, proc.stdout[-3000:])


def test_ports_handed_to_concurrent_test_processes_differ_and_none_is_one_a_client_socket_could_take(tmp_path):
    """multiproc.free_port: a port ``bind(0)`` picked was once taken by another process's outgoing connection
    before the test's store bound it (EADDRINUSE on CI); four processes drawing at once never share a port either."""
    import subprocess
    import sys

    draw = "import multiproc; print(*[multiproc.free_port() for _ in range(200)])"
    procs = [subprocess.Popen([sys.executable, "-c", draw], cwd=os.path.dirname(__file__), stdout=subprocess.PIPE,
                              text=True) for _ in range(4)]
    drawn = [int(port) for proc in procs for port in proc.communicate(timeout=60)[0].split()]
    low, high = map(int, open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
    assert len(drawn) == len(set(drawn)) == 800
    assert not [port for port in drawn + [free_port()] if low <= port <= high or port < 20000]
