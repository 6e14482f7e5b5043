"""End to end: the ported PPO MuJoCo recipe (Trainer + learner) against torchrl's recipe loop.

    python benchmarks/end_to_end.py [--reps 3] [--batches 2]          # parts 1 and 2: results/end_to_end.json
    python benchmarks/end_to_end.py --part 1 --reps 8 --batches 2 --out benchmarks/results/end_to_end_part1.json
    python benchmarks/end_to_end.py --part stages --reps 5 --batches 1   # --reps 0: the call counts only

The parts and the goal (the port at least 0.97 of the loop's frames/s): benchmarks/README.md, "End to end".
"""

from __future__ import annotations

import functools
import gc
import itertools
import os
import random
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "examples"), str(ROOT / "tests")]

import harness  # noqa: E402
import numpy  # noqa: E402
import ppo_mujoco as recipe  # noqa: E402
import torch  # noqa: E402

from fabric_learner import FabricLearner, LocalLearner  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "end_to_end.json"
GOAL = 0.97  # the port's frames/s at least this share of the recipe loop's (part 1)
# Part 1's turns: ~30 ms of work each. Turns of one step (2,369 a batch) cost about as much switching as work;
# turns of a whole batch (~4 s) no longer shared the host's speed, which drifts faster than that.
ENV_STEPS_PER_PAUSE, DRAWS_PER_PAUSE = 16, 4
LOOP, TWIN = "torchrl recipe loop", "torchrl recipe loop (twin)"  # the twin: part 1's A/A control
CODE = ("fabric_learner", "benchmarks/*.py", "examples", "tests")  # "+dirty" on the commit when these differ
TURN_TIMEOUT_S = 600  # a turn is ~30 ms; compile=True's first one compiles


class Lockstep:
    """Whole runs side by side in one process, one thread each, taking short turns: a run pauses at points every
    run reaches in the same order (``_pausing``) and the next takes the core, in a random order per round, so
    segment ``s`` of every run runs back to back with the others'. One thread runs at a time, so a segment's
    thread CPU and wall time are its run's. Each run's RNG states are set aside at a pause and restored at its
    turn; a full garbage collection runs every 100 rounds, between turns."""

    def __init__(self, runs: dict[str, Callable[[], Any]], seed: int = 0) -> None:
        self.runs, self.seed = runs, seed  # the seed, with the round, seeds each round's order
        self.process_cpu = 0.0  # the whole process's CPU seconds over run(): the turns' sum plus the switching
        self._turn = {name: threading.Semaphore(0) for name in runs}
        self._back = threading.Semaphore(0)
        self._names: dict[int, str] = {}  # thread id -> run
        self._rng: dict[str, tuple] = {}
        self._start: dict[str, float] = {}
        self.cpu: dict[str, list[float]] = {name: [] for name in runs}
        self.wall: dict[str, list[float]] = {name: [] for name in runs}
        self.results: dict[str, Any] = {}

    def pause(self) -> None:
        """Called from a run's thread: end its segment and wait for its next turn."""
        name = self._names.get(threading.get_ident())
        if name is None:  # not a lockstep run
            return
        self._end_segment(name)
        self._back.release()
        self._turn[name].acquire()
        self._begin_segment(name)

    def _begin_segment(self, name: str) -> None:
        if name in self._rng:
            torch_state, numpy_state, python_state = self._rng[name]
            torch.set_rng_state(torch_state)
            numpy.random.set_state(numpy_state)
            random.setstate(python_state)
        self._start[name] = time.thread_time()

    def _end_segment(self, name: str) -> None:
        self.cpu[name].append(time.thread_time() - self._start[name])
        self._rng[name] = (torch.get_rng_state(), numpy.random.get_state(), random.getstate())

    def _thread(self, name: str) -> None:
        self._names[threading.get_ident()] = name
        self._turn[name].acquire()
        self._begin_segment(name)
        try:
            self.results[name] = self.runs[name]()
        except BaseException as err:  # noqa: BLE001 - reported by run() in the main thread
            self.results[name] = err
        self._end_segment(name)
        self._back.release()

    def run(self) -> None:
        """Every run to its end, one segment each per round; raises the first run's error."""
        for name in self.runs:
            threading.Thread(target=self._thread, args=(name,), daemon=True).start()
        was_enabled = gc.isenabled()
        gc.disable()
        start_cpu = time.process_time()
        try:
            for segment in itertools.count():
                active = [name for name in self.runs if name not in self.results]
                if not active:
                    break
                if segment % 100 == 0:  # a full collection costs ~0.1 s with the runs alive
                    gc.collect()
                for name in harness.order_for(self.seed * 1_000_003 + segment, active):
                    start = time.perf_counter()
                    self._turn[name].release()
                    if not self._back.acquire(timeout=TURN_TIMEOUT_S):
                        raise RuntimeError(f"lockstep run {name!r} did not pause or end within {TURN_TIMEOUT_S} s")
                    self.wall[name].append(time.perf_counter() - start)
        finally:
            self.process_cpu = time.process_time() - start_cpu
            if was_enabled:
                gc.enable()
        for name, result in self.results.items():
            if isinstance(result, BaseException):
                raise RuntimeError(f"lockstep run {name!r} failed") from result
        lengths = {name: len(v) for name, v in self.cpu.items()}
        if len(set(lengths.values())) != 1:
            raise RuntimeError(f"the runs took different numbers of segments: {lengths}")


