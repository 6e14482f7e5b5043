"""The Ray runtime a ``RemoteLearner`` runs on: joined at an address, found running, or started here.

A runtime this package starts (no address, none running) is embedded: local, without dashboard,
its CPUs the machine's, quiet; it ends when the last learner using it closes. A runtime the
script started itself (``ray.init``) or one reached at ``address=`` is never shut down here.
"""

from __future__ import annotations

import os
import threading

_lock = threading.Lock()
_embedded = {"users": 0}  # learners using the runtime this package started


def join(address: str | None) -> bool:
    """Connect this process to a Ray runtime; True when it is the embedded one (then ``leave`` it)."""
    try:
        import ray
    except ImportError as err:
        raise ImportError("RemoteLearner runs on Ray, which is not installed: pip install 'fabric_learner[ray]' "
                          "(or pip install 'ray>=2.60').") from err
    with _lock:
        if ray.is_initialized():
            if _embedded["users"]:
                _embedded["users"] += 1
                return True
            return False
        if address is not None:
            ray.init(address=address, logging_level="ERROR", log_to_driver=False)
            return False
        ray.init(num_cpus=os.cpu_count() or 1, include_dashboard=False, log_to_driver=False, logging_level="ERROR",
                 configure_logging=True)
        _embedded["users"] = 1
        return True


def leave() -> None:
    """One learner of the embedded runtime is done; the last one shuts it down."""
    import ray

    with _lock:
        _embedded["users"] = max(0, _embedded["users"] - 1)
        if _embedded["users"] == 0 and ray.is_initialized():
            ray.shutdown()
