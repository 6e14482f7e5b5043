"""Learning at full length (#38): torchrl's PPO and SAC MuJoCo recipes, four contenders, three seeds.

    python benchmarks/learning.py plan                                      # the runs missing, with estimated times
    python benchmarks/learning.py probe                                     # this host's speed (host_probe)
    python benchmarks/learning.py run --algo ppo --contender ddp --seed 0   # one run (PPO: 1M frames, SAC: 300k)
    python benchmarks/learning.py run --algo sac --contender learner --seed 1 --frames 4000   # a smoke run
    PYTHONPATH=.:/work/mpl python benchmarks/learning.py report              # summary, curves, docs/results.md

Contenders, measures and verdicts: docs/results.md. ``--frames`` below the full length makes a smoke run, never
written into ``results/learning``.
"""

from __future__ import annotations

import argparse
import functools
import glob
import os
import resource
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "examples"), str(ROOT / "benchmarks")]

import harness  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

ALGOS = ("ppo", "sac")
CONTENDERS = ("torchrl", "learner", "ddp", "fsdp", "ddp_split")
CONTENDERS_OF = {"ppo": CONTENDERS, "sac": CONTENDERS[:4]}
SEEDS = (0, 1, 2)
FULL_FRAMES = {"ppo": 1_000_000, "sac": 300_000}
# Stated before any run (docs/results.md, "Verdicts"): a return every contender should pass well
# before the end (CleanRL's PPO ends near 1,400 on HalfCheetah at 1M frames; SAC passes 3,000
# early in published curves)
THRESHOLD = {"ppo": 1000.0, "sac": 3000.0}
FINAL_GOAL = 0.9  # learner / torchrl final return, seed-paired: at least this
WALL_GOAL = 1.0  # 2 ranks / 1 process, seconds to the threshold, seed-paired: at most this
LAST_EPISODES = 10
# CleanRL's ppo_continuous_action on HalfCheetah-v4 at 1M steps, 3 seeds: mean and standard deviation of the
# final returns (docs/results.md, "External references", cites the page)
CLEANRL_PPO = (1442.64, 46.03)
RESULTS_DIR = ROOT / "benchmarks" / "results" / "learning"
SUMMARY = ROOT / "benchmarks" / "results" / "learning.json"
PAGE = ROOT / "docs" / "results.md"
BEGIN, END = "<!-- learning-table:begin (benchmarks/learning.py report) -->", "<!-- learning-table:end -->"
# a run's "code_dirty": these differ from its commit (result files, the run's own and its neighbours', are not code)
CODE = ("fabric_learner", "benchmarks", "examples", ":(exclude)benchmarks/results")
# Estimated seconds of one full run on this project's 2-core machine, from one short run of each contender on
# 2026-12-02 (docs/results.md, "Estimated run times")
ESTIMATE_S = {
    ("ppo", "torchrl"): 3400, ("ppo", "learner"): 3800, ("ppo", "ddp"): 2600, ("ppo", "fsdp"): 5400,
    ("ppo", "ddp_split"): 2400,  # its short run alone: 57 s for 10 batches of 2048, 2026-12-02
    ("sac", "torchrl"): 6700, ("sac", "learner"): 6900, ("sac", "ddp"): 4900, ("sac", "fsdp"): 8900,
}


def run_name(algo: str, contender: str, seed: int) -> str:
    return f"{algo}-{contender}-s{seed}"


def _all_runs() -> int:
    return sum(len(CONTENDERS_OF[a]) for a in ALGOS) * len(SEEDS)


# ---- the "torchrl" contender: torchrl's sota loops by hand, over the recipes' own pieces -------------