def _adjusted_builders(**adjust: Callable[[Any], Any]):
    """``ppo_mujoco``'s builders named in ``adjust`` patched for a ``with`` block, each result passed through its
    adjuster: the loop (``tests/test_ppo_recipe.py``) and the ports build from them alike."""
    def through(name: str, original: Callable) -> Callable:
        return lambda *args, **kwargs: adjust[name](original(*args, **kwargs))

    return mock.patch.multiple(recipe, **{name: through(name, getattr(recipe, name)) for name in adjust})


def _pausing(lockstep: Lockstep):
    """Every ``ENV_STEPS_PER_PAUSE`` environment steps and ``DRAWS_PER_PAUSE`` minibatch draws pause their run."""
    def pausing(built, attr: str, every: int):
        call, calls = getattr(built, attr), itertools.count()

        def paused(*args, **kwargs):
            if next(calls) % every == 0:
                lockstep.pause()
            return call(*args, **kwargs)
        setattr(built, attr, paused)
        return built

    return _adjusted_builders(make_env=lambda b: pausing(b, "step_and_maybe_reset", ENV_STEPS_PER_PAUSE),
                              TensorDictReplayBuffer=lambda b: pausing(b, "sample", DRAWS_PER_PAUSE))


def _recipe_args(batches: int, world: int = 1):
    return recipe.parse_args(["--frames", str(2048 * batches), "--seed", "0", "--no-progress", "--devices", str(world)])


