"""Asynchronous collection (fabric_learner.asynchronous, docs/asynchronous.md).

One process: LocalLearner with torchrl's AsyncCollector (environment in another process).
Two ranks: tests/workers/async_checks.py, one launch for DDP, FSDP and a resume, rank 1's
environment sleeping 0.1 s per step; a second launch where rank 1 stops mid-training.
"""

from __future__ import annotations

import copy
import os
import sys
import time

import pytest
import torch
from multiproc import WORKERS, launch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule

sys.path.insert(0, WORKERS)

import async_common as ac
import trainer_common as tc
from rl_cases import make_loss
from torchrl.collectors import Collector

from fabric_learner import AsyncCollection, LocalLearner, Trainer, VersionedPolicy


def local(loss, optimizer, policy):
    return LocalLearner(loss, optimizer, policy=policy)


# ---- one process ------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs,match", [
    ({"max_policy_lag": -1}, "max_policy_lag"), ({"max_policy_lag": 1.5}, "max_policy_lag"),
    ({"max_policy_lag": True}, "max_policy_lag"), ({"max_queued_batches": 0}, "max_queued_batches"),
    ({"poll_s": 0}, "poll_s"),
])
def test_bad_settings_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AsyncCollection(**kwargs)


def test_a_collector_without_a_versioned_policy_is_refused_before_anything_changes():
    loss, qnet = make_loss("dqn")
    learner = LocalLearner(loss, policy=qnet)
    collector = Collector(tc.make_env(), copy.deepcopy(qnet), frames_per_batch=tc.FRAMES_PER_BATCH, total_frames=-1)
    before = {k: v.clone() for k, v in learner.state_dict().items()}
    with pytest.raises(TypeError, match="VersionedPolicy"):
        Trainer(learner=learner, collector=collector, total_frames=100, optim_steps_per_batch=1,
                async_collection=AsyncCollection())
    with pytest.raises(TypeError, match="AsyncCollection"):
        Trainer(learner=learner, collector=collector, total_frames=100, optim_steps_per_batch=1, async_collection="yes")
    assert all(torch.equal(before[k], v) for k, v in learner.state_dict().items()) and learner.num_updates == 0
    collector.shutdown()


def test_versioned_policy_labels_a_frame_with_the_version_read_before_acting():
    class Publishes(torch.nn.Module):
        """A policy during whose forward new weights and version 7 arrive (as from another process)."""

        def __init__(self):
            super().__init__()
            self.owner = []  # not a submodule

        def forward(self, obs):
            self.owner[0].version.fill_(7)
            return obs.sum(-1, keepdim=True)

    inner = Publishes()
    policy = VersionedPolicy(TensorDictModule(inner, in_keys=["observation"], out_keys=["action"]))
    inner.owner.append(policy)
    policy.version.fill_(3)
    out = policy(TensorDict({"observation": torch.ones(5, 4)}, [5]))
    assert out["policy_version"].tolist() == [3] * 5  # not 7: never newer than the weights it acted with
    weights = VersionedPolicy.weights(TensorDict.from_module(policy.policy), 11)
    weights.to_module(policy)
    assert policy.version.item() == 11 and out["action"].shape == (5, 1)


@pytest.fixture
def forked_collectors():
    """The collector's environment process by fork, as in the 2-rank worker: torchrl's default,
    spawn, imports torch and torchrl again (seconds on 2 shared cores); nothing tested depends on it."""
    import multiprocessing

    before = multiprocessing.get_start_method(allow_none=True)
    multiprocessing.set_start_method("fork", force=True)
    yield
    multiprocessing.set_start_method(before, force=True)


def test_one_process_async_dqn_admits_only_fresh_frames_and_stamps_published_versions(forked_collectors):
    trainer, learner, admissions, rb = ac.build(local, total_frames=20 * ac.FRAMES_PER_BATCH, max_policy_lag=3)
    trainer.train()
    s = trainer.async_stats
    assert learner.num_updates == trainer._optim_count > 0
    assert s["admitted_frames"] + s["dropped_frames"] == trainer.collected_frames >= 20 * ac.FRAMES_PER_BATCH
    assert s["dropped_frames"] == s["global_dropped_frames"]
    assert admissions.frames == s["admitted_frames"] == len(rb) and admissions.max_lag <= 3
    versions = rb[:len(rb)]["policy_version"]
    # published after each round of optim_steps_per_batch updates per batch: multiples of 3
    assert (versions % ac.OPTIM_STEPS == 0).all() and versions.max() <= learner.num_updates
    assert s["queue_high_water"] <= 2


