"""Ends an embedded Ray runtime's leftover processes within a second of its controller's death.

Run as a script by ``remote._runtime`` (``python -I _watchdog.py RAYLET_PID [PID ...]``), the
controller's child, standard library only. Without it, a controller killed outright (SIGKILL, the
OOM killer) leaves Ray's DashboardAgent and RuntimeEnvAgent (about 190 MB) alive for about a
minute: the raylet and the ranks die with the controller, but the agents, on noticing their
raylet gone, report its death to the GCS, already dead too, and wait out that call's fixed 60 s
timeout before exiting.

Every 0.25 s it checks whether its parent (the controller) is still alive; every second it notes the
raylet's descendants (the agents, the workers) with their start times. Once the parent is gone it
SIGKILLs every process noted (and those given) that still runs with the same start time, then exits.
"""

from __future__ import annotations

import os
import signal
import sys
import time


def _stat(pid: int) -> tuple[int, int] | None:
    """``(parent pid, start time)`` of ``pid`` from /proc, or ``None`` when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), int(fields[19])


def _descendants(root: int) -> dict[int, int]:
    """Every live descendant of ``root``: pid -> start time."""
    children: dict[int, list[int]] = {}
    started: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            stat = _stat(int(name))
            if stat is not None:
                children.setdefault(stat[0], []).append(int(name))
                started[int(name)] = stat[1]
    out, todo = {}, [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in out:
                out[child] = started[child]
                todo.append(child)
    return out


def main(argv: list[str]) -> None:
    parent = os.getppid()
    noted = {pid: stat[1] for pid in map(int, argv) if (stat := _stat(pid)) is not None}
    raylet, last = int(argv[0]), 0.0
    while os.getppid() == parent:
        if time.monotonic() - last > 1.0 and _stat(raylet) is not None:
            noted.update(_descendants(raylet))
            last = time.monotonic()
        time.sleep(0.25)
    for pid, started in noted.items():
        stat = _stat(pid)
        if stat is not None and stat[1] == started:  # the same process, not a new one with a reused pid
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


if __name__ == "__main__":
    main(sys.argv[1:])
