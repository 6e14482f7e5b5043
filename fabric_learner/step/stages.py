"""Several optimizers in one learner: stages, what each trains, and the order they step in.

A ``Stage`` is one optimizer over the loss parameters whose names start with its ``params``
prefixes, stepped on its own loss terms, with its own clipping and schedule. Stages run in
the order given. Consecutive stages without a ``method`` share one forward of the loss and one
backward of their summed terms (SAC's actor, critic and temperature, as torchrl's SAC scripts
step them); a stage with a ``method`` (``"value_loss"``, ``"actor_loss"``) runs that method
after the stages before it have stepped, so it sees their new weights (TD3's delayed actor).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Union

import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn
from torchrl.objectives import LossModule

from fabric_learner.optim import build_optimizer
from fabric_learner.step.output import loss_keys

OptimizerFactory = Union[Callable[[list[nn.Parameter]], torch.optim.Optimizer], None]


@dataclass(frozen=True)
class Stage:
    """One optimizer of a learner with several.

    Args:
        name (str): names the stage in outputs (``"grad_norm_<name>"``), errors and checkpoints.
        params (str or sequence of str): prefixes of the loss's parameter names this stage trains
            (``"qvalue_network_params"``, ``"log_alpha"``); every trained parameter belongs to
            exactly one stage.
        optimizer (callable, optional): a factory ``f(params) -> Optimizer``; ``None`` is Adam.
        loss (str or sequence of str, optional): the loss entries this stage minimises; by default
            every ``"loss"``-prefixed entry of its forward.
        method (str, optional): a loss method run for this stage instead of sharing the forward
            (e.g. ``"value_loss"``); it returns a TensorDict, a ``(loss, metadata)`` pair or a tensor,
            reported as ``"loss_<name>"``.
        clip_grad_norm (float, optional): max norm of this stage's gradients.
        every (int): the stage steps on every ``every``-th update (TD3's ``policy_update_delay``).

    Examples:
        >>> from fabric_learner import Stage
        >>> stages = [Stage("critic", "qvalue_network_params", method="value_loss"),
        ...           Stage("actor", "actor_network_params", method="actor_loss", every=2)]
    """

    name: str
    params: str | Sequence[str]
    optimizer: OptimizerFactory = None
    loss: str | Sequence[str] | None = None
    method: str | None = None
    clip_grad_norm: float | None = None
    every: int = 1

    @property
    def prefixes(self) -> tuple[str, ...]:
        return (self.params,) if isinstance(self.params, str) else tuple(self.params)

    @property
    def loss_keys(self) -> tuple[str, ...] | None:
        return None if self.loss is None else ((self.loss,) if isinstance(self.loss, str) else tuple(self.loss))

    def owns(self, name: str) -> bool:
        return any(name == p or name.startswith(p + ".") for p in self.prefixes)

    def due(self, update_index: int) -> bool:
        """Whether this stage steps on update number ``update_index + 1``."""
        return (update_index + 1) % self.every == 0

    def terms(self, output: TensorDictBase) -> torch.Tensor:
        """The sum of this stage's loss entries in ``output``."""
        keys = self.loss_keys or tuple(loss_keys(output))
        missing = [k for k in keys if k not in output.keys()]
        if missing:
            raise KeyError(f"Stage {self.name!r} minimises {missing}, which its loss output lacks (it has "
                           f"{sorted(map(str, output.keys()))}). Name entries the loss returns in Stage(loss=...).")
        total = output.get(keys[0])
        for k in keys[1:]:
            total = total + output.get(k)
        return total.sum() if total.ndim else total


def loss_methods(loss: nn.Module) -> list[str]:
    """The public methods ``loss`` adds to torchrl's ``LossModule`` (and ``nn.Module``) whose names hold "loss"."""
    base = set(dir(LossModule))
    return sorted(m for m in dir(type(loss)) if "loss" in m and not m.startswith("_") and m not in base
                  and not isinstance(getattr(type(loss), m, None), property) and callable(getattr(loss, m, None)))


def check_stages(stages: Sequence[Stage], named_params: Iterable[tuple[str, nn.Parameter]], loss: nn.Module) -> None:
    """Raise, before anything is built, for stages that cannot train this loss as declared."""
    if not stages:
        raise ValueError("stages must name at least one Stage.")
    names = [s.name for s in stages]
    if len(set(names)) != len(names):
        raise ValueError(f"Stage names must be distinct, got {names}.")
    for s in stages:
        if not isinstance(s, Stage):
            raise TypeError(f"stages must hold fabric_learner.Stage objects, got {type(s).__name__}.")
        if isinstance(s.every, bool) or not isinstance(s.every, int) or s.every < 1:
            raise ValueError(f"Stage {s.name!r}: every must be an integer >= 1, got {s.every!r}.")
        if s.method is not None and not callable(getattr(loss, s.method, None)):
            methods = loss_methods(loss)
            known = (f"Its loss methods are {methods}" if methods else
                     f"{type(loss).__name__} has no loss method besides forward") + "; name one, or leave method=None"
            raise ValueError(f"Stage {s.name!r} runs loss method {s.method!r}, which {type(loss).__name__} does not "
                             f"have. {known} (stages without a method share the forward; see Stage(loss=...)).")
    trained = [(n, p) for n, p in named_params if p.requires_grad]
    for n, _ in trained:
        owners = [s.name for s in stages if s.owns(n)]
        if len(owners) > 1:
            raise ValueError(f"Parameter {n!r} belongs to stages {owners}: every parameter is trained by one "
                             "stage only. Make the stages' params prefixes disjoint.")
    for s in stages:
        if not any(s.owns(n) for n, _ in trained):
            raise ValueError(f"Stage {s.name!r} trains no parameter: no trainable loss parameter name starts with "
                             f"{list(s.prefixes)}. Loss parameters: {sorted({n.split('.')[0] for n, _ in trained})}.")
    unowned = [n for n, _ in trained if not any(s.owns(n) for s in stages)]
    if unowned:
        raise ValueError(f"No stage trains {unowned[:8]}; they would never learn. Add their prefix to a stage's "
                         "params, or freeze them (requires_grad=False).")
    shared = [i for i in range(1, len(stages)) if stages[i].method is None and stages[i - 1].method is None]
    if shared and any(stages[i].loss is None or stages[i - 1].loss is None for i in shared):
        raise ValueError("Stages that share one forward (consecutive stages without method=) must each name their "
                         "loss entries with Stage(loss=...), so that each minimises its own terms.")


def build_stage_optimizers(stages: Sequence[Stage], named_params: Iterable[tuple[str, nn.Parameter]]):
    """``{stage name: optimizer}`` over each stage's parameters, in the loss's parameter order."""
    named = list(named_params)
    return {s.name: build_optimizer(s.optimizer, [p for n, p in named if s.owns(n) and p.requires_grad])
            for s in stages}


class StageOptimizers:
    """The stages' optimizers seen as one where the learner treats them alike.

    ``param_groups`` lists every stage's groups in stage order, ``zero_grad`` clears them all,
    and the state dict holds each stage's under its name.
    """

    def __init__(self, optimizers: dict[str, Any]) -> None:
        self.by_stage = optimizers

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for o in self.by_stage.values() for g in o.param_groups]

    @property
    def state(self) -> dict:
        return {p: s for o in self.by_stage.values() for p, s in o.state.items()}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.by_stage.values():
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"stages": {name: o.state_dict() for name, o in self.by_stage.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, o in self.by_stage.items():
            o.load_state_dict(state["stages"][name])


def groups(stages: Sequence[Stage]) -> list[list[Stage]]:
    """Runs of stages that share one forward: consecutive stages without a method, or one method stage."""
    out: list[list[Stage]] = []
    for s in stages:
        if s.method is None and out and out[-1][0].method is None:
            out[-1].append(s)
        else:
            out.append([s])
    return out


def as_output(value: Any, stage: Stage) -> TensorDictBase:
    """A loss method's return value as a TensorDict of loss entries and metadata."""
    if isinstance(value, TensorDictBase):
        return value
    if isinstance(value, tuple) and value and isinstance(value[0], torch.Tensor):
        meta = value[1] if len(value) > 1 and isinstance(value[1], dict) else {}
        return TensorDict({f"loss_{stage.name}": value[0],
                           **{k: v for k, v in meta.items() if isinstance(v, torch.Tensor)}}, batch_size=[])
    if isinstance(value, torch.Tensor):
        return TensorDict({f"loss_{stage.name}": value}, batch_size=[])
    raise TypeError(f"Stage {stage.name!r}: loss method {stage.method!r} returned {type(value).__name__}; expected a "
                    "TensorDict, a (loss, metadata) pair or a tensor.")
