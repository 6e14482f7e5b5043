"""Building and launching Fabric the way the user's launcher expects."""

from __future__ import annotations

import contextlib
import os
from typing import Any

from lightning.fabric import Fabric

from fabric_learner._sharded import default_sharded_strategy

SHARDED_NAMES = ("fsdp", "fsdp2")


def using_fabric_cli() -> bool:
    """True inside processes started by ``fabric run`` (which forbids ``fabric.launch()``)."""
    return os.environ.get("LT_CLI_USED", "0") == "1"


def external_world() -> tuple[int, int] | None:
    """``(local_world_size, num_nodes)`` when an external launcher such as torchrun started us."""
    if "LT_CLI_USED" in os.environ or "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return local, max(1, world // max(local, 1))


def resolve_strategy(strategy: Any) -> Any:
    """``"fsdp"`` means FSDP2 sharding of the loss's parameters, which works on CPU and GPU.

    Fabric's own ``"fsdp"`` (FSDP1) refuses CPU and cannot wrap a torchrl ``LossModule``.
    """
    from lightning.fabric.strategies import FSDPStrategy

    if isinstance(strategy, str) and strategy.lower() in SHARDED_NAMES:
        return default_sharded_strategy()
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


def build_fabric(*, accelerator: Any, strategy: Any, devices: Any, num_nodes: int, precision: Any) -> Fabric:
    """A Fabric for these settings, honouring the launcher's.

    ``"auto"`` devices under torchrun means the launched world (Fabric alone would give each
    process its own one-device world); ``fabric run --strategy=fsdp`` means the sharded
    strategy; ``fabric run --precision=...`` wins over this constructor's default precision.
    """
    world = external_world()
    if world is not None and devices == "auto":
        devices, launched_nodes = world
        if num_nodes == 1:
            num_nodes = launched_nodes
    hidden = []
    if strategy == "auto" and os.environ.get("LT_STRATEGY", "").lower() in SHARDED_NAMES:
        strategy = os.environ["LT_STRATEGY"]
    strategy = resolve_strategy(strategy)
    if not isinstance(strategy, str):
        hidden.append("LT_STRATEGY")  # Fabric would let the CLI's string override the object
    if using_fabric_cli() and precision == "32-true" and "LT_PRECISION" in os.environ:
        precision = None
    with _without_env(*hidden):
        return Fabric(accelerator=accelerator, strategy=strategy, devices=devices, num_nodes=num_nodes,
                      precision=precision)


def launch(fabric: Fabric) -> None:
    """Start the other ranks and the process group, unless a launcher already did.

    ``fabric.launch()`` is a no-op on a second call and, in the process that spawned the other
    ranks, does not spawn again, so a program may build several learners.
    """
    if not using_fabric_cli():
        fabric.launch()
