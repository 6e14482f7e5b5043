"""Asynchronous sharded saves (``save(path, blocking=False)``) on 2 real gloo processes under FSDP.

Launches: tests/workers/async_save_checks.py ``main`` (what an async save holds, what waits for it)
and ``kill`` (rank 1 SIGKILLed during the background write).
"""

from __future__ import annotations

import os

import pytest
import torch
from multiproc import WORKERS, launch, plain_python
from rl_cases import make_loss

from fabric_learner import LocalLearner
from fabric_learner.checkpoint import dcp_folder

SCRIPT = os.path.join(WORKERS, "async_save_checks.py")


@pytest.fixture(scope="module")
def main(tmp_path_factory):
    out = tmp_path_factory.mktemp("async_main")
    proc = launch(SCRIPT, "main", out, timeout=300)
    assert proc.returncode == 0 and proc.leftovers == 0, proc.stdout[-6000:]
    return {"ranks": [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)], "dir": out}


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    out = tmp_path_factory.mktemp("async_kill")
    proc = plain_python(SCRIPT, "kill", str(out), timeout=300)  # rank 0 forked from the zygote; it starts rank 1
    assert proc.leftovers == 0, proc.stdout[-6000:]
    return {"rank0": torch.load(out / "kill_rank0.pt", weights_only=False), "dir": out,
            "rank1_wrote_results": (out / "kill_rank1.pt").exists()}


def by_name(checkpoint):
    """Optimizer moments keyed by parameter name (learners may index their optimizers differently)."""
    names = checkpoint["param_names"]
    return {names[int(i)]: fields for i, fields in checkpoint["optimizer"]["state"].items()}


def assert_same_state(a, b):
    assert a["num_updates"] == b["num_updates"]
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    moments_a, moments_b = by_name(a), by_name(b)
    assert moments_a.keys() == moments_b.keys() and moments_a
    for name in moments_a:
        assert moments_a[name].keys() == moments_b[name].keys(), name
        for field, value in moments_a[name].items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(moments_b[name][field])), (name, field)


def test_an_async_save_holds_its_moments_state_although_training_went_on(main):
    for rank in main["ranks"]:
        assert rank["handle_type"] == "Future" and rank["done_after_wait"]
        assert rank["at_save"]["num_updates"] == 2 and rank["after_steps"]["num_updates"] == 4
        changed = [k for k in rank["at_save"]["model"]
                   if not torch.equal(rank["at_save"]["model"][k], rank["after_steps"]["model"][k])]
        assert changed  # the two steps taken during the write changed the live weights ...
        assert_same_state(rank["loaded"], rank["at_save"])  # ... but the checkpoint is of save()'s moment


def test_an_async_save_writes_what_a_sync_save_writes(main):
    sync, background = (dcp_folder.read_full(main["dir"] / name) for name in ("sync", "async"))
    assert_same_state(sync, background)
    assert sync["param_names"] == background["param_names"]
    assert sync["optimizer"]["param_groups"] == background["optimizer"]["param_groups"]
    assert len(sync["rng"]) == len(background["rng"]) == 2
    for a, b in zip(sync["rng"], background["rng"]):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_load_and_the_next_save_wait_for_the_pending_save(main):
    for rank in main["ranks"]:
        waits = rank["load_waits"]
        assert waits["handle_done"]
        assert_same_state(waits["after_load"], waits["before"])  # read the version the pending save wrote
        saves = rank["save_waits"]
        assert saves["first_done_when_second_returned"] and saves["second_done"]
        assert saves["versions"] == [saves["published"][0]] and saves["published"][1] == saves["updates"] == 5


def test_close_and_interpreter_exit_wait_for_the_pending_save(main):
    for rank in main["ranks"]:
        close = rank["close_waits"]
        assert close["handle_done"] and close["published"][1] == close["updates"] == 6
    # the worker returned with a save pending: the exit hook completed and published it
    fresh = LocalLearner(make_loss("sac", seed=21)[0])
    fresh.load(main["dir"] / "exit_waits")
    expected = main["ranks"][0]["exit_state"]
    assert fresh.num_updates == expected["num_updates"] == 4
    for k, v in expected["model"].items():
        assert torch.equal(fresh.checkpoint()["model"][k], v), k


def test_unsharded_blocking_false_saves_before_returning(main):
    for rank in main["ranks"]:
        assert rank["ddp"] == {"done": True, "exists": True}


def test_a_rank_killed_during_the_background_write_leaves_the_previous_checkpoint(killed):
    rank0, path = killed["rank0"], killed["dir"] / "ckpt"
    assert not killed["rank1_wrote_results"]  # rank 1 really died in its background write
    assert rank0["error"] is not None and "still the previous complete one" in rank0["error"], rank0["error"]
    version, updates = rank0["previous"]["published"]
    assert updates == 2
    assert (path / "LATEST").read_text() == version  # never switched to the killed version
    folders = sorted(p.name for p in path.iterdir() if p.is_dir())
    assert len(folders) == 2 and version in folders
    killed_version = path / next(f for f in folders if f != version)
    assert (killed_version / "__1_0.distcp").exists()  # rank 1's shards were written ...
    assert not (killed_version / "meta.json").exists()  # ... but the version was never completed
    fresh = LocalLearner(make_loss("sac", seed=21)[0])
    fresh.load(path)  # complete and valid: every check of a sharded load passes
    assert_same_state(fresh.checkpoint(), rank0["previous"]["state"])
