"""Collection apart from learning: collectors in their own processes and hosts (``RemoteCollectors``)."""

from fabric_learner.remote.collectors import RemoteCollectors

__all__ = ["RemoteCollectors"]
