"""Building the optimizer and checking that it trains everything that gets a gradient."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Union

import torch
from torch import nn

OptimizerLike = Union[torch.optim.Optimizer, Callable[[list[nn.Parameter]], torch.optim.Optimizer], None]


def build_optimizer(optimizer: OptimizerLike, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """An optimizer instance from ``None`` (Adam), an instance (kept) or a factory ``f(params)``."""
    if optimizer is None:
        return torch.optim.Adam(list(params))
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    if callable(optimizer):
        built = optimizer(list(params))
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
