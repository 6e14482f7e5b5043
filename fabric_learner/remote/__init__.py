"""Other processes: collectors apart from learning (``RemoteCollectors``), and the learner as a group of Ray
actors driven from one process (``RemoteLearner``).

Imported on first use, as the package's top level is: a collector node or a collector's driver imports
the collectors' modules, not the learner's (which bring Lightning).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_HOMES = {"LearnerLostError": "faults", "LearnerTimeoutError": "faults", "RemoteCollectors": "collectors",
          "RemoteLearner": "learner"}
__all__ = ["LearnerLostError", "LearnerTimeoutError", "RemoteCollectors", "RemoteLearner"]

if TYPE_CHECKING:
    from fabric_learner.remote.collectors import RemoteCollectors
    from fabric_learner.remote.faults import LearnerLostError, LearnerTimeoutError
    from fabric_learner.remote.learner import RemoteLearner


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
    globals()[name] = value
    return value
