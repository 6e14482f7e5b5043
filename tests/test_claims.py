"""The README's published numbers: honest verdicts, a table no older than the code it times, curves that name
their run."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
# files an update surely runs through: a guard that benchmarks/update_path.py's derivation still finds the step
CORE_OF_THE_STEP = {"fabric_learner/learner.py", "fabric_learner/fabric.py", "fabric_learner/local.py",
                    "fabric_learner/step/carrier.py", "fabric_learner/step/output.py", "fabric_learner/step/stages.py",
                    "fabric_learner/llm/counts.py", "fabric_learner/backends/replicated.py",
                    "fabric_learner/backends/sharded.py", "fabric_learner/sharding/owner.py"}


@pytest.fixture(scope="module")
def update_path() -> list[str]:
    """Every package file an update runs through, found by running updates (benchmarks/update_path.py): a
    benchmark table older than the last change to any of them no longer describes the code it times."""
    from harness import run_bounded

    done = run_bounded([sys.executable, os.path.join(ROOT, "benchmarks", "update_path.py")], 300,
                       "benchmarks/update_path.py")
    files = [line for line in done.stdout.splitlines() if line.startswith("fabric_learner/")]
    assert CORE_OF_THE_STEP <= set(files), (sorted(CORE_OF_THE_STEP - set(files)), done.stdout[-3000:])
    return files


def test_one_rule_decides_met_and_not_met_and_noise_never_helps():
    from harness import decide, verdict

    assert decide((0.95, 1.02), 1.03) is True
    assert decide((1.04, 1.10), 1.03) is False
    assert decide((1.00, 1.06), 1.03) is None and verdict((1.00, 1.06), 1.03).startswith("undecided")
    # mirror images get mirror answers: a wide interval makes a point below the goal as undecided
    # as a point above it
    assert decide((0.98, 1.08), 1.03) is decide((0.98, 1.08), 1.03) is None
    assert decide((1.031, 1.2), 1.03) is False and decide((0.8, 1.03), 1.03) is True
    assert decide((0.5, 2.0), None) is None and verdict((0.5, 2.0), None) == "-"
    # a floor is the mirror image: met only when the whole interval is at or above it
    assert decide((0.97, 1.1), 0.97, at_least=True) is True and decide((0.9, 0.969), 0.97, at_least=True) is False
    assert decide((0.95, 0.99), 0.97, at_least=True) is None


def _git(*args):
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)


def _commit(short: str, what: str) -> str:
    """The full hash of ``short``, which ``what`` names; skips where no full git history is here."""
    if _git("rev-parse", "--git-dir").returncode != 0:
        pytest.skip(f"no git repository here: {what}'s commit cannot be checked")
    if _git("rev-parse", "--is-shallow-repository").stdout.strip() == "true":
        pytest.skip(f"shallow git history: {what}'s commit may lie before the cut")
    found = _git("rev-parse", "--verify", "--quiet", short + "^{commit}")
    assert found.returncode == 0, f"{what} names {short}, which is not in this history"
    return found.stdout.strip()


@pytest.mark.parametrize("page", ["README.md", "docs/performance.md"])
def test_the_published_performance_table_is_no_older_than_the_update_path(page, update_path):
    text = open(os.path.join(ROOT, page)).read()
    section = text[text.index("# Performance"):]
    named = re.search(r"git `([0-9a-f]{7,40})`", section)
    assert named, f"{page}'s Performance section names no commit"
    _assert_not_older_than_the_update_path(named.group(1), f"{page}'s benchmark table", "benchmarks/run.py", update_path)


def _assert_not_older_than_the_update_path(short: str, what: str, script: str, update_path: list[str]) -> None:
    measured = _commit(short, what)
    last = _git("log", "-1", "--format=%H", "--", *update_path).stdout.strip()
    assert last, "git log found no commit touching the update path"
    older = _git("merge-base", "--is-ancestor", last, measured).returncode != 0
    changed = " ".join(_git("diff", "--name-only", last + "^", last, "--", *update_path).stdout.split())
    assert not older, (
        f"{what} was measured at {short}, before the update path last changed ({last[:7]}: {changed}). "
        f"Rerun `python {script}` at HEAD and copy its figures.")


def test_the_published_instruction_counts_are_the_files_and_no_older_than_the_update_path(update_path):
    import json

    from instructions import rows_for

    result = json.load(open(os.path.join(ROOT, "benchmarks", "results", "instructions.json")))
    machine = result["machine"]
    assert machine.get("fabric_learner_dirty") is False, (
        f"counted at {machine.get('git_head')} with fabric_learner/ uncommitted or unknown "
        f"(fabric_learner_dirty={machine.get('fabric_learner_dirty')!r}): "
        "rerun benchmarks/instructions.py on a clean tree")
    rows = {(row["workload"], row["contender"].split(".")[0]): row
            for name, counts in result["per_update"].items() for row in rows_for(name, counts)}
    assert list(rows.values()) == result["rows"], "the stored rows do not follow from the stored counts"
    fabric = [rows[w, "FabricLearner(cpu,1)"] for w in ("ppo", "dqn", "sac")]
    readme = open(os.path.join(ROOT, "README.md")).read()
    published = " / ".join(f"{row['ratio']:.3f}" for row in fabric)
    assert f"| same, instructions (callgrind, `{machine['git_head']}`) | {published} |" in readme, published
    performance = open(os.path.join(ROOT, "docs", "performance.md")).read()
    for row in fabric:
        lo, hi = row["range"]
        assert f"{row['ratio']:.4f} (" in performance and f"{lo:.4f}-{hi:.4f})" in performance, row
    _assert_not_older_than_the_update_path(machine["git_head"], "benchmarks/results/instructions.json",
                                           "benchmarks/instructions.py", update_path)


def _png_text(path) -> dict[str, str]:
    """The text chunks of a PNG file (where matplotlib's ``savefig(metadata=...)`` writes): ``tEXt``
    (Latin-1) and uncompressed ``iTXt`` (UTF-8, what non-Latin-1 text becomes)."""
    import struct

    data, chunks, at = open(path, "rb").read(), {}, 8
    while at < len(data):
        (length,), kind = struct.unpack(">I", data[at:at + 4]), data[at + 4:at + 8]
        body = data[at + 8:at + 8 + length]
        if kind == b"tEXt":
            key, _, value = body.partition(b"\0")
            chunks[key.decode("latin-1")] = value.decode("latin-1")
        elif kind == b"iTXt" and body.partition(b"\0")[2][:1] == b"\0":  # compression flag 0
            key, _, rest = body.partition(b"\0")
            chunks[key.decode("latin-1")] = rest[2:].split(b"\0", 2)[2].decode("utf-8")
        at += 12 + length
    return chunks


@pytest.mark.parametrize("image", ["docs/ppo_pendulum.png", "docs/ppo_mujoco.png"])
def test_a_published_learning_curve_names_the_committed_code_and_the_command_that_drew_it(image):
    text = _png_text(os.path.join(ROOT, image))
    command, source = text.get("Description", ""), text.get("Source", "")
    assert command.startswith("python examples/") and "--plot " + image in command, (image, text)
    docs = open(os.path.join(ROOT, "docs/examples.md")).read()
    assert command in docs, f"docs/examples.md does not give the command {command!r}"
    named = re.fullmatch(r"git ([0-9a-f]{7,40})", source)
    assert named, f"{image} was drawn from {source!r}, not from a clean commit: rerun {command!r} on a clean tree"
    _commit(named.group(1), image)


def _functions(path):
    import ast

    tree = ast.parse(open(os.path.join(ROOT, path)).read())
    return {node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}


def _cited(row):
    """``(file, name)`` for each test or function a claims.md row names in its "backed by" cell.

    ``file.py::name`` names a function of ``tests/file.py`` (or of ``benchmarks/file.py``);
    ``::name`` one of the last file named in the cell; ``name...`` any function starting so.
    """
    cell = row.split("|")[2]
    current = None
    for token in re.findall(r"`([^`]*)`", cell):
        m = re.fullmatch(r"((?:tests/|benchmarks/)?\w+\.py)?(?:::(\w+(?:\.\.\.)?))?", token)
        if not m or not (m.group(1) or m.group(2)):
            continue  # a -k pattern, an option, a JSON file
        if m.group(1):
            current = m.group(1) if "/" in m.group(1) else "tests/" + m.group(1)
        if m.group(2):
            assert current, f"{token} names no file in: {row}"
            yield current, m.group(2)


def test_every_test_the_claims_table_names_exists():
    """docs/claims.md is only worth its rows if the tests it cites are there under those names."""
    rows = [line for line in open(os.path.join(ROOT, "docs", "claims.md")) if line.startswith("| ")
            and not line.startswith("| claim") and "---" not in line]
    cited = [c for row in rows for c in _cited(row)]
    assert len(cited) > 40, cited  # the parser found the table
    missing = []
    for path, name in cited:
        names = _functions(path)
        if not (any(n.startswith(name[:-3]) for n in names) if name.endswith("...") else name in names):
            missing.append(f"{path}::{name}")
    assert not missing, f"docs/claims.md cites tests that do not exist: {missing}"


def test_the_tampering_counts_checkpoints_md_quotes_are_the_cases_tested():
    import tamper

    text = open(os.path.join(ROOT, "docs", "checkpoints.md")).read()
    quoted = re.search(r"one process: (\d+) damaged sharded folders, (\d+) damaged\s+files of each single-file kind, "
                       r"(\d+) damaged trainer folders", text)
    assert quoted, "docs/checkpoints.md no longer quotes the tampering counts this test checks"
    assert tuple(map(int, quoted.groups())) == (len(tamper.SHARDED), len(tamper.FILE), len(tamper.TRAINER))
