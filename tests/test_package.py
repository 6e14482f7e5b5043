"""The package's top level: every public name is there, imported on first use, so a process that needs only
part of the package (a collector node, a collector's driver) does not import Lightning."""

from __future__ import annotations

import subprocess
import sys

import fabric_learner


def test_every_public_name_resolves_to_the_object_its_module_defines_and_dir_lists_it():
    import importlib

    for name in fabric_learner.__all__:
        home = importlib.import_module(f"fabric_learner.{fabric_learner._HOMES[name]}")
        assert getattr(fabric_learner, name) is getattr(home, name), name
    assert set(fabric_learner.__all__) == set(fabric_learner._HOMES) and set(fabric_learner.__all__) <= set(dir(fabric_learner))
    assert fabric_learner.llm.loss_count is importlib.import_module("fabric_learner.llm").loss_count  # a submodule
    remote = fabric_learner.remote
    assert remote.learner is importlib.import_module("fabric_learner.remote.learner")
    assert {"RemoteLearner", "learner", "collectors"} <= set(dir(remote)) and "llm" in dir(fabric_learner)
    try:
        fabric_learner.NoSuchName  # noqa: B018
    except AttributeError as err:
        assert "has no attribute 'NoSuchName'" in str(err)
    else:
        raise AssertionError("an unknown name did not raise AttributeError")


def test_a_collector_node_imports_neither_lightning_nor_the_learner():
    code = ("import sys, fabric_learner, fabric_learner.collect, fabric_learner.remote.driver; print(sorted(m for m in "
            "('lightning', 'fabric_learner.fabric', 'fabric_learner.remote.learner') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
