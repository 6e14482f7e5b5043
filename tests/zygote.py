"""A process that imports torch, lightning, torchrl and fabric_learner once and forks the ranks
of each multi-rank check from there.

Under plain ``python`` a 2-rank check pays the ~4 s import twice in a row (rank 0 imports, then
the learner starts rank 1, which imports again); forked from here, both ranks start at once with
everything imported. The ranks are still real processes in a real gloo group, with the variables
Fabric gives the ranks it starts itself (LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so
Fabric creates no process; the launchers themselves are tested by launches of their own
(tests/test_launch.py, test_launcher_options.py, test_multinode.py, test_elastic.py, ...).

Hazards: a fork copies the forking process's memory, held locks included, but only its calling
thread; it is safe here because this process does no torch work and runs one thread when it
forks, which it checks before it serves anything. Forked ranks share this process's hash seed
and what its imports read from the environment: a launch may not change such a variable
(``_READ_AT_IMPORT``), and numpy's global generator is reseeded in each rank.

Protocol: ``python zygote.py SOCKET``; it prints ``READY`` once imported and listening, and
exits when its standard input closes. Each connection sends one JSON request line (script,
args, env with FL_RUN_ID, nproc, output, timeout) and gets one JSON line back (returncodes,
leftovers, timed_out) once the launch has ended; a manager process forked per connection runs
the ranks, so launches can run concurrently, and ends them if the connection closes first.
A connection that starts with ``R`` and passes two file descriptors (tests/zygote_rank.py, the
rank an outside launcher such as torchrun's elastic agent starts) asks for one rank with exactly
the environment that launcher gave, writing to those descriptors; see :func:`_relay`.
"""

from __future__ import annotations

import json
import os
import runpy
import select
import selectors
import signal
import socket
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_STARTUP_ENV = dict(os.environ)
# variables the imports below read (or that shape the interpreter): a launch may not change them
_READ_AT_IMPORT = ("PYTHON", "OMP_", "MKL_", "TORCH", "CUDA", "RL_WARNINGS")
# ... except those a launcher gives its ranks, which torch and Lightning read when a group starts, and the
# inductor cache folder, which torch writes into a launcher's environment and reads when it compiles
_SET_BY_LAUNCHERS = ("TORCHELASTIC_", "TORCH_NCCL_", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "TORCHINDUCTOR_CACHE_DIR")
_SCRIPT_GLOBALS: dict = {}
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import lightning  # noqa: E402,F401
import numpy  # noqa: E402
import tensordict  # noqa: E402,F401
import torch  # noqa: E402,F401
import torchrl  # noqa: E402,F401
from multiproc import free_port, pids, proc_stat, tagged_pids  # noqa: E402

import fabric_learner  # noqa: E402

for _name in fabric_learner.__all__:  # the package imports its names on first use: all of them, before any fork
    getattr(fabric_learner, _name)


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


class _Rank(BaseException):
    """Unwinds a forked rank out of the server loop before it runs its script."""

    def __init__(self, request, rank, port, output):
        self.request, self.rank, self.port, self.output = request, rank, port, output


def _members(tag: str | None) -> list[int]:
    """The live processes of this launch but this one: those of this session, and those that
    left it (setsid) but carry the launch's tag in the environment they were started with.
    One whose memory is already released (an empty command line) is exiting, not left running."""
    sid = os.getsid(0)
    session = [pid for pid in pids() if (stat := proc_stat(pid)) and int(stat[3]) == sid]
    return [pid for pid in {*session, *(tagged_pids(tag) if tag else ())} if _running(pid)]


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            exiting = not f.read(1)
    except OSError:
        return False
    stat = proc_stat(pid)
    return not exiting and stat is not None and stat[0] not in "ZX"


