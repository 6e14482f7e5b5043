"""fabric_learner.Trainer: torchrl's Trainer driven by a Learner (docs/contract.md §9).

Single-process tests use LocalLearner; the DDP tests start 2 real gloo processes once
(tests/workers/trainer_ddp.py) and compare what each rank saved.
"""

from __future__ import annotations

import functools
import os
import sys

import pytest
import torch
from multiproc import WORKERS, launch
from tensordict import TensorDict
from torchrl.trainers import OptimizationStepper

sys.path.insert(0, WORKERS)

import trainer_common as tc

from fabric_learner import LocalLearner
from fabric_learner.onpolicy import (
    EpochPartitionSampler,
    global_mean,
    normalize_advantage,
    partition_indices,
)
from fabric_learner.replay import TorchPrioritizedSampler
from fabric_learner.trainer import Trainer
from fabric_learner.weights import PublishWeights, collector_policy, shares_policy_memory


def local(loss, optimizer, policy):
    return LocalLearner(loss, optimizer, policy=policy, clip_grad_norm=1.0)


def assert_same(a: dict, b: dict, what: str = "") -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{what}{k} differs"


def _plain(x):
    return [_plain(v) for v in x] if isinstance(x, (list, tuple)) else x


def assert_same_optimizer(a: dict, b: dict) -> None:
    # a sharded checkpoint keeps param groups as JSON: Adam's betas come back as a list
    assert [{k: _plain(v) for k, v in g.items()} for g in a["param_groups"]] == \
        [{k: _plain(v) for k, v in g.items()} for g in b["param_groups"]]
    for i, s in a["state"].items():
        for k, v in s.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(b["state"][i][k])), f"optimizer state {i}.{k}"


def assert_priorities_from_last_minibatch(snap, last) -> None:
    """The sampler holds (|td_error| + eps) ** alpha at the indices of the last minibatch."""
    index, td_error = last
    index, td_error = index.reshape(-1), td_error.reshape(-1)
    expected = (td_error + snap["eps"]) ** snap["alpha"]
    # with replacement an index may repeat in a minibatch; the last write wins
    for i in index.unique():
        where = (index == i).nonzero().max()
        torch.testing.assert_close(snap["priorities"][i], expected[where])
    assert not torch.allclose(snap["priorities"], torch.ones_like(snap["priorities"])), "priorities never updated"


# ---- one process ------------------------------------------------------------------------------


