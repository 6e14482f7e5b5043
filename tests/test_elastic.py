"""Runs survive a lost rank: torchrun's elastic agent restarts the workers and the Trainer resumes (#18).

tests/workers/elastic_trainer.py trains a DQN Trainer (checkpoint after every batch) on 2 gloo ranks;
ranks are SIGKILLed during an update, during collection and during a save. The run must end by
itself, equal bit for bit to an uninterrupted run, with no process left behind.

torchrun's agent starts, watches and restarts each rank's process as usual; that process forks the
rank from the test zygote (tests/zygote_rank.py), so a restart costs no new imports (26 rank starts
in this module, about 5 s of CPU each otherwise).
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from multiproc import RELAY, WORKERS, forked_ranks, free_port, run

SCRIPT = os.path.join(WORKERS, "elastic_trainer.py")
FRESH_STORES = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # a new store per rendezvous round (see launch/build.py)
KEYS = ("params", "num_updates", "optim_count", "collected_frames", "rb_obs", "priorities", "rng")


def torchrun(*args, restarts: int):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
            f"--max-restarts={restarts}", RELAY, SCRIPT, *args]


def events(out) -> list[dict]:
    with open(out / "events.jsonl") as f:
        return [json.loads(line) for line in f]


def finals(out, strategy) -> list[dict]:
    return [torch.load(out / f"final_{strategy}_rank{r}.pt", weights_only=False) for r in (0, 1)]


def assert_equal_runs(a: dict, b: dict, what: str) -> None:
    for key in KEYS:
        x, y = a[key], b[key]
        if isinstance(x, dict):
            assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), f"{what}: {key} differs"
        elif isinstance(x, torch.Tensor):
            assert torch.equal(x, y), f"{what}: {key} differs"
        else:
            assert x == y, f"{what}: {key} {x} != {y}"
    for i, s in a["optimizer"]["state"].items():
        for k, v in s.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(b["optimizer"]["state"][i][k])), f"{what}: Adam {k}"


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted")
    proc = run(torchrun(str(out), "ddp,fsdp", "0", restarts=0), timeout=420, **forked_ranks())
    assert proc.returncode == 0 and proc.leftovers == 0, proc.stdout[-4000:]
    return out


def time_lost(log: list[dict]) -> list[dict]:
    """Per kill: seconds until the restarted ranks started (agent + new interpreters), and until they
    were back at the kill's frame count (that plus loading and the redone work)."""
    out = []
    for kill in (e for e in log if e["event"] == "kill"):
        later = [e for e in log if e["attempt"] == kill["attempt"] + 1]
        start = min(e["t"] for e in later if e["event"] == "start")
        back = min(e["t"] for e in later if e["event"] in ("batch", "done") and e.get("frames", 0) >= kill["frames"])
        out.append({"where": kill["where"], "restart_s": round(start - kill["t"], 1), "lost_s": round(back - kill["t"], 1)})
    return out


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_rank_killed_in_an_update_a_collection_and_a_save_the_run_ends_as_if_uninterrupted(
        uninterrupted, tmp_path, strategy):
    proc = run(torchrun(str(tmp_path), strategy, "1", restarts=3), timeout=600, **FRESH_STORES, **forked_ranks())
    assert proc.returncode == 0 and proc.leftovers == 0, proc.stdout[-6000:]
    log = events(tmp_path)
    kills = [(e["attempt"], e["rank"], e["where"]) for e in log if e["event"] == "kill"]
    assert kills == [(0, 1, "update"), (1, 0, "collection"), (2, 1, "save")]
    assert sorted((e["attempt"], e["rank"]) for e in log if e["event"] == "done") == [(3, 0), (3, 1)]
    # each restart resumed from the last complete checkpoint (the save killed half-way is not one)
    for attempt, resumed_at in ((1, 96), (2, 192), (3, 240)):
        first = min(e["frames"] for e in log if e["attempt"] == attempt and e["event"] == "batch")
        assert first == resumed_at + 48, (attempt, first)
    ref, got = finals(uninterrupted, strategy), finals(tmp_path, strategy)
    assert_equal_runs(got[0], got[1] | {"rb_obs": got[0]["rb_obs"], "priorities": got[0]["priorities"],
                                        "rng": got[0]["rng"]}, "ranks")  # replay and RNG are per rank
    for r in (0, 1):
        assert_equal_runs(ref[r], got[r], f"rank {r} against the uninterrupted run")
    print(f"\n{strategy}: time lost per failure {time_lost(log)}")


def test_restarts_through_torchruns_shared_store_are_refused_naming_the_fix(tmp_path):
    """Without TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 the restarted ranks could never connect: the learner
    refuses before any group starts, in every attempt, and torchrun gives up after its restarts."""
    proc = run(torchrun(str(tmp_path), "ddp", "0", restarts=1), timeout=300, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="0",
               **forked_ranks())
    assert proc.returncode != 0 and proc.leftovers == 0
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in proc.stdout, proc.stdout[-4000:]
    assert {e["attempt"] for e in events(tmp_path)} == {0, 1}
    assert not [e for e in events(tmp_path) if e["event"] != "start"]


def test_two_nodes_on_c10d_rendezvous_recover_from_a_killed_rank(uninterrupted, tmp_path):
    """Two torchrun "nodes" of one rank each meet through the c10d rendezvous on the loopback address;
    rank 1's worker is killed during an update: both agents restart their workers, which resume and
    end as the uninterrupted DDP run."""
    from concurrent.futures import ThreadPoolExecutor

    port = free_port()

    def node(n):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1", "--max-restarts=3",
               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=elastic-{port}",
               f"--node-rank={n}", RELAY, SCRIPT, str(tmp_path), "ddp", "once"]
        return run(cmd, timeout=600, **FRESH_STORES, **forked_ranks())

    with ThreadPoolExecutor(max_workers=2) as pool:
        nodes = list(pool.map(node, (0, 1)))
    for n, proc in enumerate(nodes):
        assert proc.returncode == 0 and proc.leftovers == 0, (n, proc.stdout[-4000:])
    log = events(tmp_path)
    assert [(e["rank"], e["where"]) for e in log if e["event"] == "kill"] == [(1, "update")]
    assert sorted(e["rank"] for e in log if e["event"] == "done") == [0, 1]
    ref, got = finals(uninterrupted, "ddp"), finals(tmp_path, "ddp")
    for r in (0, 1):
        assert_equal_runs(ref[r], got[r], f"rank {r} against the uninterrupted run")
    print(f"\n2 nodes: time lost per failure {time_lost(log)}")
