"""Building the optimizer and checking that it trains everything that gets a gradient."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Union

import torch
from torch import nn

OptimizerLike = Union[torch.optim.Optimizer, Callable[[list[nn.Parameter]], torch.optim.Optimizer], None]


def build_optimizer(optimizer: OptimizerLike, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """An optimizer instance from ``None`` (Adam), an instance (kept) or a factory ``f(params)``.

    ``None`` and a factory get the trainable parameters only (``requires_grad``): frozen ones (a
    LoRA model's base, a reference model) never get optimizer state or a place in checkpoints'
    optimizer entries. An instance holding a frozen parameter is refused (:func:`check_no_frozen`).
    """
    if optimizer is None:
        return torch.optim.Adam(trainable(params))
    if isinstance(optimizer, torch.optim.Optimizer):
        check_no_frozen(optimizer)
        return optimizer
    if callable(optimizer):
        built = optimizer(trainable(params))
        if not isinstance(built, torch.optim.Optimizer):
            raise TypeError(
                f"The optimizer factory returned {type(built).__name__}, not a torch.optim.Optimizer. "
                "Pass a callable params -> Optimizer, e.g. functools.partial(torch.optim.Adam, lr=3e-4)."
            )
        return built
    raise TypeError(
        f"optimizer must be None, a torch.optim.Optimizer or a callable params -> Optimizer, "
        f"got {type(optimizer).__name__}."
    )


def trainable(params: Iterable[nn.Parameter]) -> list[nn.Parameter]:
    """The parameters that require a gradient, in order."""
    return [p for p in params if p.requires_grad]


def check_no_frozen(optimizer: torch.optim.Optimizer) -> None:
    """Raise if ``optimizer`` lists a frozen parameter (``requires_grad=False``).

    Frozen parameters are not the learner's state (checkpoints leave them out), so an optimizer
    over them would pair checkpoint moments with tensors no checkpoint holds.
    """
    frozen = sum(1 for p in optimizer_params(optimizer) if not p.requires_grad)
    if frozen:
        raise ValueError(
            f"The optimizer lists {frozen} frozen parameter(s) (requires_grad=False, e.g. a LoRA model's base "
            "weights); the learner keeps no optimizer state for frozen parameters. Build it over the trainable "
            "ones, e.g. torch.optim.Adam([p for p in loss.parameters() if p.requires_grad]), or pass a factory "
            "(functools.partial(torch.optim.Adam, lr=...)) or None, which get the trainable parameters only."
        )


def optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every parameter of ``optimizer``, in group order (the group's own list when there is one: do not mutate)."""
    groups = optimizer.param_groups
    if len(groups) == 1:
        return groups[0]["params"]
    return [p for group in groups for p in group["params"]]


def uncovered_with_grad(
    named_params: Iterable[tuple[str, torch.Tensor]], optimizer: torch.optim.Optimizer
) -> list[str]:
    """Names of parameters that hold a gradient but belong to no optimizer param group."""
    covered = {id(p) for p in optimizer_params(optimizer)}
    return [name for name, p in named_params if p.grad is not None and id(p) not in covered]


def coverage_error(names: list[str]) -> RuntimeError:
    shown = ", ".join(names[:8]) + (f", ... ({len(names)} in all)" if len(names) > 8 else "")
    return RuntimeError(
        f"These parameters received a gradient but no optimizer param group covers them, so they "
        f"would never train: {shown}. Build the optimizer over loss_module.parameters() (torchrl "
        "losses such as SACLoss own expanded copies of the networks you passed in), or pass "
        "optimizer=None for Adam over all of them."
    )
