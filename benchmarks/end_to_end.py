"""End to end: the ported PPO MuJoCo recipe (Trainer + learner) against torchrl's recipe loop.

Part 1, one process, interleaved repetitions: frames per second of torchrl's recipe loop
(rewritten in ``tests/test_ppo_recipe.py``, the test that shows both give the same updates)
against the port (``examples/ppo_mujoco.py``) on ``LocalLearner``, on
``FabricLearner(devices=1)`` and on ``FabricLearner(devices=1, compile=True)``. Each run builds
its networks, environments and collector, collects ``--batches`` batches of 2048 frames and
takes the recipe's 10 epochs x 32 minibatch updates per batch; the clock covers all of it.
Goal: the port at least 0.97 of the recipe loop: met when the 95% bootstrap interval of the
per-repetition ratio lies at or above 0.97 (modes run in a random order each repetition, the
garbage collector between runs). The median ``update`` call is reported beside it: ``compile=True`` pays its warm-up (tens of seconds, once) inside a short run's frames/s.

Part 2, the same total frames on 2 DDP ranks and on 1 process (``FabricLearner``), each with a
per-stage profile of rank 0: collection (the collector's iterator), advantage (GAE before each
epoch), update (``learner.update``, gradient sync included) and gradient sync (from each DDP
bucket's all-reduce start to its completion, so it overlaps the backward: an upper bound on
what the sync adds); what remains is the Trainer's own bookkeeping and hooks.

Part "stages" (only when asked): where the one-process gap goes. torchrl's recipe loop and the
port (``LocalLearner``, ``FabricLearner``) run interleaved with the same seeds and the same
instrumentation of the recipe's pieces (``ppo_mujoco``'s collector, GAE and replay buffer, timed
alike on both sides): collection, advantage (the GAE forward), replay (extend and minibatch
sampling), update (the port's ``learner.update``; the loop's loss, backward and Adam steps are
what remains of its total), setup (building networks, env, collector) and the rest (the Trainer's
hooks and bookkeeping). Setup is everything before the first batch is asked for (networks,
environments, collector, learner, trainer). Wall and process CPU seconds per stage, medians over
repetitions.

    python benchmarks/end_to_end.py [--reps 3] [--batches 2]
    python benchmarks/end_to_end.py --part stages --reps 5 --batches 1   # --reps 0: the call counts only

Results: printed, and written to ``benchmarks/results/end_to_end.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "examples"), str(ROOT / "tests")]

import torch  # noqa: E402

import common  # noqa: E402
import ppo_mujoco as recipe  # noqa: E402
from fabric_learner import FabricLearner, LocalLearner  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "end_to_end.json"
GOAL = 0.97  # the port's frames/s at least this share of the recipe loop's (part 1)


class StageClock:
    """Wall (and process CPU) seconds spent in each wrapped call, summed."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.cpu: dict[str, float] = {}
        self.calls: dict[str, list[float]] = {}
        self.origin: tuple[float, float] | None = None  # (wall, cpu) start of a run: "setup" ends at the first batch
        self.stage: str | None = None  # the stage running now, for count_calls
        self.python_calls: dict[str, int] | None = None

    def count_calls(self) -> None:
        """From now on count Python and C function calls per stage (a profile hook: slow, but exact)."""
        self.python_calls = {}
        counts = self.python_calls

        def hook(frame, event, arg):
            if event == "call" or event == "c_call":
                stage = self.stage or ("rest" if "setup" in self.seconds else "setup")
                counts[stage] = counts.get(stage, 0) + 1
        sys.setprofile(hook)

    def _enter(self, name: str):
        outer, self.stage = self.stage, self.stage or name  # nested stages count for the outer one
        return outer

    def _add(self, name: str, wall: float, cpu: float) -> float:
        self.seconds[name] = self.seconds.get(name, 0.0) + wall
        self.cpu[name] = self.cpu.get(name, 0.0) + cpu
        return wall

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            outer = self._enter(name)
            start, cpu = time.perf_counter(), time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                took = self._add(name, time.perf_counter() - start, time.process_time() - cpu)
                self.calls.setdefault(name, []).append(took)
                self.stage = outer
        return timed

    def wrap_iterator(self, name: str, make_iterator):
        def timed_iterator():
            it = make_iterator()
            while True:
                start, cpu = time.perf_counter(), time.process_time()
                if self.origin is not None and "setup" not in self.seconds:
                    self._add("setup", start - self.origin[0], cpu - self.origin[1])
                outer = self._enter(name)
                try:
                    item = next(it)
                except StopIteration:
                    return
                finally:
                    self._add(name, time.perf_counter() - start, time.process_time() - cpu)
                    self.stage = outer
                yield item
        return timed_iterator


