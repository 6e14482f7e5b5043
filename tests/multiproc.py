"""Running multi-rank programs from tests: bounded in time, nothing left behind."""

from __future__ import annotations

import atexit
import functools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKERS = os.path.join(ROOT, "tests", "workers")


# Libraries write variables into os.environ mid-session: torch TORCHINDUCTOR_CACHE_DIR the first time this process
# compiles, Ray PYTHONBREAKPOINT when a test starts a runtime. A launch after that would hand them to ranks forked from
# a zygote that started without them (which refuses them): launches get the session's own values
_SET_BY_LIBRARIES = {key: os.environ.get(key) for key in ("TORCHINDUCTOR_CACHE_DIR", "PYTHONBREAKPOINT")}


def env(**extra):
    e = dict(os.environ)
    for key, value in _SET_BY_LIBRARIES.items():
        if value is None:
            e.pop(key, None)
        else:
            e[key] = value
    # this checkout first, then what the caller's path held (the GPU machine's --target folder of wheels)
    path = os.pathsep.join(filter(None, [extra.pop("PYTHONPATH", ROOT), os.environ.get("PYTHONPATH")]))
    e.update({"OMP_NUM_THREADS": "1", "RL_WARNINGS": "False", "PYTHONPATH": path, **extra})
    for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR", "LT_CLI_USED", "TORCHELASTIC_RUN_ID",
                "TORCHELASTIC_USE_AGENT_STORE",
                "LT_STRATEGY", "LT_DEVICES", "LT_ACCELERATOR", "LT_PRECISION", "LT_NUM_NODES"):
        e.pop(key, None)
    return e


class Finished(subprocess.CompletedProcess):
    """A finished run; ``leftovers`` counts processes of the run still alive when it ended."""

    leftovers: int = 0
    seconds: float = 0.0
    tag: str = ""  # FL_RUN_ID in the run's environment


def run(cmd, timeout=300, **extra) -> Finished:
    """Run ``cmd`` in its own session, tagged so every descendant can be found and killed.

    On timeout the test fails with the output so far; either way no process of the run
    survives this call.
    """
    tag = uuid.uuid4().hex
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env(FL_RUN_ID=tag, **extra), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tagged(tag)
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            out = "<output unavailable>"
        raise AssertionError(f"{cmd} did not finish within {timeout}s:\n{out[-4000:]}") from None
    result = Finished(cmd, proc.returncode, out, None)
    result.seconds = time.monotonic() - start
    result.leftovers = kill_tagged(tag) + out.count(LEFT_RUNNING)  # the latter: by ranks a relay ran
    return result


RELAY = os.path.join(ROOT, "tests", "zygote_rank.py")
LEFT_RUNNING = "zygote: left running after the launch"


def forked_ranks(alone: bool = False) -> dict:
    """The variables that let a launcher's ranks be forked from this session's zygote: the launcher
    starts ``RELAY SCRIPT ARGS`` (tests/zygote_rank.py) as its rank instead of ``SCRIPT ARGS``. For
    checks of what a launcher does with its ranks (restarts, rendezvous) rather than of how a fresh
    interpreter starts and ends. ``alone``: the relay is the launch itself, ``python RELAY SCRIPT``
    (see :func:`plain_python`), and whatever the rank leaves running counts as left running."""
    return {"FL_ZYGOTE": _zygote(), **({"FL_ZYGOTE_ALONE": "1"} if alone else {})}


def plain_python(script, *args, timeout=300, **extra) -> Finished:
    """``python SCRIPT ARGS`` as a user runs it, the learner starting the other ranks itself (fresh
    interpreters, as Lightning starts them), with rank 0 forked from the zygote through the relay: its
    imports done, so the run starts ~5 s sooner and costs one import less. For checks of the plain
    launcher's behaviour rather than of how rank 0's interpreter starts; every process it leaves
    running is counted, as :func:`run` counts them."""
    return run(python(RELAY, script, *args), timeout=timeout, **extra, **forked_ranks(alone=True))


def launch(script, *args, nproc=2, timeout=300, **extra) -> Finished:
    """Run ``script`` on ``nproc`` ranks forked from tests/zygote.py, for checks of what ranks compute.

    The ranks get the variables Fabric gives the ranks it starts itself (LOCAL_RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT; the learner sees the plain ``python`` launcher) and start at once,
    their imports done. They share the zygote's hash seed and whatever its imports read from the
    environment (a launch that changes such a variable fails, naming it). Checks of a launcher
    (plain python, torchrun, ``fabric run``) launch it with :func:`run`. ``returncode`` is the
    status of the first rank seen to fail (0 when none did); one failed rank ends the others, as
    under torchrun. On timeout the test fails with the output so far.
    """
    args = [str(a) for a in args]
    cmd = ["zygote", script, *args]
    with tempfile.NamedTemporaryFile("r", prefix="launch-", suffix=".log") as log:
        tag = uuid.uuid4().hex
        request = {"script": script, "args": args, "env": env(FL_RUN_ID=tag, **extra), "nproc": nproc,
                   "output": log.name, "timeout": timeout}
        start = time.monotonic()
        with socket.socket(socket.AF_UNIX) as conn:
            conn.settimeout(timeout + 60)
            conn.connect(_zygote())
            conn.sendall((json.dumps(request) + "\n").encode())
            reply = json.loads(conn.makefile().readline())
        out = log.read()
    if reply["timed_out"]:
        raise AssertionError(f"{cmd} did not finish within {timeout}s:\n{out[-4000:]}")
    result = Finished(cmd, next((c for c in reply["returncodes"] if c != 0), 0), out, None)
    result.seconds = time.monotonic() - start
    result.leftovers, result.tag = reply["leftovers"], tag
    return result


