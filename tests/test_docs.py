"""The README and docs/ pages point at files that exist, and cite nothing outside the repository."""

from __future__ import annotations

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md"] + sorted(os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md"))


@pytest.mark.parametrize("page", PAGES)
def test_every_relative_link_leads_to_a_file_of_the_repository(page):
    text = open(os.path.join(ROOT, page)).read()
    missing = []
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if re.match(r"[a-z]+://", target):
            continue
        path = os.path.normpath(os.path.join(ROOT, os.path.dirname(page), target))
        if not path.startswith(ROOT + os.sep) or not os.path.exists(path):
            missing.append(target)
    assert not missing, f"{page} links to {missing}, which are not files of this repository"


@pytest.mark.parametrize("page", PAGES)
def test_no_page_cites_files_its_readers_do_not_have(page):
    text = open(os.path.join(ROOT, page)).read()
    assert "shared/" not in text and "CONTRACT.md" not in text and "FINDINGS" not in text, page


def test_the_readme_stays_a_newcomers_page():
    # 10,500 until the quick start became a script that runs as written (#39): about 700 bytes more;
    # #57 links RemoteLearner's page from the documentation list: about 100 more
    assert os.path.getsize(os.path.join(ROOT, "README.md")) <= 11_600


def _readme_blocks():
    text = open(os.path.join(ROOT, "README.md")).read()
    return text, re.findall(r"```python\n(.*?)```", text, re.S)


def test_the_readme_quick_start_runs_as_written(tmp_path, monkeypatch):
    text, _ = _readme_blocks()
    quick = re.search(r"```python\n(.*?)```", text[text.index("## Quick start"):], re.S).group(1)
    import torch

    monkeypatch.chdir(tmp_path)  # it saves ckpt.pt in the working directory
    scope = {"__name__": "readme_quick_start"}
    exec(compile(quick, "README.md (quick start)", "exec"), scope)
    learner, loss = scope["learner"], scope["loss"]
    assert learner.num_updates == len(scope["data"]) and (tmp_path / "ckpt.pt").is_file()
    weights = {".".join(k): v for k, v in scope["weights"].items(True, True)}
    assert weights.keys() == dict(loss.named_parameters()).keys()
    assert all(torch.equal(v, dict(loss.named_parameters())[k]) for k, v in weights.items())


def test_no_comment_in_the_readmes_code_breaks_off_into_the_next_lines_comment():
    """The quick start read "...; under FSDP every" on one code line and "rank calls these three, ..." on the next."""
    dangling = {"every", "the", "a", "an", "and", "or", "of", "to", "with", "for", "under", "as", "is", "by", "in", "on"}
    for block in _readme_blocks()[1]:
        lines = block.splitlines()
        for line, following in zip(lines, lines[1:]):
            (code, _, comment), (next_code, _, next_comment) = line.partition("  # "), following.partition("  # ")
            if code.strip() and next_code.strip() and comment.strip() and next_comment.strip():
                assert comment.split()[-1].lower() not in dangling, f"{line}\n{following}"


def test_every_class_the_readme_names_in_code_is_imported_there():
    """A newcomer copying a README snippet finds where each class comes from in that snippet or an earlier one."""
    import ast

    imported, missing = set(), []
    for block in _readme_blocks()[1]:
        tree = ast.parse(block)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                imported.update((a.asname or a.name).split(".")[0] for a in node.names)
        used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id[:1].isupper()}
        missing += sorted(used - imported)
    assert not missing, f"README code uses {missing} without importing them"


def test_the_readme_trainer_example_runs_as_written_under_ddp_and_fsdp(tmp_path):
    """Its order (the learner, then SoftUpdate on its loss) works under both: ranks end in step, the targets
    were updated and the checkpoint folder written (tests/workers/readme_trainer.py, one launch)."""
    import torch
    from multiproc import WORKERS, launch

    proc = launch(os.path.join(WORKERS, "readme_trainer.py"), tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout[-6000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    for strategy in ("ddp", "fsdp"):
        a, b = ranks[0][strategy], ranks[1][strategy]
        assert a["sharded"] == (strategy == "fsdp")
        assert a["frames"] == b["frames"] == 256 and a["num_updates"] == b["num_updates"] == 2 * 8
        assert a["targets_moved"] and b["targets_moved"]
        for key, value in a["weights"].items():
            assert torch.equal(value, b["weights"][key]), (strategy, key)
        assert (tmp_path / f"{strategy}_ckpt" / "meta.json").exists()
