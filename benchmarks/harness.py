"""The benchmark harness: what the scripts of benchmarks/ share apart from their workloads. Importing it loads only
the standard library, so a worker can load it before it measures its memory."""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import json
import os
import platform
import random
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Iterator, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PACKAGE = os.path.join(ROOT, "fabric_learner")
RESULTS = os.path.join(HERE, "results")


# ---- command line and result files ---------------------------------------------------------------


def parser(doc: str | None, out: str | None = None, **kwargs) -> argparse.ArgumentParser:
    """A script's parser, described by its docstring's first line, with ``--out`` (default ``results/<out>``)."""
    p = argparse.ArgumentParser(description=(doc or "").strip().split("\n")[0], **kwargs)
    p.add_argument("--out", default=os.path.join(RESULTS, out) if out else None, help="the result file")
    return p


def command_line(argv: Sequence[str] | None = None) -> str:
    """This process's command from the repository root: ``python benchmarks/x.py ARGS``."""
    argv = sys.argv if argv is None else argv
    script = os.path.relpath(os.path.abspath(argv[0]), ROOT) if argv else "?"
    return shlex.join(["python", script, *argv[1:]])


def write_result(path: str | os.PathLike, data: dict) -> None:
    """``write_json`` of ``data`` with its ``command``: ``command_line()``, unless ``data`` names one."""
    write_json(path, {"command": command_line(), **data})


def write_json(path: str | os.PathLike, data: Any, *, indent: int | None = 1) -> None:
    """``data`` as JSON at ``path``, whole (written beside it, then renamed onto it), its folder made if missing."""
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(data, f, indent=indent)
    os.replace(path + ".tmp", path)


def read_json(path: str | os.PathLike) -> Any:
    with open(path) as f:
        return json.load(f)


def show(data: Any) -> None:
    print(json.dumps(data, indent=1, default=str), flush=True)


def gathered(result: Any) -> list:
    """Every rank's ``result``, a list by rank (a collective); ``[result]`` without a process group."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return [result]
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, result)
    return every


def write_gathered(path: str | os.PathLike, result: Any) -> None:
    """``gathered(result)``, written by rank 0 (a collective)."""
    import torch.distributed as dist

    every = gathered(result)
    if not dist.is_initialized() or dist.get_rank() == 0:
        write_json(path, every, indent=None)


# ---- process and launches ------------------------------------------------------------------------


def set_one_thread(quiet: bool = False) -> None:
    """One intra-op thread in this process and in any process it starts; ``quiet``: torchrl's and Python's
    warnings off too."""
    import torch

    if quiet:
        import warnings

        os.environ.setdefault("RL_WARNINGS", "False")
        warnings.filterwarnings("ignore")
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


def status_mib(field: str) -> float:
    """``field`` of /proc/self/status in MiB (``VmRSS``, ``VmHWM`` its peak, ``VmSize``, ``VmPeak``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(field)


def peak(baseline_mib: float) -> dict:
    """This rank's peak resident memory over ``baseline_mib`` (its memory before the model)."""
    return {"rank": int(os.environ.get("RANK", 0)), "baseline_mib": baseline_mib,
            "peak_over_baseline_mib": status_mib("VmHWM") - baseline_mib}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# what an enclosing launch (torchrun, ``fabric run``) sets; a child that kept them would join it
LAUNCH_VARIABLES = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR", "LT_CLI_USED",
                    "TORCHELASTIC_RUN_ID")


