"""Status lines on stderr, each written whole.

Ranks under a launcher share one pipe. ``print`` writes the text and its newline in two calls, each
reaching the pipe at once when stderr is unbuffered (``python -u``, ``PYTHONUNBUFFERED``), so another
rank's line can land between them and two lines become one. One write of a line under the pipe's
atomic size (4 KiB on Linux) is never split.
"""

from __future__ import annotations

import sys


def say(line: str) -> None:
    """Write ``line`` and its newline to stderr in one call, and flush."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
