"""The update's cheap paths (issue #17) give exactly what the generic code and a hand-written loop give."""

from __future__ import annotations

import functools

import pytest
import torch
from rl_cases import flat_params, make_batch, make_loss
from tensordict import LazyStackedTensorDict, NonTensorData, TensorDict

from fabric_learner import FabricLearner, LocalLearner
from fabric_learner.step.carrier import _on_device
from fabric_learner.step.output import detached, loss_keys


def _outputs():
    grad = torch.randn(3, requires_grad=True)
    flat = TensorDict({"loss_a": grad.sum() * 2, "metric": torch.tensor(1.0),
                       "frozen": torch.nn.Parameter(torch.ones(2), requires_grad=False)}, [])
    nested = TensorDict({"loss": grad.sum(), "info": TensorDict({"x": grad * 3}, [])}, [])
    batched = TensorDict({"loss": grad * 2}, [3])
    named = TensorDict({"loss": grad * 2}, [3], names=["n"])
    locked = TensorDict({"loss": grad.sum()}, []).lock_()
    lazy = LazyStackedTensorDict.lazy_stack([TensorDict({"loss": grad[i] * 1}, []) for i in range(3)])
    with_text = TensorDict({"loss": grad.sum(), "note": NonTensorData("x")}, [])
    on_device = TensorDict({"loss": grad.sum() * 2, "x": grad * 1}, [], device="cpu")
    ppo_loss = make_loss("ppo")[0]
    real = ppo_loss(make_batch("ppo", seed=1))
    return {"flat": flat, "nested": nested, "batched": batched, "named": named, "locked": locked, "lazy": lazy,
            "non-tensor": with_text, "device": on_device, "ppo": real}


@pytest.mark.parametrize("name", list(_outputs()))
def test_detached_is_detach(name):
    output = _outputs()[name]
    got, want = detached(output), output.detach()
    assert type(got) is type(want)
    assert got.batch_size == want.batch_size and got.device == want.device and got.names == want.names
    assert got.is_locked == want.is_locked
    assert set(got.keys(True, True)) == set(want.keys(True, True))
    assert loss_keys(got) == loss_keys(want)
    for key in want.keys(True, True, is_leaf=lambda cls: not issubclass(cls, TensorDict)):
        a, b = got.get(key), want.get(key)
        if isinstance(b, torch.Tensor):
            assert not a.requires_grad and torch.equal(a, b), key
            assert type(a) is type(b), key  # a Parameter in the output comes back a plain tensor, as from detach()
            if name != "lazy":  # a lazy stack's get() stacks anew on every call
                assert a.data_ptr() == b.data_ptr(), key
    if name == "ppo":
        assert any(output.get(k).requires_grad for k in loss_keys(output))


def _batches():
    cpu = make_batch("dqn", n=4, seed=2)
    nested_meta = cpu.clone()
    nested_meta["next", "reward"] = torch.empty(4, 1, device="meta")
    top_meta = cpu.clone()
    top_meta["observation"] = torch.empty(4, 8, device="meta")
    lazy = TensorDict({"a": LazyStackedTensorDict.lazy_stack([TensorDict({"x": torch.zeros(2)}, [])] * 4),
                       "b": torch.zeros(4)}, [4])
    lazy_meta = TensorDict({"a": LazyStackedTensorDict.lazy_stack(
        [TensorDict({"x": torch.zeros(2, device="meta")}, [])] * 4), "b": torch.zeros(4)}, [4])
    with_device = cpu.clone().to("cpu")
    return {"cpu": cpu, "nested meta": nested_meta, "top meta": top_meta, "lazy": lazy, "lazy meta": lazy_meta,
            "with device": with_device}


@pytest.mark.parametrize("name", list(_batches()))
def test_on_device_agrees_with_the_generic_walk(name):
    batch = _batches()[name]
    for device in (torch.device("cpu"), torch.device("meta")):
        generic = (batch.device == device) if batch.device is not None else all(
            t.device == device for t in batch.values(include_nested=True, leaves_only=True))
        assert _on_device(batch, device) == generic, (name, device)


