"""benchmarks/: one entry lists every benchmark and the results it stores, and every stored result names the command
that rewrites it, a command whose arguments its script still parses. No benchmark runs here: importing a script
starts no work, and only its parser is called."""

from __future__ import annotations

import argparse
import glob
import importlib
import json
import os
import shlex
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")
sys.path.insert(0, BENCH)
SCRIPTS = sorted(os.path.basename(p) for p in glob.glob(os.path.join(BENCH, "*.py")))
# the stored results: not a stopped learning run's checkpoint (learning/partial/), nor results/partial.* (ignored)
RESULTS = sorted(path for path in (os.path.relpath(p, BENCH) for p in glob.glob(
    os.path.join(BENCH, "results", "**", "*.json"), recursive=True))
    if "partial" not in path.split(os.sep) and not path.startswith("results/partial."))


class _Parsed(Exception):
    def __init__(self, namespace):
        self.namespace = namespace


def parsed(script: str, args: list[str], monkeypatch) -> argparse.Namespace:
    """``args`` parsed by ``script``'s parser: its ``parser()``, or else the one its ``main`` builds, stopped as soon
    as it has parsed (benchmarks/remote_learner.py builds its parser inside ``main``)."""
    module = importlib.import_module(script[:-3])
    if hasattr(module, "parser"):
        return module.parser().parse_args(args)
    parse = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, argv=None, namespace=None):
        raise _Parsed(parse(self, argv, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    monkeypatch.setattr(sys, "argv", [script, *args])
    with pytest.raises(_Parsed) as stopped:
        module.main()
    return stopped.value.namespace


@pytest.mark.parametrize("result", RESULTS)
def test_every_stored_result_names_the_command_that_rewrites_it_and_its_script_parses_it(result, monkeypatch):
    data = json.load(open(os.path.join(BENCH, result)))
    commands = [data.get("command"), *data.get("merged_commands", [])]
    assert isinstance(commands[0], str), f"{result} names no command that rewrites it"
    for command in commands:
        python, script, *args = shlex.split(command)
        assert python == "python" and os.path.dirname(script) == "benchmarks", command
        assert os.path.basename(script) in SCRIPTS, f"{result}: {script} is not a benchmark"
        try:
            namespace = parsed(os.path.basename(script), args, monkeypatch)
        except SystemExit:
            pytest.fail(f"{result}: {script} no longer parses {args}")
        # where it writes, named from the repository root, is this file (a report written elsewhere, such as the
        # GPU machine's, names where it ran and was copied in from)
        written = getattr(namespace, "out", None) or getattr(namespace, "report", None)
        if written is not None and not os.path.isabs(written):
            assert os.path.abspath(os.path.join(ROOT, written)) == os.path.join(BENCH, result), (command, result)
        folder = getattr(namespace, "out_dir", None)
        if folder is not None and not os.path.isabs(folder):
            assert os.path.abspath(os.path.join(ROOT, folder)) == os.path.dirname(os.path.join(BENCH, result))


def test_a_command_with_an_argument_its_script_does_not_take_fails_to_parse(monkeypatch):
    with pytest.raises(SystemExit):
        parsed("fsdp.py", ["peak", "--repeats", "2", "--no-such-option"], monkeypatch)
    with pytest.raises(SystemExit):
        parsed("remote_learner.py", ["--workload", "sac"], monkeypatch)
    assert parsed("remote_learner.py", ["--workload", "grpo", "--inner", "2"], monkeypatch).inner == 2


def test_the_entry_lists_every_benchmark_and_every_stored_result_under_the_script_its_command_runs(capsys):
    import run

    listing = run.listing()
    assert set(listing) == set(SCRIPTS) - {"harness.py", "common.py"}
    assert all(entry["what"] for entry in listing.values()), "a benchmark without a docstring's first line"
    listed = {path: script for script, entry in listing.items() for path in entry["results"]}
    assert sorted(listed) == RESULTS
    for path, script in listed.items():
        assert shlex.split(json.load(open(os.path.join(BENCH, path)))["command"])[1] == f"benchmarks/{script}"
    assert listing["run.py"]["results"]["results/latest.json"] == "python benchmarks/run.py"
    assert run.main(["--list"]) == 0
    printed = capsys.readouterr().out
    assert all(f"{script}: " in printed for script in listing) and all(path in printed for path in RESULTS)


def test_a_result_written_through_the_harness_names_the_command_that_wrote_it(tmp_path, monkeypatch):
    import harness

    monkeypatch.setattr(sys, "argv", [os.path.join(BENCH, "fsdp.py"), "peak", "--repeats", "2", "--out", "x y.json"])
    harness.write_result(tmp_path / "r.json", {"ratio": 0.5})
    assert json.load(open(tmp_path / "r.json")) == {
        "command": "python benchmarks/fsdp.py peak --repeats 2 --out 'x y.json'", "ratio": 0.5}
    harness.write_result(tmp_path / "r.json", {"command": "python benchmarks/run.py", "ratio": 0.5})
    assert json.load(open(tmp_path / "r.json"))["command"] == "python benchmarks/run.py"
