"""torchrl's algorithm trainers driven by a learner: PPO, A2C, SAC, TD3, DDPG, DQN, IQL and CQL.

One process: ``learner_trainer(<torchrl trainer>, LocalLearner).train()`` ends with the weights
torchrl's own ``train()`` reaches from the same seeds, bit for bit (its hooks: GAE, replay
buffers, target updates, epsilon annealing, all kept). Two ranks (one launch per strategy serves
all eight, tests/workers/algorithm_trainers.py): each rank fed half of fixed batches through the
trainer's hooks equals one process on the whole batches within 1e-5 where the loss is
deterministic, ranks are bit-identical always, and ``train()`` on the real environments runs.
"""

from __future__ import annotations

import functools
import gc
import os
import sys

import pytest
import torch
from multiproc import WORKERS, launch

sys.path.insert(0, WORKERS)
import algorithm_trainers as A
from torchrl.trainers.trainers import UTDRHook

from fabric_learner import LocalLearner
from fabric_learner.from_torchrl import learner_trainer
from fabric_learner.replay import prioritized_sampler

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.mark.parametrize("algo", A.ALGOS)
def test_on_a_local_learner_an_algorithm_trainer_trains_as_torchrls_own_bit_for_bit(algo):
    reference = A.build(algo)
    reference.train()
    torchrl_trainer = A.build(algo)
    trainer = learner_trainer(torchrl_trainer, LocalLearner)
    trainer.train()
    assert trainer.collected_frames == reference.collected_frames == reference.total_frames
    assert trainer.learner.num_updates > 0
    want, got = A.weights(reference.loss_module), A.weights(trainer.learner.loss_module)
    assert want.keys() <= got.keys()  # the learner also materialises the value estimator's gamma at build
    for k in want:
        assert torch.equal(want[k], got[k]), k
    if algo == "dqn":  # torchrl's epsilon annealing hook, a method of its trainer, saw the frames
        assert torchrl_trainer.greedy_module.eps == reference.greedy_module.eps < 1.0


def test_the_trainers_norm_clipping_is_the_learners():
    trainer = learner_trainer(A.build("sac"), LocalLearner)
    assert trainer.learner.clip_grad_norm == A.CLIP
    trainer.collector.shutdown()
    own = learner_trainer(A.build("sac"), functools.partial(LocalLearner, clip_grad_norm=0.25))
    assert own.learner.clip_grad_norm == 0.25  # a factory that fixes its own clipping keeps it
    own.collector.shutdown()
    td3 = learner_trainer(A.build("td3"), LocalLearner)
    assert [s.clip_grad_norm for s in td3.learner.stages] == [A.CLIP, A.CLIP]
    td3.collector.shutdown()


def test_cqls_loss_term_selection_is_kept():
    trainer = learner_trainer(A.build("cql"), LocalLearner)
    (stage,) = trainer.learner.stages
    assert "loss_actor_bc" not in stage.loss_keys and {"loss_actor", "loss_qvalue", "loss_cql", "loss_alpha"} \
        == set(stage.loss_keys)
    trainer.collector.shutdown()


def test_the_collector_is_shut_down_once_by_the_trainer_that_trains_with_it():
    torchrl_trainer = A.build("ddpg")
    trainer = learner_trainer(torchrl_trainer, LocalLearner)
    collector = trainer.collector
    calls = []
    shutdown = collector.shutdown
    collector.shutdown = lambda *a, **k: (calls.append(1), shutdown(*a, **k))[1]
    del torchrl_trainer
    gc.collect()  # torchrl's Trainer.__del__ shut the shared collector down here, before training
    assert calls == []
    trainer.train()
    assert trainer.collected_frames == trainer.total_frames and calls == [1]
    del trainer
    gc.collect()  # and here again, after train() had closed it
    assert calls == [1]


def test_the_update_to_data_ratio_counts_the_learner_trainers_updates():
    trainer = learner_trainer(A.build("sac"), LocalLearner)
    trainer.train()
    (utdr,) = [op for op, _ in trainer._pre_steps_log_ops if isinstance(_innermost(op), UTDRHook)]
    logged = utdr(None)  # the registered hook, as the loop calls it
    assert logged["update_count"] == trainer._optim_count > 0


