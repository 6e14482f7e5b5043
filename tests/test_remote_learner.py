"""RemoteLearner: the Learner contract from one process, each update run by two Ray actors (gloo, CPU).

The oracle is LocalLearner on the whole batch (SGD, so a gradient-scale error shows). One Ray
runtime serves the module: the first learner starts it (embedded) and the last one to close ends
it; the learners are built once per module and checked many times.
"""

from __future__ import annotations

import functools
import os
import signal
import socket
import sys
import threading
import time

import llm_cases
import pytest
import rl_cases
import torch
from rl_cases import flat_params, make_batch, make_loss
from tensordict import TensorDict

from fabric_learner import LearnerLostError, LearnerTimeoutError, LocalLearner, RemoteLearner, Stage
from fabric_learner.llm import weight_buckets
from fabric_learner.remote import _shares
from fabric_learner.remote import learner as learner_module
from fabric_learner.remote._wire import packed, unpacked

# the `ray` extra, which `make test` installs (the lent GPU machine gets Ray's runtime packed by `make gpu-wheels`);
# where Ray is missing this module is skipped, saying why, rather than failing the whole collection
ray = pytest.importorskip("ray", reason="RemoteLearner needs the ray extra (pip install fabric_learner[ray])")

# the ranks rebuild the test's losses and factories from their pickles, by value: these modules are not on their path
for module in (rl_cases, llm_cases, sys.modules[__name__]):
    ray.cloudpickle.register_pickle_by_value(module)

SGD = functools.partial(torch.optim.SGD, lr=0.1)
TOL = {"atol": 1e-5, "rtol": 1e-5}
SMALL = {"num_learners": 2, "num_cpus_per_learner": 0.25, "timeout": 60}  # 2 ranks; 8 fit the 2-CPU runtime


def remote(loss, optimizer=SGD, **kwargs):
    return RemoteLearner(loss, optimizer, **{**SMALL, **kwargs})


def rank_models(learner):
    """Each rank's full model state (a collective under FSDP: every rank is called)."""
    return learner.call_on_ranks(lambda rank: {k: v.detach().clone() for k, v in rank.checkpoint()["model"].items()})


def assert_ranks_identical(learner):
    first, *others = rank_models(learner)
    for other in others:
        assert first.keys() == other.keys()
        for k, v in first.items():
            assert torch.equal(v, other[k]), k
    return first


def assert_close_state(got, want):
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, **TOL, msg=k)


@pytest.fixture(scope="module")
def ddp():
    """DQN under DDP; the first learner of the module, so it starts the embedded runtime."""
    assert not ray.is_initialized()
    loss, policy = make_loss("dqn")
    learner = remote(loss, policy=policy, strategy="ddp", max_in_flight=2)
    assert ray.is_initialized()
    yield learner
    learner.close()
    assert not ray.is_initialized(), "the embedded runtime must end with the last learner using it"


@pytest.fixture(scope="module")
def fsdp(ddp):
    """PPO under FSDP with two micro-batches per optimizer step."""
    learner = remote(make_loss("ppo")[0], strategy="fsdp", grad_accum_steps=2)
    yield learner
    learner.close()


def local_dqn():
    loss, policy = make_loss("dqn")
    return LocalLearner(loss, SGD, policy=policy)


# ---- the step equals one process --------------------------------------------------------------


def test_dqn_under_ddp_equals_one_process_on_the_whole_batch_and_the_ranks_are_bit_identical(ddp, monkeypatch):
    local, inline = local_dqn(), learner_module.INLINE_BYTES
    for step in range(3):
        if step < 2:  # step 2 updates the same batches again: the td_error they hold is written anew
            mine, theirs = make_batch("dqn", n=16, seed=100 + step), make_batch("dqn", n=16, seed=100 + step)
        # small shares ride inside the call; step 1's go through the object store (as a large batch's do)
        monkeypatch.setattr(learner_module, "INLINE_BYTES", -1 if step == 1 else inline)
        size = mine.bytes()
        got, want = ddp.update(mine), local.update(theirs)
        stored = ddp.last_transfer["object_store_bytes"]
        assert (stored, ddp.last_transfer["inline_bytes"]) == ((size, 0) if step == 1 else (0, size))
        assert sorted(got.keys()) == sorted(want.keys()) == ["grad_norm", "loss"]
        for k in want.keys():
            torch.testing.assert_close(got[k], want[k], **TOL)
        torch.testing.assert_close(mine["td_error"], theirs["td_error"], **TOL)  # written into the caller's batch
    assert ddp.num_updates == local.num_updates == 3
    model = assert_ranks_identical(ddp)
    assert_close_state(model, local.loss_module.state_dict())
    weights = ddp.get_weights()  # the policy's layout, plain tensors here
    for k, v in local.get_weights().items(include_nested=True, leaves_only=True):
        assert type(weights.get(k)) is torch.Tensor
        torch.testing.assert_close(weights.get(k), v, **TOL)
    # each rank received its own share, not the batch: the bytes sent are the batch's own
    assert ddp.last_transfer["sent_bytes"] == ddp.last_transfer["batch_bytes"] == size
    assert len(ddp.last_rank_seconds) == 2 and all(s > 0 for s in ddp.last_rank_seconds)


def test_ppo_under_fsdp_with_accumulation_equals_one_process_and_weights_arrive_whole(fsdp):
    loss, policy = make_loss("ppo")
    local = LocalLearner(loss, SGD, grad_accum_steps=2)
    for step in range(2):
        batch = make_batch("ppo", n=32, seed=200 + step)
        for micro in batch.split(16):
            got, want = fsdp.update(micro.clone()), local.update(micro.clone())
            assert ("grad_norm" in got.keys()) == ("grad_norm" in want.keys())
            for k in want.keys():
                if k.startswith("loss") or k == "grad_norm":
                    torch.testing.assert_close(got[k], want[k], **TOL)
    assert fsdp.num_updates == 2
    model = assert_ranks_identical(fsdp)
    assert_close_state(model, local.loss_module.state_dict())
    weights = fsdp.get_weights()  # gathered from the shards: every parameter whole
    for k, v in local.get_weights().items(include_nested=True, leaves_only=True):
        assert type(weights.get(k)) is torch.Tensor and weights.get(k).shape == v.shape
        torch.testing.assert_close(weights.get(k), v, **TOL)


