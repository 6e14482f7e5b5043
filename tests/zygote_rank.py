"""The process an outside launcher starts as a rank, whose rank is forked from the test zygote.

``torchrun ... tests/zygote_rank.py SCRIPT ARGS`` with ``FL_ZYGOTE`` (the zygote's socket) in the
environment: this process, which imports nothing heavy, asks tests/zygote.py for one rank running
SCRIPT with this process's environment, output and working folder, passes the signals it gets
on to that rank's process group (torchrun signals its ranks' groups, which reaches what a rank
started: a collector's driver, a resource tracker), and exits as the rank did (the same status,
or the same signal), so the launcher sees its rank start, fail, be killed and be restarted as it
would a fresh interpreter, without the ~5 s of imports each start costs. ``python tests/zygote_rank.py
SCRIPT ARGS`` with ``FL_ZYGOTE_ALONE=1`` is rank 0 of a plain ``python`` run (tests/multiproc.plain_python).
A process the rank left running is killed and named on stderr as ``zygote: left running after the
launch: ...``, which tests/multiproc.run counts.
"""

import json
import os
import signal
import socket
import sys


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:  # the rank and all it started are gone
        pass


def main() -> None:
    conn = socket.socket(socket.AF_UNIX)
    conn.connect(os.environ["FL_ZYGOTE"])
    sys.stdout.flush()
    socket.send_fds(conn, [b"R"], [1, 2])
    request = {"script": sys.argv[1], "args": sys.argv[2:], "env": dict(os.environ), "cwd": os.getcwd()}
    conn.sendall((json.dumps(request) + "\n").encode())
    replies = conn.makefile()
    pid = json.loads(replies.readline())["pid"]
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, lambda sig, frame: _signal_group(pid, sig))
    line = replies.readline()
    if not line:
        sys.exit("zygote_rank: the zygote ended before the rank did")
    reply = json.loads(line)
    for described in reply["leftovers"]:
        print(f"zygote: left running after the launch: {described}", file=sys.stderr, flush=True)
    code = reply["returncode"]
    if code < 0:
        if -code not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


if __name__ == "__main__":
    main()