def test_local_trainer_resume_equals_uninterrupted(tmp_path):
    total = 6 * tc.FRAMES_PER_BATCH
    a = tc.build_dqn(local, total_frames=total)
    a[0].train()
    b = tc.build_dqn(local, total_frames=total // 2, save_file=tmp_path / "ckpt")
    b[0].train()
    c = tc.build_dqn(local, total_frames=total)
    c[0].load_from_file(tmp_path / "ckpt")
    assert c[1].num_updates == b[1].num_updates == 3 * tc.OPTIM_STEPS
    c[0].train()
    sa, sc = tc.snapshot(*a), tc.snapshot(*c)
    assert sa["num_updates"] == sc["num_updates"] == 6 * tc.OPTIM_STEPS
    assert sa["optim_count"] == sc["optim_count"] and sa["collected_frames"] == sc["collected_frames"] == total
    assert_same(sa["params"], sc["params"])
    assert_same_optimizer(sa["optimizer"], sc["optimizer"])
    assert torch.equal(sa["rb_obs"], sc["rb_obs"]) and torch.equal(sa["priorities"], sc["priorities"])


class _Crash(Exception):
    pass


def test_a_rerun_with_the_same_save_file_resumes_from_the_last_checkpoint_like_a_restart(tmp_path):
    """A run killed after its 3rd batch's checkpoint, built again and trained: it resumes by itself
    (no load_from_file) and ends equal to the uninterrupted run; run once more, it has nothing left to do."""
    total, ckpt = 6 * tc.FRAMES_PER_BATCH, tmp_path / "ckpt"
    a = tc.build_dqn(local, total_frames=total)
    a[0].train()
    b = tc.build_dqn(local, total_frames=total, save_file=ckpt, save_interval=0)  # a checkpoint after every batch

    def crash(batch):
        if b[0].collected_frames == 4 * tc.FRAMES_PER_BATCH:  # during the 4th batch, before its checkpoint
            raise _Crash

    b[0].register_op("pre_steps_log", crash)
    with pytest.raises(_Crash):
        b[0].train()
    assert b[1].num_updates == 3 * tc.OPTIM_STEPS  # the 4th batch was collected, not trained on
    c = tc.build_dqn(local, total_frames=total, save_file=ckpt, save_interval=0, seed=7)  # the state comes from the checkpoint
    batches = []
    c[0].register_op("pre_steps_log", batches.append)
    c[0].train()
    assert len(batches) == 3  # the 4th batch again, then the 5th and 6th
    sa, sc = tc.snapshot(*a), tc.snapshot(*c)
    assert sc["num_updates"] == sa["num_updates"] == 6 * tc.OPTIM_STEPS
    assert sa["optim_count"] == sc["optim_count"] and sa["collected_frames"] == sc["collected_frames"] == total
    assert_same(sa["params"], sc["params"])
    assert_same_optimizer(sa["optimizer"], sc["optimizer"])
    assert torch.equal(sa["rb_obs"], sc["rb_obs"]) and torch.equal(sa["priorities"], sc["priorities"])
    assert torch.equal(sa["rng"], sc["rng"])
    done = tc.build_dqn(local, total_frames=total, save_file=ckpt, save_interval=0)
    done[0].register_op("pre_steps_log", crash)  # a batch collected at all would be one too many
    done[0].train()
    assert done[1].num_updates == 6 * tc.OPTIM_STEPS and done[0].collected_frames == total
    assert_same(tc.snapshot(*done)["params"], sa["params"])


def test_resume_false_starts_afresh_and_load_from_file_wins(tmp_path):
    total, ckpt = 2 * tc.FRAMES_PER_BATCH, tmp_path / "ckpt"
    first = tc.build_dqn(local, total_frames=total, save_file=ckpt)
    first[0].train()
    fresh = tc.build_dqn(local, total_frames=total, save_file=ckpt, resume=False)
    fresh[0].train()  # from zero: the same run again
    assert fresh[1].num_updates == first[1].num_updates and fresh[0].collected_frames == total
    assert_same(tc.snapshot(*fresh)["params"], tc.snapshot(*first)["params"])
    other = tmp_path / "other"
    shorter = tc.build_dqn(local, total_frames=tc.FRAMES_PER_BATCH, save_file=other)
    shorter[0].train()
    given = tc.build_dqn(local, total_frames=total, save_file=ckpt)
    given[0].load_from_file(other)  # the user's choice of checkpoint is not replaced by the latest one
    given[0].train()
    assert given[0].collected_frames == total and given[1].num_updates == 2 * tc.OPTIM_STEPS


def test_post_loss_priority_updates_run_unlike_stock_torchrl():
    from torchrl.trainers import Trainer as TorchRLTrainer

    record = []
    trainer, learner, loss, qnet, rb, collector = tc.build_dqn(local, total_frames=3 * tc.FRAMES_PER_BATCH, record=record)
    trainer.train()
    assert len(record) == learner.num_updates == 3 * tc.OPTIM_STEPS  # post_loss ran after every update
    assert_priorities_from_last_minibatch(tc.snapshot(trainer, learner, loss, qnet, rb, collector), record[-1])

    # the same hooks on torchrl's own Trainer with an optimization stepper: priorities never move
    class Stepper(OptimizationStepper):
        def step(self, trainer, sub_batch):
            return other.update(sub_batch)

    other_loss, other_q = tc.make_loss("dqn")
    other = LocalLearner(other_loss, policy=other_q)
    env = tc.make_env()
    col = tc.Collector(env, other_q, frames_per_batch=tc.FRAMES_PER_BATCH, total_frames=-1,
                       auto_register_policy_transforms=False)
    rb2 = tc.TensorDictReplayBuffer(storage=tc.LazyTensorStorage(1000), sampler=TorchPrioritizedSampler(1000, 0.7, 0.5),
                                    priority_key="td_error", batch_size=tc.RB_BATCH)
    stock = TorchRLTrainer(collector=col, total_frames=2 * tc.FRAMES_PER_BATCH, frame_skip=1, optim_steps_per_batch=2,
                           loss_module=other_loss, optimization_stepper=Stepper(), progress_bar=False)
    with pytest.warns(FutureWarning):
        tc.ReplayBufferTrainer(rb2, flatten_tensordicts=True).register(stock)
    stock.train()
    n = len(rb2)
    assert other.num_updates == 4
    assert torch.equal(rb2._sampler._sum_tree.values[:n], torch.ones(n)), "stock torchrl updated priorities after all"


def test_in_memory_state_dict_round_trip():
    total = 4 * tc.FRAMES_PER_BATCH
    a = tc.build_dqn(local, total_frames=total // 2)
    a[0].train()
    b = tc.build_dqn(local, total_frames=total)
    b[0].load_state_dict(a[0].state_dict())
    sa, sb = tc.snapshot(*a), tc.snapshot(*b)
    for key in ("num_updates", "optim_count", "collected_frames", "rb_len"):
        assert sa[key] == sb[key], key
    assert_same(sa["params"], sb["params"])
    assert torch.equal(sa["priorities"], sb["priorities"]) and torch.equal(sa["rng"], sb["rng"])
    b[0].train()
    assert b[1].num_updates == 4 * tc.OPTIM_STEPS


def test_hook_stages_the_learner_cannot_honour_are_refused():
    trainer = tc.build_dqn(local, total_frames=tc.FRAMES_PER_BATCH)[0]
    for dest in ("process_loss", "optimizer"):
        with pytest.raises(RuntimeError, match="learner.update"):
            trainer.register_op(dest, lambda *a: None)
    loss, q = tc.make_loss("dqn")
    learner = LocalLearner(loss, policy=q)
    for kwargs, match in (({"loss_module": loss}, "from the learner"), ({"optimizer": learner.optimizer}, "from the learner"),
                          ({"clip_norm": 1.0}, "clip_grad_norm")):
        with pytest.raises(TypeError, match=match):
            Trainer(learner=learner, collector=None, total_frames=1, optim_steps_per_batch=1, **kwargs)


def _pendulum_trainer(tmp_path, learner_factory=local, frames_batches=2, minibatch=400, epochs=2):
    sys.path.insert(0, os.path.join(os.path.dirname(WORKERS), "..", "examples"))
    import ppo_pendulum as ex

    args = ex.parse_args(["--devices", "1", "--envs", "4", "--frames", str(frames_batches * 4 * ex.MAX_STEPS),
                          "--epochs", str(epochs), "--minibatch", str(minibatch), "--logdir", str(tmp_path / "tb"),
                          "--no-progress"])
    return ex, args


def test_ppo_example_pipeline_counts_updates_and_logs_to_tensorboard(tmp_path):
    """The example's hooks in one process: partitions, global normalisation, Fabric TensorBoard logging."""
    ex, args = _pendulum_trainer(tmp_path)
    learner, trainer, returns = ex.build(args, {"accelerator": "cpu", "devices": 1})
    trainer.train()
    per_epoch = 4 * ex.MAX_STEPS // 400
    assert learner.num_updates == trainer._optim_count == 2 * args.epochs * per_epoch
    assert len(returns.curve) == 2 and all(torch.isfinite(torch.tensor(r)) for _, r, _ in returns.curve)
    assert shares_policy_memory(learner, trainer.collector)  # the collector acts with the trained weights in place

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    runs = [os.path.join(r, f) for r, _, fs in os.walk(tmp_path / "tb") for f in fs if f.startswith("events")]
    assert runs, "no TensorBoard event file"
    acc = EventAccumulator(os.path.dirname(runs[0]))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"loss_objective", "loss_critic", "grad_norm", "episode_return", "fps", "updates_per_s"} <= tags, tags


def test_dqn_example_runs_in_one_process(tmp_path):
    sys.path.insert(0, os.path.join(os.path.dirname(WORKERS), "..", "examples"))
    import dqn_replay_ddp as ex

    args = ex.parse_args(["--devices", "1", "--frames", "1280", "--logdir", "", "--no-progress",
                          "--checkpoint", str(tmp_path / "ckpt")])
    learner, trainer, lengths = ex.build(args, {"accelerator": "cpu", "devices": 1})
    trainer.train()
    init_batches = -(-1000 // (args.envs * args.steps))  # collector.init_random_frames = 1000
    assert learner.num_updates == (1280 // (args.envs * args.steps) - init_batches + 1) * args.updates
    assert (tmp_path / "ckpt" / "meta.json").exists()
    assert trainer._modules["replay_buffer"].replay_buffer._sampler._max_priority[0] is not None


@pytest.mark.parametrize("entries,loads", [("earlier", True), ("unknown", False)])
def test_trainer_checkpoints_of_the_earlier_hook_states_still_load(tmp_path, entries, loads):
    """LearnerValueEstimator once saved no state and EpochPartitionSampler only its generator:
    checkpoints written so still resume; any other set of entries is refused before anything changes."""
    ex, args = _pendulum_trainer(tmp_path, frames_batches=1, minibatch=300, epochs=1)
    learner, trainer, _ = ex.build(args, {"accelerator": "cpu", "devices": 1})
    trainer.train()
    trainer.save_checkpoint(tmp_path / "ckpt")
    rank_file = tmp_path / "ckpt" / "rank0.pt"
    state = torch.load(rank_file, weights_only=True)
    generator = trainer._modules["epoch_partition_sampler"].state_dict()["generator"]
    if entries == "earlier":
        state["modules"]["value_estimator"] = {}
        state["modules"]["epoch_partition_sampler"] = {"generator": generator}
    else:
        state["modules"]["epoch_partition_sampler"] = {"generator": generator, "bogus": 1}
    torch.save(state, rank_file)
    fresh_learner, fresh, _ = ex.build(args, {"accelerator": "cpu", "devices": 1})
    if loads:
        fresh.load_from_file(tmp_path / "ckpt")
        assert fresh_learner.num_updates == learner.num_updates
        restored = fresh._modules["epoch_partition_sampler"].state_dict()["generator"]
        assert (restored is None and generator is None) or torch.equal(restored, generator)
    else:
        with pytest.raises(ValueError, match="epoch_partition_sampler.*bogus"):
            fresh.load_from_file(tmp_path / "ckpt")
        assert fresh_learner.num_updates == 0


def test_partition_sampler_with_stop_iteration_counts_only_real_steps(tmp_path):
    ex, args = _pendulum_trainer(tmp_path, frames_batches=1, minibatch=300, epochs=3)
    learner, trainer, _ = ex.build(args, {"accelerator": "cpu", "devices": 1})
    trainer.optim_steps_per_batch = None  # run each epoch until the sampler raises StopIteration
    trainer.train()
    assert learner.num_updates == trainer._optim_count == 3 * (4 * ex.MAX_STEPS // 300)


def test_publish_weights_copies_into_a_collector_that_holds_its_own_policy():
    import copy

    loss, q = tc.make_loss("dqn")
    learner = LocalLearner(loss, functools.partial(torch.optim.Adam, lr=1e-2), policy=q)
    own = copy.deepcopy(q)
    collector = tc.Collector(tc.make_env(), own, frames_per_batch=tc.FRAMES_PER_BATCH, total_frames=-1,
                             auto_register_policy_transforms=False)
    assert not shares_policy_memory(learner, collector)
    rb = tc.TensorDictReplayBuffer(storage=tc.LazyTensorStorage(1000), batch_size=tc.RB_BATCH)
    trainer = Trainer(learner=learner, collector=collector, total_frames=3 * tc.FRAMES_PER_BATCH,
                      optim_steps_per_batch=2, progress_bar=False)
    tc.ReplayBufferTrainer(rb, flatten_tensordicts=True).register(trainer)
    trainer.train()
    publisher = trainer._modules["publish_weights"]
    assert isinstance(publisher, PublishWeights) and publisher.copies == 3
    theirs = TensorDict.from_module(collector_policy(collector))
    for key, value in learner.get_weights().items(True, True):
        assert torch.equal(theirs[key], value), key


def test_interrupted_save_leaves_previous_checkpoint_loadable(tmp_path):
    trainer, learner = tc.build_dqn(local, total_frames=2 * tc.FRAMES_PER_BATCH, save_file=tmp_path / "ckpt")[:2]
    trainer.train()
    saved_updates = learner.num_updates

    def crash(path):
        raise KeyboardInterrupt("killed mid-save")

    learner.update(trainer._modules["replay_buffer"].sample(None))
    learner.save = crash
    with pytest.raises(KeyboardInterrupt):
        trainer.save_checkpoint(tmp_path / "ckpt")
    fresh, fresh_learner = tc.build_dqn(local, total_frames=4 * tc.FRAMES_PER_BATCH)[:2]
    fresh.load_from_file(tmp_path / "ckpt")
    assert fresh_learner.num_updates == saved_updates


def test_torch_prioritized_sampler_samples_by_priority_and_round_trips(tmp_path):
    rb = tc.TensorDictReplayBuffer(storage=tc.LazyTensorStorage(64), sampler=TorchPrioritizedSampler(64, alpha=1.0, beta=0.5),
                                   priority_key="td_error", batch_size=4000)
    rb.extend(TensorDict({"x": torch.arange(10.0)}, [10]))
    prio = torch.ones(10)
    prio[3] = 10.0
    rb.update_tensordict_priority(TensorDict({"index": torch.arange(10), "td_error": prio}, [10]))
    torch.manual_seed(0)
    import numpy as np

    np.random.seed(0)
    sample = rb.sample()
    share = (sample["index"] == 3).float().mean().item()
    assert abs(share - 10 / 19) < 0.04
    weights = sample["priority_weight"]
    torch.testing.assert_close(weights[sample["index"] == 3], torch.full_like(weights[sample["index"] == 3], 10 ** -0.5))
    torch.save(rb.state_dict(), tmp_path / "rb.pt")
    other = tc.TensorDictReplayBuffer(storage=tc.LazyTensorStorage(64), sampler=TorchPrioritizedSampler(64, 1.0, 0.5),
                                      priority_key="td_error", batch_size=4000)
    other.load_state_dict(torch.load(tmp_path / "rb.pt", weights_only=True))
    np.random.seed(1)
    a = rb.sample()["index"]
    np.random.seed(1)
    assert torch.equal(a, other.sample()["index"])


# ---- the global helpers, one process (they reduce to the local computation) ----------------------


def test_normalize_advantage_matches_torchrl_in_one_process():
    from torchrl._utils import _standardize

    td = TensorDict({"advantage": torch.randn(20, 1) * 3 + 1, "valid": torch.rand(20) > 0.3}, [20])
    out = normalize_advantage(td.clone())
    torch.testing.assert_close(out["advantage"], _standardize(td["advantage"]))
    masked = normalize_advantage(td.clone(), mask_key="valid")
    a, m = td["advantage"], td["valid"].unsqueeze(-1)
    mean = a[m].mean()
    std = ((a[m] - mean) ** 2).mean().sqrt()
    torch.testing.assert_close(masked["advantage"], (a - mean) / std)
    torch.testing.assert_close(global_mean(a, td["valid"]), mean)


def test_global_mean_loss_is_the_masked_mean_in_one_process():
    loss, _ = tc.make_global_ppo()
    batch = tc.equivalence_batch()
    out = loss(batch)
    ref = loss.loss_module(batch)
    valid = batch["valid"]
    for key in ("loss_objective", "loss_critic", "loss_entropy"):
        torch.testing.assert_close(out[key], ref[key][valid].mean())
    assert out["entropy"].ndim == 0


def test_partition_indices_cover_without_replacement():
    g = torch.Generator().manual_seed(0)
    parts = partition_indices(10, 3, generator=g)
    assert [len(p) for p in parts] == [3, 3, 3]
    flat = torch.cat(parts)
    assert flat.unique().numel() == 9
    sampler = EpochPartitionSampler(4, seed=3)
    data = TensorDict({"i": torch.arange(12)}, [12])
    for _ in range(2):
        sampler.start_epoch(data)
        seen = []
        with pytest.raises(StopIteration):
            while True:
                seen.append(sampler(data)["i"])
        assert sorted(torch.cat(seen).tolist()) == list(range(12))


def _epoch(sampler, data):
    sampler.start_epoch(data)
    out = []
    with pytest.raises(StopIteration):
        while True:
            out.append(sampler(data)["i"].tolist())
    return out


@pytest.mark.parametrize("n", [12, 10])
def test_partition_sampler_resumes_with_the_partitions_of_the_uninterrupted_run(tmp_path, n):
    """Its state (generator and torchrl sampler) goes through a weights-only file and continues exactly."""
    data = TensorDict({"i": torch.arange(n)}, [n])
    whole = EpochPartitionSampler(4, seed=5)
    expected = [_epoch(whole, data) for _ in range(3)]
    first = EpochPartitionSampler(4, seed=5)
    assert _epoch(first, data) == expected[0]
    torch.save(first.state_dict(), tmp_path / "sampler.pt")
    resumed = EpochPartitionSampler(4, seed=5)
    resumed.load_state_dict(torch.load(tmp_path / "sampler.pt", weights_only=True))
    assert [_epoch(resumed, data) for _ in range(2)] == expected[1:]
    gens = torch.Generator().manual_seed(5)
    assert expected == [[p.tolist() for p in partition_indices(n, 4, generator=gens)] for _ in range(3)]


# ---- two ranks (DDP, then FSDP), one launch --------------------------------------------------------


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("trainer_2ranks")
    proc = launch(os.path.join(WORKERS, "trainer_ddp.py"), out, timeout=300)
    assert proc.returncode == 0, proc.stdout[-6000:]
    return [{**torch.load(out / f"rank{r}.pt", weights_only=False), "dir": out} for r in (0, 1)]


STRATEGIES = ["ddp", "fsdp"]


def runs(ranks, strategy):
    """Each rank's results for the DQN trainer runs under ``strategy``."""
    return [r if strategy == "ddp" else r["fsdp"] for r in ranks]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_trainer_ranks_identical_with_expected_updates(ranks, strategy):
    r0, r1 = runs(ranks, strategy)
    assert ranks[0]["world_size"] == 2
    assert all(r["sharded"] == (strategy == "fsdp") for r in (r0, r1))
    for run_name in ("A", "C"):
        assert_same(r0[run_name]["params"], r1[run_name]["params"], f"run {run_name}: ranks differ on ")
    expected = 6 * tc.OPTIM_STEPS
    for r in (r0, r1):
        assert r["A"]["num_updates"] == r["A"]["optim_count"] == expected
        assert r["A"]["collected_frames"] == 6 * tc.FRAMES_PER_BATCH * 2  # frames over both ranks
        assert r["record_len"] == expected
    start = tc.make_loss("dqn")[0].state_dict()
    assert any(not torch.equal(start[k], v) for k, v in r0["A"]["params"].items())
    assert not torch.equal(r0["A"]["rb_obs"], r1["A"]["rb_obs"])  # each rank collected its own data


def test_ddp_and_fsdp_trainers_learn_the_same(ranks):
    for r in ranks:
        for k, v in r["A"]["params"].items():
            torch.testing.assert_close(r["fsdp"]["A"]["params"][k], v, atol=1e-5, rtol=1e-5, msg=k)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_collector_policy_carries_trained_weights(ranks, strategy):
    start = TensorDict.from_module(tc.make_loss("dqn")[1])
    for r in runs(ranks, strategy):
        # the collector runs TensorDictSequential(qnet, EGreedyModule): the Q-network is its module 0
        acting = r["A"]["collector_weights"]
        qnet = acting["module", "0"]
        # it runs the loss's own Q-network in place (the learner's policy): shared memory under DDP,
        # kept full and refreshed after every step under FSDP (the same program, only the strategy differs)
        for key, value in r["A"]["learner_weights"].items(True, True):
            assert torch.equal(qnet[key], value), key
        assert any(not torch.equal(qnet[k], v) for k, v in start.items(True, True))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_seed_seeds_each_rank_like_one_process_with_seed_plus_1000_times_the_rank(ranks, strategy):
    """docs/trainer.md: ``seed=`` seeds rank r (collector, torch, numpy) with ``seed + 1000 * r``; the
    worker's trainers use seed=0, so rank r's torch seed is one process's with seed 1000 * r."""
    import numpy as np

    got = [r["seeded"] for r in runs(ranks, strategy)]
    numpy_state = np.random.get_state()
    try:
        for rank, seeded in enumerate(got):
            with torch.random.fork_rng():
                tc.build_dqn(local, total_frames=tc.FRAMES_PER_BATCH, seed=1000 * rank)
                assert torch.initial_seed() == seeded, (rank, seeded)
    finally:
        np.random.set_state(numpy_state)
    assert got[0] != got[1]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_priorities_updated_from_td_error(ranks, strategy):
    for r in runs(ranks, strategy):
        assert_priorities_from_last_minibatch(r["A"], r["last_minibatch"])


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_resume_from_trainer_checkpoint_equals_uninterrupted_run(ranks, strategy):
    for r in runs(ranks, strategy):
        assert r["ckpt_files"] == ["learner.ckpt", "meta.json", "rank0.pt", "rank1.pt"]
        assert r["C_loaded"] == {"num_updates": 3 * tc.OPTIM_STEPS, "collected_frames": 3 * tc.FRAMES_PER_BATCH * 2,
                                 "optim_count": 3 * tc.OPTIM_STEPS}
        a, c = r["A"], r["C"]
        assert c["num_updates"] == a["num_updates"] and c["collected_frames"] == a["collected_frames"]
        assert_same(a["params"], c["params"], "resumed run: ")
        assert_same_optimizer(a["optimizer"], c["optimizer"])
        assert torch.equal(a["rb_obs"], c["rb_obs"]) and torch.equal(a["priorities"], c["priorities"])
        assert torch.equal(a["rng"], c["rng"])


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_logging_and_progress_bar_on_rank0_only(ranks, strategy):
    r0, r1 = runs(ranks, strategy)
    assert r0["A"]["progress_bar"] and not r1["A"]["progress_bar"]
    names = {name for name, _, _ in r0["A"]["logged"]}
    assert {"reward", "grad_norm", "loss", "fps", "updates_per_s", "optim_steps"} <= names, names
    assert r1["A"]["logged"] == []


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_logged_losses_are_the_mean_over_ranks_of_each_ranks_batch_average(ranks, strategy):
    r0, r1 = runs(ranks, strategy)
    averages = []  # per rank: {collected frames at the batch: {name: mean over that batch's updates}}
    for r in (r0, r1):
        by_batch: dict[int, dict[str, list[float]]] = {}
        for frames, out in r["A_update_outputs"]:
            for name, value in out.items():
                by_batch.setdefault(frames, {}).setdefault(name, []).append(value)
        averages.append({f: {n: sum(v) / len(v) for n, v in outs.items()} for f, outs in by_batch.items()})
    assert averages[0].keys() == averages[1].keys() and len(averages[0]) == 6
    logged = {(name, step): value for name, value, step in r0["A"]["logged"]}
    for frames in averages[0]:
        own = [averages[r][frames]["loss"] for r in (0, 1)]
        assert logged["loss", frames] == pytest.approx(sum(own) / 2, rel=1e-5, abs=1e-7), (frames, own)
        # the ranks' batches differ, so neither rank's own average is what was logged
        assert all(logged["loss", frames] != pytest.approx(x, rel=1e-4) for x in own), (frames, own)
        # grad_norm is taken after the gradient sync: equal on every rank, and logged as it is
        norms = [averages[r][frames]["grad_norm"] for r in (0, 1)]
        assert norms[0] == pytest.approx(norms[1], rel=1e-5) and logged["grad_norm", frames] == pytest.approx(norms[0])


def test_global_log_scalar_averages_over_ranks(ranks):
    (s0, n0), (s1, n1) = (r["A"]["local_reward"] for r in ranks)
    for r in ranks:
        history = r["A"]["history"]
        assert history["reward_all_ranks"][-1] == pytest.approx((s0 + s1) / (n0 + n1), rel=1e-6)
    assert ranks[0]["A"]["history"]["reward"][-1] == pytest.approx(s0 / n0, rel=1e-6)  # torchrl's: rank-local


def test_a_stop_or_a_dry_collector_on_one_rank_stops_every_rank(ranks):
    for r in ranks:
        assert r["stops"]["request_stop"] == 2 * tc.FRAMES_PER_BATCH * 2
        assert r["stops"]["collector_dry"] == 3 * tc.FRAMES_PER_BATCH * 2


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_publish_from_rank0_only(ranks, strategy):
    key = "published" if strategy == "ddp" else "published_fsdp"
    r0, r1 = (r[key] for r in ranks)
    assert len(r0["sent"]) == 1 and not r0["returned_none"]
    assert r1["sent"] == [] and r1["returned_none"]
    for k, value in r0["weights"].items(True, True):
        assert torch.equal(r0["sent"][0][k], value)


def _one_process_reference(make):
    """One process on the whole batch: minibatch k of an epoch = rank 0's k-th + rank 1's k-th."""
    loss, actor = make()
    learner = LocalLearner(loss, torch.optim.Adam(loss.parameters(), lr=1e-2), policy=actor, clip_grad_norm=1.0)
    batch = tc.equivalence_batch()
    halves = [batch[: tc.EQ_N // 2], batch[tc.EQ_N // 2:]]
    gens = [torch.Generator().manual_seed(tc.EQ_SEED + r) for r in (0, 1)]
    norms = []
    for _ in range(tc.EQ_EPOCHS):
        parts = [partition_indices(tc.EQ_N // 2, tc.EQ_MINIBATCH, generator=g) for g in gens]
        for k in range(len(parts[0])):
            mb = torch.cat([halves[0][parts[0][k]], halves[1][parts[1][k]]]).clone()
            normalize_advantage(mb, mask_key="valid")
            norms.append(learner.update(mb)["grad_norm"])
    return {k: v.detach() for k, v in loss.named_parameters()}, torch.stack(norms)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_global_normalisation_on_two_ranks_equals_one_process_on_whole_batch(ranks, strategy):
    """Point 4: partitions + global advantage normalisation + global masked means, uneven valid counts."""
    params, norms = _one_process_reference(tc.make_global_ppo)
    name = "global" if strategy == "ddp" else "global_fsdp"
    for r in ranks:
        got = r["equivalence"][name]
        assert got["num_updates"] == tc.EQ_EPOCHS * (tc.EQ_N // 2 // tc.EQ_MINIBATCH)
        torch.testing.assert_close(got["grad_norm"], norms, atol=1e-5, rtol=1e-5)
        for k, v in params.items():
            torch.testing.assert_close(got["params"][k], v, atol=1e-5, rtol=1e-5, msg=k)


def test_rank_local_statistics_do_not_give_the_one_process_update(ranks):
    params, _ = _one_process_reference(tc.make_global_ppo)
    naive = ranks[0]["equivalence"]["naive"]["params"]
    assert any(not torch.allclose(naive[k.removeprefix("loss_module.")], v, atol=1e-4) for k, v in params.items())


class _Payload:
    def __reduce__(self):
        return (os.system, (f"touch {os.environ['FL_MARKER']}",))


@pytest.mark.parametrize("victim", ["rank0.pt", "learner.ckpt"])
def test_a_crafted_trainer_checkpoint_is_refused_and_runs_nothing(tmp_path, monkeypatch, victim):
    import pickle

    trainer, learner = tc.build_dqn(local, total_frames=2 * tc.FRAMES_PER_BATCH, save_file=tmp_path / "ckpt")[:2]
    trainer.train()
    assert (tmp_path / "ckpt" / victim).is_file()
    marker = tmp_path / "pwned"
    monkeypatch.setenv("FL_MARKER", str(marker))
    torch.save({"format": "fabric_learner/1", "model": {}, "optimizer": {}, "rng": _Payload()}, tmp_path / "ckpt" / victim)
    fresh, fresh_learner = tc.build_dqn(local, total_frames=4 * tc.FRAMES_PER_BATCH)[:2]
    before = {k: v.clone() for k, v in fresh_learner.loss_module.state_dict().items()}
    with pytest.raises(pickle.UnpicklingError):
        fresh.load_from_file(tmp_path / "ckpt")
    assert not marker.exists()
    assert fresh_learner.num_updates == 0
    for k, v in fresh_learner.loss_module.state_dict().items():
        assert torch.equal(v, before[k]), k


# ---- resuming on another number of ranks ----------------------------------------------------------


def _fixture_samples():
    """The observations and priorities the one-process trainer fixture stored (48 samples)."""
    trainer, learner, _, _, rb, _ = tc.build_dqn(local, total_frames=tc.FRAMES_PER_BATCH)
    trainer.load_from_file(os.path.join(os.path.dirname(WORKERS), "fixtures", "checkpoints", "trainer"))
    return rb[: len(rb)]["observation"], rb._sampler._sum_tree.values[: len(rb)].clone(), learner


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_one_process_checkpoint_resumes_on_two_ranks_with_every_sample_once(ranks, strategy):
    obs, priorities, learner = _fixture_samples()
    got = [r["resized"][strategy] for r in ranks]
    assert [g["rb_len"] for g in got] == [24, 24]
    # sample j went to rank j % 2, with its priority
    for rank, g in enumerate(got):
        assert torch.equal(g["rb_obs"], obs[rank::2])
        torch.testing.assert_close(g["priorities"], priorities[rank::2], rtol=1e-5, atol=1e-7)
        assert (g["collected_frames"], g["num_updates"], g["optim_count"]) == (48, 6, 6)  # global counters kept
    for k, v in learner.loss_module.state_dict().items():  # the learner resharded from the file
        assert torch.equal(got[0]["after"]["params"][k], got[1]["after"]["params"][k]), k
    assert got[0]["after"]["collected_frames"] == 4 * tc.FRAMES_PER_BATCH * 2  # and training went on


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_resume_on_two_ranks_does_not_repeat_the_random_warm_up_the_run_took(ranks, strategy):
    """The one-process fixture's run had collected 48 frames; its resume on 2 ranks, whose collectors
    have init_random_frames=24 each (48 over both), acts with the policy from the first frame on."""
    for g in (r["resized"][strategy] for r in ranks):
        collected_here = (g["after"]["collected_frames"] - g["collected_frames"]) // 2
        assert collected_here == 3 * tc.FRAMES_PER_BATCH  # 48 -> 192 frames over both ranks
        assert g["after"]["policy_frames"] == collected_here  # no frame at random


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("warm_up_left", [0, 2 * tc.FRAMES_PER_BATCH])
def test_a_resume_in_one_process_takes_only_the_random_warm_up_left(ranks, strategy, warm_up_left):
    """Run B's 2-rank checkpoint resumed by one process whose collector's init_random_frames reaches
    ``warm_up_left`` frames past what B collected: the Trainer's global frame count decides, so the
    collector acts at random for those frames only, then with the policy."""
    saved = runs(ranks, strategy)[0]["B"]["collected_frames"]
    trainer, learner, _, _, rb, collector = tc.build_dqn(
        local, total_frames=saved + 4 * tc.FRAMES_PER_BATCH, init_random_frames=saved + warm_up_left)
    acted = tc.policy_frames(collector)
    with pytest.warns(UserWarning, match="written by 2 rank"):
        trainer.load_from_file(ranks[0]["dir"] / f"trainer_ckpt_{strategy}")
    assert trainer.collected_frames == saved
    updates = learner.num_updates
    trainer.train()
    assert trainer.collected_frames == saved + 4 * tc.FRAMES_PER_BATCH
    assert sum(acted) == 4 * tc.FRAMES_PER_BATCH - warm_up_left
    # optimisation waits for the whole warm-up, as the configured run would: saved + warm_up_left frames
    batches = [b for b in range(1, 5) if b * tc.FRAMES_PER_BATCH >= warm_up_left]
    assert learner.num_updates == updates + tc.OPTIM_STEPS * len(batches)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_two_rank_checkpoint_resumes_in_one_process_with_every_sample_once(ranks, strategy):
    """Run B's checkpoint (2 ranks, half the frames) loaded by a one-process trainer."""
    b = [r["B"] for r in runs(ranks, strategy)]  # each rank's state when B saved
    trainer, learner, _, _, rb, _ = tc.build_dqn(local, total_frames=10 * tc.FRAMES_PER_BATCH * 2)
    with pytest.warns(UserWarning, match="written by 2 rank"):
        trainer.load_from_file(ranks[0]["dir"] / f"trainer_ckpt_{strategy}")
    stored = rb[: len(rb)]["observation"]
    assert len(rb) == b[0]["rb_len"] + b[1]["rb_len"]
    assert torch.equal(stored, torch.cat([b[0]["rb_obs"], b[1]["rb_obs"]]))  # both ranks' samples, each once
    torch.testing.assert_close(rb._sampler._sum_tree.values[: len(rb)],
                               torch.cat([b[0]["priorities"], b[1]["priorities"]]), rtol=1e-5, atol=1e-7)
    assert (trainer.collected_frames, learner.num_updates) == (b[0]["collected_frames"], b[0]["num_updates"])
    for k, v in b[0]["params"].items():  # the learner resharded from the 2-rank checkpoint
        assert torch.equal(learner.loss_module.state_dict()[k], v), k
    trainer.train()  # and training goes on
    assert learner.num_updates > b[0]["num_updates"]


@pytest.fixture(scope="module")
def four_ranks(ranks, tmp_path_factory):
    """Run B's 2-rank checkpoints (DDP and FSDP) resumed on 4 ranks, one launch."""
    out = tmp_path_factory.mktemp("trainer_4ranks")
    proc = launch(os.path.join(WORKERS, "trainer_resize4.py"), ranks[0]["dir"], out, nproc=4, timeout=400)
    assert proc.returncode == 0, proc.stdout[-6000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(4)]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_two_rank_checkpoint_resumes_on_four_ranks_with_every_sample_once(ranks, four_ranks, strategy):
    b = [r["B"] for r in runs(ranks, strategy)]  # each of the 2 ranks' state when B saved
    saved = torch.cat([b[0]["rb_obs"], b[1]["rb_obs"]])
    saved_priorities = torch.cat([b[0]["priorities"], b[1]["priorities"]])
    got = [r[strategy] for r in four_ranks]
    assert [r["world_size"] for r in four_ranks] == [4] * 4
    for rank, g in enumerate(got):  # sample j of the 2 buffers, in rank order, went to rank j % 4
        assert torch.equal(g["rb_obs"], saved[rank::4])
        torch.testing.assert_close(g["priorities"], saved_priorities[rank::4], rtol=1e-5, atol=1e-7)
        assert (g["collected_frames"], g["num_updates"]) == (b[0]["collected_frames"], b[0]["num_updates"])
        assert len(g["warnings"]) == 1 and "written by 2 rank" in g["warnings"][0], g["warnings"]
        for k, v in b[0]["params"].items():  # the learner resharded from the 2-rank checkpoint
            assert torch.equal(g["params"][k], v), (rank, k)
    assert sum(g["rb_len"] for g in got) == len(saved)  # none lost, none duplicated
    for g in got[1:]:  # training went on, ranks identical
        assert g["after"]["num_updates"] == got[0]["after"]["num_updates"] > b[0]["num_updates"]
        for k, v in got[0]["after"]["params"].items():
            assert torch.equal(g["after"]["params"][k], v), k
    assert got[0]["after"]["collected_frames"] == b[0]["collected_frames"] + 2 * 4 * tc.FRAMES_PER_BATCH

