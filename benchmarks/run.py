"""The fabric_learner benchmark suite: every case, side by side, in one command.

    python benchmarks/run.py            # full mode (~10-15 minutes on 2 busy cores)
    python benchmarks/run.py --quick    # under 5 minutes on 2 cores
    python benchmarks/run.py --only a,d # a subset of cases (a b c d e f compile)
    python benchmarks/run.py --only a --workloads ppo --reps 61   # one case, one workload, more repetitions
    python benchmarks/run.py --smoke    # 2 repetitions: checks that the suite runs, numbers meaningless

Each case compares a learner call with the code a user would write by hand for the same work,
same seeds, same data. Contenders take turns: every repetition runs each of them once (``inner``
calls timed together with ``time.perf_counter``; one update per block in case a and, in full
mode, b), in a random order, so slow phases of a noisy machine hit all of them; the garbage
collector runs between repetitions, never inside one (``harness.interleaved``). In cases a and b
each contender is five copies taking turns (``harness.rotating``) and the intervals resample copies,
then repetitions; case b reports process CPU time summed over the ranks and meets a goal only when
its CPU and its wall interval both do. Reported: the median per call over the repetitions,
``ratio`` = learner median / hand-written median, and ``paired`` = the median of the
per-repetition ratios (adjacent blocks, so it cancels shared noise best). Results go to
``benchmarks/results/latest.json`` and ``benchmarks/results/latest.png``.

Cases: a) one process, one thread, update(): PPO, DQN, SAC; b) DDP on 2 gloo ranks, update();
d) checkpoint save/load; e) get_weights of a 20M+ parameter policy (1 process and DDP);
f) updates/second per rank at 1 and 2 ranks; c) memory per rank, FSDP vs DDP (``fsdp_memory.py``,
full mode or ``--only c``). compile) ``compile=True`` learners vs the eager hand loop (a HOOK below).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable

os.environ["OMP_NUM_THREADS"] = "1"  # before torch is imported: one thread, here and in every rank
os.environ.setdefault("RL_WARNINGS", "False")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import common  # noqa: E402
import harness  # noqa: E402
import torch  # noqa: E402
from tensordict import TensorDict  # noqa: E402

from fabric_learner import FabricLearner, LocalLearner  # noqa: E402

RESULTS = os.path.join(HERE, "results")


@dataclass(frozen=True)
class Config:
    quick: bool
    # case a: single-process update()
    reps: int
    inner: int
    warmup: int
    # case b/f: DDP update()
    ddp_reps: int
    ddp_inner: int
    ddp_timeout_s: int
    # case d: checkpoints
    ckpt_reps: int
    ckpt_inner: int
    # case e: get_weights
    gw_reps: int
    gw_inner: int
    workloads: tuple[str, ...] = common.WORKLOADS
    explicit: tuple = ()  # cases named with --only; quick mode runs c and compile only then


QUICK = Config(quick=True, reps=150, inner=1, warmup=5, ddp_reps=10, ddp_inner=4, ddp_timeout_s=200,
               ckpt_reps=4, ckpt_inner=1, gw_reps=4, gw_inner=1)
FULL = Config(quick=False, reps=600, inner=1, warmup=10, ddp_reps=600, ddp_inner=1, ddp_timeout_s=600,
              ckpt_reps=10, ckpt_inner=2, gw_reps=10, gw_inner=2)
SMOKE = Config(quick=True, reps=2, inner=2, warmup=1, ddp_reps=2, ddp_inner=2, ddp_timeout_s=200,
               ckpt_reps=2, ckpt_inner=1, gw_reps=2, gw_inner=1)  # checks the suite runs; numbers meaningless


@dataclass
class Row:
    """One comparison: ``contender`` (a learner call) against ``baseline`` (hand-written).

    ``ratio`` = contender median / baseline median, in the row's ``measure``: wall clock, or
    process CPU time (case b, summed over the ranks). ``paired`` = median over repetitions of the
    per-repetition ratio, with its 95% bootstrap interval ``ci``, which the verdict reads (case b:
    with ``wall_ci``);
    ``cpu_ratio`` = the ratio of medians in process CPU time, which leaves out the time spent
    waiting for a core on a shared machine. A CPU-time row keeps its wall-clock ``paired`` and
    ``ci`` in ``wall_paired`` and ``wall_ci``.
    """

    case: str
    workload: str
    contender: str
    baseline: str
    unit: str
    contender_median: float
    baseline_median: float
    ratio: float
    paired: float
    ci: tuple[float, float]
    cpu_ratio: float | None
    goal: float | None
    met: bool | None
    verdict: str
    note: str = ""
    samples: dict[str, list[float]] = field(default_factory=dict)
    cpu_samples: dict[str, list[float]] = field(default_factory=dict)
    measure: str = "wall"
    wall_paired: float | None = None
    wall_ci: tuple[float, float] | None = None


def compare(case: str, workload: str, samples_s: dict[str, list[float]], contender: str, baseline: str,
            goal: float | None, *, unit: str = "ms", note: str = "",
            cpu_s: dict[str, list[float]] | None = None, by_cpu: bool = False, copies: int = 1) -> Row:
    """A Row from interleaved per-call samples in seconds (reported in milliseconds).

    The verdict is ``harness.decide`` on the bootstrap interval of the wall-clock samples (over ``copies``
    copies of each contender, see ``harness.rotating``). With ``by_cpu`` (case b, where a block's
    wall time also holds the barrier's wait for the other rank) the row reports process CPU time,
    and a goal is met only when both the CPU and the wall interval meet it: CPU time alone would
    not see a cost that is spent waiting.
    """
    wall_c, wall_b = samples_s[contender], samples_s[baseline]
    c, b = (cpu_s[contender], cpu_s[baseline]) if by_cpu else (wall_c, wall_b)
    cm, bm = harness.median(c) * 1e3, harness.median(b) * 1e3
    ci = harness.bootstrap_ci(c, b, copies=copies)
    cpu_ratio = None
    cpu_samples = {}
    if cpu_s and contender in cpu_s and baseline in cpu_s:
        cpu_ratio = harness.median(cpu_s[contender]) / harness.median(cpu_s[baseline])
        cpu_samples = {k: [x * 1e3 for x in cpu_s[k]] for k in (contender, baseline)}
    met, text, extra = harness.decide(ci, goal), harness.verdict(ci, goal), {}
    if by_cpu:
        wall_ci = harness.bootstrap_ci(wall_c, wall_b, copies=copies)
        extra = {"measure": "cpu", "wall_paired": harness.paired_ratio(wall_c, wall_b), "wall_ci": wall_ci}
        wall_met = harness.decide(wall_ci, goal)
        if met is not wall_met:
            met = False if False in (met, wall_met) else None
            text = ("NOT met" if met is False else "undecided") + (
                f" (cpu interval {ci[0]:.2f}-{ci[1]:.2f}, wall {wall_ci[0]:.2f}-{wall_ci[1]:.2f}, vs {goal:.2f})")
    return Row(case, workload, contender, baseline, unit, cm, bm, cm / bm, harness.paired_ratio(c, b), ci, cpu_ratio,
               goal, met, text, note, {contender: [x * 1e3 for x in wall_c], baseline: [x * 1e3 for x in wall_b]},
               cpu_samples, **extra)


# ---- case a: one process, one thread, update() ---------------------------------------------------


def case_a(cfg: Config) -> list[Row]:
    rows = []
    for name in cfg.workloads:
        batches = common.make_batches(name)
        cpu: dict[str, list[float]] = {}
        samples = harness.interleaved(
            {label: harness.rotating(build, batches) for label, build in common.case_a_contenders(name).items()},
            reps=cfg.reps, inner=cfg.inner, warmup=cfg.warmup, cpu=cpu,
        )
        assert torch.get_num_threads() == 1, torch.get_num_threads()
        note = common.WORKLOAD_DESC[name]
        row = functools.partial(compare, "a", name, samples, unit="ms/update", cpu_s=cpu, copies=harness.INSTANCES)
        rows += [
            row("LocalLearner.update", "hand torchrl loop", 1.03, note=note),
            row("FabricLearner(cpu,1).update", "hand torchrl loop", 1.02, note=note),
            row("FabricLearner(cpu,1).update", "hand Fabric loop", 1.03, note=note),
            row("hand Fabric loop", "hand torchrl loop", None, note="reference: what Fabric itself costs"),
            row("hand torchrl loop (twin)", "hand torchrl loop", None,
                note="A/A control: two identical loops; its distance from 1 is this run's noise floor"),
        ]
    return rows


# ---- cases b, e (DDP) and f: multi-rank launches --------------------------------------------------


def launch_ranks(nproc: int, cfg: Config, *, get_weights: bool) -> dict[str, Any]:
    """Run ``ddp_case.py`` under torchrun on ``nproc`` gloo ranks, one thread each; its JSON."""
    with harness.scratch_path() as out:
        cmd = harness.torchrun(
            nproc, os.path.join(HERE, "ddp_case.py"), "--out", out, "--workloads", ",".join(cfg.workloads),
            "--reps", str(cfg.ddp_reps), "--inner", str(cfg.ddp_inner), "--warmup", str(cfg.warmup),
            "--gw-reps", str(cfg.gw_reps if get_weights else 0), "--gw-inner", str(cfg.gw_inner))
        harness.run_bounded(cmd, cfg.ddp_timeout_s, f"{nproc}-rank launch")
        return harness.read_json(out)


def case_b_e_f(cfg: Config, single_rows: list[Row], *, with_e: bool = True,
               with_f: bool = True) -> tuple[list[Row], list[dict]]:
    """One 2-rank launch (b, and e under DDP); for f in full mode, one 1-rank launch of the same worker.

    Quick mode skips the 1-rank DDP launch (its start-up alone is ~30 s on 2 busy cores): its
    1-rank reference is then the single-process, no-DDP time of case a.
    """
    two = launch_ranks(2, cfg, get_weights=with_e)
    one = launch_ranks(1, cfg, get_weights=False) if with_f and not cfg.quick else None
    rows = []
    for name, res in two["updates"].items():
        note = ("2 gloo ranks, 1 thread each; process CPU time summed over the ranks (verdict: CPU and wall)"
                + ("" if res["same_weights"] is not False else "; WEIGHTS DIFFER"))
        row = functools.partial(compare, "b", name, res["samples_s"], unit="ms/update (cpu, both ranks)",
                                cpu_s=res["cpu_s"], by_cpu=True, copies=harness.INSTANCES)
        rows.append(row("FabricLearner(ddp)", "hand DDP", 1.05, note=note))
        rows.append(row("hand DDP (twin)", "hand DDP", None,
                        note="A/A control: two identical loops; its distance from 1 is this run's noise floor"))
    gw = two.get("get_weights")
    if gw:
        rows.append(compare("e", f"ppo actor {gw['policy_params'] / 1e6:.1f}M params", gw["samples_s"],
                            "FabricLearner(ddp).get_weights", "raw TensorDict.from_module(policy).data.clone()",
                            None, unit="ms/call", note="DDP, 2 ranks (rank 0's clock)", cpu_s=gw.get("cpu_s")))
    scaling = []
    if not with_f:
        return rows, scaling
    single = {(r.workload, r.contender): r.contender_median for r in single_rows if r.case == "a"}
    single.update({(r.workload, r.baseline): r.baseline_median for r in single_rows if r.case == "a"})
    for name in two["updates"]:
        for contender in ("FabricLearner(ddp)", "hand DDP"):
            ms2 = harness.median(two["updates"][name]["samples_s"][contender]) * 1e3
            ms1 = None if one is None else harness.median(one["updates"][name]["samples_s"][contender]) * 1e3
            ref = "FabricLearner(cpu,1).update" if contender == "FabricLearner(ddp)" else "hand torchrl loop"
            ms0 = single.get((name, ref))
            base = ms1 if ms1 is not None else ms0  # the 1-rank time efficiency is measured against
            scaling.append({
                "workload": name, "contender": contender,
                "no_ddp_1proc_updates_per_s": None if ms0 is None else 1e3 / ms0,
                "ddp_1rank_updates_per_s": None if ms1 is None else 1e3 / ms1,
                "ddp_2rank_updates_per_s_per_rank": 1e3 / ms2,
                "efficiency_vs": "DDP 1 rank" if ms1 is not None else "1 process, no DDP",
                "per_rank_efficiency": None if base is None else base / ms2,  # 1.0 = perfect weak scaling
                "total_speedup_2_vs_1": None if base is None else 2 * base / ms2,
            })
    return rows, scaling


# ---- case d: checkpoints -----------------------------------------------------------------------------


def case_d(cfg: Config) -> list[Row]:
    name, cells = "ppo", (1024, 1024, 1024)
    batches = common.make_batches(name, count=2)
    loss_h = common.make_loss(name, cells=cells)[0]
    opt_h = torch.optim.Adam(loss_h.parameters())
    local = LocalLearner(common.make_loss(name, cells=cells)[0])
    fabric = FabricLearner(common.make_loss(name, cells=cells)[0], accelerator="cpu", devices=1)
    for td in batches:  # populate Adam's state, as in a real checkpoint
        common.summed_loss(loss_h(td)).backward()
        opt_h.step()
        opt_h.zero_grad()
        local.update(td)
        fabric.update(td)
    nparams = common.count_params(loss_h)
    workload = f"ppo MLP[1024]x3, {nparams / 1e6:.1f}M params + Adam"
    tmp = tempfile.mkdtemp(prefix="fl_bench_ckpt_")
    paths = {k: os.path.join(tmp, f"{k}.pt") for k in ("hand", "atomic", "local", "fabric")}

    def hand_save(i):
        torch.save({"model": loss_h.state_dict(), "optimizer": opt_h.state_dict()}, paths["hand"])

    def hand_atomic_save(i):  # what the learner's durability costs when written by hand
        part = paths["atomic"] + ".partial"
        with open(part, "wb") as f:
            torch.save({"model": loss_h.state_dict(), "optimizer": opt_h.state_dict()}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(part, paths["atomic"])

    def hand_load(i):
        state = torch.load(paths["hand"], map_location="cpu", weights_only=True)
        loss_h.load_state_dict(state["model"])
        opt_h.load_state_dict(state["optimizer"])

    cpu: dict[str, list[float]] = {}
    try:
        save = harness.interleaved({
            "torch.save(state_dicts)": hand_save,
            "torch.save + fsync + rename": hand_atomic_save,
            "LocalLearner.save": lambda i: local.save(paths["local"]),
            "FabricLearner.save": lambda i: fabric.save(paths["fabric"]),
        }, reps=cfg.ckpt_reps, inner=cfg.ckpt_inner, warmup=1, cpu=cpu)
        load = harness.interleaved({
            "torch.load + load_state_dicts": hand_load,
            "LocalLearner.load": lambda i: local.load(paths["local"]),
            "FabricLearner.load": lambda i: fabric.load(paths["fabric"]),
        }, reps=cfg.ckpt_reps, inner=cfg.ckpt_inner, warmup=1, cpu=cpu)
        size_mb = os.path.getsize(paths["local"]) / 2**20
    finally:
        for p in paths.values():
            if os.path.exists(p):
                os.unlink(p)
        os.rmdir(tmp)
    w = f"{workload}, {size_mb:.0f} MB file"
    return [
        compare("d", w, save, "LocalLearner.save", "torch.save(state_dicts)", 1.2, unit="ms/call", cpu_s=cpu),
        compare("d", w, save, "FabricLearner.save", "torch.save(state_dicts)", 1.2, unit="ms/call", cpu_s=cpu),
        compare("d", w, save, "torch.save + fsync + rename", "torch.save(state_dicts)", None, unit="ms/call",
                note="reference: the cost of an atomic, durable write by hand", cpu_s=cpu),
        compare("d", w, save, "LocalLearner.save", "torch.save + fsync + rename", None, unit="ms/call",
                note="reference: learner vs an equally durable hand-written save", cpu_s=cpu),
        compare("d", w, load, "LocalLearner.load", "torch.load + load_state_dicts", 1.2, unit="ms/call",
                cpu_s=cpu),
        compare("d", w, load, "FabricLearner.load", "torch.load + load_state_dicts", 1.2, unit="ms/call",
                cpu_s=cpu),
    ]


# ---- case e: get_weights, one process ----------------------------------------------------------


def case_e(cfg: Config) -> list[Row]:
    loss, policy = common.make_loss("ppo_big_actor")
    local = LocalLearner(loss, policy=policy)
    fabric = FabricLearner(loss, policy=policy, accelerator="cpu", devices=1)
    cpu: dict[str, list[float]] = {}
    samples = harness.interleaved({
        "raw TensorDict.from_module(policy).data.clone()": lambda i: TensorDict.from_module(policy).data.clone(),
        "raw {k: v.detach().clone() for state_dict}": lambda i: {
            k: v.detach().clone() for k, v in policy.state_dict().items()},
        "LocalLearner.get_weights": lambda i: local.get_weights(),
        "FabricLearner(cpu,1).get_weights": lambda i: fabric.get_weights(),
    }, reps=cfg.gw_reps, inner=cfg.gw_inner, warmup=1, cpu=cpu)
    w = f"ppo actor {common.count_params(policy) / 1e6:.1f}M params"
    base = "raw TensorDict.from_module(policy).data.clone()"
    return [
        compare("e", w, samples, "LocalLearner.get_weights", base, None, unit="ms/call", note="1 process",
                cpu_s=cpu),
        compare("e", w, samples, "FabricLearner(cpu,1).get_weights", base, None, unit="ms/call", note="1 process",
                cpu_s=cpu),
        compare("e", w, samples, "raw {k: v.detach().clone() for state_dict}", base, None, unit="ms/call",
                note="reference: the two raw calls", cpu_s=cpu),
    ]


# ======================================================================================================
# HOOKS: cases other engineers add. Each is ``fn(cfg) -> list[Row] | None``; ``None`` means "not
# implemented yet" and is listed as skipped. Build rows with ``compare(case, workload, samples_s,
# contender, baseline, goal, unit=...)`` from ``harness.interleaved(...)`` samples (seconds), or
# construct ``Row`` directly for non-time metrics (e.g. unit="MiB" for memory; ratio = learner/hand).
# Multi-rank hooks should follow ``launch_ranks``/``ddp_case.py`` (``harness.torchrun`` and
# ``harness.run_bounded``: one thread, timeout; barrier + destroy_process_group at the end).
# ======================================================================================================


def case_c_fsdp_memory(cfg: Config) -> list[Row] | None:
    """HOOK, case c: memory per rank of ``FabricLearner`` under FSDP vs under DDP (2 CPU ranks).

    Runs ``fsdp_memory.py`` (by the FSDP work; a 21M-parameter PPO loss, a few Adam updates) once
    per strategy: tensor bytes each rank holds (parameters + gradients + Adam state + buffers) and
    peak RSS, again with glibc's mmap threshold fixed (four 2-rank launches, ~2 minutes); ``--only c``
    runs it alone.
    Goal-less: the ideal state ratio on 2 ranks is 0.5.
    """
    if cfg.quick and "c" not in cfg.explicit:
        return None
    got = {}
    # the default allocator, and glibc's mmap threshold fixed at 1 MiB (see fsdp_memory.py)
    for strategy, threshold in (("ddp", None), ("fsdp", None), ("ddp", "1048576"), ("fsdp", "1048576")):
        with harness.scratch_path() as out:
            harness.run_bounded([sys.executable, os.path.join(HERE, "fsdp_memory.py"), "--strategy", strategy,
                                 "--out", out], cfg.ddp_timeout_s, f"fsdp_memory.py --strategy {strategy}",
                                **({"MALLOC_MMAP_THRESHOLD_": threshold} if threshold else {}))
            got[strategy, threshold] = harness.read_json(out)
    n = got["ddp", None][0]["n_params"]
    rows = []
    for metric, key, threshold in (
            ("tensor state per rank (params+grads+Adam+buffers)", "total_mib", None),
            ("peak RSS per rank", "peak_rss_mib", None),
            ("peak RSS over the pre-model baseline, glibc mmap threshold 1 MiB", "peak_over_baseline_mib", "1048576")):
        f_mib = max(r[key] for r in got["fsdp", threshold])
        d_mib = max(r[key] for r in got["ddp", threshold])
        ratio = f_mib / d_mib
        rows.append(Row("c", f"ppo actor {n / 1e6:.1f}M params: {metric}", "FabricLearner(fsdp)", "FabricLearner(ddp)",
                        "MiB", f_mib, d_mib, ratio, ratio, (ratio, ratio), None, None, None, "-",
                        "max over the 2 ranks, one measurement; ideal state ratio 0.5",
                        {"FabricLearner(fsdp)": [r[key] for r in got["fsdp", threshold]],
                         "FabricLearner(ddp)": [r[key] for r in got["ddp", threshold]]}))
    return rows


def case_compile(cfg: Config) -> list[Row] | None:
    """HOOK, issue "compile=True": ``LocalLearner``/``FabricLearner(compile=True).update`` vs the eager hand loop.

    As case a, one process, one thread. Goal (PPO): at least 1.5x faster than the hand-written eager
    torchrl loop, i.e. ratio <= 0.667; DQN and SAC are reported. Full mode adds a hand-written
    ``torch.compile(loss)`` loop (fused Adam) as a reference. Compilation happens in an explicit
    warm-up before timing (two passes over the batches: the loss writes keys into them on the
    first, which is a second graph variant); its time goes into each row's note, apart from the
    steady-state medians.
    """
    if cfg.quick and "compile" not in cfg.explicit:  # compiling alone takes 1-2 minutes here
        return None
    rows = []
    for name in cfg.workloads:
        batches = common.make_batches(name)
        k = len(batches)
        contenders: dict[str, Any] = {
            "hand torchrl loop": common.HandTorchrl(common.make_loss(name)[0]),
            "LocalLearner(compile).update": LocalLearner(common.make_loss(name)[0], clip_grad_norm=common.CLIP,
                                                         compile=True),
            "FabricLearner(cpu,1,compile).update": FabricLearner(
                common.make_loss(name)[0], clip_grad_norm=common.CLIP, accelerator="cpu", devices=1, compile=True),
        }
        # the second baseline of the row: the same compiled loss by hand, with the same fused Adam
        contenders["hand torch.compile loop"] = common.HandCompiled(common.make_loss(name)[0])
        compile_s = {}
        for label, obj in contenders.items():
            calls = []
            for i in range(2 * k + 1):
                t = time.perf_counter()
                obj.update(batches[i % k])
                calls.append(time.perf_counter() - t)
            compile_s[label] = (max(calls), sum(calls))
        cpu: dict[str, list[float]] = {}
        samples = harness.interleaved(
            {label: (lambda i, obj=obj: obj.update(batches[i % k])) for label, obj in contenders.items()},
            reps=cfg.reps, inner=cfg.inner, warmup=cfg.warmup, cpu=cpu,
        )
        assert torch.get_num_threads() == 1, torch.get_num_threads()
        goal = 1 / 1.5 if name == "ppo" else None
        base = "hand torchrl loop"

        def note(label: str) -> str:
            slowest, total = compile_s[label]
            shared = "; FabricLearner reuses LocalLearner's graph" if "Fabric" in label else ""
            return (f"{common.WORKLOAD_DESC[name]}; warm-up (compiling) {total:.1f} s, "
                    f"slowest call {slowest:.1f} s{shared}")

        for label in contenders:
            if label not in (base, "hand torch.compile loop"):
                rows.append(compare("compile", name, samples, label, base, goal if "Learner" in label else None,
                                    unit="ms/update", note=note(label), cpu_s=cpu))
        for label in ("LocalLearner(compile).update", "FabricLearner(cpu,1,compile).update"):
            rows.append(compare("compile", name, samples, label, "hand torch.compile loop", 1.03,
                                unit="ms/update", cpu_s=cpu,
                                note="the learner around the same compiled loss and the same fused Adam"))
    return rows


HOOKS: dict[str, Callable[[Config], list[Row] | None]] = {"c": case_c_fsdp_memory, "compile": case_compile}

# ======================================================================================================


def fmt_table(rows: list[Row]) -> str:
    head = ("case", "workload", "contender", "baseline", "unit", "contender", "baseline", "ratio", "paired [95% CI]",
            "cpu ratio", "goal", "verdict")
    lines = [head]
    for r in rows:
        lines.append((r.case, r.workload, r.contender, r.baseline, r.unit, f"{r.contender_median:.3f}",
                      f"{r.baseline_median:.3f}", f"{r.ratio:.3f}", f"{r.paired:.3f} [{r.ci[0]:.2f}, {r.ci[1]:.2f}]",
                      "-" if r.cpu_ratio is None else f"{r.cpu_ratio:.3f}",
                      "-" if r.goal is None else f"<= {r.goal:.2f}", r.verdict))
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(head))]
    out = ["| " + " | ".join(str(c).ljust(w) for c, w in zip(line, widths)) + " |" for line in lines]
    out.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(out)


def fmt_scaling(scaling: list[dict]) -> str:
    def num(x, f="{:.1f}"):
        return "-" if x is None else f.format(x)

    head = ("workload", "contender", "1 proc, no DDP", "DDP 1 rank", "DDP 2 ranks (per rank)", "per-rank eff.",
            "total speedup", "efficiency vs")
    lines = [head]
    for s in scaling:
        lines.append((s["workload"], s["contender"], num(s["no_ddp_1proc_updates_per_s"]),
                      num(s["ddp_1rank_updates_per_s"]), num(s["ddp_2rank_updates_per_s_per_rank"]),
                      num(s["per_rank_efficiency"], "{:.2f}"), num(s["total_speedup_2_vs_1"], "{:.2f}x"),
                      s["efficiency_vs"]))
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(head))]
    out = ["| " + " | ".join(str(c).ljust(w) for c, w in zip(line, widths)) + " |" for line in lines]
    out.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "updates/second per rank, 1 thread per rank:\n" + "\n".join(out)


def plot(rows: list[Row], scaling: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(16, max(6, 0.38 * len(rows) + 2)),
                             gridspec_kw={"width_ratios": [3, 2]})
    ax = axes[0]
    def short(r: Row) -> str:
        return r.workload.split(": ")[-1].split(" (")[0] if r.case == "c" else r.workload.split(",")[0][:22]

    labels = [f"{r.case} {short(r)}: {r.contender} / {r.baseline}"[:90] for r in rows]
    y = list(range(len(rows)))[::-1]
    colors = ["tab:gray" if r.met is None else ("tab:green" if r.met else "tab:red") for r in rows]
    ax.barh(y, [r.ratio for r in rows], color=colors)
    ax.scatter([r.paired for r in rows], y, color="black", marker="|", s=120, zorder=3, label="paired ratio")
    for yi, r in zip(y, rows):
        if r.goal is not None:
            ax.plot([r.goal, r.goal], [yi - 0.4, yi + 0.4], color="tab:blue", lw=2)
    ax.axvline(1.0, color="black", lw=0.8)
    ax.set_yticks(y)
    ax.set_yticklabels(labels, fontsize=7)
    ax.set_xlabel("ratio of medians (contender / hand-written); blue tick = goal; grey = no goal")
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title("learner vs hand-written (lower is better)")
    ax = axes[1]
    if scaling:
        names = [f"{s['workload']}\n{s['contender'].replace('FabricLearner', 'Learner')}" for s in scaling]
        x = range(len(scaling))
        w = 0.27
        ax.bar([i - w for i in x], [s["no_ddp_1proc_updates_per_s"] or 0 for s in scaling], w,
               label="1 process, no DDP")
        ax.bar(list(x), [s["ddp_1rank_updates_per_s"] or 0 for s in scaling], w, label="DDP, 1 rank")
        ax.bar([i + w for i in x], [s["ddp_2rank_updates_per_s_per_rank"] for s in scaling], w,
               label="DDP, 2 ranks (per rank)")
        ax.set_xticks(list(x))
        ax.set_xticklabels(names, fontsize=7)
        ax.set_ylabel("updates / second / rank")
        ax.legend(fontsize=8)
    ax.set_title("case f: scaling, 1 thread per rank")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def replot(path: str) -> int:
    saved = harness.read_json(path)
    rows = [Row(**{**r, "ci": tuple(r["ci"])}) for r in saved["rows"]]
    meta = saved["meta"]
    print(fmt_table(rows))
    if saved["scaling"]:
        print()
        print(fmt_scaling(saved["scaling"]))
    png = os.path.splitext(path)[0] + ".png"
    plot(rows, saved["scaling"], png, _title(meta))
    print(f"wrote {png}")
    return 0


def _title(meta: dict[str, Any]) -> str:
    return (f"fabric_learner benchmarks, {meta['mode']} mode, {meta['date']}, {meta['machine']['cpus']} CPUs "
            f"({meta['machine']['cpu']}), load {meta['loadavg_before'][0]:.1f}; torch {meta['machine']['torch']}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer repetitions: under 5 minutes on 2 cores")
    p.add_argument("--smoke", action="store_true", help="2 repetitions: only checks that the suite runs")
    p.add_argument("--only", default="a,b,d,e,f," + ",".join(HOOKS),
                   help="comma-separated cases to run (b, DDP get_weights and f share one launch)")
    p.add_argument("--workloads", default=",".join(common.WORKLOADS),
                   help=f"comma-separated workloads for cases a, b, f and compile (of {', '.join(common.WORKLOADS)})")
    p.add_argument("--reps", type=int, default=None, help="repetitions of case a (default: the mode's)")
    p.add_argument("--out", default=None,
                   help="results JSON (default: results/latest.json for a full run of every case, the one the "
                        "docs cite; results/partial.json for --quick, --smoke, --only, --workloads or --reps)")
    p.add_argument("--replot", metavar="JSON", help="only redraw the PNG beside a results JSON, and print its tables")
    args = p.parse_args(argv)
    if args.replot:
        return replot(args.replot)
    cfg = SMOKE if args.smoke else QUICK if args.quick else FULL
    if args.only != p.get_default("only"):
        cfg = replace(cfg, explicit=tuple(args.only.split(",")))
    workloads = tuple(w for w in args.workloads.split(",") if w)
    unknown = sorted(set(workloads) - set(common.WORKLOADS))
    if unknown or not workloads:
        p.error(f"--workloads {args.workloads!r}: unknown {unknown or 'empty'}; "
                f"choose from {', '.join(common.WORKLOADS)}")
    if workloads != common.WORKLOADS:
        cfg = replace(cfg, workloads=workloads)
    if args.reps is not None:
        if args.reps < 2:
            p.error(f"--reps must be at least 2 (a median and an interval need repetitions), got {args.reps}")
        cfg = replace(cfg, reps=args.reps)
    if args.out is None:  # any change to the full configuration (mode, --only, --workloads, --reps) makes it partial
        args.out = os.path.join(RESULTS, "latest.json" if cfg == FULL else "partial.json")
    only = set(args.only.split(","))
    warnings.filterwarnings("ignore")
    harness.set_one_thread()
    t0 = time.perf_counter()
    load_before = os.getloadavg()
    rows: list[Row] = []
    scaling: list[dict] = []
    timings: dict[str, float] = {}
    skipped: list[str] = []

    def timed(key: str, fn: Callable[[], Any]) -> Any:
        t = time.perf_counter()
        print(f"[bench] case {key} ...", flush=True)
        result = fn()
        timings[key] = time.perf_counter() - t
        print(f"[bench] case {key}: {timings[key]:.0f}s", flush=True)
        return result

    if "a" in only:
        rows += timed("a", lambda: case_a(cfg))
    if only & {"b", "e", "f"}:
        ddp_rows, scaling = timed("b+e(ddp)+f", lambda: case_b_e_f(cfg, rows, with_e="e" in only,
                                                                    with_f="f" in only))
        rows += ddp_rows
    if "d" in only:
        rows += timed("d", lambda: case_d(cfg))
    if "e" in only:
        rows += timed("e", lambda: case_e(cfg))
    for key, hook in HOOKS.items():
        if key in only:
            got = timed(key, lambda hook=hook: hook(cfg))
            if got is None:
                skipped.append(key)
            else:
                rows += got
    rows.sort(key=lambda r: r.case)

    total = time.perf_counter() - t0
    meta = {"mode": "smoke" if args.smoke else "quick" if cfg.quick else "full", "config": asdict(cfg),
            "machine": harness.machine(), "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
            "wall_s": total, "case_wall_s": timings, "skipped_hooks": skipped,
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    table = fmt_table(rows)
    print()
    print(table)
    if scaling:
        print()
        print(fmt_scaling(scaling))
    goals = [r for r in rows if r.goal is not None]
    print(f"\ngoals: {sum(r.met is True for r in goals)} met, {sum(r.met is False for r in goals)} not met, "
          f"{sum(r.met is None for r in goals)} undecided, of {len(goals)}"
          + "".join(f"\n  {'NOT MET' if r.met is False else 'UNDECIDED'}: {r.case} {r.workload}: {r.contender} / "
                    f"{r.baseline} = {r.ratio:.3f} [{r.ci[0]:.3f}, {r.ci[1]:.3f}] vs {r.goal}"
                    for r in goals if r.met is not True))
    if skipped:
        print(f"cases skipped (quick mode runs c and compile only when named with --only): {', '.join(skipped)}")
    print(f"mode {meta['mode']}, {total:.0f}s, load average {load_before[0]:.1f} -> "
          f"{meta['loadavg_after'][0]:.1f}, {meta['machine']['cpus']} CPUs")

    harness.write_json(args.out, {"meta": meta, "rows": [asdict(r) for r in rows], "scaling": scaling, "table": table,
                                  "scaling_table": fmt_scaling(scaling) if scaling else ""})
    png = os.path.splitext(args.out)[0] + ".png"
    plot(rows, scaling, png, _title(meta))
    print(f"wrote {args.out} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