SAC_STAGES = [Stage("critic", "qvalue_network_params", SGD, loss="loss_qvalue"),
              Stage("actor", "actor_network_params", SGD, loss="loss_actor"),
              Stage("alpha", "log_alpha", SGD, loss="loss_alpha")]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_sac_with_stages_keeps_the_ranks_bit_identical_and_steps_every_stage(ddp, strategy):
    """SAC samples actions, so its ranks draw other numbers than one process: the ranks must agree, every
    stage must step as in one process, and the weights must move."""
    with remote(make_loss("sac")[0], None, stages=SAC_STAGES, strategy=strategy) as learner:
        start = flat_params(make_loss("sac")[0])
        local = LocalLearner(make_loss("sac")[0], stages=SAC_STAGES)
        for step in range(2):
            torch.manual_seed(step)
            mine, theirs = make_batch("sac", n=16, seed=300 + step), make_batch("sac", n=16, seed=300 + step)
            if step == 1:  # an old td_error of another dtype: SAC's loss replaces it (not in place, as DQN's writes)
                for batch in (mine, theirs):
                    batch.set("td_error", torch.zeros(16, dtype=torch.float64))
            got, want = learner.update(mine), local.update(theirs)
            assert sorted(got.keys()) == sorted(want.keys())
            layout = {k: (v.shape, v.dtype) for k, v in theirs.items(include_nested=True, leaves_only=True)}
            assert {k: (v.shape, v.dtype) for k, v in mine.items(include_nested=True, leaves_only=True)} == layout
        model = assert_ranks_identical(learner)
        assert learner.num_updates == 2
        moved = [k for k, v in start.items() if not torch.equal(model[k], v)]
        assert any(k.startswith("qvalue") for k in moved) and any(k.startswith("actor") for k in moved)
        assert "log_alpha" in moved


def test_grpo_token_mean_with_unequal_tokens_per_share_equals_one_process(ddp):
    _, policy = llm_cases.make_loss("token_mean")
    batch = llm_cases.whole(llm_cases.pieces(policy))
    shares, groups = _shares.split(batch, 2)
    counts = [llm_cases.tokens(s) for s in shares]
    assert counts[0] != counts[1] and sorted(groups[0] + groups[1]) == list(range(8))
    assert max(counts) < 0.6 * sum(counts)  # dealt by tokens: the long samples are not all on one rank
    loss, policy = llm_cases.make_loss("token_mean")
    local = LocalLearner(loss, llm_cases.SGD, policy=policy)
    want = local.update(batch)
    # a factory: each rank builds the model and tokenizer itself
    with remote(lambda: llm_cases.make_loss("token_mean"), llm_cases.SGD, strategy="ddp") as learner:
        got = learner.update(batch)
        for k in ("loss_objective", "grad_norm"):
            torch.testing.assert_close(got[k], want[k], **TOL)  # token-weighted over the shares
        model = assert_ranks_identical(learner)
        # the generation engine's weights, in buckets, from rank 0 (every rank iterates: a collective under FSDP)
        buckets = learner.call_on_ranks(lambda rank: list(weight_buckets(rank, bucket_bytes=100_000)))[0]
    assert_close_state(model, {k: v for k, v in local.loss_module.state_dict().items() if k in model})
    expected = [pair for bucket in weight_buckets(local, bucket_bytes=100_000) for pair in bucket]
    assert [name for bucket in buckets for name, _ in bucket] == [name for name, _ in expected]
    assert_close_state(dict(pair for bucket in buckets for pair in bucket), dict(expected))


def test_shares_cross_as_numpy_arrays_and_come_back_as_the_same_tensordict():
    for case in ("dqn", "ppo", "sac"):
        batch = make_batch(case, n=8)
        sent = ray.cloudpickle.loads(ray.cloudpickle.dumps(packed(batch)))
        assert isinstance(sent[1], dict)  # numpy arrays by key, not pickled tensors
        back = unpacked(sent)
        assert back.device is None
        assert back.batch_size == batch.batch_size and back["next"].batch_size == batch["next"].batch_size
        assert_same_tensordict(back, batch)
        back.get("observation").add_(1)  # writable, and its own
        assert not torch.equal(back.get("observation"), batch.get("observation"))
    sampled = make_batch("dqn", n=8).to("cpu")  # a replay buffer's sample says device="cpu"
    sent = packed(sampled)
    assert isinstance(sent[1], dict) and unpacked(sent).device == torch.device("cpu")
    assert_same_tensordict(unpacked(sent), sampled)
    unsigned = TensorDict({str(dt): torch.arange(4).to(dt) for dt in (torch.uint16, torch.uint32, torch.uint64)}, [4])
    sent = ray.cloudpickle.loads(ray.cloudpickle.dumps(packed(unsigned)))  # torch's own pickle fails on these
    assert isinstance(sent[1], dict)
    assert_same_tensordict(unpacked(sent), unsigned)
    # what the arrays would not rebuild crosses pickled, exactly: names, a lock, an empty nested entry
    named = TensorDict(a=torch.arange(4.0), batch_size=[4], names=["time"])
    locked = make_batch("dqn", n=8).lock_()
    hollow = TensorDict(a=torch.arange(4.0), b=TensorDict(batch_size=[4]), batch_size=[4])
    for td in (named, locked, hollow):
        back = unpacked(ray.cloudpickle.loads(ray.cloudpickle.dumps(packed(td))))
        assert back.names == td.names and back.is_locked == td.is_locked and set(back.keys()) == set(td.keys())
        assert_same_tensordict(back, td)


def test_a_share_carries_only_its_own_elements_whatever_tensordict_it_is(tmp_path):
    """Shares are views of the caller's batch: none may drag the whole batch's storage along, or its file."""
    from tensordict import LazyStackedTensorDict, lazy_stack

    big = make_batch("dqn", n=2048)
    rows = TensorDict(observation=torch.randn(64, 1024), batch_size=[64])  # samples: views of one storage
    cases = (big, big.bfloat16(), TensorDict(big.to_dict(), batch_size=[2048], device="cpu"),
             lazy_stack(list(rows.unbind(0))), make_batch("dqn", n=2048).memmap_(tmp_path))
    for whole in cases:
        share = _shares.split(whole, 8)[0][0]
        expected = share.apply(lambda t: t.as_subclass(torch.Tensor).clone())
        sent = ray.cloudpickle.dumps(packed(share))
        framing = 4096 + (300 * share.batch_size[0] if isinstance(share, LazyStackedTensorDict) else 0)
        assert len(sent) < share.bytes() + framing < whole.bytes() / 2, type(whole)
        whole.apply_(lambda t: t.zero_())  # the caller reuses its batch once update() has returned
        back = unpacked(ray.cloudpickle.loads(sent))
        assert type(back) is type(share) and back.device == share.device
        assert all(type(v) is torch.Tensor for v in back.values(True, True))  # no file behind them
        assert_same_tensordict(back, expected)
    _, policy = llm_cases.make_loss("token_mean")
    chats = llm_cases.whole(llm_cases.pieces(policy))  # a lazy stack of tensorclasses and strings
    shares, _ = _shares.split(chats, 2)
    for share in shares:
        sent = ray.cloudpickle.dumps(packed(share))
        assert len(sent) < 0.75 * len(ray.cloudpickle.dumps(packed(chats)))
        back = unpacked(ray.cloudpickle.loads(sent))
        assert type(back) is type(share) and back.batch_size == share.batch_size
        for got, sent in zip(back.tensordicts, share.tensordicts):
            assert got.get("history").full.content == sent.get("history").full.content  # text as it was
            for k, v in sent.items(include_nested=True, leaves_only=True):
                assert type(got.get(k)) is type(v) and torch.equal(got.get(k), v), k
        back.tensordicts[0].get(("tokens", "full")).zero_()  # writable, and its own
        assert share.tensordicts[0].get(("tokens", "full")).any()


