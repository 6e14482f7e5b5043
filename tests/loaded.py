"""Run a command with busy processes beside it: the suite on a machine that is not quiet (``make test-loaded``).

Usage: python tests/loaded.py [--busy N] [--times K] -- COMMAND ...

Starts ``N`` processes (default 2) that each spin on one core for as long as the command runs, runs the command
``K`` times in a row (default 1, stopping at the first failure), then stops them, whatever happened. Prints each
run's wall time and exit status; exits with the first failing run's status, else 0.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import subprocess
import sys
import time


def _spin() -> None:
    while True:
        pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--busy", type=int, default=2, help="busy processes beside the command (default 2)")
    parser.add_argument("--times", type=int, default=1, help="runs of the command in a row (default 1)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --, for example: -- make test")
    busy = [mp.get_context("spawn").Process(target=_spin, daemon=True) for _ in range(args.busy)]
    for p in busy:
        p.start()
    try:
        for i in range(args.times):
            start = time.monotonic()
            code = subprocess.call(command)
            print(f"[loaded] run {i + 1} of {args.times} with {args.busy} busy processes: exit {code} in "
                  f"{time.monotonic() - start:.0f} s", flush=True)
            if code:
                return code
        return 0
    finally:
        for p in busy:
            p.kill()
            p.join(5)


if __name__ == "__main__":
    sys.exit(main())
