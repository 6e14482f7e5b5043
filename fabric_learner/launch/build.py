"""Building and launching Fabric the way the user's launcher expects."""

from __future__ import annotations

import contextlib
import os
from datetime import timedelta
from typing import Any

from lightning.fabric import Fabric

from fabric_learner.backends.sharded import default_sharded_strategy
from fabric_learner.utils.compat import set_group_timeout, set_strategy_timeout, strategy_mesh

SHARDED_NAMES = ("fsdp", "fsdp2")
DEFAULT_TIMEOUT = timedelta(minutes=5)


def as_timeout(timeout: Any) -> timedelta | None:
    """A process-group timeout from a ``timedelta``, seconds, or ``None`` (torch's default)."""
    if timeout is None:
        return None
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        timeout = timedelta(seconds=timeout)
    if not isinstance(timeout, timedelta):
        raise TypeError(f"timeout must be a datetime.timedelta, a number of seconds or None, got {type(timeout).__name__}.")
    if timeout <= timedelta(0):
        raise ValueError(f"timeout must be positive, got {timeout!r}.")
    return timeout


def launcher() -> str:
    """How this process was started: ``"fabric"``, ``"torchrun"`` or ``"python"``.

    ``"fabric"``: by ``fabric run`` (which runs torchrun underneath, so it is checked first).
    ``"torchrun"``: by ``torchrun`` / ``python -m torch.distributed.run``. ``"python"``: anything
    else, including the ranks a learner started itself from a plain ``python script.py``.

    Examples:
        >>> import fabric_learner
        >>> fabric_learner.launcher()  # in a plain interpreter
        'python'
    """
    if os.environ.get("LT_CLI_USED", "0") == "1":
        return "fabric"
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return "torchrun"
    return "python"


def using_fabric_cli() -> bool:
    """True inside processes started by ``fabric run`` (which forbids ``fabric.launch()``)."""
    return launcher() == "fabric"


