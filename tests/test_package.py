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


def _documented_imports() -> list[tuple[str, str, list[str]]]:
    """``(page, module, names)`` for each ``from fabric_learner... import ...`` and ``import fabric_learner...`` in
    the code blocks of README.md and docs/*.md (a doctest's ``>>>`` lines included)."""
    import glob
    import os
    import re

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    fence = re.compile(r"```[^\n]*\n(.*?)```", re.S)
    line = re.compile(r"^[ \t]*(?:>>> |\.\.\. )?(?:from (fabric_learner[\w.]*) import (\([^)]*\)|[^\n#]*)"
                      r"|import (fabric_learner[\w.]*))", re.M)
    found = []
    for path in [os.path.join(root, "README.md"), *sorted(glob.glob(os.path.join(root, "docs", "*.md")))]:
        with open(path, encoding="utf-8") as f:
            blocks = fence.findall(f.read())
        for block in blocks:
            for m in line.finditer(block):
                names = [n.split(" as ")[0].strip() for n in (m.group(2) or "").strip("() \n").split(",")]
                found.append((os.path.relpath(path, root), m.group(1) or m.group(3), [n for n in names if n]))
    return found


def _dotted_references() -> list[tuple[str, str]]:
    """``(page, dotted)`` for each ``fabric_learner.a.b`` the README and docs name in code (inline or in a block)."""
    import glob
    import os
    import re

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    found = []
    for path in [os.path.join(root, "README.md"), *sorted(glob.glob(os.path.join(root, "docs", "*.md")))]:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        found += [(os.path.relpath(path, root), d) for d in sorted(set(re.findall(r"`(fabric_learner(?:\.\w+)+)", text)))]
    return found


def test_every_import_and_name_the_readme_and_docs_show_works():
    """A user's code copied from the pages keeps working whatever room the code behind a name moves to."""
    import importlib

    shown = _documented_imports()
    assert len(shown) >= 15 and any(module == "fabric_learner.cli" for _, module, _ in shown), shown
    for page, module, names in shown:
        imported = importlib.import_module(module)
        for name in names:
            assert hasattr(imported, name), f"{page}: from {module} import {name} fails"
    for page, dotted in _dotted_references():
        parts = dotted.split(".")
        obj, i = None, len(parts)
        while obj is None:
            try:
                obj = importlib.import_module(".".join(parts[:i]))
            except ModuleNotFoundError:
                i -= 1
        for part in parts[i:]:
            assert hasattr(obj, part), f"{page} names {dotted}, which does not resolve"
            obj = getattr(obj, part)