def _describe(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return f"{pid} (gone)"
    return f"{pid} state {(proc_stat(pid) or ['gone'])[0]}: {cmd}"


def _reap(ranks: dict, status: dict, block: bool) -> None:
    for pid, rank in ranks.items():
        if rank not in status:
            done, raw = os.waitpid(pid, 0 if block else os.WNOHANG)
            if done:
                status[rank] = os.waitstatus_to_exitcode(raw)


def _kill(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _manage(conn: socket.socket) -> None:
    """Run one launch's ranks to their end and answer on ``conn``; a forked rank raises instead.

    The ranks share one pipe for their output, as under a launcher. The launch ends when every
    rank has exited and the pipe is closed; a failed rank, the timeout or the test hanging up
    kills the launch's processes first (as torchrun ends the others when one fails). Whatever
    still runs 2 s after that, or after the last rank exited, is a leftover: counted and killed.
    """
    os.setsid()
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    head, fds, _, _ = socket.recv_fds(conn, 1, 2)
    if head == b"R":
        _relay(conn, fds)
    request = json.loads(head.decode() + conn.makefile().readline())
    nproc, port, tag = request["nproc"], free_port(), request["env"]["FL_RUN_ID"]
    read, write = os.pipe()
    ranks = {}
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            conn.close()
            os.close(read)
            raise _Rank(request, rank, port, write)
        ranks[pid] = rank
    os.close(write)
    status: dict[int, int] = {}  # rank: exit status, in the order the ranks were seen to end
    deadline, ended, timed_out, eof = time.monotonic() + request["timeout"], False, False, False
    with open(request["output"], "wb") as log:
        while not (eof and len(status) == nproc):
            ready = select.select(([] if eof else [read]) + ([] if ended else [conn]), [], [], 0.1)[0]
            if read in ready:
                chunk = os.read(read, 1 << 16)
                eof = not chunk
                log.write(chunk)
            _reap(ranks, status, block=False)
            now = time.monotonic()
            if ended:
                if now > deadline:
                    break
                continue
            failed = conn in ready or any(status.values()) or now > deadline  # conn is readable once closed
            if failed or len(status) == nproc:
                ended, timed_out, deadline = True, now > deadline, now + 2
                if failed:
                    _kill(_members(tag))
    _kill([pid for pid, rank in ranks.items() if rank not in status])
    _reap(ranks, status, block=True)
    described = _ended(_members(tag))  # none survives the reply
    if described:
        with open(request["output"], "a") as log:
            log.write("".join(f"\nzygote: left running after the launch: {d}" for d in described))
    reply = {"returncodes": list(status.values()), "leftovers": len(described), "timed_out": timed_out}
    try:
        conn.sendall((json.dumps(reply) + "\n").encode())
    except OSError:
        pass  # the test is gone
    os._exit(0)


def _ended(pids) -> list[str]:
    """Kill what still runs of ``pids`` and wait (5 s at most) until it is gone; what it was."""
    described = [_describe(pid) for pid in pids]
    _kill(pids)
    gone_by = time.monotonic() + 5
    while any(map(_running, pids)) and time.monotonic() < gone_by:
        time.sleep(0.01)
    return described


def _relay(conn: socket.socket, fds: list[int]) -> None:
    """One rank for an outside launcher, whose process (tests/zygote_rank.py) waits for it.

    The rank gets the launcher's environment as it is (RANK, TORCHELASTIC_RESTART_COUNT, ...) and
    writes to the launcher's process's stdout and stderr (``fds``). This manager answers the
    rank's pid, the leader of its own process group (the launcher's process passes signals on to that
    group), then, once the rank has exited, its status and what it left running outside its group
    (killed; what stayed in the group is killed too, as torchrun's ``killpg`` would, unreported); if
    the launcher's process goes away first, the rank and what it started are killed, as when a
    launcher kills a rank's process group. With ``FL_ZYGOTE_ALONE=1`` the relay is the launch itself
    (``python tests/zygote_rank.py SCRIPT``: rank 0 of a plain ``python`` run, which starts the other
    ranks as fresh interpreters): nothing it left running is ended unreported.
    """
    request = json.loads(conn.makefile().readline())
    pid = os.fork()
    if pid == 0:
        conn.close()
        os.setpgid(0, 0)
        raise _Rank(request, None, None, fds)
    try:  # also here, so that the group exists before its pid is answered
        os.setpgid(pid, pid)
    except (PermissionError, ProcessLookupError):  # the child did it first, or is gone
        pass
    for fd in fds:
        os.close(fd)
    conn.sendall((json.dumps({"pid": pid}) + "\n").encode())
    while not (done := os.waitpid(pid, os.WNOHANG))[0]:
        if select.select([conn], [], [], 0.1)[0]:  # readable once closed: the launcher's process is gone
            _ended(_members(None))
            os.waitpid(pid, 0)
            os._exit(0)
    # torchrun ends each rank's process group once the run ends (``killpg``): what the rank started and left in
    # its group (a driver, a resource tracker) is the launcher's to end, not left running. A rank that is the whole
    # launch (``python SCRIPT``, which starts the other ranks itself: FL_ZYGOTE_ALONE=1) has no launcher after it:
    # whatever it left running is a leftover
    if request["env"].get("FL_ZYGOTE_ALONE") != "1":
        _ended([member for member in _members(None) if (stat := proc_stat(member)) and int(stat[2]) == pid])
    settled_by = time.monotonic() + 2  # what left the group may still be ending
    while _members(None) and time.monotonic() < settled_by:
        time.sleep(0.02)
    leftovers = _ended(_members(None))
    reply = {"returncode": os.waitstatus_to_exitcode(done[1]), "leftovers": leftovers}
    try:
        conn.sendall((json.dumps(reply) + "\n").encode())
    except OSError:
        pass
    os._exit(0)


def _serve(path: str) -> None:
    if _threads() != 1:
        raise SystemExit(f"zygote: {_threads()} threads after the imports; forking would copy a half-held lock")
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    server.listen(16)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # managers are reaped by the kernel
    print("READY", flush=True)
    events = selectors.DefaultSelector()
    events.register(server, selectors.EVENT_READ)
    events.register(sys.stdin, selectors.EVENT_READ)
    while True:
        for key, _ in events.select():
            if key.fileobj is sys.stdin:
                if not sys.stdin.readline():
                    return
                continue
            conn, _ = server.accept()
            if os.fork() == 0:
                events.close()
                server.close()
                _manage(conn)
            conn.close()


def _run_rank(rank: _Rank) -> None:
    request, relayed = rank.request, rank.rank is None
    outputs = rank.output if relayed else [rank.output, rank.output]
    os.dup2(outputs[0], 1)
    os.dup2(outputs[1], 2)
    for fd in set(outputs):
        os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    if relayed:  # as under `python -u`, which launchers run
        sys.stdout.reconfigure(line_buffering=True)
        sys.stderr.reconfigure(line_buffering=True)
    stale = sorted(k for k in {*request["env"], *_STARTUP_ENV} if k.startswith(_READ_AT_IMPORT)
                   and not k.startswith(_SET_BY_LAUNCHERS) and request["env"].get(k) != _STARTUP_ENV.get(k))
    if stale:
        sys.exit(f"zygote: {stale} differ from this zygote's, whose imports already read them: "
                 "launch this script with multiproc.run instead")
    os.environ.clear()
    os.environ.update(request["env"])
    if not relayed:
        n = request["nproc"]
        os.environ.update({"LOCAL_RANK": str(rank.rank), "RANK": str(rank.rank), "NODE_RANK": "0", "GROUP_RANK": "0",
                           "WORLD_SIZE": str(n), "LOCAL_WORLD_SIZE": str(n), "MASTER_ADDR": "127.0.0.1",
                           "MASTER_PORT": str(rank.port)})
    tempfile.tempdir = None  # TMPDIR may differ from the zygote's
    numpy.random.seed()  # from the OS, as at a fresh import (CPython reseeds `random` after a fork itself)
    os.chdir(request.get("cwd", ROOT))
    sys.argv = [request["script"], *request["args"]]
    sys.path.insert(0, os.path.dirname(os.path.abspath(request["script"])))  # as `python script` puts it
    # kept, as a script's globals live until after its exit handlers
    _SCRIPT_GLOBALS.update(runpy.run_path(request["script"], run_name="__main__"))


if __name__ == "__main__":
    forked = None
    try:
        _serve(sys.argv[1])
    except _Rank as rank:
        forked = rank
    if forked is not None:
        _run_rank(forked)
