"""What the examples tell a user before and after a run: ``--help`` with defaults, the GRPO reward report.

In this process: each example is imported from its file and asked for ``--help`` (nothing is launched).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import sys

import pytest
from multiproc import ROOT

EXAMPLES = os.path.join(ROOT, "examples")
SCRIPTS = sorted(f for f in os.listdir(EXAMPLES) if f.endswith(".py") and not f.startswith("_"))


def load(name: str):
    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)  # the examples import their sibling _plot.py
    spec = importlib.util.spec_from_file_location(f"example_{name[:-3]}", os.path.join(EXAMPLES, name))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def asked_for_help(name: str, monkeypatch) -> argparse.ArgumentParser:
    """The example's parser, after it answered ``--help`` (and exited 0)."""
    module, seen = load(name), []
    printed = argparse.ArgumentParser.print_help
    monkeypatch.setattr(argparse.ArgumentParser, "print_help", lambda self, file=None: (seen.append(self),
                                                                                        printed(self, file)))
    monkeypatch.setattr(sys, "argv", [name, "--help"])
    with pytest.raises(SystemExit) as done:
        module.parse_args(["--help"]) if hasattr(module, "parse_args") else module.main()
    assert done.value.code == 0 and len(seen) == 1
    return seen[0]


def entries(parser: argparse.ArgumentParser) -> dict[str, tuple[object, str]]:
    """``{option: (its default, its --help entry)}`` for each option that takes a value."""
    formatter = parser._get_formatter()
    return {action.option_strings[-1]: (action.default, " ".join(formatter._format_action(action).split()))
            for action in parser._actions if action.option_strings and action.nargs != 0}


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_option_of_an_example_with_a_default_says_it_in_help(name, capsys, monkeypatch):
    found = entries(asked_for_help(name, monkeypatch))
    assert found, f"{name} has no option that takes a value"
    silent = [option for option, (default, entry) in found.items() if default is not None and "default" not in entry]
    assert not silent, f"{name} --help gives no default for {silent}"
    assert "default" in capsys.readouterr().out


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_option_of_an_example_says_what_it_does_in_plain_text(name, capsys, monkeypatch):
    """--resume and --no-progress had no help text; descriptions taken from docstrings showed reST's ``quotes``."""
    parser = asked_for_help(name, monkeypatch)
    bare = [action.option_strings[-1] for action in parser._actions
            if action.option_strings and not (action.help or "").strip()]
    assert not bare, f"{name} --help says nothing about {bare}"
    shown = capsys.readouterr().out
    assert "``" not in shown, shown


def test_the_cli_module_run_as_a_program_shows_its_options_and_what_they_give():
    """``python -m fabric_learner.cli --help`` printed nothing and exited 0."""
    import subprocess

    shown = subprocess.run([sys.executable, "-m", "fabric_learner.cli", "--help"], capture_output=True, text=True,
                           timeout=120)
    assert shown.returncode == 0 and shown.stdout.startswith("usage: python -m fabric_learner.cli"), shown
    for option in ("--accelerator", "--strategy", "--devices", "--num-nodes", "--precision", "add_launch_arguments"):
        assert option in shown.stdout, shown.stdout


def test_the_cli_module_prints_the_learner_arguments_of_the_options_given(capsys):
    from fabric_learner.cli import main

    main(["--strategy", "fsdp", "--devices", "2"])  # plain python here: FabricLearner's defaults for the rest
    assert capsys.readouterr().out.strip() == str({"accelerator": "auto", "strategy": "fsdp", "devices": 2,
                                                   "num_nodes": 1, "precision": "32-true"})


def test_grpo_countdowns_help_gives_the_values_it_runs_with(monkeypatch):
    found = entries(asked_for_help("grpo_countdown.py", monkeypatch))
    assert "(default: 100)" in found["--steps"][1] and "default: 16" in found["--max-new-tokens"][1]
    assert "(default fsdp)" in found["--strategy"][1] and "(default 2)" in found["--devices"][1]
    assert "default" not in found["--model"][1]  # None: no model folder unless given


@pytest.mark.parametrize("steps,report", [
    (1, "reward 0.000 (one update)"),
    (2, "reward 0.000 -> 1.000 (the first and last updates)"),
    (5, "reward 0.500 -> 3.500 (means of the first and last 2 updates)"),
    (20, "reward 4.500 -> 14.500 (means of the first and last 10 updates)"),
    (30, "reward 4.500 -> 24.500 (means of the first and last 10 updates)"),
])
def test_grpo_countdowns_reward_report_compares_windows_that_never_overlap(steps, report):
    curve = [{"reward": float(i)} for i in range(steps)]
    assert load("grpo_countdown.py").reward_report(curve) == report


class _Parsed(Exception):
    """Raised once an example's parser has parsed its command line: nothing runs past parsing."""


def _doc_commands() -> list[tuple[str, str, list[str]]]:
    """``(page, example, its options)`` for each example command line of the README and docs/."""
    pages = ["README.md"] + sorted(os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs"))
                                   if f.endswith(".md"))
    found = set()
    for page in pages:
        for line in open(os.path.join(ROOT, page)).read().splitlines():
            match = re.search(r"(?:python|torchrun)\b.*?examples/([a-z_]+\.py)((?: [^`#|]*)?)", line)
            if match:
                found.add((page, match.group(1), tuple(match.group(2).split())))
    return sorted((page, script, list(args)) for page, script, args in found)


def test_the_docs_give_command_lines_for_the_mesh_examples():
    scripts = {script for page, script, _ in _doc_commands() if page == os.path.join("docs", "meshes.md")}
    assert scripts == {"ppo_tensor_parallel.py", "grpo_tensor_parallel.py", "ppo_hsdp.py"}, scripts


@pytest.mark.parametrize("page,script,args", _doc_commands(), ids=lambda v: v if isinstance(v, str) else None)
def test_every_example_command_line_in_the_docs_names_an_example_and_options_it_takes(page, script, args,
                                                                                     monkeypatch, capsys):
    assert script in SCRIPTS, f"{page} runs examples/{script}, which does not exist"
    module = load(script)
    parse = argparse.ArgumentParser.parse_args

    def parse_and_stop(self, argv=None, namespace=None):
        parse(self, argv, namespace)
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_and_stop)
    monkeypatch.setattr(sys, "argv", [script, *args])
    with pytest.raises(_Parsed):
        module.parse_args(args) if hasattr(module, "parse_args") else module.main()
