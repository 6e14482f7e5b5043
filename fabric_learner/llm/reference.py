"""A frozen reference model for the KL term of torchrl's LLM losses, sharded like the policy under FSDP.

``GRPOLoss(kl_to_ref_coeff=...)`` and ``SFTLoss(kl_to_ref_coeff=...)`` read the reference model's
log-probs of each sample's tokens from the batch (``("next", "ref_log_probs", "full")``); torchrl
computes them with a transform around a frozen copy of the model. :class:`ReferenceLogProbs` does
it on the learner's ranks: the model is frozen (no parameter requires a gradient, so none ever gets
one), lives outside the loss (so it is in no optimizer and in no checkpoint of the learner), and
under FSDP is sharded with the learner's plan (:func:`fabric_learner.sharding.apply_fsdp`: one unit
per decoder layer, the learner's mixed-precision policy) over the learner's data-parallel ranks.
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDictBase
from torch import nn

__all__ = ["ReferenceLogProbs"]

REF_LOG_PROBS = ("next", "ref_log_probs", "full")  # where torchrl's GRPOLoss and SFTLoss read them


class ReferenceLogProbs:
    """Writes a frozen reference model's log-probs of each sample's tokens into a batch.

    The model is frozen here (``requires_grad_(False)``, eval mode) and wrapped in torchrl's
    ``TransformersWrapper(generate=False, return_log_probs=True)``, reading the conversation
    (``input_mode="history"``). With a sharded ``learner`` (``strategy="fsdp"``) the model is
    sharded in place over the learner's data-parallel ranks as the default plan shards the policy
    (``apply_fsdp``: one unit per decoder layer, the rest in the root; the learner's
    mixed-precision policy), so each rank
    holds 1/N of it and each decoder layer is gathered only while it runs; calling it is then a
    collective (every rank calls it, each with its own batch, as it calls ``update``). The
    log-probs equal one process's on the same samples. Never in the learner's optimizer or
    checkpoints: rebuild it from the same weights when resuming.

    Args:
        model: a transformers causal LM, typically a copy of the policy's initial weights.
        tokenizer: its tokenizer.
        learner: the learner whose ranks compute the log-probs; ``None`` for one process (also
            fine with an unsharded learner: the model then stays whole).
        out_key: where each sample's log-probs go; the default is what ``GRPOLoss`` and ``SFTLoss`` read.
        **wrapper_kwargs: passed to ``TransformersWrapper`` (e.g. ``input_mode="tokens"``).

    Examples:
        >>> import copy
        >>> from fabric_learner import LocalLearner
        >>> from fabric_learner.llm import ReferenceLogProbs
        >>> from fabric_learner.testing import grpo_example, tiny_causal_lm
        >>> loss, policy, batch = grpo_example(kl_to_ref_coeff=0.1)
        >>> reference = ReferenceLogProbs(copy.deepcopy(policy.model), policy.tokenizer)
        >>> batch = reference(batch)
        >>> [tuple(t.shape) == tuple(lp.shape) for t, lp in zip(batch.get(("next", "ref_log_probs", "full"), as_list=True),
        ...                                                      batch.get(("log_probs", "full"), as_list=True))]
        [True, True, True, True]
        >>> out = LocalLearner(loss, policy=policy).update(batch)
        >>> float(out["kl_to_ref"])  # the reference is the policy's own weights: no divergence yet
        0.0
        >>> any(p.requires_grad for p in reference.model.parameters())
        False

        Under FSDP, ``ReferenceLogProbs(model, tokenizer, learner=learner)`` on every rank shards it
        like the policy, and ``batch = reference(batch)`` before each ``learner.update(batch)``.
    """

    def __init__(self, model: nn.Module, tokenizer: Any, *, learner: Any = None, out_key=REF_LOG_PROBS,
                 **wrapper_kwargs: Any) -> None:
        from torchrl.modules.llm import TransformersWrapper

        if not isinstance(model, nn.Module):
            raise TypeError(f"ReferenceLogProbs needs a transformers model (an nn.Module), got {type(model).__name__}; "
                            "pass e.g. copy.deepcopy(policy.model).")
        if learner is not None and not hasattr(learner, "capabilities"):
            raise TypeError(f"learner must be a fabric_learner learner (or None), got {type(learner).__name__}.")
        model.requires_grad_(False)
        model.eval()
        if learner is not None and learner.capabilities.sharded:
            _shard_like(model, learner)
        elif learner is not None and getattr(learner, "fabric", None) is not None:
            model.to(learner.fabric.device)
        kwargs = {"input_mode": "history", "pad_output": False, **wrapper_kwargs}
        self.model = model
        self.out_key = out_key
        self.wrapper = TransformersWrapper(model, tokenizer=tokenizer, generate=False, return_log_probs=True, **kwargs)

    @torch.no_grad()
    def __call__(self, batch: TensorDictBase) -> TensorDictBase:
        """Write the reference log-probs of ``batch``'s samples at ``out_key`` (in place) and return ``batch``."""
        if not isinstance(batch, TensorDictBase):
            raise TypeError(f"ReferenceLogProbs takes a TensorDict batch, got {type(batch).__name__}.")
        missing = [k for k in self.wrapper.in_keys if k not in batch.keys(include_nested=True)]
        if missing:
            raise KeyError(f"The batch lacks {missing}, which the reference model reads; nothing was written. "
                           "Pass the batch the loss trains on (its conversation history).")
        out = self.wrapper(batch.select(*self.wrapper.in_keys))
        log_probs = out.get((self.wrapper.log_probs_key, "full"), as_list=True)
        _reshard(self.model)
        members = getattr(batch, "tensordicts", None)
        if members is not None and batch.stack_dim == 0 and len(members) == len(log_probs):
            for sample, lp in zip(members, log_probs):
                sample.set(self.out_key, lp)
        else:
            batch.set(self.out_key, out.get((self.wrapper.log_probs_key, "full")))
        return batch


def _shard_like(model: nn.Module, learner: Any) -> None:
    """``apply_fsdp`` over the learner's data-parallel ranks, with the mixed-precision policy it trains with."""
    from fabric_learner.sharding import apply_fsdp, whole_world

    owner = learner.sharded_module
    model.to(learner.fabric.device)
    if owner.mp_policy is not None and next(iter(owner.parameters())).dtype != torch.float32:
        model.to(next(iter(owner.parameters())).dtype)  # bf16-true: stored as the learner stores its weights
    apply_fsdp(model, whole_world(learner.fabric.strategy.device_mesh), mp_policy=owner.mp_policy)


def _reshard(model: nn.Module) -> None:
    """Free the root unit's gathered weights: FSDP2 keeps the root gathered after a forward without backward."""
    reshard = getattr(model, "reshard", None)
    if callable(reshard):
        reshard()
