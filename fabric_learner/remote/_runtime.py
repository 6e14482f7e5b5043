"""The Ray runtime a ``RemoteLearner`` runs on: joined at an address, found running, or started here.

A runtime this package starts (no address, none running) is embedded: local, without dashboard,
its CPUs the machine's, quiet, and reachable from this machine only: its node address is the
loopback address, so Ray's own servers (GCS, raylet, object manager, the workers' and this
process's core workers, the runtime-env agent) listen on 127.0.0.1, and so does every group's
rendezvous (``remote.actors``). It ends when the last learner using it closes, and a watchdog
(``remote._watchdog``) ends its leftover processes within a second if this process is killed.
A runtime the script started itself (``ray.init``) or one reached at ``address=`` is never shut
down here, and keeps the addresses it was given.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading

LOOPBACK = "127.0.0.1"

_lock = threading.Lock()
_embedded: dict = {"users": 0, "watchdog": None}  # learners using the runtime this package started


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
        _start_on_loopback(ray)
        _embedded["users"] = 1
        _embedded["watchdog"] = _watchdog()
        return True


def refuse_what_never_fits(ranks: int, cpus: float, gpus: float) -> None:
    """On the embedded runtime (this machine, which does not grow), a group it can never hold is refused at once.

    Raises:
        RuntimeError: ``ranks`` x ``cpus`` (or ``gpus``) exceed what the machine has, naming it and the fix.
    """
    import ray

    have = ray.cluster_resources()
    need = {"CPU": ranks * cpus, "GPU": ranks * gpus}
    if all(need[kind] <= have.get(kind, 0) + 1e-9 for kind in need):
        return  # it fits once other learners on this runtime are closed, if not now: their wait is setup_timeout's
    raise RuntimeError(
        f"{ranks} learner ranks of {cpus:g} CPU and {gpus:g} GPU each need {need['CPU']:g} CPUs and {need['GPU']:g} "
        f"GPUs, but this machine has {have.get('CPU', 0):g} CPUs and {have.get('GPU', 0):g} GPUs (the Ray runtime "
        "RemoteLearner started here, which cannot grow), so the group could never start. Nothing was started. "
        "Lower num_learners, num_cpus_per_learner (fractions are allowed, e.g. 0.5) or num_gpus_per_learner, or "
        "join a cluster with address=.")


def _start_on_loopback(ray) -> None:
    """``ray.init`` of a local runtime whose node address is 127.0.0.1.

    Ray 2.60 binds its servers to 127.0.0.1 only when that is the node's address, but replaces a
    given 127.0.0.1 by the host's address unless its clusters are disabled, as it does on macOS
    and Windows (``ray_constants.ENABLE_RAY_CLUSTER``): so they are, for this call only.

    Ray starts its workers 15 steps nicer than the runtime (``worker_niceness``), which suits
    background tasks but not ranks that are the job: beside any busy process (the controller, a
    collector, another job) they would get a fraction of a core, where the same ranks under torchrun
    get their share. Here the ranks keep the controller's priority.
    """
    from ray._private import ray_constants

    before = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        ray.init(num_cpus=os.cpu_count() or 1, include_dashboard=False, log_to_driver=False, logging_level="ERROR",
                 configure_logging=True, _node_ip_address=LOOPBACK,
                 _system_config={"worker_niceness": 0})
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = before


def _watchdog() -> subprocess.Popen | None:
    """The watchdog of the runtime just started (Linux; none where its processes cannot be found)."""
    from ray._private import ray_constants, worker

    node = worker._global_node
    try:
        raylet = node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid
        others = [info.process.pid for infos in node.all_processes.values() for info in infos]
    except (AttributeError, KeyError, IndexError):
        return None
    if not sys.platform.startswith("linux"):
        return None
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_watchdog.py")
    try:
        return subprocess.Popen([sys.executable, "-I", script, str(raylet), *map(str, others)],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except OSError:  # no process to spare: the runtime still works, its agents just outlive a killed controller
        return None


def leave() -> None:
    """One learner of the embedded runtime is done; the last one shuts it down."""
    import ray

    with _lock:
        _embedded["users"] = max(0, _embedded["users"] - 1)
        if _embedded["users"] == 0:
            if ray.is_initialized():
                ray.shutdown()
            watchdog, _embedded["watchdog"] = _embedded["watchdog"], None
            if watchdog is not None:
                watchdog.kill()
                watchdog.wait()
