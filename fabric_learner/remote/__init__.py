"""Other processes: collectors apart from learning (``RemoteCollectors``), and the learner as a group of Ray
actors driven from one process (``RemoteLearner``).

Imported on first use, as the package's top level is: a collector node or a collector's driver imports
the collectors' modules, not the learner's (which bring Lightning).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fabric_learner.utils.lazy import lazy

_HOMES = {"LearnerLostError": "faults", "LearnerTimeoutError": "faults", "RemoteCollectors": "collectors",
          "RemoteLearner": "learner"}
__all__ = ["LearnerLostError", "LearnerTimeoutError", "RemoteCollectors", "RemoteLearner"]

if TYPE_CHECKING:
    from fabric_learner.remote.collectors import RemoteCollectors
    from fabric_learner.remote.faults import LearnerLostError, LearnerTimeoutError
    from fabric_learner.remote.learner import RemoteLearner


__getattr__, __dir__ = lazy(globals(), _HOMES)
