"""Whether every rank fed each optimizer step the same number of samples, without a collective per step.

Gradients are averaged over ranks, each rank's loss being a mean over its own samples, so unequal
counts weigh samples unequally and the step differs from one on the full batch. Comparing counts
on every step would cost a collective per step (about a tenth of a small DDP update on a busy
CPU), so each rank keeps a rolling hash of its per-step counts and the ranks compare hashes every
``CHECK_EVERY`` steps: equal hashes mean equal counts on every step of the period (up to a
collision chance of about one in 2**61 per step).
"""

from __future__ import annotations

import warnings

import torch

CHECK_EVERY = 100  # ranks compare when num_updates is a multiple: a fresh learner's first step, then every 100th
_MODULUS = 2**61 - 1  # a prime: the hash below is a polynomial over its field
_BASE = 1_000_003


class SampleTrace:
    """This rank's per-step sample counts since the last comparison: their hash and range."""

    __slots__ = ("trace", "fewest", "most", "warned")

    def __init__(self) -> None:
        self.warned = False
        self.reset()

    def reset(self) -> None:
        self.trace, self.fewest, self.most = 0, None, 0

    def add(self, samples: int) -> None:
        self.trace = (self.trace * _BASE + samples + 1) % _MODULUS
        self.fewest = samples if self.fewest is None else min(self.fewest, samples)
        self.most = max(self.most, samples)

    def due(self, step: int) -> bool:
        """Whether ranks compare on this step (``step`` counts taken steps, the same on every rank)."""
        return not self.warned and step % CHECK_EVERY == 0

    def packet(self, flag: bool, device: torch.device) -> torch.Tensor:
        """What one MAX all-reduce needs: ``flag`` (any rank), and the hash's and counts' extremes."""
        return torch.tensor([int(flag), self.trace, -self.trace, self.most, -(self.fewest or 0)],
                            dtype=torch.int64, device=device)

    def read(self, reduced: torch.Tensor, step: int) -> bool:
        """Warn (once per learner) when the ranks' hashes differed; reset; return the reduced flag."""
        flag, high, neg_low, most, neg_fewest = reduced.tolist()
        if high != -neg_low and not self.warned:
            self.warned = True
            warnings.warn(
                f"Ranks fed different numbers of samples (from {-neg_fewest} to {most} per step) to at least one "
                f"optimizer step up to step {step + 1}. Gradients are averaged over ranks, each rank's loss "
                "being a mean over its own samples, so a sample on a rank with fewer weighs more and the step "
                "differs from one on the full batch. Give every rank the same number of samples (split "
                "evenly; drop or pad the remainder) for full-batch equivalence. Ranks compare their counts "
                f"at least every {CHECK_EVERY} steps; warned once per learner.",
                stacklevel=5,  # the caller of update()
            )
        self.reset()
        return bool(flag)