def _recipe_args(batches: int, world: int = 1):
    frames = 2048 * batches
    return recipe.parse_args(["--frames", str(frames), "--seed", "0", "--no-progress", "--devices", str(world)])


def run_torchrl_loop(batches: int) -> dict:
    from test_ppo_recipe import original_recipe_loop

    args = _recipe_args(batches)
    n_updates = batches * args.epochs * (args.frames_per_batch // args.minibatch)
    start = time.perf_counter()
    original_recipe_loop(args, n_updates)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "frames": args.frames, "updates": n_updates}


def _sync_clock(learner, clock: StageClock) -> None:
    """Times each DDP bucket's all-reduce, from the hook's call to the future's completion."""
    from torch.nn.parallel import DistributedDataParallel

    ddp = [m for m in learner._backend.module.modules() if isinstance(m, DistributedDataParallel)]
    if not ddp:
        return

    def timed_allreduce(state, bucket):
        start = time.perf_counter()
        tensor = bucket.buffer().div_(torch.distributed.get_world_size())
        fut = torch.distributed.all_reduce(tensor, async_op=True).get_future()

        def done(f):
            clock.seconds["gradient sync"] = clock.seconds.get("gradient sync", 0.0) + time.perf_counter() - start
            return f.value()[0]
        return fut.then(done)

    ddp[0].register_comm_hook(None, timed_allreduce)


def run_port(batches: int, learner_cls, learner_kwargs: dict, world: int = 1) -> dict:
    args = _recipe_args(batches * world, world)
    clock = StageClock()
    start = time.perf_counter()
    learner, trainer, _ = recipe.build(args, learner_kwargs, learner_cls=learner_cls)
    learner.update = clock.wrap("update", learner.update)
    collector = trainer.collector
    collector.iterator = clock.wrap_iterator("collection", collector.iterator)
    _wrap_value_estimator(trainer, clock)
    if world > 1:
        _sync_clock(learner, clock)
    built = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    out = {"seconds": seconds, "setup seconds": built - start, "frames": trainer.collected_frames,
           "updates": learner.num_updates, "stages": clock.seconds, "rank": learner.global_rank,
           # the median update: compile's warm-up (tens of seconds, once) is in the sums, not here
           "update ms (median call)": 1e3 * statistics.median(clock.calls["update"])}
    learner.close()
    return out


def _wrap_value_estimator(trainer, clock: StageClock) -> None:
    from fabric_learner.onpolicy import LearnerValueEstimator

    for hook in trainer._modules.values():
        if isinstance(hook, LearnerValueEstimator):
            hook.value_estimator = clock.wrap("advantage", hook.value_estimator)


