"""Building and launching Fabric the way the user's launcher expects."""

from __future__ import annotations

import os
from typing import Any

from lightning.fabric import Fabric


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


def build_fabric(*, accelerator: Any, strategy: Any, devices: Any, num_nodes: int, precision: Any) -> Fabric:
    """A Fabric for these settings; ``"auto"`` devices under torchrun means the launched world.

    Fabric alone would give each torchrun process its own single-device world.
    """
    world = external_world()
    if world is not None and devices == "auto":
        devices, launched_nodes = world
        if num_nodes == 1:
            num_nodes = launched_nodes
    return Fabric(accelerator=accelerator, strategy=strategy, devices=devices, num_nodes=num_nodes, precision=precision)


def launch(fabric: Fabric) -> None:
    """Start the other ranks and the process group, unless a launcher already did.

    ``fabric.launch()`` is a no-op on a second call and, in the process that spawned the other
    ranks, does not spawn again, so a program may build several learners.
    """
    if not using_fabric_cli():
        fabric.launch()
