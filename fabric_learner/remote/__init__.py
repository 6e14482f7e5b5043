"""Other processes: collectors apart from learning (``RemoteCollectors``), and the learner as a group of Ray
actors driven from one process (``RemoteLearner``)."""

from fabric_learner.remote.collectors import RemoteCollectors
from fabric_learner.remote.faults import LearnerLostError, LearnerTimeoutError
from fabric_learner.remote.learner import RemoteLearner

__all__ = ["LearnerLostError", "LearnerTimeoutError", "RemoteCollectors", "RemoteLearner"]