def ranks_main(argv) -> None:
    """One launch of part 2: ``--ranks N --batches B --out PATH`` (FabricLearner launches the ranks)."""
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int)
    p.add_argument("--batches", type=int)
    p.add_argument("--out")
    a = p.parse_args(argv)
    kwargs = {"accelerator": "cpu", "devices": a.ranks, "strategy": "ddp" if a.ranks > 1 else "auto"}
    result = run_port(a.batches // a.ranks, FabricLearner, kwargs, world=a.ranks)
    if result["rank"] == 0:
        Path(a.out).write_text(json.dumps(result))


def part_two(batches: int) -> dict:
    out = {}
    for ranks in (1, 2):
        path = RESULTS.with_name(f"end_to_end_ranks{ranks}.tmp.json")
        cmd = [sys.executable, __file__, "--ranks", str(ranks), "--batches", str(batches), "--out", str(path)]
        subprocess.run(cmd, check=True, timeout=1800, env={**os.environ, "OMP_NUM_THREADS": "1"})
        out[ranks] = json.loads(path.read_text())
        path.unlink()
    return out


def main() -> None:
    if "--ranks" in sys.argv:
        ranks_main(sys.argv[1:])
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--batches", type=int, default=2, help="batches of 2048 frames per run (part 1)")
    p.add_argument("--part", choices=["1", "2", "both", "stages"], default="both")
    p.add_argument("--out", default=None, help="results JSON (default benchmarks/results/end_to_end.json; "
                   "--part stages: end_to_end_stages.json)")
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.part == "stages":
        report = {"batches": args.batches, "reps": args.reps, "git": _git_head(), "load": os.getloadavg(),
                  "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), **part_stages(args.reps, args.batches)}
        out = Path(args.out) if args.out else RESULTS.with_name("end_to_end_stages.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1))
        return
    modes = {
        "torchrl recipe loop": lambda: run_torchrl_loop(args.batches),
        "port, LocalLearner": lambda: run_port(args.batches, LocalLearner, {}),
        "port, FabricLearner": lambda: run_port(args.batches, FabricLearner, {"accelerator": "cpu", "devices": 1}),
        "port, FabricLearner compile=True": lambda: run_port(
            args.batches, FabricLearner, {"accelerator": "cpu", "devices": 1, "compile": True}),
    }
    report: dict = {"batches": args.batches, "reps": args.reps, "git": _git_head(),
                    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    if args.part in ("1", "both"):
        runs: dict[str, list] = {name: [] for name in modes}
        for rep in range(args.reps):
            for name in common.order_for(rep, list(modes)):  # every mode once per repetition, in a random order
                gc.collect()
                runs[name].append(modes[name]())
                r = runs[name][-1]
                print(f"rep {rep} {name}: {r['frames'] / r['seconds']:.0f} frames/s ({r['seconds']:.1f} s)", flush=True)
        fps = {name: [r["frames"] / r["seconds"] for r in rs] for name, rs in runs.items()}
        base = fps["torchrl recipe loop"]
        report["part 1"] = {
            name: {"frames/s median": statistics.median(v), "frames/s": v,
                   "ratio to the recipe loop (per repetition)": [x / b for x, b in zip(v, base)],
                   "ratio median": statistics.median([x / b for x, b in zip(v, base)]),
                   "ratio 95% interval": common.bootstrap_ci(v, base),
                   "update ms, median call (median over repetitions)": (statistics.median(
                       [r["update ms (median call)"] for r in runs[name]]) if "stages" in runs[name][0] else None)}
            for name, v in fps.items()}
        print("\npart 1: one process, frames/s (median) and ratio to torchrl's recipe loop (goal >= 0.97)"
              + ("; with under 10 repetitions the interval is close to the range of the ratios" if args.reps < 10 else ""))
        for name, row in report["part 1"].items():
            ms = row["update ms, median call (median over repetitions)"]
            lo, hi = row["ratio 95% interval"]
            # the goal is a floor: met when the whole interval is at or above it (run.decide's rule, mirrored)
            if name != "torchrl recipe loop":
                row["verdict"] = "met" if lo >= GOAL else "NOT met" if hi < GOAL else "undecided"
            print(f"  {name:36s} {row['frames/s median']:7.0f}  ratio {row['ratio median']:.3f} [{lo:.3f}, {hi:.3f}]"
                  + (f"  update {ms:.2f} ms" if ms else "") + ("" if name == "torchrl recipe loop" else f"  {row['verdict']}"))
    if args.part in ("2", "both"):
        two = part_two(2 * args.batches)
        report["part 2"] = two
        print("\npart 2: same total frames, FabricLearner, rank 0's stages (s)")
        for ranks, r in two.items():
            stages = r["stages"]
            other = r["seconds"] - r["setup seconds"] - sum(v for k, v in stages.items() if k != "gradient sync")
            print(f"  {ranks} rank(s): {r['frames'] / r['seconds']:.0f} frames/s, {r['seconds']:.1f} s "
                  f"(setup {r['setup seconds']:.1f}), " + ", ".join(f"{k} {v:.1f}" for k, v in stages.items())
                  + f", other {other:.1f}")
        report["part 2 ratio (2 ranks / 1 process, frames/s)"] = (
            (two[2]["frames"] / two[2]["seconds"]) / (two[1]["frames"] / two[1]["seconds"]))
        print(f"  ratio 2 ranks / 1 process: {report['part 2 ratio (2 ranks / 1 process, frames/s)']:.2f}")
    out = Path(args.out) if args.out else RESULTS
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))


@contextlib.contextmanager
def _instrumented_recipe(clock: StageClock):
    """The recipe's collector, GAE and replay buffer, timed; patched in ``ppo_mujoco``, which both the
    loop (``tests/test_ppo_recipe.py``) and the port build them from, so both sides are timed alike."""
    saved = recipe.Collector, recipe.make_loss, recipe.TensorDictReplayBuffer

    def collector(*args, **kwargs):
        built = saved[0](*args, **kwargs)
        built.iterator = clock.wrap_iterator("collection", built.iterator)
        return built

    def make_loss(*args, **kwargs):
        loss, gae = saved[1](*args, **kwargs)
        gae.forward = clock.wrap("advantage", gae.forward)
        return loss, gae

    def buffer(*args, **kwargs):
        built = saved[2](*args, **kwargs)
        built.extend = clock.wrap("replay", built.extend)
        built.sample = clock.wrap("replay", built.sample)
        return built

    recipe.Collector, recipe.make_loss, recipe.TensorDictReplayBuffer = collector, make_loss, buffer
    try:
        yield
    finally:
        recipe.Collector, recipe.make_loss, recipe.TensorDictReplayBuffer = saved


def staged_run(name: str, batches: int, count_calls: bool = False) -> dict:
    """One run of ``name`` (the torchrl loop or a port) with its stages timed: wall and CPU seconds
    (or, with ``count_calls``, the Python and C function calls of each stage: exact, not timed)."""
    clock = StageClock()
    start, cpu = time.perf_counter(), time.process_time()
    clock.origin = (start, cpu)
    if count_calls:
        clock.count_calls()
    with _instrumented_recipe(clock):
        if name == "torchrl recipe loop":
            run_torchrl_loop(batches)
        else:
            cls, kwargs = (LocalLearner, {}) if name == "port, LocalLearner" else (
                FabricLearner, {"accelerator": "cpu", "devices": 1})
            args = _recipe_args(batches)
            learner, trainer, _ = recipe.build(args, kwargs, learner_cls=cls)
            learner.update = clock.wrap("update", learner.update)
            trainer.train()
            learner.close()
    if count_calls:
        sys.setprofile(None)
        return {"calls": dict(clock.python_calls, total=sum(clock.python_calls.values()))}
    total = {"wall": time.perf_counter() - start, "cpu": time.process_time() - cpu}
    out = {}
    for kind, stages in (("wall", clock.seconds), ("cpu", clock.cpu)):
        row = dict(stages)
        row["rest"] = total[kind] - sum(stages.values())  # the loop's own update, or the Trainer's bookkeeping
        row["total"] = total[kind]
        out[kind] = row
    return out


def part_stages(reps: int, batches: int) -> dict:
    names = ["torchrl recipe loop", "port, LocalLearner", "port, FabricLearner"]
    calls = {name: staged_run(name, batches, count_calls=True)["calls"] for name in names}
    order = ["setup", "collection", "advantage", "replay", "update", "rest", "total"]
    print("\nfunction calls (Python and C) per stage, one run each (exact; rest: see below)")
    print(f"  {'':24s}" + "".join(f"{s:>12s}" for s in order))
    for name in names:
        print(f"  {name:24s}" + "".join(f"{calls[name].get(s, 0):12d}" for s in order), flush=True)
    if reps == 0:  # the counts only
        return {"calls": calls}
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for rep in range(reps):
        for name in common.order_for(rep, names):  # interleaved, in a random order
            runs[name].append(staged_run(name, batches))
            print(f"rep {rep} {name}: {runs[name][-1]['wall']['total']:.2f} s wall, "
                  f"{runs[name][-1]['cpu']['total']:.2f} s cpu", flush=True)
    table: dict = {}
    for kind in ("wall", "cpu"):
        table[kind] = {}
        for name in names:
            keys = sorted({k for r in runs[name] for k in r[kind]})
            table[kind][name] = {k: statistics.median(r[kind].get(k, 0.0) for r in runs[name]) for k in keys}
            table[kind][name]["total (min)"] = min(r[kind]["total"] for r in runs[name])
    stages = ["setup", "collection", "advantage", "replay", "update", "rest", "total", "total (min)"]
    for kind in ("cpu", "wall"):
        print(f"\nstages, {kind} seconds, median of {reps} (rest: the loop's own update for torchrl; "
              "hooks and bookkeeping for the port)")
        print(f"  {'':24s}" + "".join(f"{s:>12s}" for s in stages))
        for name in names:
            print(f"  {name:24s}" + "".join(f"{table[kind][name].get(s, 0.0):12.3f}" for s in stages))
        base = table[kind]["torchrl recipe loop"]["total"]
        print("  ratio of totals (loop / port, as frames/s): " + ", ".join(
            f"{n}: {base / table[kind][n]['total']:.3f}" for n in names[1:]))
    return {"runs": runs, "medians": table, "calls": calls}


def _git_head() -> str:
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


if __name__ == "__main__":
    main()
