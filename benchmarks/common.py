"""Workloads and hand-written baselines shared by the benchmark scripts (the harness is ``harness.py``).

Deterministic given a seed: contenders built with the same seed start from the same weights and see the same
batches, so they do the same work.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import torch
from lightning.fabric import Fabric
from tensordict import TensorDict
from tensordict.nn import NormalParamExtractor, TensorDictModule
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torchrl.data import Bounded
from torchrl.envs import Transform
from torchrl.modules import MLP, ProbabilisticActor, QValueActor, TanhNormal, ValueOperator
from torchrl.objectives import ClipPPOLoss, DQNLoss, SACLoss

from fabric_learner import FabricLearner, LocalLearner

# Shapes of the update workloads (case a/b/f): MuJoCo-like continuous control, LunarLander-like DQN.
OBS, ACT = 17, 6
DQN_OBS, DQN_ACTIONS = 8, 4
BATCH = 256
CLIP = 1.0  # every contender clips at the same norm, so all do the same work

WORKLOADS = ("ppo", "dqn", "sac")
WORKLOAD_DESC = {
    "ppo": "ClipPPOLoss, actor+critic MLP [64,64] (TanhNormal), batch 256",
    "dqn": "DQNLoss (delay_value), MLP [256,256], batch 256",
    "sac": "SACLoss (2 Q-nets), actor+Q MLP [256,256], batch 256",
}


def _gaussian_actor(obs: int, act: int, cells: Sequence[int]) -> ProbabilisticActor:
    net = nn.Sequential(MLP(in_features=obs, out_features=2 * act, num_cells=list(cells)), NormalParamExtractor())
    return ProbabilisticActor(TensorDictModule(net, in_keys=["observation"], out_keys=["loc", "scale"]),
                              in_keys=["loc", "scale"], distribution_class=TanhNormal, return_log_prob=True)


def make_loss(name: str, seed: int = 0, *, cells: Sequence[int] | None = None):
    """``(loss_module, policy)`` for a workload; equal seeds give equal weights. ``ppo_big_actor``: a 21M-parameter
    policy (6 layers of 2048), small critic; ``sac_big_critic``: a large critic ensemble (2 critics of 4 layers of
    2048), small actor; ``cells`` replaces the large networks' (or, for ppo, dqn and sac, every network's) layers."""
    torch.manual_seed(seed)
    if name in ("ppo", "ppo_big_actor"):
        big = name == "ppo_big_actor"
        policy = _gaussian_actor(OBS, ACT, cells or ((2048,) * 6 if big else (64, 64)))
        critic = ValueOperator(MLP(in_features=OBS, out_features=1, num_cells=[64, 64] if big else list(cells or (64, 64))),
                               in_keys=["observation"])
        return ClipPPOLoss(policy, critic, entropy_coeff=0.01, normalize_advantage=False), policy
    if name == "dqn":
        policy = QValueActor(MLP(in_features=DQN_OBS, out_features=DQN_ACTIONS, num_cells=list(cells or (256, 256))),
                             in_keys=["observation"], spec=None, action_space="one_hot")
        return DQNLoss(policy, action_space="one_hot", delay_value=True), policy
    if name in ("sac", "sac_big_critic"):
        big = name == "sac_big_critic"
        policy = _gaussian_actor(OBS, ACT, (64, 64) if big else cells or (256, 256))
        qvalue = ValueOperator(MLP(in_features=OBS + ACT, out_features=1,
                                   num_cells=list(cells or ((2048,) * 4 if big else (256, 256)))),
                               in_keys=["observation", "action"])
        return SACLoss(policy, qvalue, action_spec=Bounded(-1.0, 1.0, shape=(ACT,))), policy
    raise KeyError(name)


def make_batch(name: str, n: int = BATCH, seed: int = 1) -> TensorDict:
    """A batch of ``n`` transitions; equal seeds give equal batches."""
    g = torch.Generator().manual_seed(seed)
    obs_dim = DQN_OBS if name == "dqn" else OBS
    obs = torch.randn(n, obs_dim, generator=g)
    nxt = {"observation": torch.randn(n, obs_dim, generator=g), "reward": torch.randn(n, 1, generator=g),
           "done": torch.zeros(n, 1, dtype=torch.bool), "terminated": torch.zeros(n, 1, dtype=torch.bool)}
    if name == "dqn":
        action = nn.functional.one_hot(torch.randint(DQN_ACTIONS, (n,), generator=g), DQN_ACTIONS)
        return TensorDict({"observation": obs, "action": action, "next": nxt}, [n])
    action = torch.rand(n, ACT, generator=g) * 1.8 - 0.9
    td = TensorDict({"observation": obs, "action": action, "next": nxt}, [n])
    if name.startswith("ppo"):
        td["action_log_prob"] = -torch.rand(n, generator=g) - 1.0
        td["advantage"] = torch.randn(n, 1, generator=g)
        td["value_target"] = torch.randn(n, 1, generator=g)
    return td


def make_batches(name: str, count: int = 4, seed: int = 1, n: int = BATCH) -> list[TensorDict]:
    return [make_batch(name, n=n, seed=seed + 1000 * i) for i in range(count)]


def count_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def grpo_loss(hidden: int, layers: int):
    """``(GRPOLoss, model)``: torchrl's GRPO loss (token mean) over ``tiny_causal_lm``'s Qwen2 (4 heads, 2 key/value
    heads, MLP 2x hidden, untied head) at this size, seed 0's weights, ``tiny_tokenizer``'s vocabulary."""
    from torchrl.modules.llm import TransformersWrapper
    from torchrl.objectives.llm import GRPOLoss

    from fabric_learner.testing import tiny_causal_lm, tiny_tokenizer

    model = tiny_causal_lm(0, tokenizer=tiny_tokenizer(), hidden_size=hidden, num_layers=layers)
    policy = TransformersWrapper(model, tokenizer=tiny_tokenizer(), input_mode="history", generate=False,
                                 return_log_probs=True, pad_output=False)
    return GRPOLoss(policy, masking_strategy="rlhf"), model


def grpo_params(hidden: int, layers: int) -> int:
    """``grpo_loss``'s parameter count, from a copy of its model on the meta device (no memory)."""
    from transformers import Qwen2ForCausalLM  # noqa: F401  (a first import under "meta" would run there)

    from fabric_learner.testing import tiny_causal_lm, tiny_tokenizer

    tokenizer = tiny_tokenizer()
    with torch.device("meta"):
        return count_params(tiny_causal_lm(0, tokenizer=tokenizer, hidden_size=hidden, num_layers=layers))