def torchrun(nproc: int, *argv: str) -> list[str]:
    """The command running ``argv`` (a script and its arguments) as ``nproc`` local ranks under torchrun."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *argv]


def run_bounded(cmd: list[str], timeout_s: float, what: str, *, check: bool = True,
                **extra_env: str) -> subprocess.CompletedProcess:
    """``cmd`` run from the repository root (output in ``stdout``), one thread per process, torchrl's warnings off,
    this checkout first on its path, no variable of an enclosing launch, ``extra_env`` set; its process group is
    killed when it ends. ``RuntimeError`` past ``timeout_s`` or, with ``check``, on failure."""
    path = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, OMP_NUM_THREADS="1", RL_WARNINGS="False", PYTHONPATH=path, **extra_env)
    for key in LAUNCH_VARIABLES:
        env.pop(key, None)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        raise RuntimeError(f"{what} did not finish in {timeout_s}s:\n{log[-3000:]}") from None
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{what} failed (exit {proc.returncode}):\n{log[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, log)


@contextlib.contextmanager
def scratch_path(name: str = "result.json") -> Iterator[str]:
    """A path in a fresh temporary folder, which goes with the block."""
    folder = tempfile.mkdtemp(prefix="fl_bench_")
    try:
        yield os.path.join(folder, name)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def launch(argv: Sequence, *, ranks: int | None = None, timeout_s: float = 600, what: str | None = None,
           **extra_env: str) -> Any:
    """The JSON that ``argv`` (a script and its arguments, ``--out PATH`` appended) writes at ``PATH``, run as one
    process or, given ``ranks``, as that many under torchrun (``run_bounded``)."""
    with scratch_path() as out:
        cmd = [*map(str, argv), "--out", out]
        cmd = [sys.executable, *cmd] if ranks is None else torchrun(ranks, *cmd)
        run_bounded(cmd, timeout_s, what or " ".join(map(str, argv[:3])), **extra_env)
        return read_json(out)


def rotated(kinds: Sequence[str], repeats: int, run: Callable[[str], dict], show: Callable[[dict], str] = str
            ) -> list[dict]:
    """``repeats`` rounds of ``run(kind)`` for every kind, rotated (``rotation``): every run as ``{"kind",
    **run(kind)}`` with its ``seconds`` unless it has its own, printed with ``show``."""
    runs = []
    for rep in range(repeats):
        for kind in rotation(rep, kinds):
            start = time.monotonic()
            runs.append({"kind": kind, **run(kind)})
            runs[-1].setdefault("seconds", time.monotonic() - start)
            print(f"{kind:27s} {show(runs[-1])} ({runs[-1]['seconds']:.0f} s)", flush=True)
    return runs


def peak_launches(kinds: Sequence[str], repeats: int, argv: Callable[[str], list], **launch_kwargs
                  ) -> tuple[list[dict], dict[str, float]]:
    """``rotated`` launches of ``argv(kind)``, whose ranks report ``peak``: every run with its worst rank's peak,
    and each kind's median of it."""
    def one(kind: str) -> dict:
        ranks = launch(argv(kind), what=f"{kind} launch", **launch_kwargs)
        return {"ranks": ranks, "worst_peak_mib": max(r["peak_over_baseline_mib"] for r in ranks)}

    runs = rotated(kinds, repeats, one, lambda r: f"worst-rank peak {r['worst_peak_mib']:8.1f} MiB")
    return runs, {k: statistics.median(r["worst_peak_mib"] for r in runs if r["kind"] == k) for k in kinds}


# ---- provenance ----------------------------------------------------------------------------------


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def git_head(*, short: bool = True) -> str:
    """The commit checked out (abbreviated unless ``short=False``), or "unknown"."""
    return _git("rev-parse", *(["--short"] if short else []), "HEAD") or "unknown"


def git_dirty(*paths: str) -> bool | None:
    """Whether ``paths`` (git pathspecs from the repository root) differ from the commit; ``None`` if unknown."""
    status = _git("status", "--porcelain", "--", *paths)
    return None if status is None else status != ""


def package_sha256() -> str:
    """16 hex digits of a sha256 over every file under fabric_learner/ (but ``__pycache__``) and its path."""
    files = []
    for folder, subfolders, names in os.walk(PACKAGE):
        subfolders[:] = [d for d in subfolders if d != "__pycache__"]
        files += [os.path.relpath(os.path.join(folder, name), PACKAGE).replace(os.sep, "/") for name in names]
    digest = hashlib.sha256()
    for relative in sorted(files):
        with open(os.path.join(PACKAGE, relative), "rb") as f:
            data = f.read()
        digest.update(f"{relative}\0{len(data)}\0".encode())
        digest.update(data)
    return digest.hexdigest()[:16]