@pytest.mark.parametrize("algo", ["sac", "dqn"])
def test_an_off_policy_trainers_random_warm_up_reaches_its_replay_buffer(algo):
    def with_warm_up():
        torchrl_trainer = A.build(algo)  # two batches; updates once the frames pass the warm-up: after the second
        torchrl_trainer.collector.init_random_frames = torchrl_trainer.total_frames // 2 + 1
        return torchrl_trainer

    reference = with_warm_up()
    reference.train()
    torchrl_trainer = with_warm_up()
    trainer = learner_trainer(torchrl_trainer, LocalLearner)
    trainer.train()
    assert trainer.collected_frames == reference.collected_frames == reference.total_frames
    assert trainer.learner.num_updates > 0
    # torchrl's own loop stores a batch only when it updates: the warm-up is lost there
    assert reference.replay_buffer.write_count == reference.total_frames // 2
    assert torchrl_trainer.replay_buffer.write_count == trainer.collected_frames


def _innermost(op):
    while hasattr(op, "__wrapped__"):
        op = op.__wrapped__
    return op


def td3_with_priorities():
    torchrl_trainer = A.build("td3")
    torchrl_trainer.replay_buffer._sampler = prioritized_sampler(A.K * A.B, alpha=0.6, beta=0.4)
    torchrl_trainer.optim_steps_per_batch = A.K  # a prioritized sampler never runs out
    return torchrl_trainer


def test_td3_replay_priorities_are_written_back_as_torchrls_stepper_writes_them():
    reference = td3_with_priorities()
    A.run_fed(reference, "td3", None, steps=2)
    torchrl_trainer = td3_with_priorities()
    trainer = learner_trainer(torchrl_trainer, LocalLearner)
    A.run_fed(trainer, "td3", None, steps=2)
    want = _priorities(reference.replay_buffer.sampler, A.K * A.B)
    got = _priorities(torchrl_trainer.replay_buffer.sampler, A.K * A.B)
    assert torch.equal(got, want)
    assert len(set(got.tolist())) > 2  # written per sample, not left at the default
    trainer.collector.shutdown()


def _priorities(sampler, n):
    return torch.as_tensor([float(sampler._sum_tree[i]) for i in range(n)], dtype=torch.float64)


# ---- two ranks -----------------------------------------------------------------------------


@functools.cache
def _ranks(strategy: str, out: str):
    os.makedirs(out, exist_ok=True)
    proc = launch(os.path.join(WORKERS, "algorithm_trainers.py"), out, strategy, timeout=540)
    assert proc.returncode == 0, proc.stdout[-6000:]
    assert proc.leftovers == 0, proc.stdout[-2000:]
    return [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False) for r in (0, 1)]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    base = tmp_path_factory.mktemp("algorithm_trainers")
    return lambda strategy: _ranks(strategy, str(base / strategy))


@functools.cache
def one_process(algo):
    """LocalLearner on the full fixed batches: update outputs and the loss's final state."""
    trainer = learner_trainer(A.build(algo), LocalLearner)
    result = A.run_fed(trainer, algo, None)
    result["model"] = A.weights(trainer.learner.loss_module)
    trainer.collector.shutdown()
    return result


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
@pytest.mark.parametrize("algo", A.ALGOS)
def test_on_two_ranks_an_algorithm_trainer_equals_one_process_on_the_whole_data(ranks, strategy, algo):
    r0, r1 = (r[algo] for r in ranks(strategy))
    for k, v in r0["model"].items():
        assert torch.equal(v, r1["model"][k]), k  # the ranks agree bit for bit
    for k, v in r0["train"]["model"].items():
        assert torch.equal(v, r1["train"]["model"][k]), k
    reference = one_process(algo)
    assert r0["updates"] == r1["updates"] == reference["updates"] > 0
    assert [sorted(o) for o in r0["outputs"]] == [sorted(o) for o in reference["outputs"]]  # same stages stepped
    assert r0["train"]["frames"] == r1["train"]["frames"] == 2 * (A.ENVS * A.T if algo in A.ON_POLICY else A.K * A.B)
    assert r0["train"]["updates"] > 0
    if A.DETERMINISTIC[algo]:
        for got, want in zip(r0["outputs"], reference["outputs"]):
            for k in want:
                torch.testing.assert_close(got[k], want[k], atol=1e-5, rtol=1e-5, msg=k)
        assert r0["model"].keys() == reference["model"].keys()
        for k, v in reference["model"].items():
            torch.testing.assert_close(r0["model"][k], v, atol=1e-5, rtol=1e-5, msg=k)