def external_world() -> tuple[int, int] | None:
    """``(local_world_size, num_nodes)`` when torchrun (not ``fabric run``) started us."""
    if launcher() != "torchrun":
        return None
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return local, max(1, world // max(local, 1))


# What a constructor argument holds when the script left the choice open (the launcher's then applies).
_OPEN = {"accelerator": ("auto",), "strategy": ("auto",), "devices": ("auto",), "num_nodes": (1,),
         "precision": ("32-true", None)}


def agree_with_launcher(*, accelerator: Any, strategy: Any, devices: Any, num_nodes: Any,
                        precision: Any) -> tuple[Any, Any, Any, Any, Any]:
    """The settings to build Fabric with, once the launcher's have been applied.

    One rule for ``fabric run`` and ``torchrun``: a setting the launcher fixes wins over an
    argument left open (``"auto"``, ``num_nodes=1``, the default precision); an argument equal to
    the launcher's is fine; one that differs raises ``ValueError`` before anything starts, naming
    both. ``fabric run`` fixes the devices and nodes, and the accelerator, strategy and precision
    it was given; torchrun fixes the devices per node and the nodes. A strategy *object* is the
    script's explicit choice and is used as it is.
    """
    how = launcher()
    given = {"accelerator": accelerator, "strategy": strategy, "devices": devices, "num_nodes": num_nodes,
             "precision": precision}
    if how == "fabric":
        fixed = {name: os.environ.get("LT_" + name.upper()) for name in given}
        if fixed["strategy"] == "auto":
            fixed["strategy"] = None
        flag = "fabric run --{}={}"
    elif how == "torchrun":
        local, nodes = external_world()
        fixed = {"devices": str(local), "num_nodes": str(nodes)}
        flag = "torchrun --{}={}"
    else:
        return accelerator, strategy, devices, num_nodes, precision
    out = dict(given)
    for name, theirs in fixed.items():
        ours = given[name]
        if theirs is None or (name == "strategy" and not isinstance(ours, str)):
            continue
        if ours in _OPEN[name]:
            out[name] = _typed(name, theirs)
        elif not _same(name, ours, theirs):
            option = {"devices": "nproc-per-node", "num_nodes": "nnodes"}[name] if how == "torchrun" else \
                name.replace("_", "-")
            open_value = _OPEN[name][0]
            raise ValueError(
                f"FabricLearner({name}={ours!r}) disagrees with the launcher, started as "
                f"`{flag.format(option, theirs)}`. Under fabric run and torchrun the launcher decides: pass "
                f"{name}={open_value!r} (or leave it out) to take the launcher's, or launch with "
                f"`--{option}={ours}`. Nothing was started."
            )
    return out["accelerator"], out["strategy"], out["devices"], out["num_nodes"], out["precision"]


def _typed(name: str, value: str) -> Any:
    if name == "num_nodes" or (name == "devices" and value.isdigit()):
        return int(value)
    return value


def _same(name: str, ours: Any, theirs: str) -> bool:
    if name == "strategy":
        ours, theirs = ours.lower(), theirs.lower()
        return ours == theirs or (ours in SHARDED_NAMES and theirs in SHARDED_NAMES)
    if name == "precision":
        from lightning.fabric.connector import _convert_precision_to_unified_args

        try:
            return _convert_precision_to_unified_args(ours) == _convert_precision_to_unified_args(theirs)
        except ValueError:
            return False
    return str(ours).lower() == str(theirs).lower()


def resolve_strategy(strategy: Any, timeout: timedelta | None = None) -> Any:
    """``"fsdp"`` means FSDP2 sharding of the loss's parameters, which works on CPU and GPU.

    Fabric's own ``"fsdp"`` (FSDP1) refuses CPU and cannot wrap a torchrl ``LossModule``.
    """
    from lightning.fabric.strategies import FSDPStrategy

    if isinstance(strategy, str) and strategy.lower() in SHARDED_NAMES:
        return default_sharded_strategy(timeout)
    if isinstance(strategy, FSDPStrategy):
        raise ValueError(
            "Fabric's FSDPStrategy (FSDP1) cannot wrap a torchrl LossModule and refuses CPU. Use "
            "strategy='fsdp' (FSDP2 over the loss's parameters) or a "
            "lightning.fabric.strategies.ModelParallelStrategy(parallelize_fn=...) you build yourself."
        )
    return strategy


@contextlib.contextmanager
def _without_env(*names: str):
    saved = {n: os.environ.pop(n) for n in names if n in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def build_fabric(*, accelerator: Any, strategy: Any, devices: Any, num_nodes: int, precision: Any,
                 timeout: timedelta | None = None) -> tuple[Fabric, bool]:
    """A Fabric for these settings, agreeing with the launcher's (see ``agree_with_launcher``).

    ``"auto"`` devices under torchrun means the launched world (Fabric alone would give each
    process its own one-device world); ``fabric run --strategy=fsdp`` means the sharded
    strategy. Also says whether ``timeout`` is this Fabric's to set (its strategy was built from a name).
    """
    accelerator, strategy, devices, num_nodes, precision = agree_with_launcher(
        accelerator=accelerator, strategy=strategy, devices=devices, num_nodes=num_nodes, precision=precision)
    hidden = []
    by_name = isinstance(strategy, str)
    strategy = resolve_strategy(strategy, timeout)
    if not isinstance(strategy, str):
        hidden.append("LT_STRATEGY")  # Fabric would let the CLI's string override the object
    with _without_env(*hidden):
        fabric = Fabric(accelerator=accelerator, strategy=strategy, devices=devices, num_nodes=num_nodes,
                        precision=precision)
    owns_timeout = by_name and timeout is not None
    if owns_timeout:
        set_timeout(fabric.strategy, rendezvous_timeout(timeout))
    return fabric, owns_timeout


def rendezvous_timeout(timeout: timedelta) -> timedelta:
    """How long ranks may take to meet: never shorter than the default, since starting a rank
    (imports, spawning) can take longer than a short collective timeout allows."""
    return max(timeout, DEFAULT_TIMEOUT)


def set_timeout(strategy: Any, timeout: timedelta) -> None:
    """Give a strategy Fabric built from a name (DDP, FSDP2) the timeout its group starts with.

    Fabric resolves names such as ``"auto"`` or ``"ddp_spawn"`` itself, so the timeout is set on
    the strategy it chose, before ``launch()`` creates the group. Strategies without a process
    group timeout (single device) are left alone.
    """
    from lightning.fabric.strategies import DDPStrategy, ModelParallelStrategy

    if isinstance(strategy, (DDPStrategy, ModelParallelStrategy)):
        set_strategy_timeout(strategy, timeout)


def apply_collective_timeout(fabric: Fabric, timeout: timedelta) -> None:
    """Bound every collective of the groups this Fabric's strategy uses by ``timeout``.

    Applied once the group exists: the rendezvous had ``rendezvous_timeout``, and under
    ``fabric run`` the group is created inside ``Fabric()``, before any strategy setting could
    reach it.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or fabric.world_size == 1:
        return
    groups = [None]
    mesh = strategy_mesh(fabric.strategy)
    if mesh is not None:
        groups += [g for g in mesh.get_all_groups() if g is not dist.group.WORLD]
    for group in groups:
        set_group_timeout(timeout, group)


def launch(fabric: Fabric) -> None:
    """Start the other ranks and the process group, unless a launcher already did.

    ``fabric.launch()`` is a no-op on a second call and, in the process that spawned the other
    ranks, does not spawn again, so a program may build several learners.
    """
    check_elastic_restarts()
    if not using_fabric_cli():
        fabric.launch()


def check_elastic_restarts() -> None:
    """Refuse, before any group starts, a torchrun whose restarts could never rejoin.

    Under ``torchrun --max-restarts=N`` (N > 0) the agent's own store is shared with the workers by
    default, and it outlives them: the restarted workers' process group reads the dead workers'
    addresses from it under the same keys and fails to connect ("Connection refused", then a
    timeout), on every restart (pytorch/pytorch#135712, #167288). ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``
    makes every rendezvous round start a fresh store on a fresh port.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return  # the script made the group itself
    restarts = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and restarts.isdigit() and int(restarts) > 0:
        raise RuntimeError(
            f"torchrun was started with --max-restarts={restarts} and shares its store with the workers "
            "(TORCHELASTIC_USE_AGENT_STORE=True): restarted ranks would read the dead ranks' addresses from it "
            "and never connect. Start torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment and "
            "the c10d rendezvous (--standalone on one node, --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT on "
            "several), or without --max-restarts."
        )
