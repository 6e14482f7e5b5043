"""The random state an update draws from, saved and restored with the learner.

Stochastic losses (SAC, TD3's target noise, PPO's entropy samples) draw from torch's global
generator (and the current CUDA device's). A checkpoint keeps one such state per rank so
that a resumed run draws exactly what the uninterrupted run would have drawn.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch


def local_state() -> dict[str, torch.Tensor]:
    """This process's torch generator states, as plain uint8 tensors (weights-only loadable)."""
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore(states: Any, rank: int, world_size: int) -> None:
    """Set this rank's generators from a checkpoint's per-rank ``states``.

    A checkpoint saved at another world size has no state for this rank's place in the run,
    so the generators are left alone, with a warning: the run continues, not bit-identically.
    """
    if not states:
        return
    if len(states) != world_size:
        warnings.warn(
            f"The checkpoint holds the random state of {len(states)} rank(s) and this run has {world_size}; "
            "the random state was not restored, so stochastic losses will not draw what the saved run would have.",
            stacklevel=4,
        )
        return
    state = states[rank]
    # a fresh tensor: torch 2.13 reads a view's storage from its start, past its end for a
    # non-zero offset (a segfault on rank 1 of a stacked all_gather result)
    torch.set_rng_state(state["torch"].to(device="cpu", dtype=torch.uint8).clone())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"].to(device="cpu", dtype=torch.uint8).clone())


def check(states: Any) -> None:
    """Raise before anything is loaded if a checkpoint's ``rng`` entry is malformed."""
    if states is None:
        return
    size = torch.get_rng_state().numel()
    if not isinstance(states, (list, tuple)) or not all(
        isinstance(s, dict) and _is_state(s.get("torch"), size) and set(s) <= {"torch", "cuda"}
        and ("cuda" not in s or _is_state(s["cuda"])) for s in states
    ):
        raise ValueError(
            f"checkpoint['rng'] must be a list with one {{'torch': uint8 tensor of {size} bytes}} per rank; nothing "
            "was loaded. Remove the entry to load the checkpoint without restoring the random state."
        )


def _is_state(value: Any, size: int | None = None) -> bool:
    return isinstance(value, torch.Tensor) and value.dtype == torch.uint8 and value.dim() == 1 \
        and (size is None or value.numel() == size)
