"""compile=True: equal to eager within 1e-5, eager after one warning where a loss does not compile.

Compiling is slow on small machines, so the checks of one case share one compiled graph: losses
of one class and shape reuse it across learners (see ``step/compile.py``).
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from conftest import make_learner
from rl_cases import CLIP, LR, flat_params, make_batch, make_loss, run_steps
from tensordict import TensorDict
from torch import nn
from torchrl.objectives import LossModule

from fabric_learner import FabricLearner, LocalLearner

TOL = dict(atol=1e-5, rtol=1e-5)


def assert_same_training(a_loss, b_loss, a_norms, b_norms):
    torch.testing.assert_close(a_norms, b_norms, **TOL)
    b_params = flat_params(b_loss)
    for k, v in flat_params(a_loss).items():
        torch.testing.assert_close(v, b_params[k], **TOL, msg=k)


# First: it compiles PPO's graph for the equality test below. Other losses change tensordict
# globals that PPO's graph is guarded on, so after them PPO would compile once more.
def test_compiled_accumulation_clipping_and_nonfinite_steps():
    factory = functools.partial(torch.optim.Adam, lr=LR)
    a_loss, b_loss = make_loss("ppo")[0], make_loss("ppo")[0]
    settings = dict(clip_grad_norm=0.1, grad_accum_steps=2, on_nonfinite="skip")
    eager = LocalLearner(a_loss, factory, **settings)
    compiled = LocalLearner(b_loss, factory, **settings, compile=True)
    norms_of = {}
    for learner in (eager, compiled):
        norms = []
        for step in range(3):
            for micro in range(2):  # full-size micro-batches: no new shape to compile for
                torch.manual_seed(10 * step + micro)
                batch = make_batch("ppo", seed=50 + 10 * step + micro)
                if step == 1 and micro == 1:
                    batch["observation"][0] = float("nan")
                out = learner.update(batch)
            norms.append(out["grad_norm"])
        assert learner.num_updates == 2 and learner.skipped_updates == 1
        norms_of[learner] = torch.stack(norms).nan_to_num(0.0)  # the skipped step's norm is nan
    assert norms_of[compiled][0] > 0.1  # clipping was exercised
    assert_same_training(a_loss, b_loss, norms_of[eager], norms_of[compiled])


@pytest.mark.parametrize("case", ["ppo", "dqn", "sac"])
def test_compiled_update_equals_eager(case, tmp_path):
    eager_loss, compiled_loss, fabric_loss = (make_loss(case)[0] for _ in range(3))
    eager = LocalLearner(eager_loss, clip_grad_norm=CLIP)
    local = LocalLearner(compiled_loss, clip_grad_norm=CLIP, compile=True)
    fabric = make_learner("fabric", fabric_loss, clip_grad_norm=CLIP, compile=True)
    assert local.optimizer.param_groups[0]["fused"] is True  # the default Adam, fused
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no fallback: these losses compile
        norms = run_steps(eager, case)
        assert_same_training(eager_loss, compiled_loss, norms, run_steps(local, case))
        assert_same_training(eager_loss, fabric_loss, norms, run_steps(fabric, case))
    assert local._loss_call.fallback is None and fabric._loss_call.fallback is None

    # checkpoints: the same keys as eager (no _orig_mod.), and both ways between eager and compiled
    assert local.state_dict().keys() == eager.state_dict().keys()
    assert local.checkpoint()["model"].keys() == eager.checkpoint()["model"].keys()
    local.save(tmp_path / "compiled.pt")
    eager.save(tmp_path / "eager.pt")
    fresh_loss = make_loss(case, seed=5)[0]
    fresh = make_learner("fabric", fresh_loss, clip_grad_norm=CLIP, compile=True)
    fresh.load(tmp_path / "eager.pt")
    assert fresh.optimizer.param_groups[0]["fused"] is True  # an eager checkpoint keeps it fused
    local_norms, fresh_norms = run_steps(local, case), run_steps(fresh, case)
    assert_same_training(compiled_loss, fresh_loss, local_norms, fresh_norms)
    LocalLearner(make_loss(case, seed=6)[0]).load(tmp_path / "compiled.pt")


@torch.library.custom_op("fabric_learner_tests::opaque_square", mutates_args=())
def opaque_square(x: torch.Tensor) -> torch.Tensor:
    """An op without a fake (meta) implementation: torch.compile cannot trace through it."""
    return x * x


opaque_square.register_autograd(
    lambda ctx, grad: 2 * ctx.saved_tensors[0] * grad,
    setup_context=lambda ctx, inputs, output: ctx.save_for_backward(inputs[0]),
)


class ToyLoss(LossModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(3, 2)

    def forward(self, td):
        return TensorDict({"loss": self.net(td["x"]).pow(2).mean()}, [])


class UncompilableLoss(ToyLoss):
    def forward(self, td):
        return TensorDict({"loss": opaque_square(self.net(td["x"])).mean()}, [])


def toy_batches(n):
    return [TensorDict({"x": torch.randn(8, 3, generator=torch.Generator().manual_seed(i))}, [8]) for i in range(n)]


def test_a_bad_batch_is_still_the_batchs_error():
    learner = LocalLearner(ToyLoss(), compile=True)
    good = toy_batches(3)
    learner.update(good[0])
    learner.update(good[1])
    with pytest.raises(KeyError, match="x"):
        learner.update(TensorDict({"y": torch.zeros(8, 3)}, [8]))
    learner.update(good[2])
    assert learner._loss_call.fallback is None  # the batch's fault, not the compiler's: still compiled


def test_a_loss_that_does_not_compile_warns_once_then_runs_eagerly(kind):
    eager_loss, compiled_loss = UncompilableLoss(), UncompilableLoss()
    eager = LocalLearner(eager_loss, functools.partial(torch.optim.SGD, lr=0.1))
    compiled = make_learner(kind, compiled_loss, functools.partial(torch.optim.SGD, lr=0.1), compile=True)
    batches = toy_batches(4)
    norms = [compiled.update(batches[0])["grad_norm"]]  # the warm-up call is eager
    with pytest.warns(RuntimeWarning, match=r"UncompilableLoss did not compile .*fake") as caught:
        norms.append(compiled.update(batches[1])["grad_norm"])
    assert len([w for w in caught if "did not compile" in str(w.message)]) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # once only
        norms += [compiled.update(b)["grad_norm"] for b in batches[2:]]
    assert "fake" in compiled._loss_call.fallback
    eager_norms = torch.stack([eager.update(batch)["grad_norm"] for batch in batches])
    assert (eager_norms > 0).all()
    assert_same_training(eager_loss, compiled_loss, eager_norms, torch.stack(norms))


def test_sharded_strategies_refuse_compile():
    with pytest.raises(ValueError, match="compile=True is not supported with sharded strategies"):
        FabricLearner(make_loss("dqn")[0], accelerator="cpu", strategy="fsdp", devices=1, compile=True)
    with pytest.raises(TypeError, match="compile must be True or False"):
        LocalLearner(make_loss("dqn")[0], compile="yes")