def provenance() -> dict[str, Any]:
    """The code a result was measured on: commit, package changed since it (bool or None), package hash."""
    return {"git_head": git_head(), "fabric_learner_dirty": git_dirty("fabric_learner"),
            "fabric_learner_sha256": package_sha256()}


def machine() -> dict[str, Any]:
    """``provenance()`` plus the machine and the library versions."""
    import lightning
    import tensordict
    import torch
    import torchrl

    cpu = platform.processor()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    return {**provenance(), "cpus": os.cpu_count(), "cpu": cpu, "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__, "tensordict": tensordict.__version__,
            "torchrl": torchrl.__version__, "lightning": lightning.__version__}


# ---- stage clock ---------------------------------------------------------------------------------


class StageClock:
    """Time in each named stage, summed over the calls it wraps, on each timer: by default wall seconds in
    ``seconds`` and process CPU seconds in ``cpu`` (dicts stage -> sum); ``calls[stage]``: each call's time on the
    first timer. A stage inside another counts in both. ``origin`` (the timers at a run's start) starts "setup",
    which lasts until a wrapped iterator's first item."""

    def __init__(self, **timers: Callable[[], float]) -> None:
        timers = timers or {"seconds": time.perf_counter, "cpu": time.process_time}
        self._names, self._readers = tuple(timers), tuple(timers.values())
        for name in self._names:
            setattr(self, name, {})
        self.calls: dict[str, list[float]] = {}
        self.origin: tuple[float, ...] | None = None
        self.stage: str | None = None  # the outermost stage running now, for count_calls
        self.python_calls: dict[str, int] | None = None

    def _read(self) -> list[float]:
        return [read() for read in self._readers]

    def _add(self, stage: str, end: Sequence[float], start: Sequence[float]) -> float:
        for name, stop, begin in zip(self._names, end, start):
            sums = getattr(self, name)
            sums[stage] = sums.get(stage, 0) + (stop - begin)
        return end[0] - start[0]

    def count_calls(self) -> None:
        """Counts Python and C function calls per outermost stage from now on (exact, slow); outside every stage,
        "setup" until a setup time is recorded, "rest" after."""
        counts = self.python_calls = {}

        def hook(frame, event, arg):
            if event == "call" or event == "c_call":
                stage = self.stage or ("rest" if "setup" in getattr(self, self._names[0]) else "setup")
                counts[stage] = counts.get(stage, 0) + 1
        sys.setprofile(hook)

    def wrap(self, stage: str, fn: Callable) -> Callable:
        """``fn``, its every call timed into ``stage``."""
        calls = self.calls.setdefault(stage, [])

        def timed(*args, **kwargs):
            outer, self.stage = self.stage, self.stage or stage
            start = self._read()
            try:
                return fn(*args, **kwargs)
            finally:
                calls.append(self._add(stage, self._read(), start))
                self.stage = outer
        return timed

    def wrap_iterator(self, stage: str, make_iterator: Callable[[], Iterator]) -> Callable[[], Iterator]:
        """``make_iterator``, its iterators' every ``next`` timed into ``stage``."""
        def timed_iterator():
            it = make_iterator()
            while True:
                start = self._read()
                if self.origin is not None and "setup" not in getattr(self, self._names[0]):
                    self._add("setup", start, self.origin)
                outer, self.stage = self.stage, self.stage or stage
                try:
                    item = next(it)
                except StopIteration:
                    return
                finally:
                    self._add(stage, self._read(), start)
                    self.stage = outer
                yield item
        return timed_iterator


# ---- verdicts and tables -------------------------------------------------------------------------


def decide(ci: tuple[float, float], goal: float | None, *, at_least: bool = False) -> bool | None:
    """The one rule: ``True`` (met) when the whole interval lies within the goal, ``False`` when it lies wholly
    beyond it, ``None`` (undecided) when it straddles it or there is none. The goal is a ceiling, or with
    ``at_least`` a floor: mirror images, so noise never helps either way; the point estimate never moves it."""
    if goal is None:
        return None
    lo, hi = ci
    if at_least:
        return True if lo >= goal else False if hi < goal else None
    return True if hi <= goal else False if lo > goal else None