def assert_same_tensordict(got, want):
    assert set(got.keys(True, True)) == set(want.keys(True, True))
    for k, v in want.items(include_nested=True, leaves_only=True):
        assert got.get(k).dtype == v.dtype and torch.equal(got.get(k), v), k


def test_outputs_combine_the_same_whether_they_crossed_as_arrays_or_as_tensordicts():
    import warnings

    halves = torch.randn(2, 4000, generator=torch.Generator().manual_seed(0)).half()
    outputs = [TensorDict(loss=torch.tensor(0.1 + r, dtype=torch.float32), grad_norm=torch.tensor(3.0 + r),
                          count=torch.tensor(5 + r), kl=torch.full((2,), 0.3 * (r + 1), dtype=torch.float64),
                          ragged=torch.zeros(r + 1), nested=TensorDict(entropy=torch.tensor(1.0 / (r + 3))),
                          half=halves[r], extreme=torch.tensor([float("inf") * (1 - 2 * r), 1.0]))
               for r in range(2)]
    weights = [3.0, 7.0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # inf - inf is nan, silently, as in torch
        fast = learner_module.combine([packed(o) for o in outputs], weights)
    slow = learner_module.combine(outputs, weights)
    assert fast["extreme"][0].isnan() and slow["extreme"][0].isnan()
    fast["extreme"][0] = slow["extreme"][0] = 0
    assert_same_tensordict(fast, slow)  # bit for bit, dtypes too (half rounds through float32 as torch does)
    on_cpu = [o.to("cpu") for o in outputs]
    assert learner_module.combine([packed(o) for o in on_cpu], weights).device == learner_module.combine(on_cpu, weights).device
    torch.testing.assert_close(slow["loss"], torch.tensor(0.1 * 0.3 + 1.1 * 0.7))
    assert slow["grad_norm"] == 3.0 and slow["count"] == 5 and slow["ragged"].shape == (1,)  # rank 0's


def test_token_shares_deal_the_longest_samples_first_to_the_lightest_rank():
    assert _shares.balanced_shares([9, 1, 1, 8, 2, 3], 2) == [[0, 1, 4], [2, 3, 5]]  # 12 tokens each
    assert _shares.balanced_shares([5, 5, 5], 3) == [[0], [1], [2]]


# ---- asynchronous updates, two learners side by side --------------------------------------------


def test_updates_in_flight_come_back_in_order_tagged_with_the_policy_version_they_produced(ddp, fsdp):
    """Two learners on one runtime, both with updates in flight at once, each equal to its own reference."""
    local = local_dqn()
    local.load_checkpoint(ddp.checkpoint())
    start = ddp.num_updates
    ppo = LocalLearner(make_loss("ppo")[0], SGD, grad_accum_steps=2)
    ppo.load_checkpoint(fsdp.checkpoint())
    batches = [make_batch("dqn", n=16, seed=400 + s) for s in range(3)]
    ppo_batches = [make_batch("ppo", n=16, seed=500 + s) for s in range(2)]
    originals = [b.clone() for b in batches]

    def sent(batch):  # the caller refills its buffer at once: the ranks train on what was sent
        handle = ddp.update(batch, wait=False)
        batch["observation"].zero_()
        return handle

    handles = [sent(b) for b in batches[:2]]
    ppo_handles = [fsdp.update(b, wait=False) for b in ppo_batches]
    assert len(ddp._in_flight) == 2
    handles.append(sent(batches[2]))  # max_in_flight=2: waited for the oldest first
    outs = [h.result() for h in handles]
    assert [h.policy_version for h in handles] == [start + 1, start + 2, start + 3]
    for out, batch, original in zip(outs, batches, originals):
        torch.testing.assert_close(out["loss"], local.update(original)["loss"], **TOL)
        torch.testing.assert_close(batch["td_error"], original["td_error"], **TOL)  # written back when collected
    for handle, batch in zip(ppo_handles, ppo_batches):
        want = ppo.update(batch)
        torch.testing.assert_close(handle.result()["loss_objective"], want["loss_objective"], **TOL)
    assert_close_state(rank_models(ddp)[0], local.loss_module.state_dict())
    assert_close_state(rank_models(fsdp)[0], ppo.loss_module.state_dict())


def test_a_failure_after_the_ranks_stepped_stays_with_its_own_update(ddp, monkeypatch):
    """The controller's own part of an update can still fail (here: its write-back, made to fail once): the
    counters move (the ranks stepped), that update's handle keeps the error, the next one is unaffected."""
    real, calls = learner_module._write_back, []

    def fails_once(*args):
        calls.append(args)
        if len(calls) == 1:
            raise ValueError("write-back failed")
        return real(*args)

    monkeypatch.setattr(learner_module, "_write_back", fails_once)
    start = ddp.num_updates
    first = ddp.update(make_batch("dqn", n=16, seed=800), wait=False)
    second = ddp.update(make_batch("dqn", n=16, seed=801), wait=False)
    with pytest.raises(ValueError, match="write-back failed"):
        second.result()  # the first failure among the updates it waits for
    with pytest.raises(ValueError, match="write-back failed"):
        first.result()
    assert "loss" in second.result().keys() and second.policy_version == ddp.num_updates == start + 2


def test_a_lazy_stack_split_evenly_gets_back_only_what_the_loss_wrote(ddp):
    """A lazy stack reads as new stacked tensors each time: the rank looks at its samples' own entries."""
    from tensordict import lazy_stack

    local = local_dqn()
    local.load_checkpoint(ddp.checkpoint())
    batch = make_batch("dqn", n=16, seed=700)
    mine, theirs = lazy_stack(list(batch.clone().unbind(0))), batch.clone()
    pending = ddp.update(mine, wait=False)
    for sample in mine.tensordicts:  # refilled: what the loss did not write must stay as the caller left it
        sample.get("observation").zero_()
    pending.result()
    local.update(theirs)
    assert not mine.get("observation").any()
    torch.testing.assert_close(mine.get("td_error"), theirs.get("td_error"), **TOL)  # equal shares, as one process


@pytest.fixture(scope="module")
def ddpg(ddp):
    """DDPG on 2 DDP ranks, its actor shaped for Pendulum-v1 (the ``ddp`` fixture's runtime)."""
    from fabric_learner.testing import ddpg_example

    loss, actor, _ = ddpg_example()
    with remote(loss, policy=actor, replay_buffer=uniform_buffer) as learner:
        yield learner, actor


def uniform_buffer():
    from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

    return TensorDictReplayBuffer(storage=LazyTensorStorage(64), batch_size=4)


def test_a_one_process_torchrl_trainer_drives_it_and_its_collector_acts_with_the_new_weights(ddpg):
    from torchrl.collectors import Collector
    from torchrl.envs import GymEnv

    from fabric_learner import Trainer
    from fabric_learner.weights import collector_policy

    learner, actor = ddpg
    start, updates = actor.module.weight.detach().clone(), learner.num_updates
    collector = Collector(GymEnv("Pendulum-v1"), actor, frames_per_batch=8, total_frames=24,
                          auto_register_policy_transforms=False)
    Trainer(learner=learner, collector=collector, total_frames=24, optim_steps_per_batch=1,
            progress_bar=False).train()
    assert learner.num_updates == updates + 3  # one update per batch of 8 frames, 4 on each rank
    acting = collector_policy(collector).module.weight
    assert not torch.equal(acting, start) and torch.equal(acting, learner.get_weights()["module", "weight"])
    collector.shutdown()


def test_torchrls_ray_collector_on_the_same_runtime_feeds_it_and_collects_each_batch_with_the_last_weights(ddpg):
    """One script, as RLlib's env runners feed its learners: the collector is a Ray actor of the runtime
    the learner started, the Trainer publishes through the collector's own weight sync after each update."""
    import copy

    from torchrl.collectors.distributed import RayCollector
    from torchrl.envs import GymEnv

    from fabric_learner import Trainer

    learner, actor = ddpg
    updates = learner.num_updates
    # sync: each batch stacks one rollout of 8 steps per collector, [2, 8], and each rank takes one collector's
    collector = RayCollector([functools.partial(GymEnv, "Pendulum-v1")] * 2, actor, frames_per_batch=16,
                             total_frames=64, num_collectors=2, sync=True, remote_configs={"num_cpus": 0.25},
                             collector_kwargs={"auto_register_policy_transforms": False})
    assert collector.remote_collectors and ray.is_initialized()
    seen, published = [], [learner.get_weights()]  # the weights each batch must have been collected with
    trainer = Trainer(learner=learner, collector=collector, total_frames=64, optim_steps_per_batch=1,
                      progress_bar=False)
    trainer.register_op("batch_process", lambda batch: seen.append(batch.clone()) or batch)
    trainer.register_op("post_steps", lambda: published.append(learner.get_weights()))  # after PublishWeights
    trainer.train()
    assert learner.num_updates == updates + 4 and [batch.batch_size for batch in seen] == [(2, 8)] * 4
    acting = copy.deepcopy(actor)
    for batch, weights in zip(seen, published):
        weights.to_module(acting)
        with torch.no_grad():
            torch.testing.assert_close(acting(batch.select("observation"))["action"], batch["action"], **TOL)
    assert not torch.equal(published[0]["module", "weight"], published[-2]["module", "weight"])
    collector.shutdown()
    assert ray.is_initialized() and learner.broken is None  # the collector leaves the learner's runtime running
    learner.update(seen[-1])


def test_a_ray_collector_writes_into_the_ranks_buffers_and_the_ranks_train_on_what_it_wrote(ddpg):
    """RLlib's off-policy layout: env runners write into buffers beside the learners, nothing crosses the script."""
    from torchrl.collectors.distributed import RayCollector
    from torchrl.envs import GymEnv

    learner, actor = ddpg
    collector = RayCollector([functools.partial(GymEnv, "Pendulum-v1")] * 2, actor, frames_per_batch=8,
                             total_frames=32, num_collectors=2, replay_buffer=learner.replay_buffer,
                             remote_configs={"num_cpus": 0.25},
                             collector_kwargs={"auto_register_policy_transforms": False})
    with pytest.raises(ValueError, match="1 collectors cannot fill the replay buffers of 2 learner ranks"):
        learner.replay_buffer.clients(1)
    assert all(batch is None for batch in collector)  # the batches went to the ranks
    collector.shutdown()
    held = learner.call_on_ranks(lambda rank: rank.replay_buffer[:].select("observation", ("next", "reward")))
    assert all(len(rows) > 0 for rows in held) and sum(len(rows) for rows in held) == len(learner.replay_buffer) >= 32
    assert not torch.equal(held[0]["observation"][0], held[1]["observation"][0])  # each rank its own collector's
    updates = learner.num_updates
    out = learner.update_from_buffer(2)
    assert learner.num_updates == updates + 2 and out["loss_actor"].shape == (2,) and learner.broken is None
    assert learner.last_sampled["index"].shape == (2, 2, 4)


def test_full_parameters_fills_the_loss_here_with_the_group_weights_and_sends_a_target_update_back(ddp, fsdp):
    """What a value estimator or a target updater in the controller needs (the Trainer's hooks enter this block)."""
    from torchrl.objectives import SoftUpdate

    ddp.update(make_batch("dqn", n=16, seed=400))
    with ddp.full_parameters() as loss:
        assert loss is ddp.loss_module
        assert_close_state(rank_models(ddp)[0], loss.state_dict())
        before = {k: v.clone() for k, v in loss.state_dict().items()}
        SoftUpdate(loss, eps=0.5).step()  # the target network moves halfway to the online one, here
        here = {k: v.clone() for k, v in loss.state_dict().items()}
    assert any("target" in k and not torch.equal(here[k], before[k]) for k in here)
    for model in rank_models(ddp):  # every rank got it
        assert_close_state(model, here)
    with fsdp.full_parameters() as loss:  # gathered from the shards
        assert_close_state(rank_models(fsdp)[0], loss.state_dict())
    with pytest.raises(ValueError, match="parameters of a sharded group"):
        with fsdp.full_parameters() as loss:
            next(loss.parameters()).data.add_(1.0)
    assert fsdp.broken is None


# ---- the loss here follows the group: a hand-written loop swaps LocalLearner for RemoteLearner ---------------


def ppo_rollout(actor, critic, seed, steps=16):
    """A fixed synthetic env run with ``actor`` in this process, GAE read from ``critic`` here (no hooks, no publishing)."""
    from torchrl.objectives.value import GAE

    g = torch.Generator().manual_seed(seed)
    obs = torch.randn(steps + 1, rl_cases.OBS, generator=g)
    batch = TensorDict(observation=obs[:-1], batch_size=[steps])
    torch.manual_seed(seed)
    with torch.no_grad():
        actor(batch)  # samples the action and its log-prob
    done = (torch.arange(steps) % 8 == 7).unsqueeze(-1)
    batch["next"] = TensorDict(observation=obs[1:], reward=-(batch["action"] - 0.3).pow(2).sum(-1, keepdim=True),
                               done=done, terminated=done, batch_size=[steps])
    with torch.no_grad():
        GAE(gamma=0.9, lmbda=0.9, value_network=critic)(batch)
    return batch


def test_a_hand_written_ppo_loop_with_gae_here_trains_as_on_a_local_learner(fsdp):
    """The collector's actor and GAE's critic are the loss's own modules in this process: they hold the group's
    weights whenever they run (fetched on their first forward after an update), as on LocalLearner, where they are
    the trained modules; nothing is fetched for a module that does not run."""
    import copy

    local = LocalLearner(make_loss("ppo")[0], SGD, grad_accum_steps=2)
    local.load_checkpoint(fsdp.checkpoint())
    here, theirs = fsdp.loss_module, local.loss_module
    follower = fsdp._follower
    for iteration in range(3):
        mine = ppo_rollout(here.actor_network, here.critic_network, seed=900 + iteration)
        want = ppo_rollout(theirs.actor_network, theirs.critic_network, seed=900 + iteration)
        assert_close_state(flat_params(here), flat_params(theirs))  # actor and critic, as the collection ran them
        assert_close_state(dict(mine.items(True, True)), dict(want.items(True, True)))
        for a, b in zip(mine.split(8), want.split(8)):  # two micro-batches per optimizer step
            got, expected = fsdp.update(a), local.update(b)
            torch.testing.assert_close(got["loss_objective"], expected["loss_objective"], **TOL)
    assert_close_state(rank_models(fsdp)[0], theirs.state_dict())
    pulls, fetched = follower.pulls, follower.pulled_bytes
    fsdp.update(make_batch("ppo", n=16, seed=950))
    fsdp.update(make_batch("ppo", n=16, seed=951))
    assert (follower.pulls, follower.pulled_bytes) == (pulls, fetched)  # nothing runs here: nothing moves
    with torch.no_grad():
        here.actor_network(make_batch("ppo", n=4))  # with it, what ran here between updates before: the critic
        here.actor_network(make_batch("ppo", n=4))
        here.critic_network(make_batch("ppo", n=4))
    weights = sum(p.numel() * p.element_size() for p in here.parameters())
    assert (follower.pulls, follower.pulled_bytes) == (pulls + 1, fetched + weights)  # one call, once per update
    fsdp.update(make_batch("ppo", n=16, seed=951))
    fsdp.update(make_batch("ppo", n=16, seed=950))
    with torch.no_grad():
        here.critic_network(make_batch("ppo", n=4))  # in either order
        here.actor_network(make_batch("ppo", n=4))
    assert (follower.pulls, follower.pulled_bytes) == (pulls + 2, fetched + 2 * weights)
    with pytest.warns(RuntimeWarning, match="copied from the RemoteLearner's loss"):
        copy.deepcopy(here.actor_network)(make_batch("ppo", n=4))
    # a buffer written here while the parameters are behind the group: refused, nothing sent
    fsdp.update(make_batch("ppo", n=16, seed=952))
    here.entropy_coeff.fill_(0.5)
    with pytest.raises(RuntimeError, match="earlier update.*Nothing was sent"):
        fsdp.update(make_batch("ppo", n=16, seed=953))
    with fsdp.full_parameters():
        assert here.entropy_coeff.item() == pytest.approx(0.01)  # the group's value came back
    fsdp.update(make_batch("ppo", n=16, seed=953))  # still usable (and its accumulation window complete)
    assert fsdp.broken is None


def test_a_hand_written_dqn_loop_with_a_replay_buffer_and_soft_updates_trains_as_on_a_local_learner(ddp):
    """The policy acts here, the prioritized buffer and SoftUpdate live here: td_error comes back for the
    priorities, the target network moved here reaches the ranks, and the loss here follows after each update."""
    from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer
    from torchrl.objectives import SoftUpdate

    from fabric_learner import TorchPrioritizedSampler

    local = local_dqn()
    local.load_checkpoint(ddp.checkpoint())
    with ddp.full_parameters():  # the updater copies the online network: built on current weights
        updater = SoftUpdate(ddp.loss_module, eps=0.8)
    local_updater = SoftUpdate(local.loss_module, eps=0.8)
    sides = []
    for learner, step in ((ddp, updater), (local, local_updater)):
        buffer = TensorDictReplayBuffer(storage=LazyTensorStorage(64), batch_size=16, priority_key="td_error",
                                        sampler=TorchPrioritizedSampler(64, alpha=0.7, beta=0.5),
                                        generator=torch.Generator().manual_seed(7))  # the same draws on both sides
        sides.append((learner, learner.policy, buffer, step))
    for iteration in range(3):
        collected = []
        for learner, policy, buffer, _ in sides:
            batch = make_batch("dqn", n=16, seed=1000 + iteration).exclude("action")
            with torch.no_grad():
                policy(batch)  # greedy actions from the Q-network here
            buffer.extend(batch)
            collected.append(batch)
        assert torch.equal(collected[0]["action"], collected[1]["action"])
        for update in range(2):
            outs = []
            for learner, _, buffer, step in sides:
                # torchrl's DQN divides by the sum of the priority weights: per rank under DDP, which one process does
                # over the whole batch (not the same step); the weights stay out of this comparison
                sample = buffer.sample().exclude("priority_weight")
                outs.append((learner.update(sample), sample))
                buffer.update_tensordict_priority(sample)
                step.step()
            (got, mine), (want, theirs) = outs
            torch.testing.assert_close(got["loss"], want["loss"], **TOL)
            torch.testing.assert_close(mine["td_error"], theirs["td_error"], **TOL)
    model = rank_models(ddp)[0]
    assert_close_state(model, local.loss_module.state_dict())  # the target network too
    assert_close_state(local.loss_module.state_dict(), ddp.loss_module.state_dict())  # and the loss here


def test_a_target_network_moved_here_while_an_update_runs_reaches_the_ranks(ddp):
    """Pipelined (wait=False): SoftUpdate steps here on the weights this process holds while the update runs; when
    the update is collected, that write is judged by the weights it was made from and sent, not refused."""
    from torchrl.objectives import SoftUpdate

    with ddp.full_parameters():
        updater = SoftUpdate(ddp.loss_module, eps=0.5)
    ddp.update(make_batch("dqn", n=16, seed=989))  # the online network leaves the target behind
    pending = ddp.update(make_batch("dqn", n=16, seed=990), wait=False)
    before = {k: v.clone() for k, v in ddp.loss_module.state_dict().items() if k.startswith("target")}
    updater.step()  # the online network here is the one before this update: as an asynchronous program has it
    moved = {k: v.clone() for k, v in ddp.loss_module.state_dict().items() if k.startswith("target")}
    assert any(not torch.equal(v, before[k]) for k, v in moved.items())
    pending.result()  # collected: the whole loss follows (an updater is built on it), the target sent first
    for k, v in moved.items():
        torch.testing.assert_close(rank_models(ddp)[1][k], v, **TOL)
    assert ddp.broken is None


# ---- many updates in one call --------------------------------------------------------------------------------


def test_ppo_epochs_over_minibatches_run_on_the_ranks_in_one_call_equal_one_process_on_the_same_partitions(fsdp):
    """Each rank partitions its half anew each epoch (generator seed + rank), the advantage standardised over both
    ranks' minibatch, one optimizer step (two micro-batches) per minibatch: one process on the union of the ranks'
    i-th minibatches is the oracle."""
    from fabric_learner.onpolicy import normalize_advantage, partition_indices

    local = LocalLearner(make_loss("ppo")[0], SGD, grad_accum_steps=2)
    local.load_checkpoint(fsdp.checkpoint())
    batch = make_batch("ppo", n=32, seed=960)
    start = fsdp.num_updates
    got = fsdp.update_minibatches(batch.clone(), 16, epochs=3, seed=5, normalize_advantage=True)
    assert fsdp.num_updates == start + 6 and got.batch_size == (6,)
    halves = batch.split(16)
    generators = [torch.Generator().manual_seed(5 + rank) for rank in range(2)]
    want = []
    for _ in range(3):
        parts = [partition_indices(16, 8, generator=g) for g in generators]
        for j in range(2):
            minibatch = torch.cat([halves[rank][parts[rank][j]] for rank in range(2)])
            normalize_advantage(minibatch)
            outs = [local.update(micro) for micro in minibatch.split(8)]
            want.append((outs[0]["loss_objective"] + outs[1]["loss_objective"]) / 2)
    torch.testing.assert_close(got["loss_objective"], torch.stack(want), **TOL)
    assert_close_state(rank_models(fsdp)[0], local.loss_module.state_dict())
    assert fsdp.last_transfer["sent_bytes"] == batch.bytes()  # the batch once, 6 steps
    with pytest.raises(ValueError, match="the minibatch by 4"):  # 2 ranks x 2 micro-batches
        fsdp.update_minibatches(batch, 6)
    with pytest.raises(KeyError, match="lacks"):
        fsdp.update_minibatches(batch.exclude("advantage"), 16, normalize_advantage=True)
    assert fsdp.num_updates == start + 6 and fsdp.broken is None


def test_k_off_policy_updates_in_one_call_equal_k_updates_of_one_process_and_bring_each_td_error_back(ddp):
    """Three sampled batches, concatenated, in order (shuffle=False): rank r takes the r-th half of each, so step i
    trains on sample i as LocalLearner's update(sample i) does; the td_errors land at their rows for the priorities."""
    local = local_dqn()
    local.load_checkpoint(ddp.checkpoint())
    samples = [make_batch("dqn", n=16, seed=970 + k) for k in range(3)]
    mine = torch.cat(samples)
    start = ddp.num_updates
    got = ddp.update_minibatches(mine, 16, shuffle=False)
    want = [local.update(sample) for sample in samples]
    assert ddp.num_updates == start + 3
    torch.testing.assert_close(got["loss"], torch.stack([w["loss"] for w in want]), **TOL)
    torch.testing.assert_close(mine["td_error"], torch.cat([s["td_error"] for s in samples]), **TOL)
    assert_close_state(rank_models(ddp)[0], local.loss_module.state_dict())
    with pytest.raises(ValueError, match="whole minibatches"):
        ddp.update_minibatches(mine[:40], 16, shuffle=False)


# ---- replay buffers beside the ranks ------------------------------------------------------------------


def prioritized_buffer():
    """Each rank's buffer: 32 rows, prioritized (alpha 0.7), 4 rows a sample, td_error its priority. beta=0 keeps the
    importance weights at 1: torchrl's DQN divides by their sum, per rank under DDP, where one process divides by the
    whole batch's (a different step, whatever the backend: see the DQN loop test above)."""
    from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

    from fabric_learner.replay import prioritized_sampler

    return TensorDictReplayBuffer(storage=LazyTensorStorage(32), sampler=prioritized_sampler(32, alpha=0.7, beta=0.0),
                                  priority_key="td_error", batch_size=4)


@pytest.fixture
def buffered(ddp):
    """DQN under DDP, a prioritized replay buffer beside each rank; closed after its test (the runtime's 2 CPUs hold
    4 groups of 2 ranks at 0.25 CPU each, and the module keeps three)."""
    loss, policy = make_loss("dqn")
    with remote(loss, policy=policy, strategy="ddp", replay_buffer=prioritized_buffer) as learner:
        yield learner


def test_k_updates_sampled_beside_the_ranks_equal_one_process_on_the_same_rows_and_write_the_priorities_there(
        buffered):
    """Rank r's buffer holds the r-th half of the rows given; step i trains on the union of the ranks' i-th samples
    (as LocalLearner on their concatenation), and each rank's priorities are (|td_error| + eps) ** alpha of its rows."""
    with pytest.raises(ValueError, match=r"rank 0 could not sample its replay buffer \(it is empty\), so no rank "
                                         r"took step 0 of 2; 0 step\(s\) were taken"):  # every rank refuses alike
        buffered.update_from_buffer(2)
    assert buffered.num_updates == 0 and buffered.broken is None
    local = local_dqn()
    local.load_checkpoint(buffered.checkpoint())
    data = make_batch("dqn", n=48, seed=990)
    assert buffered.extend(data) == [24, 24]
    halves = data.exclude("td_error").split(24)
    start = buffered.num_updates
    got = buffered.update_from_buffer(3)
    drawn = buffered.last_sampled  # [step, rank, row]: storage indices, importance weights
    assert drawn.shape == (3, 2, 4) and buffered.num_updates == start + 3
    want, priority = [], {0: {}, 1: {}}
    for step in range(3):
        rows = [halves[r][drawn["index"][step, r]].update(drawn[step, r].select("priority_weight")) for r in range(2)]
        sample = torch.cat(rows)
        want.append(local.update(sample))
        for r in range(2):
            for i, err in zip(drawn["index"][step, r].tolist(), sample["td_error"][4 * r:4 * r + 4].reshape(-1)):
                priority[r][i] = (err.abs() + 1e-8) ** 0.7  # the last step that drew a row sets its priority
    torch.testing.assert_close(got["loss"], torch.stack([w["loss"] for w in want]), **TOL)
    assert_close_state(rank_models(buffered)[0], local.loss_module.state_dict())
    kept = buffered.call_on_ranks(lambda rank: torch.as_tensor(rank.replay_buffer.sampler._sum_tree[torch.arange(24)]))
    for r in range(2):
        rows = sorted(priority[r])
        torch.testing.assert_close(kept[r][rows], torch.stack([priority[r][i] for i in rows]), **TOL)
    # rank 1 alone cannot sample: both ranks refuse that step (neither waits in its collectives), nothing moves
    buffered.call_on_ranks(lambda rank: rank.global_rank == 1 and rank.replay_buffer.empty())
    before = rank_models(buffered)[0]
    with pytest.raises(ValueError, match=r"rank 1 could not sample its replay buffer, so no rank took step 0"):
        buffered.update_from_buffer(1)
    assert buffered.num_updates == start + 3 and buffered.broken is None
    assert_close_state(rank_models(buffered)[0], before)


def test_a_learner_built_without_replay_buffers_refuses_to_fill_or_sample_them_changing_nothing(ddp):
    before, updates = rank_models(ddp)[0], ddp.num_updates
    with pytest.raises(RuntimeError, match="replay_buffer=f"):
        ddp.update_from_buffer(2)
    with pytest.raises(RuntimeError, match="replay_buffer=f"):
        ddp.extend(make_batch("dqn", n=8))
    assert ddp.num_updates == updates and ddp.broken is None
    assert_close_state(rank_models(ddp)[0], before)


# ---- checkpoints ------------------------------------------------------------------------------------


def test_a_remote_checkpoint_loads_into_a_local_learner_and_back(ddp, fsdp, tmp_path):
    ddp.save(tmp_path / "ddp.pt")
    local = local_dqn()
    local.load(tmp_path / "ddp.pt")
    assert local.num_updates == ddp.num_updates
    assert_close_state(local.loss_module.state_dict(), rank_models(ddp)[0])
    fsdp.save(tmp_path / "fsdp")  # a DCP folder, each rank writing its shards
    ppo = LocalLearner(make_loss("ppo", seed=3)[0], SGD)
    ppo.load(tmp_path / "fsdp")
    assert_close_state(ppo.loss_module.state_dict(), rank_models(fsdp)[0])
    # and back: a local learner's file into the remote group, through the object store too
    fresh = local_dqn()
    fresh.update(make_batch("dqn", n=16, seed=9))
    fresh.save(tmp_path / "local.pt")
    ddp.load(tmp_path / "local.pt")
    assert ddp.num_updates == 1
    assert_close_state(rank_models(ddp)[1], fresh.loss_module.state_dict())
    ddp.load_checkpoint(local.checkpoint())
    assert ddp.num_updates == local.num_updates
    assert_close_state(rank_models(ddp)[1], local.loss_module.state_dict())


# ---- bad inputs ----------------------------------------------------------------------------------------


def test_bad_inputs_are_refused_before_anything_changes_and_the_group_stays_usable(ddp):
    before, updates = rank_models(ddp)[0], ddp.num_updates
    with pytest.raises(ValueError, match="do not split into 2 equal shares"):
        ddp.update(make_batch("dqn", n=15))
    with pytest.raises(KeyError, match="Learner rank 0.*lacks these keys"):
        ddp.update(make_batch("dqn", n=16).exclude("action"))
    assert ddp.num_updates == updates and ddp.broken is None
    assert_close_state(rank_models(ddp)[0], before)
    ddp.update(make_batch("dqn", n=16))  # still usable
    assert ddp.num_updates == updates + 1


def test_a_ranks_error_reads_cleanly_names_this_learners_option_and_the_rank_and_rows_that_caused_it(ddp):
    """What a rank raises reaches the caller as it would print on the rank, complete without the chain Ray drops."""
    updates = ddp.num_updates
    with pytest.raises(KeyError) as err:
        ddp.update(make_batch("dqn", n=16).exclude("action"))
    message = str(err.value)  # not a KeyError's repr: no quotes around it, none escaped
    assert message.startswith("Learner rank 0: The loss failed on this batch (AttributeError: ") and "\\'" not in message
    assert "above" not in message and "lacks these keys from loss_module.in_keys: ['action']" in message
    batch = make_batch("dqn", n=16)
    batch["observation"] = batch["observation"].double()
    with pytest.raises(TypeError, match=r"differ from the loss's.*RemoteLearner\(precision='64-true'\)") as err:
        ddp.update(batch)
    assert "FabricLearner" not in str(err.value)
    batch = make_batch("dqn", n=16)
    batch["observation"][11, 0] = float("nan")  # row 3 of rank 1's share; rank 0's steps refuse too (synced NaNs)
    with pytest.raises(FloatingPointError, match=r"Learner rank 1: .*'observation' in rows \[11\] of the batch") as err:
        ddp.update(batch)
    assert err.value.nonfinite_rows == {"observation": [11]} and "on every rank" not in str(err.value)
    assert ddp.num_updates == updates and ddp.broken is None
    ddp.update(make_batch("dqn", n=16))  # still usable
    assert ddp.num_updates == updates + 1


def test_a_loss_that_cannot_be_sent_is_refused_naming_the_factory_to_use(ddp):
    loss, _ = make_loss("dqn")
    loss.lock = threading.Lock()
    with pytest.raises(TypeError, match="cannot be sent.*Pass a factory"):
        remote(loss)
    with pytest.raises(TypeError, match="not an instance"):
        remote(make_loss("dqn")[0], torch.optim.SGD(make_loss("dqn")[0].parameters(), lr=0.1))
    with pytest.raises(ValueError, match="on_nonfinite must be one of"):
        remote(make_loss("dqn")[0], on_nonfinite="ignore")
    with pytest.raises(ValueError, match="No stage trains"):  # the stages are checked against the loss here
        remote(make_loss("sac")[0], None, stages=SAC_STAGES[:1])


# ---- alone on one machine: fail fast, nothing reachable from elsewhere -------------------------------------


def test_a_group_the_embedded_runtime_can_never_hold_is_refused_at_once_naming_what_the_machine_has(ddp):
    """Without the check the constructor waits out setup_timeout (here 600 s: the suite's own timeout fails it)."""
    have = ray.cluster_resources()
    cpus, gpus = have["CPU"], have.get("GPU", 0)
    groups = placement_groups()
    with pytest.raises(RuntimeError, match=f"this machine has {cpus:g} CPUs and {gpus:g} GPUs.*Nothing was started"):
        remote(make_loss("dqn")[0], num_cpus_per_learner=cpus, setup_timeout=600)  # 2 ranks x all the CPUs
    with pytest.raises(RuntimeError, match=f"need 0.5 CPUs and {2 * (gpus + 1):g} GPUs, but this machine has"):
        remote(make_loss("dqn")[0], num_gpus_per_learner=gpus + 1, setup_timeout=600)
    assert placement_groups() == groups and ray.is_initialized()  # nothing reserved; the runtime still serves
    assert ddp.broken is None


def placement_groups():
    return sorted(k for k, v in ray.util.placement_group_table().items() if v["state"] != "REMOVED")


def listening(pids):
    """Each of ``pids``' listening TCP sockets as ``(pid, ip, port)``."""
    import psutil

    found = []
    for pid in pids:
        for conn in psutil.Process(pid).net_connections(kind="inet"):
            if conn.status == psutil.CONN_LISTEN:
                found.append((pid, conn.laddr.ip, conn.laddr.port))
    return found


def test_alone_the_runtime_and_the_groups_listen_on_loopback_only_and_refuse_the_hosts_address(ddp, fsdp):
    """Ray's servers (GCS, raylet, the core workers of this process and of every rank, its agents) and each group's
    rendezvous store and gloo pairs: no socket on ``*`` or on the host's address, so no other machine connects."""
    import psutil

    runtime = [os.getpid(), *(p.pid for p in psutil.Process().children(recursive=True))]  # every one is Ray's
    sockets = listening(runtime)
    outside = {(pid, ip, port) for pid, ip, port in sockets if ip not in ("127.0.0.1", "::ffff:127.0.0.1", "::1")}
    assert not outside, outside
    for learner in (ddp, fsdp):  # each rank: its core worker, gloo; rank 0 also the group's store
        ports = [len([s for s in sockets if s[0] == pid]) for pid in learner.pids]
        assert ports[0] >= 3 and all(n >= 2 for n in ports), ports
    hosts = [a.address for addrs in psutil.net_if_addrs().values() for a in addrs
             if a.family.name == "AF_INET" and not a.address.startswith("127.")]
    for host in hosts:  # what another machine would try: every port, at this machine's own address
        for _, _, port in sockets:
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection((host, port), timeout=5).close()


def test_alone_the_ranks_run_at_the_controller_s_priority_not_ray_s_background_niceness(ddp, fsdp):
    """Ray starts workers 15 steps nicer than the runtime; ranks at that priority would get a fraction of a core beside
    any busy process, where the same ranks under torchrun get their share."""
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    assert [os.getpriority(os.PRIO_PROCESS, pid) for pid in (*ddp.pids, *fsdp.pids)] == [mine] * 4


CONTROLLER = """
import sys, psutil, time
from fabric_learner.remote import _runtime
_runtime.join(None)  # the embedded runtime, as a RemoteLearner starts it
me = psutil.Process()
while not {"ray::DashboardAgent", "ray::RuntimeEnvAgent"} <= {p.name() for p in me.children(recursive=True)}:
    time.sleep(0.2)
time.sleep(1.5)  # the watchdog notes the raylet's descendants every second
print(*[p.pid for p in me.children(recursive=True)], flush=True)
time.sleep(600)
"""


def test_a_killed_controller_leaves_none_of_its_embedded_runtimes_processes_behind():
    """SIGKILL leaves Python no time to shut the runtime down: the raylet and the ranks follow the controller at once,
    but Ray's agents (about 190 MB) would outlive it by a minute. The watchdog ends them within a second; 30 s is
    the bound (half of what they lived before), not the expectation."""
    import subprocess

    import psutil

    def alive(pid):
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    controller = subprocess.Popen([sys.executable, "-c", CONTROLLER], stdout=subprocess.PIPE, text=True)
    try:
        runtime = {int(pid): psutil.Process(int(pid)).name() for pid in controller.stdout.readline().split()}
    finally:
        controller.kill()  # SIGKILL
        controller.wait()
    assert {"raylet", "gcs_server", "ray::DashboardAgent", "ray::RuntimeEnvAgent"} <= set(runtime.values())
    deadline = time.monotonic() + 30
    while left := [name for pid, name in runtime.items() if alive(pid)]:
        assert time.monotonic() < deadline, left
        time.sleep(0.2)


# ---- faults ---------------------------------------------------------------------------------------------


class SlowOnRankOne(torch.nn.Module):
    """DQN's loss; on rank 1, a batch holding ``"stall"`` makes its forward sleep for a minute."""

    def __init__(self) -> None:
        super().__init__()
        self.loss = make_loss("dqn")[0]
        self.loss.make_value_estimator()  # its state complete from the start, as a checkpoint holds it

    def forward(self, td):
        if "stall" in td.keys() and os.environ.get("NODE_RANK") == "1":
            time.sleep(60)
        return self.loss(td.exclude("stall"))


def stalling_batch():
    batch = make_batch("dqn", n=16, seed=7)
    batch["stall"] = torch.zeros(16)
    return batch


class Interrupted(Exception):
    pass


def test_a_killed_rank_fails_the_update_within_seconds_naming_it_and_the_group_restarts_from_the_last_save(
        ddp, tmp_path):
    """And, that learner's ``with`` block exiting on an exception: its update in flight says the learner was closed."""
    with pytest.raises(Interrupted):
        with remote(SlowOnRankOne(), on_lost_rank="rebuild") as learner:
            restarts_from_the_last_save(learner, tmp_path)
            pending = learner.update(make_batch("dqn", n=16, seed=11), wait=False)
            raise Interrupted("the script stops")
    with pytest.raises(RuntimeError, match="closed: the with block exited on Interrupted.*no rank was lost"):
        pending.result()
    with pytest.raises(RuntimeError, match="is closed"):
        learner.update(make_batch("dqn", n=16))


def restarts_from_the_last_save(learner, tmp_path):
    local = LocalLearner(SlowOnRankOne(), SGD)
    for step in range(2):
        batch = make_batch("dqn", n=16, seed=600 + step)
        learner.update(batch.clone())
        local.update(batch.clone())
    learner.save(tmp_path / "last.pt")
    learner.update(make_batch("dqn", n=16, seed=9))  # after the save: lost with the group
    batch = stalling_batch()
    kept, pids = batch.clone(), list(learner.pids)
    pending = learner.update(batch, wait=False)
    time.sleep(1.0)
    os.kill(pids[1], signal.SIGKILL)  # mid-update: rank 0 waits for it in a collective
    with pytest.raises(LearnerLostError, match="rank 1 was lost.*1 update\\(s\\) since") as err:
        pending.result()
    assert err.value.rank == 1  # found lost (LearnerLostError), not by the update's timeout, however slow the host
    message = str(err.value)  # one story: what was rebuilt, not also "build a new RemoteLearner"
    assert "The learner is usable" in message and "Build a new RemoteLearner" not in message
    assert "nothing in this process changed" not in message  # num_updates went back to the save
    assert err.value.rebuilt_from == str(tmp_path / "last.pt") and err.value.lost_updates == 1
    assert learner.num_updates == 2 and (batch == kept).all()  # back at the save; the caller's batch untouched
    assert set(learner.pids).isdisjoint(pids)  # a new group
    batch = make_batch("dqn", n=16, seed=10)
    torch.testing.assert_close(learner.update(batch.clone())["loss"], local.update(batch.clone())["loss"], **TOL)
    assert_close_state(assert_ranks_identical(learner), local.loss_module.state_dict())


def test_a_hanging_rank_hits_the_timeout_with_an_error_naming_it_and_where_it_is(ddp):
    with remote(SlowOnRankOne(), timeout=4) as learner:
        times_out_naming_the_silent_rank(learner)


def times_out_naming_the_silent_rank(learner):
    learner.update(make_batch("dqn", n=16))
    start = time.monotonic()
    with pytest.raises(LearnerTimeoutError, match="timed out after 4 s") as err:
        learner.update(stalling_batch())
    assert time.monotonic() - start < 60  # the timeout ended it, not rank 1's minute-long forward
    assert 1 in err.value.ranks and "rank 1: busy in forward" in str(err.value)  # the stalled rank, in its loss
    assert learner.num_updates == 1 and learner.broken is err.value
    with pytest.raises(RuntimeError, match="ended by an earlier fault"):
        learner.update(make_batch("dqn", n=16))
