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
    assert os.path.getsize(os.path.join(ROOT, "README.md")) <= 10_500
