"""Warnings a user did not cause are silenced narrowly: the known one only, nothing else of its kind (issue #55)."""

from __future__ import annotations

import warnings

import pytest
import torch

from fabric_learner.utils import quiet as _warnings


def scored_warnings(quiet: bool) -> list[str]:
    """The warnings of scoring an LLM batch with torchrl's TransformersWrapper, every one shown."""
    from fabric_learner.testing import grpo_example

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")  # no once-per-location registry hiding a repeat
        if quiet:
            _warnings.quiet()
        grpo_example(reply_words=(2, 3))  # scores its batch with the policy
    return [str(w.message) for w in seen]


def test_torchrls_cross_entropy_deprecation_is_silenced_when_scoring_llm_batches():
    pytest.importorskip("transformers")
    loud = scored_warnings(quiet=False)
    assert any("size_average and reduce args will be deprecated" in m for m in loud), loud  # torchrl still warns
    assert not any("size_average" in m for m in scored_warnings(quiet=True))


def test_the_filter_leaves_other_warnings_of_torch_nn_functional_alone():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _warnings.quiet()
        torch.nn.functional.softmax(torch.zeros(2, 2))  # implicit dim: its own UserWarning
    assert any("Implicit dimension choice for softmax" in str(w.message) for w in seen)
