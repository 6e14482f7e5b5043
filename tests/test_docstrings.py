"""Every exported function and class carries Examples, and the Examples run (doctests, one CPU process).

The objects come from ``__all__``: the package's and that of every public module (no part of its
name starts with ``_``), plus the ``Learner`` methods users call. So a name that is exported without
an example fails here instead of being skipped. Constants (``CHECKPOINT_FORMAT``) are exempt by
type; an object exported from several modules is tested once, under the first name found. Each
example runs in an empty namespace, as a user pasting it would: it imports what it uses.
``SHOWN_ONLY`` lists the examples that need more than a test may start (a Hydra app): they must
parse, and are not run.
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil
import sys

import pytest

import fabric_learner
from fabric_learner import Learner

LEARNER_METHODS = {f"fabric_learner.Learner.{m}": getattr(Learner, m)
                   for m in ("update", "get_weights", "checkpoint", "save", "load")}
SHOWN_ONLY = {"fabric_learner.configs.instantiate_trainer"}  # decorates a Hydra main


def _raise(name):
    raise ImportError(f"cannot import {name} while listing the public modules")


def public_modules() -> list:
    """``fabric_learner`` and every submodule no part of whose name starts with ``_``, in walk order."""
    names = [info.name for info in pkgutil.walk_packages(fabric_learner.__path__, "fabric_learner.", onerror=_raise)
             if not any(part.startswith("_") for part in info.name.split("."))]
    return [fabric_learner] + [importlib.import_module(name) for name in names]


def public_objects() -> dict[str, object]:
    """Each exported function or class once, by its first public name, then the Learner methods."""
    found, seen = {}, set()
    for module in public_modules():
        for name in getattr(module, "__all__", ()):
            obj = getattr(module, name)
            if not callable(obj) or id(obj) in seen:  # constants carry no example
                continue
            seen.add(id(obj))
            found[f"{module.__name__}.{name}"] = obj
    return {**found, **LEARNER_METHODS}


PUBLIC = public_objects()


def _examples(name, obj) -> doctest.DocTest:
    module = sys.modules[obj.__module__]
    tests = doctest.DocTestFinder(recurse=False).find(obj, name, module=module, globs={})
    assert len(tests) == 1 and tests[0].examples, f"{name} has no Examples in its docstring"
    return tests[0]


def test_the_public_modules_are_found():
    names = {module.__name__ for module in public_modules()}
    for expected in ("fabric_learner.collectives", "fabric_learner.sharding", "fabric_learner.testing",
                     "fabric_learner.trainer.hooks", "fabric_learner.trainer.logging"):
        assert expected in names
    assert not any("._" in name for name in names)
    assert SHOWN_ONLY <= set(PUBLIC), "SHOWN_ONLY names an object that is no longer exported"


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_the_example_runs(name):
    obj = PUBLIC[name]
    assert "Examples:" in (obj.__doc__ or ""), f"{name}'s docstring has no Examples section"
    test = _examples(name, obj)
    if name in SHOWN_ONLY:
        return
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    failures = []
    result = runner.run(test, out=failures.append)
    assert result.failed == 0, "".join(failures)
    assert result.attempted > 0, f"{name}'s examples are all skipped"
