"""Workloads, hand-written baselines and the interleaved timer shared by every benchmark case.

Everything here is deterministic given a seed: two contenders built with the same seed start
from the same weights and see the same batches, so they do the same work.
"""

from __future__ import annotations

import gc
import os
import random
import statistics
import time
from typing import Any, Callable, Sequence

import torch
from tensordict import TensorDict
from tensordict.nn import NormalParamExtractor, TensorDictModule
from torch import nn
from torchrl.data import Bounded
from torchrl.modules import MLP, ProbabilisticActor, QValueActor, TanhNormal, ValueOperator
from torchrl.objectives import ClipPPOLoss, DQNLoss, SACLoss

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
    return ProbabilisticActor(
        TensorDictModule(net, in_keys=["observation"], out_keys=["loc", "scale"]),
        in_keys=["loc", "scale"],
        distribution_class=TanhNormal,
        return_log_prob=True,
    )


def make_loss(name: str, seed: int = 0, *, cells: Sequence[int] | None = None):
    """``(loss_module, policy)`` for a workload; equal seeds give equal weights."""
    torch.manual_seed(seed)
    if name == "ppo":
        cells = cells or (64, 64)
        policy = _gaussian_actor(OBS, ACT, cells)
        critic = ValueOperator(MLP(in_features=OBS, out_features=1, num_cells=list(cells)), in_keys=["observation"])
        return ClipPPOLoss(policy, critic, entropy_coeff=0.01, normalize_advantage=False), policy
    if name == "ppo_big_actor":  # case e: a 20M+ parameter policy, small critic
        policy = _gaussian_actor(OBS, ACT, cells or (2048,) * 6)
        critic = ValueOperator(MLP(in_features=OBS, out_features=1, num_cells=[64, 64]), in_keys=["observation"])
        return ClipPPOLoss(policy, critic, entropy_coeff=0.01, normalize_advantage=False), policy
    if name == "dqn":
        cells = cells or (256, 256)
        policy = QValueActor(
            MLP(in_features=DQN_OBS, out_features=DQN_ACTIONS, num_cells=list(cells)),
            in_keys=["observation"], spec=None, action_space="one_hot",
        )
        return DQNLoss(policy, action_space="one_hot", delay_value=True), policy
    if name == "sac":
        cells = cells or (256, 256)
        policy = _gaussian_actor(OBS, ACT, cells)
        qvalue = ValueOperator(MLP(in_features=OBS + ACT, out_features=1, num_cells=list(cells)),
                               in_keys=["observation", "action"])
        return SACLoss(policy, qvalue, action_spec=Bounded(-1.0, 1.0, shape=(ACT,))), policy
    if name == "sac_big_critic":  # a large critic ensemble (2 critics, 4 layers), small actor
        policy = _gaussian_actor(OBS, ACT, (64, 64))
        qvalue = ValueOperator(MLP(in_features=OBS + ACT, out_features=1, num_cells=list(cells or (2048,) * 4)),
                               in_keys=["observation", "action"])
        return SACLoss(policy, qvalue, action_spec=Bounded(-1.0, 1.0, shape=(ACT,))), policy
    raise KeyError(name)


def make_batch(name: str, n: int = BATCH, seed: int = 1) -> TensorDict:
    """A batch of ``n`` transitions; equal seeds give equal batches."""
    g = torch.Generator().manual_seed(seed)
    obs_dim = DQN_OBS if name == "dqn" else OBS
    obs = torch.randn(n, obs_dim, generator=g)
    nxt = {
        "observation": torch.randn(n, obs_dim, generator=g),
        "reward": torch.randn(n, 1, generator=g),
        "done": torch.zeros(n, 1, dtype=torch.bool),
        "terminated": torch.zeros(n, 1, dtype=torch.bool),
    }
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
        from lightning.fabric import Fabric

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
        from torch.nn.parallel import DistributedDataParallel

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


# ---- interleaved timing ------------------------------------------------------------------------


def order_for(rep: int, names: Sequence[str]) -> list[str]:
    """A random order of the contenders for repetition ``rep``, the same on every rank.

    Shuffled rather than rotated: in a rotation each contender nearly always follows the same
    one, and what a block leaves in the caches then biases its successor (an A/A pair of
    identical loops measured 0.99 that way, 1.00 shuffled).
    """
    return random.Random(rep).sample(list(names), len(names))