# ---- hand-written baselines: what a user writes without the learner ----------------------------


def summed_loss(out: TensorDict) -> torch.Tensor:
    return sum(out.get(k) for k in out.keys() if isinstance(k, str) and k.startswith("loss"))


class HandTorchrl:
    """``loss(td)`` -> sum of loss keys -> backward -> clip_grad_norm_ -> step -> zero_grad."""

    def __init__(self, loss: nn.Module, clip: float = CLIP):
        self.loss = loss
        self.opt = torch.optim.Adam(loss.parameters())
        self.params = [p for g in self.opt.param_groups for p in g["params"]]
        self.clip = clip

    def update(self, td):
        total = summed_loss(self.loss(td))
        total.backward()
        torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        self.opt.step()
        self.opt.zero_grad()


class HandCompiled(HandTorchrl):
    """The torchrl loop with ``torch.compile(loss)``, fused Adam and ``foreach`` clipping (case compile)."""

    def __init__(self, loss: nn.Module, clip: float = CLIP):
        super().__init__(loss, clip)
        self.loss = torch.compile(loss)
        self.opt = torch.optim.Adam(loss.parameters(), fused=True)

    def update(self, td):
        total = summed_loss(self.loss(td))
        total.backward()
        torch.nn.utils.clip_grad_norm_(self.params, self.clip, foreach=True)
        self.opt.step()
        self.opt.zero_grad()


class HandFabric:
    """The same loop through Fabric: ``fabric.setup``, ``fabric.backward``, ``fabric.clip_gradients``."""

    def __init__(self, loss: nn.Module, clip: float = CLIP):
        self.fabric = Fabric(accelerator="cpu", devices=1)
        self.module, self.opt = self.fabric.setup(loss, torch.optim.Adam(loss.parameters()))
        self.clip = clip

    def update(self, td):
        total = summed_loss(self.module(td))
        self.fabric.backward(total)
        self.fabric.clip_gradients(self.module, self.opt, max_norm=self.clip)
        self.opt.step()
        self.opt.zero_grad()


class SumLoss(nn.Module):
    """Wraps a torchrl loss so that ``DistributedDataParallel`` sees a module returning one scalar."""

    def __init__(self, loss: nn.Module):
        super().__init__()
        self.loss = loss

    def forward(self, td):
        return summed_loss(self.loss(td))


class HandDDP:
    """A hand-written ``torch.nn.parallel.DistributedDataParallel`` loop (CPU, gloo)."""

    def __init__(self, loss: nn.Module, clip: float = CLIP):
        self.ddp = DistributedDataParallel(SumLoss(loss))
        self.opt = torch.optim.Adam(loss.parameters())
        self.params = [p for g in self.opt.param_groups for p in g["params"]]
        self.clip = clip

    def update(self, td):
        total = self.ddp(td)
        total.backward()
        torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        self.opt.step()
        self.opt.zero_grad()


class SleepPerStep(Transform):
    """Sleeps ``seconds`` at every step: an environment whose step costs real time (here, so that collector
    processes import it by name)."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def _step(self, tensordict, next_tensordict):
        time.sleep(self.seconds)
        return next_tensordict


def case_a_contenders(name: str, loss: Callable[[str], nn.Module] = lambda name: make_loss(name)[0]
                      ) -> dict[str, Callable[[], Any]]:
    """Case a's contenders on ``loss(name)``, by label, each a builder of one fresh copy: the same loss and seeds
    everywhere, clipping at ``CLIP``, Adam; the twin is the A/A control."""
    return {
        "hand torchrl loop": lambda: HandTorchrl(loss(name)),
        "hand torchrl loop (twin)": lambda: HandTorchrl(loss(name)),
        "hand Fabric loop": lambda: HandFabric(loss(name)),
        "LocalLearner.update": lambda: LocalLearner(loss(name), clip_grad_norm=CLIP),
        "FabricLearner(cpu,1).update": lambda: FabricLearner(loss(name), clip_grad_norm=CLIP, accelerator="cpu", devices=1),
    }
