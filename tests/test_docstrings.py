"""The public objects' docstrings carry Examples, and the Examples run (doctests, one CPU process).

Each object is listed here by name, so one that loses its example fails instead of being
skipped. ``SHOWN_ONLY`` lists the examples that need more than a test may start (a Hydra app).
"""

from __future__ import annotations

import doctest
import sys

import pytest

from fabric_learner import (
    FabricLearner,
    Learner,
    LocalLearner,
    Stage,
    Trainer,
    collectives,
    configs,
    from_torchrl,
    launcher,
    onpolicy,
    replay,
    weights,
)

PUBLIC = {
    "LocalLearner": LocalLearner,
    "FabricLearner": FabricLearner,
    "Learner.update": Learner.update,
    "Learner.get_weights": Learner.get_weights,
    "Learner.checkpoint": Learner.checkpoint,
    "Learner.save": Learner.save,
    "Learner.load": Learner.load,
    "Trainer": Trainer,
    "Stage": Stage,
    "launcher": launcher,
    "normalize_advantage": onpolicy.normalize_advantage,
    "GlobalAdvantageNormalization": onpolicy.GlobalAdvantageNormalization,
    "GlobalMeanLoss": onpolicy.GlobalMeanLoss,
    "LearnerValueEstimator": onpolicy.LearnerValueEstimator,
    "EpochPartitionSampler": onpolicy.EpochPartitionSampler,
    "partition_indices": onpolicy.partition_indices,
    "global_mean": collectives.global_mean,
    "global_sum": collectives.global_sum,
    "global_count": collectives.global_count,
    "PublishWeights": weights.PublishWeights,
    "PublishFromRank0": weights.PublishFromRank0,
    "publish_to_collector": weights.publish_to_collector,
    "publish_from_rank0": weights.publish_from_rank0,
    "prioritized_sampler": replay.prioritized_sampler,
    "TorchPrioritizedSampler": replay.TorchPrioritizedSampler,
    "learner_trainer": from_torchrl.learner_trainer,
    "LocalLearnerConfig": configs.LocalLearnerConfig,
    "FabricLearnerConfig": configs.FabricLearnerConfig,
    "register_configs": configs.register_configs,
}
SHOWN_ONLY = {"instantiate_trainer": configs.instantiate_trainer}  # decorates a Hydra main


def _examples(name, obj) -> doctest.DocTest:
    module = sys.modules[obj.__module__]
    tests = doctest.DocTestFinder(recurse=False).find(obj, name, module=module, globs=vars(module))
    assert len(tests) == 1 and tests[0].examples, f"{name} has no Examples in its docstring"
    return tests[0]


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_the_example_runs(name):
    obj = PUBLIC[name]
    assert "Examples:" in obj.__doc__, f"{name}'s docstring has no Examples section"
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    test = _examples(name, obj)
    failures = []
    result = runner.run(test, out=failures.append)
    assert result.failed == 0, "".join(failures)
    assert result.attempted > 0, f"{name}'s examples are all skipped"


@pytest.mark.parametrize("name", sorted(SHOWN_ONLY))
def test_the_shown_example_parses(name):
    assert "Examples:" in SHOWN_ONLY[name].__doc__
    assert _examples(name, SHOWN_ONLY[name]).examples