class _Hand:
    """The loop a user writes: loss, sum of loss keys, backward, clip_grad_norm_, Adam step, zero_grad.
    Without clipping, ``clip_grad_norm_(params, inf)`` gives the norm (and scales gradients by 1)."""

    def __init__(self, loss, clip):
        self.loss, self.opt = loss, torch.optim.Adam(loss.parameters(), lr=1e-2)
        self.params = [p for g in self.opt.param_groups for p in g["params"]]
        self.clip = float("inf") if clip is None else clip

    def update(self, td):
        out = self.loss(td)
        total = sum(out.get(k) for k in loss_keys(out))
        total.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        self.opt.step()
        self.opt.zero_grad()
        return norm


@pytest.mark.parametrize("clip", [0.5, None])
@pytest.mark.parametrize("case", ["ppo", "dqn", "sac"])
def test_one_device_learners_equal_the_hand_written_loop_bit_for_bit(case, clip):
    hand = _Hand(make_loss(case)[0], clip)
    adam = functools.partial(torch.optim.Adam, lr=1e-2)
    learners = [LocalLearner(make_loss(case)[0], adam, clip_grad_norm=clip),
                FabricLearner(make_loss(case)[0], adam, clip_grad_norm=clip, accelerator="cpu", devices=1)]
    for step in range(4):
        batch = make_batch(case, seed=60 + step)
        torch.manual_seed(step)
        norm = hand.update(batch.clone())
        for learner in learners:
            torch.manual_seed(step)
            out = learner.update(batch.clone())
            assert torch.equal(out["grad_norm"], norm), (type(learner).__name__, step)
            assert not any(v.requires_grad for v in out.values(True, True))
    for learner in learners:
        for k, v in flat_params(hand.loss).items():
            assert torch.equal(v, flat_params(learner.loss_module)[k]), (type(learner).__name__, k)


def test_the_trainer_logs_the_mean_of_each_scalar_over_a_batchs_updates():
    from fabric_learner.trainer import Trainer

    learner = LocalLearner(make_loss("ppo")[0], functools.partial(torch.optim.Adam, lr=1e-3))
    trainer = Trainer(learner=learner, collector=None, total_frames=0, optim_steps_per_batch=3, num_epochs=2,
                      progress_bar=False, log_throughput=False)
    outputs, logged = [], []
    update = learner.update

    def recorded(batch):
        outputs.append(update(batch))
        return outputs[-1]

    learner.update = recorded
    trainer._post_optim_complete_log_hook = lambda steps, average: logged.append((steps, average))
    trainer.optim_steps(make_batch("ppo", seed=5))
    assert len(outputs) == 6 and len(logged) == 1 and logged[0][0] == 6
    average = logged[0][1]
    assert set(average.keys()) == set(outputs[0].keys())
    for key in outputs[0].keys():
        expected = sum(o.get(key).reshape(()).to(torch.float64) for o in outputs) / len(outputs)
        assert average.get(key).dtype == torch.float32
        torch.testing.assert_close(average.get(key), expected.float(), rtol=0, atol=0, equal_nan=True,
                                   msg=lambda m: f"{key}: {m}")


@pytest.mark.parametrize("name", ["flat", "batched", "named", "locked", "lazy", "device"])
def test_set_entry_is_set(name):
    from fabric_learner.step.output import set_entry

    outputs = _outputs()
    got, want = detached(outputs[name]), detached(outputs[name])
    value = torch.tensor(2.0) if name not in ("batched", "named", "lazy") else torch.full((3,), 2.0)
    if name == "locked":
        with pytest.raises(RuntimeError):
            want.set("grad_norm", value)
        with pytest.raises(RuntimeError):
            set_entry(got, "grad_norm", value)
        return
    want.set("grad_norm", value)
    set_entry(got, "grad_norm", value)
    assert type(got) is type(want) and got.batch_size == want.batch_size and got.device == want.device
    assert set(got.keys(True, True)) == set(want.keys(True, True))
    assert torch.equal(got.get("grad_norm"), want.get("grad_norm"))
