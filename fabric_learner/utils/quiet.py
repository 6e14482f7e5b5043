"""Warnings a user of the package did not cause and cannot act on, silenced narrowly (message, category, module).

Each filter says why its warning is harmless here. Warnings with a cause in this package are fixed at
the cause instead (see ``utils.compat.all_gather_flat``, ``utils.compat.all_gather_stacked``, ``utils.compat.release_semaphores``,
``checkpoint.dcp_folder.load_into``).
"""

from __future__ import annotations

import warnings


def quiet() -> None:
    """Install the filters (idempotent: ``warnings`` drops a filter equal to one already installed)."""
    # torchrl 0.14.1's TransformersWrapper computes per-token log-probs with
    # cross_entropy(..., reduce=False), which torch maps to reduction="none", the same values: the
    # deprecation is torchrl's to act on, and it fires on every scoring of an LLM batch.
    warnings.filterwarnings("ignore", message="size_average and reduce args will be deprecated",
                            category=UserWarning, module=r"torch\.nn\.functional")
