"""Everything a language model needs from the learner, in one package.

- ``counts``: each micro-batch's token or sample count, so token and sample means stay exact over
  micro-batches and ranks (:func:`loss_count`).
- ``reference``: a frozen reference model for the KL term, sharded like the policy (:class:`ReferenceLogProbs`).
- ``weights``: the trained model's weights to a generation engine by name, in bounded buckets
  (:func:`weight_buckets`, :func:`load_weights`); ``lora``, ``sources`` and ``receive`` hold its parts.
- ``batching``: micro-batches cut by a token budget (:func:`update_by_tokens`), a global batch dealt
  over ranks by tokens (:func:`share_of_rank`); ``packing``: several samples in one row (:func:`pack_sequences`).
- ``export``: a folder transformers' ``from_pretrained`` loads (:func:`export_pretrained`,
  :func:`export_checkpoint`).
"""

from fabric_learner.llm.batching import (
    balanced_shares,
    micro_batches,
    sample_lengths,
    share_of_rank,
    update_by_tokens,
)
from fabric_learner.llm.counts import LossCount, loss_count
from fabric_learner.llm.export import export_checkpoint, export_pretrained
from fabric_learner.llm.packing import PACKING_ATTENTION, pack_sequences
from fabric_learner.llm.reference import ReferenceLogProbs
from fabric_learner.llm.weights import LORA_MODES, load_weights, trained_model, weight_buckets

__all__ = ["LORA_MODES", "PACKING_ATTENTION", "LossCount", "ReferenceLogProbs", "balanced_shares", "export_checkpoint",
           "export_pretrained", "load_weights", "loss_count", "micro_batches", "pack_sequences", "sample_lengths",
           "share_of_rank", "trained_model", "update_by_tokens", "weight_buckets"]
