"""Small, seeded torchrl losses and batches shared by the tests and the multi-rank workers.

Each case builds a real torchrl loss on small MLPs and a batch whose content depends only on
the seed, so every process (and every rank) can rebuild exactly the same data.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict
from tensordict.nn import NormalParamExtractor, TensorDictModule
from torch import nn
from torchrl.data import Bounded
from torchrl.modules import MLP, IndependentNormal, ProbabilisticActor, QValueActor, TanhNormal, ValueOperator
from torchrl.objectives import ClipPPOLoss, DDPGLoss, DQNLoss, SACLoss, TD3Loss

OBS, ACT, N_ACTIONS, HIDDEN = 4, 2, 3, 16

# name -> deterministic (the loss output is a pure function of weights and batch)
CASES = {"dqn": True, "ppo": True, "ddpg": True, "sac": False, "td3": False}


def _gaussian_actor(distribution_class):
    net = nn.Sequential(MLP(in_features=OBS, out_features=2 * ACT, num_cells=[HIDDEN]), NormalParamExtractor())
    module = TensorDictModule(net, in_keys=["observation"], out_keys=["loc", "scale"])
    return ProbabilisticActor(
        module, in_keys=["loc", "scale"], distribution_class=distribution_class, return_log_prob=True
    )


def _det_actor():
    return TensorDictModule(
        nn.Sequential(MLP(in_features=OBS, out_features=ACT, num_cells=[HIDDEN]), nn.Tanh()),
        in_keys=["observation"],
        out_keys=["action"],
    )


def _qvalue():
    return ValueOperator(MLP(in_features=OBS + ACT, out_features=1, num_cells=[HIDDEN]), in_keys=["observation", "action"])


def make_loss(name: str, seed: int = 0, functional: bool = True):
    """``(loss_module, policy)`` for a case, with weights fixed by ``seed``.

    ``functional=False`` (PPO only) keeps the parameters in the networks, not in the loss.
    """
    torch.manual_seed(seed)
    if name == "dqn":
        policy = QValueActor(
            MLP(in_features=OBS, out_features=N_ACTIONS, num_cells=[HIDDEN]),
            in_keys=["observation"], spec=None, action_space="one_hot",
        )
        loss = DQNLoss(policy, action_space="one_hot", delay_value=True)
        # make the target network differ from the online one, as it does mid-training
        with torch.no_grad():
            for p in loss.target_value_network_params.values(True, True):
                p.mul_(0.5)
        return loss, policy
    if name == "ppo":
        policy = _gaussian_actor(IndependentNormal)
        critic = ValueOperator(MLP(in_features=OBS, out_features=1, num_cells=[HIDDEN]), in_keys=["observation"])
        loss = ClipPPOLoss(policy, critic, entropy_coeff=0.01, normalize_advantage=False, functional=functional)
        return loss, policy
    if name == "ddpg":
        policy = _det_actor()
        loss = DDPGLoss(policy, _qvalue(), delay_actor=True, delay_value=True)
        return loss, policy
    if name == "sac":
        policy = _gaussian_actor(TanhNormal)
        return SACLoss(policy, _qvalue(), action_spec=Bounded(-1.0, 1.0, shape=(ACT,))), policy
    if name == "td3":
        policy = _det_actor()
        loss = TD3Loss(policy, _qvalue(), action_spec=Bounded(-1.0, 1.0, shape=(ACT,)))
        return loss, policy
    raise KeyError(name)


def make_batch(name: str, n: int = 16, seed: int = 1) -> TensorDict:
    """A batch of ``n`` transitions for case ``name``; equal seeds give equal batches."""
    g = torch.Generator().manual_seed(seed)
    obs = torch.randn(n, OBS, generator=g)
    nxt = {
        "observation": torch.randn(n, OBS, generator=g),
        "reward": torch.randn(n, 1, generator=g),
        "done": torch.zeros(n, 1, dtype=torch.bool),
        "terminated": torch.zeros(n, 1, dtype=torch.bool),
    }
    if name == "dqn":
        action = nn.functional.one_hot(torch.randint(N_ACTIONS, (n,), generator=g), N_ACTIONS)
        return TensorDict({"observation": obs, "action": action, "next": nxt}, [n])
    action = torch.rand(n, ACT, generator=g) * 1.8 - 0.9
    td = TensorDict({"observation": obs, "action": action, "next": nxt}, [n])
    if name == "ppo":
        td["action_log_prob"] = -torch.rand(n, generator=g) - 1.0
        td["advantage"] = torch.randn(n, 1, generator=g)
        td["value_target"] = torch.randn(n, 1, generator=g)
    return td


def halves(batch: TensorDict, rank: int, world_size: int = 2) -> TensorDict:
    n = batch.shape[0] // world_size
    return batch[rank * n : (rank + 1) * n]


STEPS, LR, CLIP = 3, 1e-2, 0.5  # the schedule every equivalence check trains with


def run_steps(learner, case: str, rank: int = 0, world_size: int = 1, grad_accum_steps: int = 1) -> torch.Tensor:
    """Train ``STEPS`` steps of the shared schedule on this rank's share; the grad norms.

    Step ``s`` uses the 16-sample batch of seed ``100 + s``; a rank takes its ``1/world_size``
    slice in ``grad_accum_steps`` micro-batches, so one process with ``world_size=1`` sees the
    very data all ranks see together.
    """
    norms = []
    for step in range(STEPS):
        local = halves(make_batch(case, n=16, seed=100 + step), rank, world_size)
        torch.manual_seed(1000 * step + rank)
        for micro in local.chunk(grad_accum_steps):
            out = learner.update(micro)
        norms.append(out["grad_norm"])
    return torch.stack(norms)


def flat_params(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone().cpu() for k, v in module.named_parameters()}


class WithConstantEntry(nn.Module):
    """A loss plus a ``loss_constant`` entry that carries no gradient: set ``value`` to inf to make
    the summed loss non-finite while every gradient stays finite."""

    def __init__(self, loss: nn.Module) -> None:
        super().__init__()
        self.loss = loss
        self.value = 0.0

    def forward(self, td):
        out = self.loss(td)
        out.set("loss_constant", torch.tensor(self.value))
        return out


def group_timeouts() -> list[float]:
    """Seconds each live process group of more than one rank waits on a collective (its gloo
    backend's bound, read from torch's groups rather than from the strategy that asked for it).
    Groups of one rank (FSDP2's tensor-parallel dimension of size 1) never wait on a peer."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if not (dist.is_available() and dist.is_initialized()):
        return []
    return [pg._get_backend(torch.device("cpu")).options._timeout.total_seconds() for pg in list(c10d._world.pg_map)
            if pg.size() > 1]


# bf16 rounds each rank's half-batch matmuls and the averaged step differently from the full batch
TD_TOL = {"32-true": 1e-5, "64-true": 1e-5, "bf16-mixed": 3e-2, "bf16-true": 6e-2}


def one_process_td_errors(precision):
    """What ``integrity`` in ddp_checks.py does, in one process on the full batch: the td_error the
    loss writes into a plain batch, then (after that step) into a lazy stack."""
    from conftest import make_learner
    from tensordict import LazyStackedTensorDict

    learner = make_learner("fabric", make_loss("dqn")[0], precision=precision)
    batch = make_batch("dqn", n=16, seed=5)
    plain = batch.clone()
    learner.update(plain)
    lazy = LazyStackedTensorDict.lazy_stack(list(batch.clone().unbind(0)), 0)
    learner.update(lazy)
    return plain["td_error"], lazy["td_error"]
