"""The Learner contract (docs/contract.md §2-§5) on LocalLearner and single-process FabricLearner."""

from __future__ import annotations

import functools
import os
import pickle

import pytest
import torch
from conftest import make_learner
from rl_cases import CASES, flat_params, make_batch, make_loss
from tensordict import TensorDict
from torch import nn
from torchrl.objectives import LossModule

from fabric_learner import LocalLearner


class ToyLoss(LossModule):
    """A LossModule with chosen output keys, to pin down the summing rule exactly."""

    def __init__(self, keys=("loss_a", "loss_b"), reduce=True):
        super().__init__()
        self.net = nn.Linear(3, 1)
        self.keys, self.reduce = keys, reduce

    def forward(self, td):
        y = self.net(td["x"]).squeeze(-1)
        out = {}
        for i, key in enumerate(self.keys):
            value = (y * (i + 1)) ** 2
            out[key] = value.mean() if self.reduce else value
        out["metric"] = y.detach().mean()
        return TensorDict(out, [])


def toy_batch(n=8):
    return TensorDict({"x": torch.arange(n * 3, dtype=torch.float32).reshape(n, 3) / 10}, [n])


def snapshot(learner):
    return {k: v.clone() for k, v in learner.loss_module.state_dict().items()}, repr(learner.optimizer.state_dict())


def assert_unchanged(learner, before):
    params, opt = before
    for k, v in learner.loss_module.state_dict().items():
        assert torch.equal(v, params[k]), k
    assert repr(learner.optimizer.state_dict()) == opt


def test_sums_loss_prefixed_keys_and_passes_metrics(kind):
    torch.manual_seed(0)
    loss = ToyLoss(keys=("loss_a", "loss_b", "lossy"))
    ref = ToyLoss(keys=("loss_a", "loss_b", "lossy"))
    ref.load_state_dict(loss.state_dict())
    learner = make_learner(kind, loss, functools.partial(torch.optim.SGD, lr=0.1))
    batch = toy_batch()
    out = learner.update(batch)
    expected = ref(batch)
    total = expected["loss_a"] + expected["loss_b"] + expected["lossy"]
    total.backward()
    with torch.no_grad():
        for p in ref.parameters():
            p -= 0.1 * p.grad
    for k in ("loss_a", "loss_b", "lossy", "metric"):
        torch.testing.assert_close(out[k], expected[k].detach())
        assert not out[k].requires_grad
    for (n, p), q in zip(loss.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, msg=n)


def test_bare_loss_key_dqn(kind):
    loss, _ = make_loss("dqn")
    learner = make_learner(kind, loss)
    out = learner.update(make_batch("dqn"))
    assert set(out.keys()) == {"loss", "grad_norm"}
    assert learner.num_updates == 1


def test_accumulation_defers_step_and_grad_norm_only_on_step(kind):
    loss, _ = make_loss("ppo")
    learner = make_learner(kind, loss, grad_accum_steps=2, clip_grad_norm=1.0)
    before = flat_params(loss)
    first = learner.update(make_batch("ppo", seed=1))
    assert "grad_norm" not in first.keys()
    assert learner.num_updates == 0
    for k, v in flat_params(loss).items():
        assert torch.equal(v, before[k]), k
    second = learner.update(make_batch("ppo", seed=2))
    assert "grad_norm" in second.keys() and learner.num_updates == 1
    assert any(not torch.equal(v, before[k]) for k, v in flat_params(loss).items())


@pytest.mark.parametrize("case", ["dqn", "ppo", "ddpg"])
def test_two_accumulated_halves_equal_one_full_batch(kind, case):
    full, _ = make_loss(case)
    acc, _ = make_loss(case)
    a = make_learner(kind, full, functools.partial(torch.optim.Adam, lr=1e-2), clip_grad_norm=0.5)
    b = make_learner(kind, acc, functools.partial(torch.optim.Adam, lr=1e-2), clip_grad_norm=0.5, grad_accum_steps=2)
    for step in range(3):
        batch = make_batch(case, n=16, seed=10 + step)
        ra = a.update(batch.clone())
        b.update(batch[:8].clone())
        rb = b.update(batch[8:].clone())
        torch.testing.assert_close(ra["grad_norm"], rb["grad_norm"], atol=1e-6, rtol=1e-5)
    pa, pb = flat_params(full), flat_params(acc)
    for k in pa:
        torch.testing.assert_close(pa[k], pb[k], atol=1e-6, rtol=1e-5, msg=k)