def verdict(ci: tuple[float, float], goal: float | None, *, at_least: bool = False) -> str:
    """``decide``'s answer in words: "met", "NOT met", "undecided (...)", or "-" without a goal."""
    if goal is None:
        return "-"
    met = decide(ci, goal, at_least=at_least)
    if met is None:
        return f"undecided (interval {ci[0]:.2f}-{ci[1]:.2f} straddles {goal:.2f})"
    return "met" if met else "NOT met"


def both(first: tuple[float, float], second: tuple[float, float], goal: float, *, at_least: bool = False,
         detail: str = "") -> tuple[bool | None, str]:
    """The verdict when two intervals (wall and CPU time) must both meet ``goal``: ``first``'s when they agree,
    else not met if either is not, undecided otherwise, in words with ``detail``."""
    a, b = decide(first, goal, at_least=at_least), decide(second, goal, at_least=at_least)
    if a is b:
        return a, verdict(first, goal, at_least=at_least)
    met = False if False in (a, b) else None
    return met, ("NOT met" if met is False else "undecided") + detail


def table(head: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A markdown table of ``rows`` under ``head``."""
    lines = [list(map(str, head)), *(list(map(str, r)) for r in rows)]
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    out = ["| " + " | ".join(c.ljust(w) for c, w in zip(line, widths)) + " |" for line in lines]
    return "\n".join([out[0], "|" + "|".join("-" * (w + 2) for w in widths) + "|", *out[1:]])


# ---- memory cap: a model one process cannot train under a cap on its address space, trained sharded ----------


def cap_address_space(baseline_mib: float, n_params: int, copies: float) -> dict[str, float]:
    """Caps this process's address space (``RLIMIT_AS``) at ``baseline_mib`` (``VmSize`` before the model) plus
    ``copies`` fp32 copies of ``n_params`` parameters (0: no cap; under 4, one process cannot hold parameters,
    gradients and Adam's moments); returns the figures a result records."""
    import resource

    copy_mib = n_params * 4 / 2**20
    if copies > 0:
        cap = int((baseline_mib + copies * copy_mib) * 2**20)
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    return {"n_params": n_params, "copy_mib": copy_mib, "cap_over_baseline_mib": copies * copy_mib}


def train_capped(out: str, result: dict, steps: Iterator) -> None:
    """Runs ``steps`` (builds what it trains, then yields each update's loss), recording in ``result`` the updates
    trained, the last loss, the allocation error (or ``None``), the peak address space and resident memory; writes
    it to ``OUT.rankN``. A rank that failed then exits (status 3), after a moment for a peer to write, so that
    torchrun stops the ranks left waiting for it."""
    done = 0
    try:
        for loss in steps:
            done += 1
            result["last_loss"] = loss
        result["error"] = None
    except Exception as err:  # the allocation the cap refuses, perhaps re-raised as another error
        cause = err
        while not isinstance(cause, (RuntimeError, MemoryError)) and cause.__cause__ is not None:
            cause = cause.__cause__
        if not isinstance(cause, (RuntimeError, MemoryError)):
            raise
        result["error"] = f"{type(cause).__name__}: {str(cause)[:300]}"
        if cause is not err:
            result["error"] += f" (raised as {type(err).__name__}: {str(err)[:200]})"
    result.update(trained_updates=done, vmpeak_over_baseline_mib=status_mib("VmPeak") - result["baseline_vmsize_mib"],
                  rss_peak_mib=status_mib("VmHWM"))
    write_json(f"{out}.rank{int(os.environ.get('RANK', 0))}", result, indent=None)
    if result["error"] is not None and int(os.environ.get("WORLD_SIZE", 1)) > 1:
        sys.stdout.flush()
        time.sleep(2)
        os._exit(3)


def launch_capped(kind: str, argv: list[str], ranks: int, timeout_s: float = 600, **extra_env: str) -> dict:
    """Runs ``argv`` (``--out PATH`` appended) as 1 process or ``ranks`` under torchrun, each reporting through
    ``train_capped``; never raises for the worker's failure. ``MALLOC_ARENA_MAX=1``: glibc otherwise reserves
    64 MiB of address space per allocating thread, which counts against ``RLIMIT_AS`` unused."""
    with scratch_path() as out:
        cmd = [*argv, "--out", out]
        cmd = [sys.executable, *cmd] if ranks == 1 else torchrun(ranks, *cmd)
        start = time.monotonic()
        proc = run_bounded(cmd, timeout_s, kind, check=False, **{"MALLOC_ARENA_MAX": "1", **extra_env})
        per_rank = [read_json(f"{out}.rank{r}") for r in range(ranks) if os.path.exists(f"{out}.rank{r}")]
    return {"kind": kind, "returncode": proc.returncode, "seconds": time.monotonic() - start, "ranks": per_rank,
            "expected_ranks": ranks, "output_tail": proc.stdout[-2000:]}


def capped_summary(runs: list[dict], updates: int) -> dict[str, bool]:
    """Prints each launch's ranks; by kind, whether every rank trained all ``updates`` without an error."""
    for r in runs:
        for x in r["ranks"]:
            print(f"{r['kind']:21s} rank {x['rank']}: {x.get('n_params', 0) / 1e6:.1f}M params, cap "
                  f"+{x.get('cap_over_baseline_mib', 0):.0f} MiB, trained {x['trained_updates']}/{updates}, "
                  f"VmPeak +{x['vmpeak_over_baseline_mib']:.0f} MiB, error: {x['error']}")
        if len(r["ranks"]) < r["expected_ranks"]:
            print(f"{r['kind']}: {r['expected_ranks'] - len(r['ranks'])} rank(s) wrote no result (exit "
                  f"{r['returncode']}):\n{r['output_tail']}")
    return {r["kind"]: len(r["ranks"]) == r["expected_ranks"] and all(
        x["error"] is None and x["trained_updates"] == updates for x in r["ranks"]) for r in runs}


# ---- interleaving and intervals ------------------------------------------------------------------


def order_for(rep: int, names: Sequence[str]) -> list[str]:
    """A random order of ``names`` for repetition ``rep``, the same on every rank and run (not rotated: a contender
    always following the same one is biased by its traces in the caches)."""
    return random.Random(rep).sample(list(names), len(names))


def rotation(rep: int, names: Sequence[str]) -> list[str]:
    """``names`` rotated left by ``rep``: for whole launches, where each takes a fixed turn."""
    k = rep % len(names)
    return list(names[k:]) + list(names[:k])


def interleaved(contenders: dict[str, Callable[[int], None]], *, reps: int, inner: int, warmup: int,
                sync: Callable[[], None] | None = None, cpu: dict[str, list[float]] | None = None
                ) -> dict[str, list[float]]:
    """Per-call wall seconds of each contender (``contenders[name](i)`` does the i-th unit of work), ``reps``
    samples each: each repetition runs each once, ``inner`` calls timed together, in ``order_for``'s order, ``sync``
    (a barrier) around each block; ``cpu`` gets the same in process CPU seconds. The garbage collector runs between
    repetitions only, the warm-up's objects frozen out of its scans."""
    names = list(contenders)
    for name in names:
        for i in range(warmup):
            contenders[name](i)
    samples: dict[str, list[float]] = {n: [] for n in names}
    counters = dict.fromkeys(names, warmup)
    was_enabled = gc.isenabled()
    gc.collect()
    gc.freeze()
    try:
        for rep in range(reps):
            gc.collect()
            gc.disable()
            for name in order_for(rep, names):
                fn, i0 = contenders[name], counters[name]
                if sync is not None:
                    sync()
                c0, t0 = time.process_time(), time.perf_counter()
                for i in range(i0, i0 + inner):
                    fn(i)
                if sync is not None:
                    sync()
                t1, c1 = time.perf_counter(), time.process_time()
                samples[name].append((t1 - t0) / inner)
                if cpu is not None:
                    cpu.setdefault(name, []).append((c1 - c0) / inner)
                counters[name] = i0 + inner
            if was_enabled:
                gc.enable()
    finally:
        gc.unfreeze()
        if was_enabled:
            gc.enable()
    return samples


def blocks(step: Callable[[int], Any], count: int, inner: int, sync: Callable[[], None] = lambda: None
           ) -> list[float]:
    """Seconds per call of ``count`` blocks of ``inner`` calls ``step(i)`` (i counting on across blocks), ``sync``
    (a barrier) before and after each block."""
    out = []
    for block in range(count):
        sync()
        start = time.perf_counter()
        for i in range(block * inner, (block + 1) * inner):
            step(i)
        sync()
        out.append((time.perf_counter() - start) / inner)
    return out


INSTANCES = 5  # copies of each contender, taking turns (``rotating``); coprime with the 4 batches


def rotating(build: Callable[[], Any], batches: Sequence[Any], instances: int = INSTANCES) -> Callable[[int], None]:
    """``step(i)``: copy ``i % instances`` of what ``build`` returns updates on ``batches[i % len(batches)]``. Copies
    taking turns average away the 1-3% two identical contenders can differ by for their whole life;
    ``bootstrap_ci(..., copies=...)`` counts them (with ``inner=1``, repetition ``r`` is copy ``r % instances``)."""
    updates = [build().update for _ in range(instances)]
    k = len(batches)
    return lambda i: updates[i % instances](batches[i % k])


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def paired_ratio(num: Sequence[float], den: Sequence[float]) -> float:
    """Median over repetitions of num[r] / den[r]: adjacent blocks, so shared noise cancels."""
    return statistics.median(a / b for a, b in zip(num, den))


def bootstrap_ci(num: Sequence[float], den: Sequence[float], n: int = 2000, seed: int = 0,
                 copies: int = 1) -> tuple[float, float]:
    """95% bootstrap interval of ``paired_ratio``; with ``copies`` (``rotating``) it resamples copies, then
    repetitions within each, so it holds the copy-to-copy spread too."""
    rng = random.Random(seed)
    ratios = [a / b for a, b in zip(num, den, strict=True)]
    groups = [group for group in (ratios[c::copies] for c in range(copies)) if group]
    meds = []
    for _ in range(n):
        drawn = []
        for group in rng.choices(groups, k=len(groups)):
            drawn += rng.choices(group, k=len(group))
        meds.append(statistics.median(drawn))
    meds.sort()
    return meds[int(0.025 * n)], meds[int(0.975 * n) - 1]


def paired(num: Sequence[float], den: Sequence[float], copies: int = 1, **extra) -> dict:
    """``{"ratio": paired_ratio, "ci": bootstrap_ci, **extra}`` of ``num`` over ``den``."""
    return {"ratio": paired_ratio(num, den), "ci": bootstrap_ci(num, den, copies=copies), **extra}


def ratio_of_sums(num: list[list[float]], den: list[list[float]], n: int = 2000,
                  seed: int = 0) -> tuple[float, tuple[float, float]]:
    """sum(num) / sum(den) over every repetition's paired segments, and its 95% bootstrap interval (repetitions,
    then segments in pairs within each: a run keeps its relative speed for its whole life)."""
    import numpy

    rng = numpy.random.default_rng(seed)
    reps = [(numpy.asarray(a), numpy.asarray(b)) for a, b in zip(num, den)]
    boot = numpy.empty(n)
    for i in range(n):
        tops = bottoms = 0.0
        for r in rng.integers(0, len(reps), size=len(reps)):
            a, b = reps[r]
            picks = rng.integers(0, len(a), size=len(a))
            tops += a[picks].sum()
            bottoms += b[picks].sum()
        boot[i] = tops / bottoms
    boot.sort()
    total = sum(a.sum() for a, _ in reps) / sum(b.sum() for _, b in reps)
    return float(total), (float(boot[int(0.025 * n)]), float(boot[int(0.975 * n) - 1]))


def summed_over_ranks(samples: dict[str, list[float]]) -> dict[str, list[float]]:
    """Each block's samples (CPU seconds) summed over the ranks (a collective); ``samples`` without a group."""
    every = gathered(samples)
    return {name: [sum(block) for block in zip(*(rank[name] for rank in every), strict=True)] for name in samples}
