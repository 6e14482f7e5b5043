"""The examples' ``--plot``: a learning curve that names the command and the commit that drew it.

The figure's footnote and its PNG text chunks (``Source``, ``Description``) carry ``git <commit>``
(``+dirty`` for uncommitted changes outside docs/, where the curves go) and the command line, so a
published curve can be traced to the code and the run behind it (``tests/test_claims.py`` reads
them). Needs matplotlib (``pip install -e ".[bench]"``).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time


def provenance() -> tuple[str, str]:
    """``("git <short commit>[+dirty]", "<the command line>")`` for the running example."""
    here = os.path.dirname(os.path.abspath(__file__))

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=here, capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = "+dirty" if git("status", "--porcelain", "--untracked-files=no", "--", ":/", ":(top,exclude)docs") else ""
    script = os.path.relpath(os.path.abspath(sys.argv[0]), os.path.dirname(here))
    return f"git {commit}{dirty}", shlex.join(["python", script, *sys.argv[1:]])


def learning_curve(curve, path: str, *, title: str, xlabel: str, ylabel: str) -> None:
    """Write ``curve`` (``(frames, episode return, ...)`` points) to the PNG ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    source, command = provenance()
    frames, returns = [p[0] for p in curve], [p[1] for p in curve]
    fig, ax = plt.subplots(figsize=(6, 3.8))
    ax.plot(frames, returns, marker=".")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.text(0.01, 0.01, f"{command}  ({source}, {time.strftime('%Y-%m-%d')})", fontsize=6, color="0.4")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110, metadata={"Source": source, "Description": command})
    plt.close(fig)