def test_no_loss_key_raises_before_any_change(kind):
    loss = ToyLoss(keys=("objective",))
    learner = make_learner(kind, loss)
    learner.update  # noqa: B018
    before = snapshot(learner)
    batch = toy_batch()
    batch_before = batch.clone()
    with pytest.raises(ValueError, match="no 'loss'-prefixed entry.*objective"):
        learner.update(batch)
    assert_unchanged(learner, before)
    assert (batch == batch_before).all()
    assert learner.num_updates == 0


def test_non_scalar_loss_raises_before_any_change(kind):
    loss = ToyLoss(reduce=False)
    learner = make_learner(kind, loss, grad_accum_steps=2)
    before = snapshot(learner)
    with pytest.raises(ValueError, match=r"shape \(8,\).*reduction='mean'"):
        learner.update(toy_batch())
    assert_unchanged(learner, before)
    assert learner._accum_step == 0


@pytest.mark.parametrize("kwargs", [{"grad_accum_steps": 0}, {"grad_accum_steps": 1.5}, {"clip_grad_norm": 0},
                                    {"clip_grad_norm": -1.0}])
def test_bad_construction_arguments(kind, kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        make_learner(kind, ToyLoss(), **kwargs)


@pytest.mark.parametrize("learner", ["local", "fabric", "remote"])
def test_a_policy_that_is_not_a_module_of_the_loss_is_refused_naming_the_rule(learner):
    """Such a policy was accepted, and get_weights() returned its untrained weights without a word."""
    import copy

    from fabric_learner import RemoteLearner

    loss, qnet = make_loss("dqn")
    build = {"local": lambda policy: make_learner("local", loss, policy=policy),
             "fabric": lambda policy: make_learner("fabric", loss, policy=policy),
             "remote": lambda policy: RemoteLearner(loss, policy=policy)}[learner]
    strays = {"a copy of the loss's network": copy.deepcopy(qnet), "a network built apart": nn.Linear(4, 2),
              "a wrapper with parameters of its own": nn.Sequential(qnet, nn.Linear(2, 2)), "no parameters": nn.ReLU()}
    for what, policy in strays.items():
        with pytest.raises(ValueError, match="policy= must be a module of the loss") as refused:
            build(policy)
        assert "Nothing was built" in str(refused.value), what
    if learner != "remote":  # the loss's own network, and a wrapper of it without parameters of its own, are taken
        from tensordict.nn import TensorDictSequential
        from torchrl.modules import EGreedyModule

        build(qnet)
        build(TensorDictSequential(qnet, EGreedyModule(qnet.spec, eps_init=0.3)))


def test_coverage_check_catches_actor_only_optimizer_for_sac(kind):
    loss, actor = make_loss("sac")
    learner = make_learner(kind, loss, torch.optim.Adam(actor.parameters()))
    before = snapshot(learner)
    with pytest.raises(RuntimeError, match="qvalue_network_params.*log_alpha|log_alpha.*qvalue_network_params"):
        learner.update(make_batch("sac"))
    assert_unchanged(learner, before)
    assert learner.num_updates == 0


def test_checkpoint_is_independent_of_live_state(kind):
    loss, _ = make_loss("ppo")
    learner = make_learner(kind, loss)
    learner.update(make_batch("ppo"))
    ckpt = learner.checkpoint()
    assert set(ckpt) >= {"model", "optimizer", "accum_step"}
    frozen = {k: v.clone() for k, v in ckpt["model"].items()}
    moments = {i: s["exp_avg"].clone() for i, s in ckpt["optimizer"]["state"].items()}
    learner.update(make_batch("ppo", seed=3))
    for k, v in ckpt["model"].items():
        assert torch.equal(v, frozen[k]), k
    for i, s in ckpt["optimizer"]["state"].items():
        assert torch.equal(s["exp_avg"], moments[i])
    live = dict(loss.state_dict())
    for v in ckpt["model"].values():
        v.add_(1.0)
    for k, v in loss.state_dict().items():
        assert torch.equal(v, live[k])


def test_checkpoint_round_trip_and_mid_window_warning(kind):
    loss, _ = make_loss("dqn")
    learner = make_learner(kind, loss, grad_accum_steps=2)
    learner.update(make_batch("dqn", seed=1))
    learner.update(make_batch("dqn", seed=2))
    learner.update(make_batch("dqn", seed=3))  # one micro-batch into the next window
    ckpt = learner.checkpoint()
    assert ckpt["accum_step"] == 1
    other = make_learner(kind, make_loss("dqn", seed=7)[0], grad_accum_steps=2)
    with pytest.warns(UserWarning, match="start of a new window"):
        other.load_checkpoint(ckpt)
    assert other.num_updates == 1 and other._accum_step == 0
    for k, v in other.loss_module.state_dict().items():
        assert torch.equal(v, ckpt["model"][k])
    out = other.update(make_batch("dqn", seed=4))
    assert "grad_norm" not in out.keys()  # a full window starts again


def test_bad_checkpoint_is_refused_before_any_change(kind):
    loss, _ = make_loss("dqn")
    learner = make_learner(kind, loss)
    learner.update(make_batch("dqn"))
    other_loss, _ = make_loss("ppo")
    bad = make_learner("local", other_loss).checkpoint()
    before = snapshot(learner)
    with pytest.raises(ValueError, match="does not match"):
        learner.load_checkpoint(bad)
    ckpt = learner.checkpoint()
    ckpt["optimizer"]["param_groups"][0]["params"] = ckpt["optimizer"]["param_groups"][0]["params"][:1]
    ckpt["model"] = {k: v + 1 for k, v in ckpt["model"].items()}
    with pytest.raises(ValueError, match="param groups"):
        learner.load_checkpoint(ckpt)
    assert_unchanged(learner, before)


def test_get_weights_plain_detached_and_independent(kind):
    loss, policy = make_loss("sac")
    learner = make_learner(kind, loss, policy=policy)
    learner.update(make_batch("sac"))
    weights = learner.get_weights()
    expected = TensorDict.from_module(policy)
    assert set(weights.keys(True, True)) == set(expected.keys(True, True))
    for key, value in weights.items(True, True):
        assert type(value) is torch.Tensor and not value.requires_grad
        assert value.device.type == "cpu"
        assert torch.equal(value, expected[key].data)
        assert value.data_ptr() != expected[key].data_ptr()
    weights.apply_(lambda t: t.zero_())
    assert any(p.abs().sum() > 0 for p in policy.parameters())
    no_policy = make_learner(kind, make_loss("dqn")[0]).get_weights(cpu_offload=False)
    assert set(no_policy.flatten_keys(".").keys()) == {n for n, _ in make_loss("dqn")[0].named_parameters()}


def test_save_load_round_trip(kind, tmp_path):
    loss, _ = make_loss("sac")
    learner = make_learner(kind, loss, clip_grad_norm=1.0)
    for s in range(3):
        learner.update(make_batch("sac", seed=s))
    path = tmp_path / "ckpt.pt"
    learner.save(path)
    fresh = make_learner(kind, make_loss("sac", seed=9)[0], clip_grad_norm=1.0)
    fresh.load(path)
    assert fresh.num_updates == 3
    for k, v in loss.state_dict().items():
        assert torch.equal(v, fresh.loss_module.state_dict()[k]), k
    for i, s in learner.optimizer.state_dict()["state"].items():
        t = fresh.optimizer.state_dict()["state"][i]
        assert torch.equal(s["exp_avg"], t["exp_avg"]) and torch.equal(s["exp_avg_sq"], t["exp_avg_sq"])
    torch.manual_seed(42)
    learner.update(make_batch("sac", seed=5))
    torch.manual_seed(42)
    fresh.update(make_batch("sac", seed=5))
    for k, v in loss.state_dict().items():
        assert torch.equal(v, fresh.loss_module.state_dict()[k]), k


class _Payload:
    def __reduce__(self):
        return (os.system, (f"touch {os.environ['FL_MARKER']}",))


def test_load_never_executes_pickled_code(kind, tmp_path, monkeypatch):
    marker = tmp_path / "pwned"
    monkeypatch.setenv("FL_MARKER", str(marker))
    path = tmp_path / "evil.pt"
    torch.save({"model": {}, "optimizer": {}, "evil": _Payload()}, path)
    learner = make_learner(kind, make_loss("dqn")[0])
    before = snapshot(learner)
    with pytest.raises(pickle.UnpicklingError):
        learner.load(path)
    assert not marker.exists()
    assert_unchanged(learner, before)


@pytest.mark.parametrize("case", list(CASES))
def test_fabric_single_process_equals_local(case):
    a_loss, _ = make_loss(case)
    b_loss, _ = make_loss(case)
    a = make_learner("local", a_loss, functools.partial(torch.optim.Adam, lr=1e-2), clip_grad_norm=0.5)
    b = make_learner("fabric", b_loss, functools.partial(torch.optim.Adam, lr=1e-2), clip_grad_norm=0.5)
    for step in range(3):
        batch = make_batch(case, seed=20 + step)
        torch.manual_seed(step)
        ra = a.update(batch.clone())
        torch.manual_seed(step)
        rb = b.update(batch.clone())
        assert ra.keys() == rb.keys()
        torch.testing.assert_close(ra["grad_norm"], rb["grad_norm"], atol=0, rtol=0)
    for k, v in flat_params(a_loss).items():
        assert torch.equal(v, flat_params(b_loss)[k]), k


def test_default_optimizer_covers_expanded_critics_and_alpha():
    loss, _ = make_loss("sac")
    learner = LocalLearner(loss)
    covered = {id(p) for g in learner.optimizer.param_groups for p in g["params"]}
    names = {n for n, p in loss.named_parameters() if id(p) in covered}
    assert "log_alpha" in names and any(n.startswith("qvalue_network_params") for n in names)
    assert not any("target" in n for n in names)


def test_checkpoint_restores_moments_by_parameter_name_whatever_the_order(kind, tmp_path):
    loss, _ = make_loss("ppo")
    reversed_opt = torch.optim.Adam(list(reversed(list(loss.parameters()))), lr=1e-2)
    learner = make_learner(kind, loss, reversed_opt)
    learner.update(make_batch("ppo"))
    learner.save(tmp_path / "c.pt")
    fresh_loss, _ = make_loss("ppo", seed=3)
    fresh = make_learner(kind, fresh_loss, functools.partial(torch.optim.Adam, lr=1e-2))
    fresh.load(tmp_path / "c.pt")
    by_param = {id(p): s for p, s in learner.optimizer.state.items()}
    for (name, p), (_, q) in zip(loss.named_parameters(), fresh_loss.named_parameters()):
        assert torch.equal(by_param[id(p)]["exp_avg"], fresh.optimizer.state[q]["exp_avg"]), name


def test_a_crafted_sharded_checkpoint_metadata_runs_nothing(kind, tmp_path, monkeypatch):
    """DCP's own reader unpickles ``.metadata`` with plain pickle; ours accepts only its classes."""
    import json

    from fabric_learner.checkpoint.dcp_folder import SHARDED_FORMAT

    marker = tmp_path / "pwned"
    monkeypatch.setenv("FL_MARKER", str(marker))
    version = tmp_path / "ckpt" / "v000000001-deadbeef"
    version.mkdir(parents=True)
    (tmp_path / "ckpt" / "LATEST").write_text(version.name)
    (version / "meta.json").write_text(json.dumps({"format": SHARDED_FORMAT}))
    (version / ".metadata").write_bytes(pickle.dumps(_Payload()))
    learner = make_learner(kind, make_loss("dqn")[0])
    before = snapshot(learner)
    with pytest.raises(pickle.UnpicklingError, match="Refusing to load posix.system"):
        learner.load(tmp_path / "ckpt")
    assert not marker.exists()
    assert_unchanged(learner, before)


class _StepCallback:
    """A Fabric callback on optimizer steps: Fabric's optimizer wrapper must then stay in the path."""

    def __init__(self):
        self.calls = 0

    def on_after_optimizer_step(self, strategy, optimizer):
        self.calls += 1


@pytest.mark.parametrize("case", ["ppo", "dqn", "sac"])
def test_one_device_calls_torch_directly_with_results_identical_to_fabrics_wrappers(case):
    """At 32-true on one device the step skips Fabric's wrappers (they only call torch's own)."""
    from lightning.fabric import Fabric

    from fabric_learner import FabricLearner

    callback = _StepCallback()
    learners = [
        FabricLearner(make_loss(case)[0], functools.partial(torch.optim.Adam, lr=1e-2), clip_grad_norm=0.5,
                      grad_accum_steps=2, accelerator="cpu", devices=1),
        FabricLearner(make_loss(case)[0], functools.partial(torch.optim.Adam, lr=1e-2), clip_grad_norm=0.5,
                      grad_accum_steps=2, fabric=Fabric(accelerator="cpu", devices=1, callbacks=[callback])),
    ]
    assert learners[0]._direct and not learners[1]._direct
    norms = [[], []]
    for step in range(6):
        batch = make_batch(case, seed=40 + step)
        for i, learner in enumerate(learners):
            torch.manual_seed(step)
            out = learner.update(batch.clone())
            if "grad_norm" in out.keys():
                norms[i].append(out["grad_norm"])
    assert callback.calls == 3  # the wrapped path did go through Fabric's optimizer wrapper
    assert torch.equal(torch.stack(norms[0]), torch.stack(norms[1]))
    for k, v in flat_params(learners[0].loss_module).items():
        assert torch.equal(v, flat_params(learners[1].loss_module)[k]), k