def run_torchrl_loop(batches: int) -> dict:
    from test_ppo_recipe import original_recipe_loop

    args = _recipe_args(batches)
    n_updates = batches * args.epochs * (args.frames_per_batch // args.minibatch)
    start = time.perf_counter()
    original_recipe_loop(args, n_updates)
    return {"seconds": time.perf_counter() - start, "frames": args.frames, "updates": n_updates}


def _sync_clock(learner, clock: harness.StageClock) -> None:
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
    """One port's run, its stages timed by a ``StageClock`` (update, collection, advantage, gradient sync)."""
    from fabric_learner.onpolicy import LearnerValueEstimator

    args = _recipe_args(batches * world, world)
    clock = harness.StageClock()
    start = time.perf_counter()
    learner, trainer, _ = recipe.build(args, learner_kwargs, learner_cls=learner_cls)
    learner.update = clock.wrap("update", learner.update)
    trainer.collector.iterator = clock.wrap_iterator("collection", trainer.collector.iterator)
    for hook in trainer._modules.values():
        if isinstance(hook, LearnerValueEstimator):
            hook.value_estimator = clock.wrap("advantage", hook.value_estimator)
    if world > 1:
        _sync_clock(learner, clock)
    built = time.perf_counter()
    trainer.train()
    out = {"seconds": time.perf_counter() - start, "setup seconds": built - start, "frames": trainer.collected_frames,
           "updates": learner.num_updates, "stages": clock.seconds, "rank": learner.global_rank,
           # the median update: leaves out compile's warm-up (tens of seconds, once) where a run pays it
           "update ms (median call)": 1e3 * statistics.median(clock.calls["update"])}
    learner.close()
    return out


def part_one(modes: dict[str, Callable[[int], dict]], reps: int, batches: int) -> dict:
    """Every mode run ``reps`` times in lockstep, after an uncounted round of one batch (one-time costs); frames/s and
    the ratio to the loop (its time over the run's, summed over the paired segments, ``harness.ratio_of_sums``),
    decided in thread CPU time: a segment's CPU time is its run's work, its wall time also waits for a core."""
    cpu: dict[str, list[list[float]]] = {name: [] for name in modes}  # per repetition, per segment
    wall: dict[str, list[list[float]]] = {name: [] for name in modes}
    results: dict[str, list[dict]] = {name: [] for name in modes}
    outside: list[float] = []  # per repetition: process CPU seconds not in any run's turns
    for rep in range(-1, reps):
        lockstep = Lockstep({name: functools.partial(run, 1 if rep < 0 else batches) for name, run in modes.items()},
                            seed=rep)
        with _pausing(lockstep):
            lockstep.run()
        if rep < 0:
            continue
        for name in modes:
            cpu[name].append(lockstep.cpu[name])
            wall[name].append(lockstep.wall[name])
            results[name].append(lockstep.results[name])
        outside.append(lockstep.process_cpu - sum(sum(v) for v in lockstep.cpu.values()))
        print(f"rep {rep}: " + ", ".join(f"{name} {sum(lockstep.wall[name]):.1f} s" for name in modes), flush=True)
    table = {}
    for name in modes:
        frames = sum(r["frames"] for r in results[name])
        row: dict[str, Any] = {
            "frames": frames, "frames/s (cpu)": frames / sum(map(sum, cpu[name])),
            "frames/s (wall)": frames / sum(map(sum, wall[name])), "segments cpu s": cpu[name],
            "segments wall s": wall[name],
            "ratio per repetition (cpu)": [sum(b) / sum(a) for a, b in zip(cpu[name], cpu[LOOP])]}
        if "stages" in results[name][0]:
            row["update ms, median call (median over repetitions)"] = statistics.median(
                r["update ms (median call)"] for r in results[name])
        if name != LOOP:
            for kind, samples in (("cpu", cpu), ("wall", wall)):
                row[f"ratio ({kind})"], row[f"ratio 95% interval ({kind})"] = harness.ratio_of_sums(samples[LOOP],
                                                                                                    samples[name])
            met = harness.decide(row["ratio 95% interval (cpu)"], GOAL, at_least=True)  # the goal is a floor
            row["verdict"] = "A/A control" if name == TWIN else {True: "met", False: "NOT met"}.get(met, "undecided")
        table[name] = row
    harness.show({name: {k: v for k, v in row.items() if not k.startswith("segments")} for name, row in table.items()})
    table["process CPU s outside the turns, per repetition"] = outside
    return table


def _instrumented_recipe(clock: harness.StageClock):
    """The recipe's collector, GAE and replay buffer, timed alike on both sides (``_adjusted_builders``)."""
    def collector(built):
        built.iterator = clock.wrap_iterator("collection", built.iterator)
        return built

    def loss_and_gae(built):
        built[1].forward = clock.wrap("advantage", built[1].forward)
        return built

    def buffer(built):
        built.extend, built.sample = clock.wrap("replay", built.extend), clock.wrap("replay", built.sample)
        return built

    return _adjusted_builders(Collector=collector, make_loss=loss_and_gae, TensorDictReplayBuffer=buffer)


def staged_run(name: str, batches: int, count_calls: bool = False) -> dict:
    """One run of ``name`` (the loop or a port) with its stages timed: wall and CPU seconds, or with
    ``count_calls`` the Python and C function calls of each stage (exact, not timed)."""
    clock = harness.StageClock()
    start, cpu = time.perf_counter(), time.process_time()
    clock.origin = (start, cpu)
    if count_calls:
        clock.count_calls()
    with _instrumented_recipe(clock):
        if name == LOOP:
            run_torchrl_loop(batches)
        else:
            cls, kwargs = (LocalLearner, {}) if name == "port, LocalLearner" else (
                FabricLearner, {"accelerator": "cpu", "devices": 1})
            learner, trainer, _ = recipe.build(_recipe_args(batches), kwargs, learner_cls=cls)
            learner.update = clock.wrap("update", learner.update)
            trainer.train()
            learner.close()
    if count_calls:
        sys.setprofile(None)
        return {"calls": dict(clock.python_calls, total=sum(clock.python_calls.values()))}
    total = {"wall": time.perf_counter() - start, "cpu": time.process_time() - cpu}
    # rest: the loop's own update, or the Trainer's bookkeeping
    return {kind: {**stages, "rest": total[kind] - sum(stages.values()), "total": total[kind]}
            for kind, stages in (("wall", clock.seconds), ("cpu", clock.cpu))}


def part_stages(reps: int, batches: int) -> dict:
    names = [LOOP, "port, LocalLearner", "port, FabricLearner"]
    calls = {name: staged_run(name, batches, count_calls=True)["calls"] for name in names}
    order = ["setup", "collection", "advantage", "replay", "update", "rest", "total"]
    print("function calls (Python and C) per stage, one run each\n" + harness.table(
        ("", *order), [(name, *(calls[name].get(s, 0) for s in order)) for name in names]), flush=True)
    if reps == 0:  # the counts only
        return {"calls": calls}
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for rep in range(reps):
        for name in harness.order_for(rep, names):  # interleaved, in a random order
            runs[name].append(staged_run(name, batches))
    table = {kind: {name: {**{k: statistics.median(r[kind].get(k, 0.0) for r in runs[name])
                               for k in sorted({k for r in runs[name] for k in r[kind]})},
                            "total (min)": min(r[kind]["total"] for r in runs[name])} for name in names}
             for kind in ("wall", "cpu")}
    for kind in ("cpu", "wall"):
        print(f"stages, {kind} seconds, median of {reps}\n" + harness.table(
            ("", *order, "total (min)"), [(n, *(f"{table[kind][n].get(s, 0.0):.3f}" for s in (*order, "total (min)")))
                                          for n in names]))
    return {"runs": runs, "medians": table, "calls": calls}


def parser():
    p = harness.parser(__doc__)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--batches", type=int, default=2, help="batches of 2048 frames per run (part 1)")
    p.add_argument("--part", choices=["1", "2", "both", "stages"], default="both")
    p.add_argument("--ranks", type=int, help="one launch of part 2 on this many ranks (a worker)")
    return p


def main(argv=None) -> None:
    args = parser().parse_args(argv)
    if args.ranks:  # part 2: the same total frames on this many ranks (FabricLearner launches them), rank 0's stages
        kwargs = {"accelerator": "cpu", "devices": args.ranks, "strategy": "ddp" if args.ranks > 1 else "auto"}
        result = run_port(args.batches // args.ranks, FabricLearner, kwargs, world=args.ranks)
        return harness.write_json(args.out, result, indent=None) if result["rank"] == 0 else None
    torch.set_num_threads(1)
    report: dict = {"batches": args.batches, "reps": args.reps,
                    "git": harness.git_head() + ("+dirty" if harness.git_dirty(*CODE) else ""),
                    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    if args.part == "stages":
        report.update(load=os.getloadavg(), **part_stages(args.reps, args.batches))
        return harness.write_result(args.out or RESULTS.with_name("end_to_end_stages.json"), report)
    fabric = {"accelerator": "cpu", "devices": 1}
    port = functools.partial(run_port, learner_cls=FabricLearner)
    modes = {LOOP: run_torchrl_loop, TWIN: run_torchrl_loop,
             "port, LocalLearner": functools.partial(run_port, learner_cls=LocalLearner, learner_kwargs={}),
             "port, FabricLearner": functools.partial(port, learner_kwargs=fabric),
             "port, FabricLearner compile=True": functools.partial(port, learner_kwargs={**fabric, "compile": True})}
    if args.part in ("1", "both"):
        report["part 1"] = part_one(modes, args.reps, args.batches)
    if args.part in ("2", "both"):
        two = report["part 2"] = {ranks: harness.launch([__file__, "--ranks", ranks, "--batches", 2 * args.batches],
                                                        timeout_s=1800, what=f"{ranks}-rank run") for ranks in (1, 2)}
        report["part 2 ratio (2 ranks / 1 process, frames/s)"] = (
            (two[2]["frames"] / two[2]["seconds"]) / (two[1]["frames"] / two[1]["seconds"]))
        harness.show({k: v for k, v in report.items() if k.startswith("part 2")})
    harness.write_result(args.out or RESULTS, report)


if __name__ == "__main__":
    main()