def _zygote() -> str:
    """The socket of this test session's zygote, started on first use; it ends with the session.
    Side-by-side runs ask for it at once from several threads: one starts it, the others wait for it."""
    with _ZYGOTE_LOCK:
        return _start_zygote()


_ZYGOTE_LOCK = threading.Lock()


@functools.cache
def _start_zygote() -> str:
    path = os.path.join(tempfile.mkdtemp(prefix="zygote-"), "socket")
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "zygote.py"), path], cwd=ROOT, env=env(),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True)
    line = proc.stdout.readline()
    if line.strip() != "READY":
        proc.kill()
        raise AssertionError(f"the test zygote did not start: {line}{proc.stdout.read()[-4000:]}")
    atexit.register(_end_zygote, proc, os.path.dirname(path))
    return path


def _end_zygote(proc, folder: str) -> None:
    proc.stdin.close()  # it exits when its standard input closes
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
    shutil.rmtree(folder, ignore_errors=True)


def side_by_side(cases: list, start, at_once: int = 2) -> dict:
    """``{case: start(case)}`` with ``at_once`` runs at a time (they overlap their start-up and their
    waits); a run that raised is kept as its exception, for :func:`finished` to raise in that case's test."""
    def one(case):
        try:
            return start(case)
        except Exception as failure:  # noqa: BLE001 (any failure is that case's own, raised in its test)
            return failure

    with ThreadPoolExecutor(max_workers=at_once) as pool:
        return dict(zip(cases, pool.map(one, cases)))


def finished(result):
    if isinstance(result, Exception):
        raise result
    return result


def child_pids() -> set[int]:
    """This process's live child processes."""
    return {pid for pid in pids() if (stat := proc_stat(pid)) and int(stat[1]) == os.getpid()}


def pids() -> list[int]:
    """Every other process's id."""
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit() and int(entry) != os.getpid()]


def proc_stat(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields after the command name (state, ppid, pgrp, session, ...); None once gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def tagged_pids(tag: str) -> list[int]:
    needle = f"FL_RUN_ID={tag}".encode()
    found = []
    for pid in pids():
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(pid)
        except OSError:
            continue
    return found


def kill_tagged(tag: str) -> int:
    """SIGKILL every live process of the run; the number found."""
    pids = [p for p in tagged_pids(tag) if not _is_zombie(p)]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return len(pids)


def _is_zombie(pid: int) -> bool:
    stat = proc_stat(pid)
    return stat is None or stat[0] == "Z"


def python(*args):
    return [sys.executable, *args]


def torchrun(*args, nproc=2):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]


def fabric_run(*args, devices=2, strategy="ddp"):
    """``fabric run`` on a port free now (its default, 29400, collides between concurrent runs)."""
    fabric = os.path.join(os.path.dirname(sys.executable), "fabric")
    return [fabric, "run", "--accelerator=cpu", f"--strategy={strategy}", f"--devices={devices}",
            f"--main-port={free_port()}", *args]


def _unleased_ports() -> list[int]:
    """Ports 20000-65535 outside the kernel's ephemeral range (Linux: 32768-60999) and Ray's worker ports (<20000)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = map(int, f.read().split())
    except OSError:
        low, high = 32768, 60999
    return [port for port in range(20000, 65536) if not low <= port <= high]


_PORTS, _PORT_COUNTER = _unleased_ports(), os.path.join(tempfile.gettempdir(), f"fabric-learner-test-ports-{os.getuid()}")


def free_port() -> int:
    """A port for a server a test starts later (a store, a launcher's rendezvous), free now and handed out once.

    A port that ``bind(0)`` picks comes from the ephemeral range, the range every outgoing connection's
    source port is drawn from too: between this pick and the server's bind, any process's client could take
    it (EADDRINUSE on CI, a test's setup lost). These come from outside that range, in turn from one counter
    that every test process of this user shares (a locked file), so two picks, however concurrent, differ
    (until the counter comes round again, some 17,000 picks later).
    """
    import fcntl

    with open(_PORT_COUNTER, "a+") as counter:
        fcntl.flock(counter, fcntl.LOCK_EX)
        counter.seek(0)
        text = counter.read().strip()
        last = int(text) if text.isdigit() else -1
        for step in range(1, len(_PORTS) + 1):
            port = _PORTS[(last + step) % len(_PORTS)]
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind(("", port))  # every address, as the servers bind: held on any of them is held
                except OSError:
                    continue  # held, or in TIME_WAIT
            counter.seek(0)
            counter.truncate()
            counter.write(str((last + step) % len(_PORTS)))
            return port
    raise AssertionError(f"no free port among {len(_PORTS)} outside the ephemeral range (/proc/sys/net/ipv4/"
                         "ip_local_port_range): every one is held, or the range leaves none from 20000 up. Narrow the "
                         "ephemeral range (sysctl net.ipv4.ip_local_port_range='32768 60999').")


def elastic_exit_codes(stdout: str) -> dict[int, int]:
    """``{rank: exit status}`` of every failed rank, from the failure summary that torchrun and
    ``fabric run`` (torch elastic underneath) print when a run fails."""
    found = re.findall(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)", stdout)
    return {int(rank): int(code) for rank, code in found}