def ppo_loop(args, record) -> dict:
    """torchrl's PPO recipe loop (as ``tests/test_ppo_recipe.py`` rewrites it) for ``args.frames`` frames (whole
    batches), each batch recorded before its updates; returns its counts."""
    import ppo_mujoco as recipe

    torch.manual_seed(args.seed)
    actor, critic = recipe.make_models(recipe.make_env(args.env))
    loss_module, gae = recipe.make_loss(actor, critic)
    optims = [torch.optim.Adam(net.parameters(), lr=args.lr, eps=1e-5) for net in (actor, critic)]
    env = recipe.make_env(args.env)
    env.set_seed(args.seed)  # the collector resets it on creation
    collector = recipe.Collector(env, actor, frames_per_batch=args.frames_per_batch, total_frames=-1,
                                 max_frames_per_traj=-1, auto_register_policy_transforms=False)
    torch.manual_seed(collector.set_seed(args.seed, static_seed=False))  # as the Trainer's seed= on one rank
    buffer = recipe.TensorDictReplayBuffer(storage=recipe.LazyTensorStorage(args.frames_per_batch),
                                           sampler=recipe.SamplerWithoutReplacement(), batch_size=args.minibatch)
    batches = args.frames // args.frames_per_batch
    total = batches * args.epochs * (args.frames_per_batch // args.minibatch)
    frames = updates = 0
    try:
        for i, data in enumerate(collector):
            frames += data.numel()
            record(frames, data)
            for _ in range(args.epochs):
                with torch.no_grad():
                    data = gae(data)
                buffer.extend(data.reshape(-1))
                for minibatch in buffer:
                    lr = args.lr * (1 - updates / total) if args.anneal_lr else args.lr
                    for optim in optims:
                        for group in optim.param_groups:
                            group["lr"] = lr
                    out = loss_module(minibatch)
                    (out["loss_objective"] + out["loss_entropy"]).backward()
                    out["loss_critic"].backward()
                    for optim in optims:
                        optim.step()
                        optim.zero_grad()
                    updates += 1
            if i + 1 == batches:
                break
    finally:
        collector.shutdown()
    return {"frames": frames, "updates": updates, "world_size": 1}


def sac_loop(args, recorder, *, budget_s: float = float("inf"), checkpoint: Path | None = None) -> dict:
    """torchrl's SAC recipe loop (``sota-implementations/sac/sac.py``) for ``args.frames`` frames; returns its counts
    and ``finished``. Past ``budget_s`` it stops after a batch and saves at ``checkpoint`` all that continues it,
    from which a later call resumes (the environments start new episodes)."""
    import sac_mujoco as recipe
    from torchrl.objectives import group_optimizers

    cfg = recipe.RECIPE
    torch.manual_seed(args.seed)
    env = recipe.make_env(args.env, args.envs)
    actor, qvalue = recipe.make_models(env)
    loss_module, target_updater = recipe.make_loss(actor, qvalue)
    env.set_seed(args.seed)
    collector = recipe.make_collector(env, actor, args.init_random_frames, {**cfg, "frames_per_batch": args.frames_per_batch})
    torch.manual_seed(collector.set_seed(args.seed, static_seed=False))
    buffer = recipe.make_buffer(args.frames + args.frames_per_batch)
    optimizer = group_optimizers(
        recipe.make_optimizer(list(loss_module.actor_network_params.flatten_keys().values())),
        recipe.make_optimizer(list(loss_module.qvalue_network_params.flatten_keys().values())),
        torch.optim.Adam([loss_module.log_alpha], lr=3.0e-4))
    batches = args.frames // args.frames_per_batch
    num_updates = int(args.frames_per_batch * cfg["utd_ratio"])
    frames = updates = done_batches = 0
    if checkpoint is not None and checkpoint.exists():
        state = torch.load(checkpoint, weights_only=False)
        loss_module.load_state_dict(state["loss"])
        optimizer.load_state_dict(state["optimizer"])
        buffer.load_state_dict(state["buffer"])
        recorder.load_state_dict(state["recorder"])
        frames, updates, done_batches = state["frames"], state["updates"], state["batches"]
        collector.init_random_frames = max(0, args.init_random_frames - frames)  # the warm-up left
        collector.set_seed(args.seed + done_batches, static_seed=False)
        torch.set_rng_state(state["torch_rng"])
        np.random.set_state(state["numpy_rng"])
    start = time.perf_counter()
    finished = done_batches >= batches
    try:
        for data in collector:
            if finished:
                break
            data = data.reshape(-1)
            frames += data.numel()
            recorder.record(frames, data)
            buffer.extend(data)
            if frames >= args.init_random_frames:
                for _ in range(num_updates):
                    loss_td = loss_module(buffer.sample())
                    (loss_td["loss_actor"] + loss_td["loss_qvalue"] + loss_td["loss_alpha"]).sum().backward()
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    target_updater.step()
                    updates += 1
            done_batches += 1
            finished = done_batches >= batches
            if finished:
                break
            if time.perf_counter() - start > budget_s and checkpoint is not None:
                checkpoint.parent.mkdir(parents=True, exist_ok=True)
                torch.save({"loss": loss_module.state_dict(), "optimizer": optimizer.state_dict(),
                            "buffer": buffer.state_dict(), "recorder": recorder.state_dict(), "frames": frames,
                            "updates": updates, "batches": done_batches, "torch_rng": torch.get_rng_state(),
                            "numpy_rng": np.random.get_state()}, str(checkpoint) + ".tmp")
                os.replace(str(checkpoint) + ".tmp", checkpoint)
                break
    finally:
        collector.shutdown()
    return {"frames": frames, "updates": updates, "world_size": 1, "finished": finished}


# ---- one run ---------------------------------------------------------------------------------------


class Recorder:
    """Per batch: ``[frames over all ranks, seconds since start, [returns of the episodes that ended]]``. ``record``
    is a collective under a process group. Seconds run on across the segments of a run stopped at its time budget
    and resumed, each counting from its process's start; the time between segments is not counted."""

    def __init__(self, start: float) -> None:
        self.start = start  # this segment's process start (perf_counter)
        self.offset = 0.0  # the seconds of the segments before this one
        self.points: list[list] = []

    def seconds(self) -> float:
        return self.offset + time.perf_counter() - self.start

    def record(self, frames: int, batch) -> None:
        done = batch.get(("next", "done"))
        returns = batch.get(("next", "episode_reward"))[done].tolist()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            returns = [r for rank in harness.gathered(returns) for r in rank]
        self.points.append([int(frames), self.seconds(), [float(r) for r in returns]])

    def hook(self, trainer):  # the Trainer's pre_steps_log: the batch with the trainer's global frame count
        return lambda batch: self.record(trainer.collected_frames, batch) or {}

    def budget_hook(self, trainer, budget_s: float):  # post_steps: stop (and checkpoint) past budget_s seconds
        def check():
            if time.perf_counter() - self.start > budget_s:
                trainer.request_stop(f"this segment's time budget of {budget_s:.0f} s is spent")
        return check

    # a checkpoint carries the curve and the seconds so far (the Trainer's registered module, or the loop's file)
    def state_dict(self) -> dict:
        return {"points": self.points, "seconds": self.seconds()}

    def load_state_dict(self, state: dict) -> None:
        self.points, self.offset = state["points"], state["seconds"]


def _train(algo: str, contender: str, seed: int, frames: int, opts, recorder: Recorder, partial: Path) -> dict:
    """One contender to its end, or (SAC) this segment's budget: its counts, ``finished``, its learner if any."""
    budget_s = opts.max_hours * 3600
    launch = {"accelerator": "cpu", "devices": 1, "strategy": "auto"} if contender == "learner" else \
        {"accelerator": "cpu", "devices": 2, "strategy": contender.split("_")[0]}
    if algo == "ppo":
        import ppo_mujoco

        argv = ["--frames", str(frames), "--seed", str(seed), "--no-progress", "--env", opts.env or ppo_mujoco.RECIPE["env"]]
        if contender == "ddp_split":  # the recipe's batch of 2048 and minibatches of 64, shared by the 2 ranks
            argv += ["--frames-per-batch", str(ppo_mujoco.RECIPE["frames_per_batch"] // 2),
                     "--minibatch", str(ppo_mujoco.RECIPE["minibatch"] // 2), "--advantage-norm", "global"]
        args = ppo_mujoco.parse_args(argv)
        if contender == "torchrl":
            return {**ppo_loop(args, recorder.record), "finished": True}
        learner, trainer, _ = ppo_mujoco.build(args, launch)
    else:
        import sac_mujoco

        from fabric_learner import FabricLearner

        argv = ["--frames", str(frames), "--seed", str(seed), "--no-progress", "--env", opts.env or sac_mujoco.RECIPE["env"]]
        if opts.init_random_frames is not None:
            argv += ["--init-random-frames", str(opts.init_random_frames)]
        args = sac_mujoco.parse_args(argv)
        if contender == "torchrl":
            return sac_loop(args, recorder, budget_s=budget_s, checkpoint=partial / "loop.pt")
        rank = int(os.environ.get("LOCAL_RANK", 0))  # the ranks FabricLearner starts have it from the start
        trainer = sac_mujoco.build(args, functools.partial(FabricLearner, **launch), world=launch["devices"], rank=rank,
                                   save_trainer_file=str(partial / "trainer"))
        learner = trainer.learner
        trainer.register_module("learning_recorder", recorder)
        trainer.register_op("post_steps", recorder.budget_hook(trainer, budget_s))
    trainer.register_op("pre_steps_log", recorder.hook(trainer))
    trainer.train()
    return {"frames": trainer.collected_frames, "updates": learner.num_updates, "world_size": learner.world_size,
            "finished": trainer.collected_frames >= trainer.total_frames, "learner": learner}


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def host_probe(repeats: int = 3) -> dict:
    """Seconds of two fixed pieces of one-thread work, the median of ``repeats``: 600 Adam updates of a PPO-sized
    MLP on 64 samples, and 5,000 HalfCheetah-v5 steps: the host a run had, so runs of different hosts compare."""
    import gymnasium as gym

    def updates() -> float:
        net = torch.nn.Sequential(torch.nn.Linear(17, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(),
                                  torch.nn.Linear(64, 12))
        optim = torch.optim.Adam(net.parameters(), lr=3e-4)
        x = torch.randn(64, 17, generator=torch.Generator().manual_seed(0))
        start = time.perf_counter()
        for _ in range(600):
            optim.zero_grad()
            net(x).square().mean().backward()
            optim.step()
        return time.perf_counter() - start

    def steps() -> float:
        env = gym.make("HalfCheetah-v5")
        env.reset(seed=0)
        action = env.action_space.sample() * 0
        start = time.perf_counter()
        for _ in range(5000):
            env.step(action)
        env.close()
        return time.perf_counter() - start

    return {"torch_s": round(statistics.median(updates() for _ in range(repeats)), 3),
            "mujoco_s": round(statistics.median(steps() for _ in range(repeats)), 3)}


def segment_totals(segments: list[dict]) -> dict:
    """A run's seconds and CPU seconds (in all and per rank): the sums over its segments."""
    by_rank = [sum(cpu) for cpu in zip(*(s["cpu_seconds_by_rank"] for s in segments), strict=True)]
    return {"seconds": sum(s["seconds"] for s in segments), "cpu_seconds": sum(by_rank), "cpu_seconds_by_rank": by_rank}


def _partial_folder(out_dir: Path, name: str) -> Path:
    """Where a SAC run stopped at its budget keeps its checkpoint (``partial/`` is not committed)."""
    return out_dir / "partial" / name


def run(opts) -> Path | None:
    """One (algo, contender, seed) run, or one segment of a SAC run (``--max-hours``); rank 0 writes the result
    file when the run completes and returns its path. A stopped run continues only on the code it started on."""
    if opts.contender not in CONTENDERS_OF[opts.algo]:
        raise SystemExit(f"the contender {opts.contender!r} has no {opts.algo.upper()} run; nothing was run. "
                         f"{opts.algo.upper()}'s contenders: {', '.join(CONTENDERS_OF[opts.algo])}.")
    harness.set_one_thread()
    os.environ.setdefault("RL_WARNINGS", "False")
    full = FULL_FRAMES[opts.algo]
    frames = opts.frames or full
    smoke = frames < full or opts.env is not None or opts.init_random_frames is not None
    out_dir = Path(opts.out_dir) if opts.out_dir else (
        Path(tempfile.gettempdir()) / "fabric_learner_learning_smoke" if smoke else RESULTS_DIR)
    if smoke and out_dir.resolve() == RESULTS_DIR.resolve():
        raise SystemExit(f"a shortened or changed run ({frames} frames, env {opts.env}) may not write into {RESULTS_DIR}, "
                         "which docs/results.md reads; nothing was run. Leave --out-dir out, or run the full length.")
    name = run_name(opts.algo, opts.contender, opts.seed)
    partial = _partial_folder(out_dir, name)
    code = {"git_head": harness.git_head(), "code_dirty": harness.git_dirty(*CODE)}  # what this segment runs
    started = harness.read_json(partial / "run.json") if (partial / "run.json").exists() else code
    if started != code:
        raise SystemExit(f"{partial} holds a run started on {started}; the code is now {code}. Nothing was run: check "
                         f"out {started['git_head']} (clean) to continue it, or delete {partial} to start again.")
    segment = {"started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "load_start": list(os.getloadavg()),
               "git_head": code["git_head"]}
    start = time.perf_counter()
    recorder = Recorder(start)
    counts = _train(opts.algo, opts.contender, opts.seed, frames, opts, recorder, partial)
    learner = counts.pop("learner", None)
    finished = counts.pop("finished")
    cpu = [_cpu_seconds()]
    rank = 0
    if learner is not None:
        rank = learner.global_rank
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            cpu = harness.gathered(_cpu_seconds())
        learner.close()
    if rank != 0:
        return None
    segment.update(seconds=time.perf_counter() - start, cpu_seconds=sum(cpu), cpu_seconds_by_rank=cpu,
                   load_end=list(os.getloadavg()), frames_at_end=counts["frames"])
    segment["host_probe"] = host_probe()  # after the clock, every rank's learner closed
    earlier = partial / "segments.json"
    segments = [*(harness.read_json(earlier) if earlier.exists() else []), segment]
    if not finished:
        harness.write_json(partial / "segments.json", segments)  # what the checkpoint's recorder lacks: this one
        harness.write_json(partial / "run.json", code)  # the code it started on, not a commit landed meanwhile
        print(f"{name}: stopped at {counts['frames']} frames after {segment['seconds']:.0f} s (--max-hours "
              f"{opts.max_hours}); checkpoint in {partial}. Run the same command again to continue.", flush=True)
        sys.exit(3)
    result = {
        "algo": opts.algo, "contender": opts.contender, "seed": opts.seed, "smoke": smoke,
        "frames_target": frames, **counts, "env": opts.env or "HalfCheetah-v5",
        **segment_totals(segments), "load_start": segments[0]["load_start"], "load_end": segment["load_end"],
        "started": segments[0]["started"], "finished": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "segments": segments, "command": shlex.join(["python", "benchmarks/learning.py", *sys.argv[1:]]),
        "code_dirty": harness.git_dirty(*CODE), "machine": harness.machine(),
        "threshold": THRESHOLD[opts.algo], "points": recorder.points,
    }
    result.update(measures(result))
    path = out_dir / f"{name}.json"
    harness.write_json(path, result, indent=None)
    if partial.exists():
        shutil.rmtree(partial)
    print(f"{path}: {result['frames']} frames, {result['updates']} updates in {result['seconds']:.0f} s over "
          f"{len(segments)} segment(s); final return {result['final_return']}, threshold {THRESHOLD[opts.algo]:.0f} "
          f"reached at {result['seconds_to_threshold']} s", flush=True)
    return path


# ---- what a run's points give ----------------------------------------------------------------------


def curve(points: list[list]) -> list[tuple[int, float, float]]:
    """``(frames, seconds, mean of the last 10 ended episodes)`` at every batch after the first ended episode."""
    episodes: list[float] = []
    out = []
    for frames, seconds, returns in points:
        episodes += returns
        if episodes:
            last = episodes[-LAST_EPISODES:]
            out.append((frames, seconds, sum(last) / len(last)))
    return out


def measures(result: dict) -> dict:
    """The final return, the episodes, the seconds and frames at which the running mean first reaches the threshold."""
    points = curve(result["points"])
    reached = next((p for p in points if p[2] >= result["threshold"]), None)
    episodes = sum(len(p[2]) for p in result["points"])
    return {"episodes": episodes, "final_return": round(points[-1][2], 2) if points else None,
            "seconds_to_threshold": None if reached is None else round(reached[1], 1),
            "frames_to_threshold": None if reached is None else reached[0]}


def plan(results_dir: Path = RESULTS_DIR, max_hours: float = 1.75) -> list[tuple[str, int]]:
    """The full runs without a result file, each with its estimated seconds, printed with their commands."""
    missing = [(run_name(a, c, s), ESTIMATE_S[a, c]) for a in ALGOS for s in SEEDS for c in CONTENDERS_OF[a]
               if not (results_dir / f"{run_name(a, c, s)}.json").exists()]
    for name, est in missing:
        algo, contender, seed = name.split("-")
        times = -(-est // int(max_hours * 3600)) if algo == "sac" else 1
        segments = _partial_folder(results_dir, name) / "segments.json"
        begun = f", begun: {harness.read_json(segments)[-1]['frames_at_end']} frames done" if segments.exists() else ""
        print(f"{est / 3600:4.1f} h  python benchmarks/learning.py run --algo {algo} --contender {contender} "
              f"--seed {seed[1:]}" + (f"   ({times} times{begun})" if times > 1 or begun else ""))
    total = sum(est for _, est in missing)
    print(f"{len(missing)} of {_all_runs()} runs missing, about {total / 3600:.1f} h "
          "one at a time (estimates from short runs on a shared 2-core machine: docs/results.md)")
    return missing


# ---- report ----------------------------------------------------------------------------------------


def load_runs(results_dir: Path = RESULTS_DIR) -> list[dict]:
    runs = [harness.read_json(p) for p in sorted(glob.glob(str(results_dir / "*.json")))]
    bad = [r.get("command") for r in runs if r.get("smoke")]
    if bad:
        raise ValueError(f"{results_dir} holds smoke runs ({bad}): remove them; docs/results.md reads only full runs")
    return runs


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _round(x, nd=1):
    return None if x is None else round(x, nd)


def summarize(runs: list[dict]) -> dict:
    """What ``report`` writes: every run's measures and provenance, a row per (algo, contender), the verdicts."""
    by = {run_name(r["algo"], r["contender"], r["seed"]): r for r in runs}
    entries = {name: {k: r[k] for k in ("algo", "contender", "seed", "frames", "updates", "world_size", "seconds",
                                         "cpu_seconds", "final_return", "seconds_to_threshold", "frames_to_threshold",
                                         "episodes", "started", "load_start", "load_end", "code_dirty")}
               | {"git_head": r["machine"]["git_head"], "fabric_learner_dirty": r["machine"]["fabric_learner_dirty"],
                  "fabric_learner_sha256": r["machine"]["fabric_learner_sha256"]}
               for name, r in sorted(by.items())}
    rows = []
    for algo in ALGOS:
        for contender in CONTENDERS_OF[algo]:
            mine = [e for e in entries.values() if e["algo"] == algo and e["contender"] == contender]
            if not mine:
                continue
            finals = [e["final_return"] for e in mine if e["final_return"] is not None]  # None: no episode ended
            rows.append({"algo": algo, "contender": contender, "seeds": sorted(e["seed"] for e in mine),
                         "final_return_mean": _round(_mean(finals)), "final_return_min": _round(min(finals, default=None)),
                         "final_return_max": _round(max(finals, default=None)),
                         "hours_mean": _round(_mean([e["seconds"] for e in mine]) / 3600, 3),
                         "reached": sum(e["seconds_to_threshold"] is not None for e in mine),
                         "hours_to_threshold_mean": _round(_mean([e["seconds_to_threshold"] for e in mine]) / 3600, 3)
                         if any(e["seconds_to_threshold"] is not None for e in mine) else None,
                         "commits": sorted({e["git_head"] for e in mine})})
    return {"command": "python benchmarks/learning.py report", "threshold": THRESHOLD,
            "goals": {"final_return": FINAL_GOAL, "seconds_to_threshold": WALL_GOAL},
            "runs": entries, "rows": rows, "verdicts": verdicts(entries)}


def verdicts(entries: dict) -> list[dict]:
    """Final return learner / torchrl (at least ``FINAL_GOAL``), seconds to the threshold 2 ranks / 1 process (at
    most ``WALL_GOAL``; never reaching it is infinitely slow), ddp_split's final return / the learner's: seed-paired
    median ratios with ``harness.bootstrap_ci``'s interval, decided by ``harness.decide``."""
    out = []
    specs = [("final return, learner / torchrl loop", "learner", "torchrl", "final_return", FINAL_GOAL, True)]
    specs += [(f"seconds to the threshold, {c} 2 ranks / learner 1 process", c, "learner", "seconds_to_threshold",
               WALL_GOAL, False) for c in ("ddp", "fsdp", "ddp_split")]
    specs += [("final return, ddp_split 2 ranks / learner 1 process", "ddp_split", "learner", "final_return",
               FINAL_GOAL, True)]
    for algo in ALGOS:
        for what, num, den, key, goal, at_least in specs:
            if num not in CONTENDERS_OF[algo]:
                continue
            pairs = [(seed, entries[run_name(algo, num, seed)][key], entries[run_name(algo, den, seed)][key])
                     for seed in SEEDS if run_name(algo, num, seed) in entries and run_name(algo, den, seed) in entries]
            row = {"algo": algo, "what": what, "goal": goal, "at_least": at_least, "seeds": [p[0] for p in pairs]}
            if len(pairs) < 2:
                out.append({**row, "ratio": None, "ci": None, "verdict": f"{len(pairs)} paired seed(s): not decided"})
                continue
            inf = float("inf")
            nums = [inf if a is None else a for _, a, _ in pairs]
            dens = [inf if b is None else b for _, _, b in pairs]
            if any(d in (0, inf) and n in (0, inf) for n, d in zip(nums, dens)) or any(d <= 0 for d in dens):
                out.append({**row, "ratio": None, "ci": None,
                            "verdict": "not decided: a ratio is undefined (neither reached the threshold, or a return <= 0)"})
                continue
            ratio = harness.paired_ratio(nums, dens)
            ci = harness.bootstrap_ci(nums, dens)
            out.append({**row, "ratio": round(ratio, 3), "ci": [round(ci[0], 3), round(ci[1], 3)],
                        "verdict": harness.verdict(ci, goal, at_least=at_least)})
    return out


def render_section(summary: dict) -> str:
    """The table of docs/results.md between its markers, from ``summary`` alone."""
    if not summary["runs"]:
        return (f"{BEGIN}\n**No runs yet.** `python benchmarks/learning.py plan` lists the runs and their "
                f"estimated times; `report` fills this table from `benchmarks/results/learning/`.\n{END}")
    lines = [BEGIN, "| algorithm | contender | seeds | final return, mean (min to max) | hours, mean | "
             "reached threshold | hours to threshold, mean | commits |", "|---|---|---|---|---|---|---|---|"]
    for r in summary["rows"]:
        to = "-" if r["hours_to_threshold_mean"] is None else f"{r['hours_to_threshold_mean']:.2f}"
        final = "-" if r["final_return_mean"] is None else (
            f"{r['final_return_mean']:.0f} ({r['final_return_min']:.0f} to {r['final_return_max']:.0f})")
        lines.append(f"| {r['algo'].upper()} | {r['contender']} | {', '.join(map(str, r['seeds']))} | {final} | "
                     f"{r['hours_mean']:.2f} | {r['reached']}/{len(r['seeds'])} | {to} | "
                     f"{', '.join('`' + c + '`' for c in r['commits'])} |")
    lines += ["", "| algorithm | verdict on | seeds | ratio | 95% interval | goal | verdict |", "|---|---|---|---|---|---|---|"]
    for v in summary["verdicts"]:
        ratio = "-" if v["ratio"] is None else f"{v['ratio']:.3f}"
        ci = "-" if v["ci"] is None else f"{v['ci'][0]:.3f}-{v['ci'][1]:.3f}"
        goal = ("≥ " if v["at_least"] else "≤ ") + f"{v['goal']:.2f}"
        lines.append(f"| {v['algo'].upper()} | {v['what']} | {', '.join(map(str, v['seeds'])) or '-'} | {ratio} | "
                     f"{ci} | {goal} | {v['verdict']} |")
    ppo = [r for r in summary["rows"] if r["algo"] == "ppo"]
    if ppo:
        mean, sd = CLEANRL_PPO
        where = "; ".join(f"{r['contender']} {r['final_return_mean']:.0f}: " + (
            "inside" if abs(r["final_return_mean"] - mean) <= sd else "below" if r["final_return_mean"] < mean else "above")
            for r in ppo if r["final_return_mean"] is not None)
        lines += ["", f"PPO final returns (seed means) against CleanRL's {mean:.2f} ± {sd:.2f} at 1M steps "
                      f"(inside: within one standard deviation): {where}."]
    for algo in ALGOS:
        if any(r["algo"] == algo for r in summary["rows"]):
            lines += ["", f"![{algo.upper()} on HalfCheetah: running mean of the last 10 training episodes]"
                          f"(learning_{algo}.png)"]
    return "\n".join(lines + [END])


def page_section(text: str) -> str:
    """The generated section of a docs/results.md text (markers included); ``ValueError`` if absent."""
    if BEGIN not in text or END not in text:
        raise ValueError(f"docs/results.md has lost its markers {BEGIN!r} ... {END!r}")
    return text[text.index(BEGIN):text.index(END) + len(END)]


def check_page(text: str, summary: dict) -> list[str]:
    """What is wrong with a docs/results.md text: nothing when its section is exactly ``render_section(summary)``."""
    try:
        shown = page_section(text)
    except ValueError as err:
        return [str(err)]
    want = render_section(summary)
    if shown == want:
        return []
    diff = [f"page: {a!r}\n  results: {b!r}" for a, b in zip(shown.splitlines(), want.splitlines()) if a != b]
    return diff or [f"the page's section has {len(shown.splitlines())} lines, the results' {len(want.splitlines())}"]


def plot(runs: list[dict], algo: str, path: Path) -> None:
    """Running mean return against frames and against wall-clock hours, one line per run, by contender."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = dict(zip(CONTENDERS, ("black", "tab:blue", "tab:orange", "tab:green", "tab:red")))
    fig, (by_frames, by_time) = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    commits = sorted({r["machine"]["git_head"] for r in runs if r["algo"] == algo})
    for r in runs:
        if r["algo"] != algo:
            continue
        pts = curve(r["points"])
        label = r["contender"] if r["seed"] == min(x["seed"] for x in runs if x["algo"] == algo and
                                                  x["contender"] == r["contender"]) else None
        kw = dict(color=colours[r["contender"]], lw=0.9, alpha=0.8, label=label)
        by_frames.plot([p[0] for p in pts], [p[2] for p in pts], **kw)
        by_time.plot([p[1] / 3600 for p in pts], [p[2] for p in pts], **kw)
    for ax in (by_frames, by_time):
        ax.axhline(THRESHOLD[algo], color="grey", ls=":", lw=0.8)
        ax.grid(alpha=0.3)
    by_frames.set_xlabel("environment steps (all ranks)")
    by_time.set_xlabel("wall-clock hours (2-core CPU, shared)")
    by_frames.set_ylabel("mean of the last 10 training episodes")
    by_frames.legend(fontsize=8)
    fig.suptitle(f"{algo.upper()} recipe on HalfCheetah-v5, per seed (git {', '.join(commits)})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Source": "git " + ", ".join(commits),
                                         "Description": "python benchmarks/learning.py report"})
    plt.close(fig)


def report(results_dir: Path = RESULTS_DIR, summary_path: Path = SUMMARY, page: Path = PAGE) -> dict:
    runs = load_runs(results_dir)
    summary = summarize(runs)
    harness.write_json(summary_path, summary)
    for algo in ALGOS:
        if any(r["algo"] == algo for r in runs):
            try:
                plot(runs, algo, page.parent / f"learning_{algo}.png")
            except ImportError:
                print("matplotlib is missing: curves not drawn (PYTHONPATH=<repo>:/work/mpl, or pip install -e .[bench])")
    text = page.read_text()
    page.write_text(text.replace(page_section(text), render_section(summary)))
    print(f"{len(runs)} run(s) -> {summary_path}, {page}")
    return summary


def parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="one run")
    r.add_argument("--algo", choices=ALGOS, required=True)
    r.add_argument("--contender", choices=CONTENDERS, required=True)
    r.add_argument("--seed", type=int, required=True)
    r.add_argument("--frames", type=int, default=None, help="fewer than the full length: a smoke run")
    r.add_argument("--env", default=None, help="another task: a smoke run (e.g. Pendulum-v1)")
    r.add_argument("--init-random-frames", type=int, default=None, help="SAC's random warm-up: a smoke run")
    r.add_argument("--out-dir", default=None, help="where a smoke run writes (default: the temporary folder)")
    r.add_argument("--max-hours", type=float, default=1.75,
                   help="SAC: stop at the first batch past this many hours of this command, keep a checkpoint in "
                        "<results>/partial/ and exit 3; the same command continues the run (PPO runs are shorter)")
    sub.add_parser("plan", help="the runs missing, with estimated times")
    sub.add_parser("probe", help="this host's speed as each run records it (host_probe), nothing else running")
    sub.add_parser("report", help="results/learning.json, docs/learning_<algo>.png, docs/results.md")
    return p


def main(argv=None) -> None:
    opts = parser().parse_args(argv)
    if opts.command == "run":
        run(opts)
    elif opts.command == "plan":
        plan()
    elif opts.command == "probe":
        harness.set_one_thread()
        print(host_probe())
    else:
        report()


if __name__ == "__main__":
    main()
