"""Public names imported on first use (PEP 562), for a package's ``__init__``.

Why: ``import fabric_learner`` eagerly would import Lightning, torchrl and the learner in every process
that touches the package (about 4 s of CPU in a fresh interpreter), also in a collector node or a
collector's driver, which need neither Lightning nor the learner.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable


def lazy(namespace: dict, homes: dict[str, str]) -> tuple[Callable, Callable]:
    """``(__getattr__, __dir__)`` for the package whose ``globals()`` is ``namespace``: each name of ``homes``
    (name -> submodule) is imported from its submodule when first asked for, and a submodule's name gives the
    submodule, as after its import."""
    package = namespace["__name__"]
    submodules = {info.name for info in pkgutil.iter_modules(namespace["__path__"])}

    def __getattr__(name: str):
        if name in homes:
            value = getattr(importlib.import_module(f"{package}.{homes[name]}"), name)
            namespace[name] = value
            return value
        if name in submodules:
            return importlib.import_module(f"{package}.{name}")
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted({*namespace, *homes, *submodules})

    return __getattr__, __dir__
