"""``python -m fabric_learner.collect --connect HOST:PORT``: a collector process for a run's learner ranks.

The command's public face; the process itself (finding the run, supervising its collector node) is
``fabric_learner.remote.supervisor``. ``serve`` and ``main`` are importable from here as before.
"""

from __future__ import annotations

import sys

from fabric_learner.remote.supervisor import main, serve  # noqa: F401

if __name__ == "__main__":
    sys.exit(main())