def interleaved(
    contenders: dict[str, Callable[[int], None]],
    *,
    reps: int,
    inner: int,
    warmup: int,
    sync: Callable[[], None] | None = None,
    cpu: dict[str, list[float]] | None = None,
) -> dict[str, list[float]]:
    """Per-call wall seconds for each contender, ``reps`` samples each.

    ``contenders[name](i)`` does the i-th unit of work. Each repetition runs every contender
    once, ``inner`` calls timed together with ``time.perf_counter``, in a random order
    (``order_for``). ``sync`` (a barrier) runs before and after each timed block when given
    (multi-rank). When ``cpu`` is a dict, it receives the same samples in process CPU seconds
    (``time.process_time``), which leaves out the time this process waited for a core.

    The garbage collector runs once per repetition, between repetitions, and never inside one:
    what the warm-up left alive is frozen out of its scans (``gc.freeze``), so a collection costs
    little and many short repetitions (``inner=1``) are affordable; many short, paired blocks
    resolve a difference far better than a few long ones on a noisy machine. The collections are
    then outside the timed blocks: a contender that allocates more Python objects is not charged
    for the extra collection work that causes.
    """
    names = list(contenders)
    for name in names:
        for i in range(warmup):
            contenders[name](i)
    samples: dict[str, list[float]] = {n: [] for n in names}
    counters = {n: warmup for n in names}
    was_enabled = gc.isenabled()
    gc.collect()
    gc.freeze()
    try:
        for rep in range(reps):
            gc.collect()
            gc.disable()
            for name in order_for(rep, names):
                fn = contenders[name]
                if sync is not None:
                    sync()
                i0 = counters[name]
                c0 = time.process_time()
                t0 = time.perf_counter()
                for i in range(i0, i0 + inner):
                    fn(i)
                if sync is not None:
                    sync()
                t1 = time.perf_counter()
                c1 = time.process_time()
                samples[name].append((t1 - t0) / inner)
                if cpu is not None:
                    cpu.setdefault(name, []).append((c1 - c0) / inner)
                counters[name] = i0 + inner
            if was_enabled:
                gc.enable()
    finally:
        gc.unfreeze()
        if was_enabled:
            gc.enable()
    return samples


def case_a_contenders(name: str) -> dict[str, Callable[[], Any]]:
    """Case a's contenders on workload ``name``, by label, each a builder of one fresh copy: the same
    loss and seeds everywhere, clipping at ``CLIP``, Adam; the twin is the A/A control."""
    from fabric_learner import FabricLearner, LocalLearner

    def loss():
        return make_loss(name)[0]

    return {
        "hand torchrl loop": lambda: HandTorchrl(loss()),
        "hand torchrl loop (twin)": lambda: HandTorchrl(loss()),
        "hand Fabric loop": lambda: HandFabric(loss()),
        "LocalLearner.update": lambda: LocalLearner(loss(), clip_grad_norm=CLIP),
        "FabricLearner(cpu,1).update": lambda: FabricLearner(loss(), clip_grad_norm=CLIP, accelerator="cpu", devices=1),
    }


INSTANCES = 5  # copies of each contender, taking turns (``rotating``); coprime with the 4 batches


def rotating(build: Callable[[], Any], batches: Sequence[TensorDict],
             instances: int = INSTANCES) -> Callable[[int], None]:
    """``step(i)``: copy ``i % instances`` of what ``build`` returns updates on ``batches[i % len(batches)]``.

    Two identical contenders, built the same way from the same seeds, can differ by 1-3% for
    their whole life, most likely from where their tensors land in memory (not isolated here):
    in one full run with three copies, LocalLearner's copies measured 1.003, 1.014 and 1.032 of the
    hand loop on PPO, and under DDP the A/A twin's copies 0.972, 0.977 and 1.017 on DQN. More
    repetitions of one copy do not average that away; several copies taking turns do, and
    ``bootstrap_ci(..., copies=...)`` counts how many there were. Every contender gets the same
    number of copies and sees the same batch on the same call, so call ``i`` of two contenders is
    still the same work; with ``inner=1`` and a warm-up that is a multiple of ``instances``,
    repetition ``r`` is copy ``r % instances``.
    """
    updates = [build().update for _ in range(instances)]
    k = len(batches)
    return lambda i: updates[i % instances](batches[i % k])


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def paired_ratio(num: Sequence[float], den: Sequence[float]) -> float:
    """Median over repetitions of num[r] / den[r]: adjacent blocks, so shared noise cancels."""
    return statistics.median(a / b for a, b in zip(num, den))


def bootstrap_ci(num: Sequence[float], den: Sequence[float], n: int = 2000, seed: int = 0,
                 copies: int = 1) -> tuple[float, float]:
    """95% bootstrap interval of ``paired_ratio``: how far noise alone moves it.

    With ``copies`` > 1 (samples from ``rotating``: sample ``r`` came from copy ``r % copies``) it
    resamples in two stages, copies and then repetitions within each, so the interval also holds
    the copy-to-copy spread, which repetitions of the same copies cannot shrink.
    """
    rng = random.Random(seed)
    ratios = [a / b for a, b in zip(num, den, strict=True)]
    groups = [group for group in (ratios[c::copies] for c in range(copies)) if group]
    meds = []
    for _ in range(n):
        drawn = []
        for group in rng.choices(groups, k=len(groups)):
            drawn += rng.choices(group, k=len(group))
        meds.append(statistics.median(drawn))
    meds.sort()
    return meds[int(0.025 * n)], meds[int(0.975 * n) - 1]


def set_one_thread() -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