def test_backpressure_bounds_what_waits_while_the_learner_is_slow(forked_collectors):
    """The learner sleeps 0.2 s a round; the collector could make ~50 batches meanwhile, but the
    feeder holds at most the queue (1) plus the batch in its hand."""
    trainer, learner, _, _ = ac.build(local, total_frames=12 * ac.FRAMES_PER_BATCH, max_queued_batches=1)
    trainer.register_op("post_steps", lambda: time.sleep(0.2))
    trainer.train()
    s = trainer.async_stats
    assert s["queue_high_water"] == 1 and s["max_backlog"] <= 2, s
    assert learner.num_updates > 0


# ---- two ranks --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("async_2ranks")
    proc = launch(os.path.join(WORKERS, "async_checks.py"), out, timeout=540)  # under pytest-timeout's 600
    assert proc.returncode == 0 and proc.leftovers == 0, proc.stdout[-6000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_ranks_take_the_same_updates_when_one_env_is_much_slower(ranks, strategy):
    r0, r1 = (r[strategy] for r in ranks)
    assert r0["num_updates"] == r1["num_updates"] == r0["optim_count"] == r1["optim_count"] > 0
    for k in r0["params"]:
        assert torch.equal(r0["params"][k], r1["params"][k]), k
    start = make_loss("dqn")[0].state_dict()
    assert any(not torch.equal(start[k], v) for k, v in r0["params"].items())  # it trained
    # rank 1 is the slow one (how much fewer depends on the machine: rank 0 is held back by its own queue)
    assert r0["stats"]["batches"] > r1["stats"]["batches"] >= 1
    assert r0["collected_frames"] == r1["collected_frames"] >= 16 * ac.FRAMES_PER_BATCH


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_stale_frames_are_dropped_counted_and_never_trained_on(ranks, strategy):
    r0, r1 = (r[strategy] for r in ranks)
    lag = 3  # async_checks.LAG
    for r in (r0, r1):
        s = r["stats"]
        assert r["hook_frames"] == s["admitted_frames"] == r["rb_len"]  # only admitted frames reach the buffer
        assert r["hook_max_lag"] <= lag and s["max_admitted_lag"] <= lag
        assert s["queue_high_water"] <= 2
    total = sum(r["stats"]["admitted_frames"] + r["stats"]["dropped_frames"] for r in (r0, r1))
    assert total == r0["collected_frames"]  # every collected frame is admitted or counted as dropped
    dropped = r0["stats"]["dropped_frames"] + r1["stats"]["dropped_frames"]
    assert r0["stats"]["global_dropped_frames"] == r1["stats"]["global_dropped_frames"] == dropped > 0


def test_resume_discards_in_flight_work_and_says_so(ranks):
    for rank, r in enumerate(ranks):
        res = r["resume"]
        assert res["files"] == ["learner.ckpt", "meta.json", "rank0.pt", "rank1.pt"]
        assert isinstance(res["rank_file_async"]["queued_frames"], int)
        loaded, b = res["C_loaded"], res["B"]
        assert loaded["num_updates"] == b["num_updates"] > 0 and loaded["collected_frames"] == b["collected_frames"]
        assert loaded["rb_len"] == b["rb_len"]  # admitted frames are kept
        for k in b["params"]:
            assert torch.equal(loaded["params"][k], b["params"][k]), k
        assert any("not the" in w and "frames that were queued" in w for w in res["warnings"]), res["warnings"]
        assert res["C"]["num_updates"] > b["num_updates"]
    assert ranks[0]["resume"]["C"]["num_updates"] == ranks[1]["resume"]["C"]["num_updates"]
    for k in ranks[0]["resume"]["C"]["params"]:
        assert torch.equal(ranks[0]["resume"]["C"]["params"][k], ranks[1]["resume"]["C"]["params"][k])


def test_a_rank_that_stops_fails_its_peer_naming_the_round_instead_of_hanging(tmp_path):
    proc = launch(os.path.join(WORKERS, "async_checks.py"), tmp_path, "stops", timeout=300)
    assert proc.returncode != 0 and proc.leftovers == 0, proc.stdout[-4000:]
    assert "Rank 0: asynchronous round" in proc.stdout and "could not complete a collective" in proc.stdout, \
        proc.stdout[-4000:]
    assert "rank 1 ends its program" in proc.stdout
