"""The benchmark suite, every case beside its hand-written loop in one command; and the list of every benchmark.

    python benchmarks/run.py              # full mode (~11-13 min on 2 busy cores): results/latest.json and .png
    python benchmarks/run.py --quick      # ~2 min (make bench); --smoke: 2 repetitions, numbers meaningless
    python benchmarks/run.py --only a,d --workloads ppo --reps 61 --set inner=2   # some cases, settings changed
    python benchmarks/run.py --list       # every benchmark script and the stored results whose command runs it

The cases (a-f, compile) and how they are timed: benchmarks/README.md. Any run but a full run of every case
writes results/partial.json unless given ``--out``.
"""

from __future__ import annotations

import ast
import functools
import glob
import os
import shlex
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Callable

os.environ["OMP_NUM_THREADS"] = "1"  # before torch is imported: one thread, here and in every rank
os.environ.setdefault("RL_WARNINGS", "False")
HERE = os.path.dirname(os.path.abspath(__file__))

import common  # noqa: E402
import harness  # noqa: E402
import torch  # noqa: E402
from tensordict import TensorDict  # noqa: E402

from fabric_learner import FabricLearner, LocalLearner  # noqa: E402

TWIN = "A/A control: two identical loops; its distance from 1 is this run's noise floor"
RAW = "raw TensorDict.from_module(policy).data.clone()"


@dataclass(frozen=True)
class Config:
    quick: bool
    reps: int  # case a (and compile): repetitions, updates per block, warm-up
    inner: int
    warmup: int
    ddp_reps: int  # cases b/f
    ddp_inner: int
    ddp_timeout_s: int
    ckpt_reps: int  # case d
    ckpt_inner: int
    gw_reps: int  # case e
    gw_inner: int
    workloads: tuple[str, ...] = common.WORKLOADS
    explicit: tuple = ()  # cases named with --only; quick mode runs c and compile only then


QUICK = Config(quick=True, reps=150, inner=1, warmup=5, ddp_reps=10, ddp_inner=4, ddp_timeout_s=200,
               ckpt_reps=4, ckpt_inner=1, gw_reps=4, gw_inner=1)
FULL = Config(quick=False, reps=600, inner=1, warmup=10, ddp_reps=600, ddp_inner=1, ddp_timeout_s=600,
              ckpt_reps=10, ckpt_inner=2, gw_reps=10, gw_inner=2)
SMOKE = Config(quick=True, reps=2, inner=2, warmup=1, ddp_reps=2, ddp_inner=2, ddp_timeout_s=200,
               ckpt_reps=2, ckpt_inner=1, gw_reps=2, gw_inner=1)


@dataclass
class Row:
    """``contender`` (a learner call) against ``baseline`` (hand-written), in ``measure`` (wall, or process CPU time
    summed over the ranks in case b, which keeps its wall figures in ``wall_paired`` / ``wall_ci``): ``ratio`` of
    medians, ``paired`` median per-repetition ratio with its interval ``ci`` (the verdict's), ``cpu_ratio``."""

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
    """A Row from interleaved per-call samples in seconds (reported in ms). ``by_cpu`` (case b) reports CPU time and
    meets a goal only when the CPU and the wall interval both do: CPU time alone would not see a cost spent waiting."""
    wall_c, wall_b = samples_s[contender], samples_s[baseline]
    c, b = (cpu_s[contender], cpu_s[baseline]) if by_cpu else (wall_c, wall_b)
    cm, bm = harness.median(c) * 1e3, harness.median(b) * 1e3
    ci = harness.bootstrap_ci(c, b, copies=copies)
    cpu_ratio, cpu_samples = None, {}
    if cpu_s and contender in cpu_s and baseline in cpu_s:
        cpu_ratio = harness.median(cpu_s[contender]) / harness.median(cpu_s[baseline])
        cpu_samples = {k: [x * 1e3 for x in cpu_s[k]] for k in (contender, baseline)}
    met, text, extra = harness.decide(ci, goal), harness.verdict(ci, goal), {}
    if by_cpu:
        wall_ci = harness.bootstrap_ci(wall_c, wall_b, copies=copies)
        extra = {"measure": "cpu", "wall_paired": harness.paired_ratio(wall_c, wall_b), "wall_ci": wall_ci}
        if harness.decide(wall_ci, goal) is not met:
            met, text = harness.both(ci, wall_ci, goal, detail=f" (cpu interval {ci[0]:.2f}-{ci[1]:.2f}, wall "
                                     f"{wall_ci[0]:.2f}-{wall_ci[1]:.2f}, vs {goal:.2f})")
    return Row(case, workload, contender, baseline, unit, cm, bm, cm / bm, harness.paired_ratio(c, b), ci, cpu_ratio,
               goal, met, text, note, {contender: [x * 1e3 for x in wall_c], baseline: [x * 1e3 for x in wall_b]},
               cpu_samples, **extra)


def case_a(cfg: Config) -> list[Row]:
    """One process, one thread, ``update()``: case a's contenders, five copies each taking turns."""
    rows = []
    for name in cfg.workloads:
        batches, cpu = common.make_batches(name), {}
        samples = harness.interleaved(
            {label: harness.rotating(build, batches) for label, build in common.case_a_contenders(name).items()},
            reps=cfg.reps, inner=cfg.inner, warmup=cfg.warmup, cpu=cpu)
        assert torch.get_num_threads() == 1, torch.get_num_threads()
        row = functools.partial(compare, "a", name, samples, unit="ms/update", cpu_s=cpu, copies=harness.INSTANCES,
                                note=common.WORKLOAD_DESC[name])
        rows += [row("LocalLearner.update", "hand torchrl loop", 1.03),
                 row("FabricLearner(cpu,1).update", "hand torchrl loop", 1.02),
                 row("FabricLearner(cpu,1).update", "hand Fabric loop", 1.03),
                 row("hand Fabric loop", "hand torchrl loop", None, note="reference: what Fabric itself costs"),
                 row("hand torchrl loop (twin)", "hand torchrl loop", None, note=TWIN)]
    return rows


def ddp_worker(cfg: Config, out: str) -> None:
    """One torchrun rank of cases b, e and f: ``FabricLearner(strategy="ddp")`` against a hand-written
    ``DistributedDataParallel`` loop and its A/A twin (5 copies each, same seeds, per-rank batches), and
    ``get_weights()`` of the 21M policy against the raw clones; rank 0 writes the JSON."""
    import torch.distributed as dist

    harness.set_one_thread(quiet=True)
    results: dict = {"updates": {}, "get_weights": None}
    rank = int(os.environ.get("RANK", "0"))
    for name in cfg.workloads:
        batches = common.make_batches(name, seed=1 + 7919 * rank)
        built: dict[str, list] = {"learner": [], "hand": [], "twin": []}

        def build(kind):
            loss = common.make_loss(name)[0]
            built[kind].append(common.HandDDP(loss) if kind != "learner" else FabricLearner(
                loss, None, clip_grad_norm=common.CLIP, accelerator="cpu", strategy="ddp"))
            return built[kind][-1]

        contenders = {label: harness.rotating(functools.partial(build, kind), batches) for label, kind in
                      (("FabricLearner(ddp)", "learner"), ("hand DDP", "hand"), ("hand DDP (twin)", "twin"))}
        cpu: dict[str, list[float]] = {}
        samples = harness.interleaved(contenders, reps=cfg.ddp_reps, inner=cfg.ddp_inner, warmup=cfg.warmup,
                                      sync=dist.barrier, cpu=cpu)
        same = None  # DQN is deterministic: each learner copy and its hand copy took the same steps
        if name == "dqn":
            same = all(torch.allclose(a, b, rtol=1e-4, atol=1e-5) for mine, h in zip(built["learner"], built["hand"], strict=True)
                       for a, b in zip(mine.loss_module.parameters(), h.ddp.module.loss.parameters(), strict=True))
        results["updates"][name] = {"samples_s": samples, "cpu_s": harness.summed_over_ranks(cpu),
                                    "same_weights": same, "threads": torch.get_num_threads()}
    if cfg.gw_reps:
        loss, policy = common.make_loss("ppo_big_actor")
        learner = FabricLearner(loss, None, policy=policy, accelerator="cpu", strategy="ddp")
        cpu = {}
        samples = harness.interleaved(
            {"FabricLearner(ddp).get_weights": lambda i: learner.get_weights(), **raw_clones(policy)},
            reps=cfg.gw_reps, inner=cfg.gw_inner, warmup=1, sync=dist.barrier, cpu=cpu)
        results["get_weights"] = {"samples_s": samples, "cpu_s": cpu, "policy_params": common.count_params(policy)}
    results.update(rank=rank, world_size=dist.get_world_size())
    dist.barrier()
    if rank == 0:
        harness.write_json(out, results, indent=None)
    dist.barrier()
    dist.destroy_process_group()


def raw_clones(policy) -> dict[str, Callable[[int], Any]]:
    return {RAW: lambda i: TensorDict.from_module(policy).data.clone(),
            "raw {k: v.detach().clone() for state_dict}": lambda i: {
                k: v.detach().clone() for k, v in policy.state_dict().items()}}


def case_b_e_f(cfg: Config, single_rows: list[Row], *, with_e: bool = True,
               with_f: bool = True) -> tuple[list[Row], list[dict]]:
    """One 2-rank launch of ``ddp_worker`` (b, and e under DDP); in full mode for f also a 1-rank launch (quick mode
    takes case a's single-process time as the 1-rank reference: a launch's start-up alone is ~30 s here)."""
    def ranks(nproc: int, get_weights: bool) -> dict:
        settings = {"ddp_reps": cfg.ddp_reps, "ddp_inner": cfg.ddp_inner, "warmup": cfg.warmup,
                    "gw_reps": cfg.gw_reps if get_weights else 0, "gw_inner": cfg.gw_inner}
        return harness.launch([__file__, "--ddp-worker", "--workloads", ",".join(cfg.workloads), "--set",
                               ",".join(f"{k}={v}" for k, v in settings.items())], ranks=nproc,
                              timeout_s=cfg.ddp_timeout_s, what=f"{nproc}-rank launch")

    two = ranks(2, with_e)
    one = ranks(1, False) if with_f and not cfg.quick else None
    rows = []
    for name, res in two["updates"].items():
        note = ("2 gloo ranks, 1 thread each; process CPU time summed over the ranks (verdict: CPU and wall)"
                + ("" if res["same_weights"] is not False else "; WEIGHTS DIFFER"))
        row = functools.partial(compare, "b", name, res["samples_s"], unit="ms/update (cpu, both ranks)",
                                cpu_s=res["cpu_s"], by_cpu=True, copies=harness.INSTANCES)
        rows += [row("FabricLearner(ddp)", "hand DDP", 1.05, note=note), row("hand DDP (twin)", "hand DDP", None, note=TWIN)]
    if two.get("get_weights"):
        gw = two["get_weights"]
        rows.append(compare("e", f"ppo actor {gw['policy_params'] / 1e6:.1f}M params", gw["samples_s"],
                            "FabricLearner(ddp).get_weights", RAW, None, unit="ms/call",
                            note="DDP, 2 ranks (rank 0's clock)", cpu_s=gw.get("cpu_s")))
    if not with_f:
        return rows, []
    single = {(r.workload, r.contender): r.contender_median for r in single_rows if r.case == "a"}
    single.update({(r.workload, r.baseline): r.baseline_median for r in single_rows if r.case == "a"})
    scaling = []
    for name in two["updates"]:
        for contender in ("FabricLearner(ddp)", "hand DDP"):
            ms2 = harness.median(two["updates"][name]["samples_s"][contender]) * 1e3
            ms1 = None if one is None else harness.median(one["updates"][name]["samples_s"][contender]) * 1e3
            ms0 = single.get((name, "FabricLearner(cpu,1).update" if contender == "FabricLearner(ddp)"
                              else "hand torchrl loop"))
            base = ms1 if ms1 is not None else ms0  # the 1-rank time efficiency is measured against
            scaling.append({
                "workload": name, "contender": contender,
                "no_ddp_1proc_updates_per_s": None if ms0 is None else 1e3 / ms0,
                "ddp_1rank_updates_per_s": None if ms1 is None else 1e3 / ms1,
                "ddp_2rank_updates_per_s_per_rank": 1e3 / ms2,
                "efficiency_vs": "DDP 1 rank" if ms1 is not None else "1 process, no DDP",
                "per_rank_efficiency": None if base is None else base / ms2,  # 1.0 = perfect weak scaling
                "total_speedup_2_vs_1": None if base is None else 2 * base / ms2})
    return rows, scaling


def case_d(cfg: Config) -> list[Row]:
    """Checkpoints of PPO with MLP [1024]x3 and Adam's state: the learners' save/load against torch.save/load."""
    cells, batches = (1024, 1024, 1024), common.make_batches("ppo", count=2)
    hand = common.HandTorchrl(common.make_loss("ppo", cells=cells)[0])
    local = LocalLearner(common.make_loss("ppo", cells=cells)[0])
    fabric = FabricLearner(common.make_loss("ppo", cells=cells)[0], accelerator="cpu", devices=1)
    for td in batches:  # Adam's state populated, as in a real checkpoint
        for each in (hand, local, fabric):
            each.update(td)
    tmp = tempfile.mkdtemp(prefix="fl_bench_ckpt_")
    paths = {k: os.path.join(tmp, f"{k}.pt") for k in ("hand", "atomic", "local", "fabric")}

    def hand_save(path):
        torch.save({"model": hand.loss.state_dict(), "optimizer": hand.opt.state_dict()}, path)

    def hand_atomic_save(i):  # what the learner's durability costs when written by hand
        with open(paths["atomic"] + ".partial", "wb") as f:
            hand_save(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(paths["atomic"] + ".partial", paths["atomic"])

    def hand_load(i):
        state = torch.load(paths["hand"], map_location="cpu", weights_only=True)
        hand.loss.load_state_dict(state["model"])
        hand.opt.load_state_dict(state["optimizer"])

    cpu: dict[str, list[float]] = {}
    timed = functools.partial(harness.interleaved, reps=cfg.ckpt_reps, inner=cfg.ckpt_inner, warmup=1, cpu=cpu)
    try:
        save = timed({"torch.save(state_dicts)": lambda i: hand_save(paths["hand"]),
                      "torch.save + fsync + rename": hand_atomic_save,
                      "LocalLearner.save": lambda i: local.save(paths["local"]),
                      "FabricLearner.save": lambda i: fabric.save(paths["fabric"])})
        load = timed({"torch.load + load_state_dicts": hand_load, "LocalLearner.load": lambda i: local.load(paths["local"]),
                      "FabricLearner.load": lambda i: fabric.load(paths["fabric"])})
        size_mb = os.path.getsize(paths["local"]) / 2**20
    finally:
        for p in paths.values():
            if os.path.exists(p):
                os.unlink(p)
        os.rmdir(tmp)
    w = f"ppo MLP[1024]x3, {common.count_params(hand.loss) / 1e6:.1f}M params + Adam, {size_mb:.0f} MB file"
    row = functools.partial(compare, "d", w, unit="ms/call", cpu_s=cpu)
    return [row(save, "LocalLearner.save", "torch.save(state_dicts)", 1.2),
            row(save, "FabricLearner.save", "torch.save(state_dicts)", 1.2),
            row(save, "torch.save + fsync + rename", "torch.save(state_dicts)", None,
                note="reference: the cost of an atomic, durable write by hand"),
            row(save, "LocalLearner.save", "torch.save + fsync + rename", None,
                note="reference: learner vs an equally durable hand-written save"),
            row(load, "LocalLearner.load", "torch.load + load_state_dicts", 1.2),
            row(load, "FabricLearner.load", "torch.load + load_state_dicts", 1.2)]


def case_e(cfg: Config) -> list[Row]:
    """``get_weights()`` of the 21M policy in one process, against the raw clones."""
    loss, policy = common.make_loss("ppo_big_actor")
    local = LocalLearner(loss, policy=policy)
    fabric = FabricLearner(loss, policy=policy, accelerator="cpu", devices=1)
    cpu: dict[str, list[float]] = {}
    samples = harness.interleaved({**raw_clones(policy), "LocalLearner.get_weights": lambda i: local.get_weights(),
                                   "FabricLearner(cpu,1).get_weights": lambda i: fabric.get_weights()},
                                  reps=cfg.gw_reps, inner=cfg.gw_inner, warmup=1, cpu=cpu)
    row = functools.partial(compare, "e", f"ppo actor {common.count_params(policy) / 1e6:.1f}M params", samples,
                            baseline=RAW, goal=None, unit="ms/call", cpu_s=cpu)
    return [row("LocalLearner.get_weights", note="1 process"), row("FabricLearner(cpu,1).get_weights", note="1 process"),
            row("raw {k: v.detach().clone() for state_dict}", note="reference: the two raw calls")]


# ---- HOOKS: ``fn(cfg) -> list[Row] | None`` (None: skipped) -------------------------------------------


def case_c_fsdp_memory(cfg: Config) -> list[Row] | None:
    """Memory per rank of ``FabricLearner`` under FSDP vs DDP (``fsdp.py memory``, 2 CPU ranks, the 21M PPO loss):
    tensor state and peak RSS, again with glibc's mmap threshold fixed; goal-less (0.5 is ideal)."""
    if cfg.quick and "c" not in cfg.explicit:
        return None
    got = {(strategy, threshold): harness.launch(
        [os.path.join(HERE, "fsdp.py"), "memory", "--strategy", strategy], timeout_s=cfg.ddp_timeout_s,
        what=f"fsdp.py memory --strategy {strategy}", **({"MALLOC_MMAP_THRESHOLD_": threshold} if threshold else {}))
        for strategy, threshold in (("ddp", None), ("fsdp", None), ("ddp", "1048576"), ("fsdp", "1048576"))}
    rows = []
    for metric, key, threshold in (
            ("tensor state per rank (params+grads+Adam+buffers)", "total_mib", None),
            ("peak RSS per rank", "peak_rss_mib", None),
            ("peak RSS over the pre-model baseline, glibc mmap threshold 1 MiB", "peak_over_baseline_mib", "1048576")):
        f_mib, d_mib = (max(r[key] for r in got[s, threshold]) for s in ("fsdp", "ddp"))
        ratio = f_mib / d_mib
        rows.append(Row("c", f"ppo actor {got['ddp', None][0]['n_params'] / 1e6:.1f}M params: {metric}",
                        "FabricLearner(fsdp)", "FabricLearner(ddp)", "MiB", f_mib, d_mib, ratio, ratio, (ratio, ratio),
                        None, None, None, "-", "max over the 2 ranks, one measurement; ideal state ratio 0.5",
                        {f"FabricLearner({s})": [r[key] for r in got[s, threshold]] for s in ("fsdp", "ddp")}))
    return rows


def case_compile(cfg: Config) -> list[Row] | None:
    """``compile=True`` learners against the eager hand loop (goal for PPO: 1.5x faster, ratio <= 0.667) and against
    a hand ``torch.compile(loss)`` loop with fused Adam; two passes over the batches first, which compile."""
    if cfg.quick and "compile" not in cfg.explicit:  # compiling alone takes 1-2 minutes here
        return None
    rows, base, hand_compiled = [], "hand torchrl loop", "hand torch.compile loop"
    for name in cfg.workloads:
        batches = common.make_batches(name)
        k = len(batches)
        contenders: dict[str, Any] = {
            base: common.HandTorchrl(common.make_loss(name)[0]),
            "LocalLearner(compile).update": LocalLearner(common.make_loss(name)[0], clip_grad_norm=common.CLIP,
                                                         compile=True),
            "FabricLearner(cpu,1,compile).update": FabricLearner(
                common.make_loss(name)[0], clip_grad_norm=common.CLIP, accelerator="cpu", devices=1, compile=True),
            hand_compiled: common.HandCompiled(common.make_loss(name)[0])}
        compile_s = {}
        for label, obj in contenders.items():
            calls = []
            for i in range(2 * k + 1):
                t = time.perf_counter()
                obj.update(batches[i % k])
                calls.append(time.perf_counter() - t)
            compile_s[label] = (max(calls), sum(calls))
        cpu: dict[str, list[float]] = {}
        samples = harness.interleaved({label: (lambda i, obj=obj: obj.update(batches[i % k]))
                                       for label, obj in contenders.items()},
                                      reps=cfg.reps, inner=cfg.inner, warmup=cfg.warmup, cpu=cpu)
        assert torch.get_num_threads() == 1, torch.get_num_threads()

        def note(label: str) -> str:
            shared = "; FabricLearner reuses LocalLearner's graph" if "Fabric" in label else ""
            return (f"{common.WORKLOAD_DESC[name]}; warm-up (compiling) {compile_s[label][1]:.1f} s, "
                    f"slowest call {compile_s[label][0]:.1f} s{shared}")

        row = functools.partial(compare, "compile", name, samples, unit="ms/update", cpu_s=cpu)
        rows += [row(label, base, (1 / 1.5 if name == "ppo" else None) if "Learner" in label else None,
                     note=note(label)) for label in contenders if label not in (base, hand_compiled)]
        rows += [row(label, hand_compiled, 1.03, note="the learner around the same compiled loss and the same fused Adam")
                 for label in ("LocalLearner(compile).update", "FabricLearner(cpu,1,compile).update")]
    return rows


HOOKS: dict[str, Callable[[Config], list[Row] | None]] = {"c": case_c_fsdp_memory, "compile": case_compile}


# ---- report ----------------------------------------------------------------------------------------


def fmt_table(rows: list[Row]) -> str:
    return harness.table(
        ("case", "workload", "contender", "baseline", "unit", "contender", "baseline", "ratio", "paired [95% CI]",
         "cpu ratio", "goal", "verdict"),
        [(r.case, r.workload, r.contender, r.baseline, r.unit, f"{r.contender_median:.3f}", f"{r.baseline_median:.3f}",
          f"{r.ratio:.3f}", f"{r.paired:.3f} [{r.ci[0]:.2f}, {r.ci[1]:.2f}]",
          "-" if r.cpu_ratio is None else f"{r.cpu_ratio:.3f}", "-" if r.goal is None else f"<= {r.goal:.2f}",
          r.verdict) for r in rows])


def fmt_scaling(scaling: list[dict]) -> str:
    def num(x, f="{:.1f}"):
        return "-" if x is None else f.format(x)

    return "updates/second per rank, 1 thread per rank:\n" + harness.table(
        ("workload", "contender", "1 proc, no DDP", "DDP 1 rank", "DDP 2 ranks (per rank)", "per-rank eff.",
         "total speedup", "efficiency vs"),
        [(s["workload"], s["contender"], num(s["no_ddp_1proc_updates_per_s"]), num(s["ddp_1rank_updates_per_s"]),
          num(s["ddp_2rank_updates_per_s_per_rank"]), num(s["per_rank_efficiency"], "{:.2f}"),
          num(s["total_speedup_2_vs_1"], "{:.2f}x"), s["efficiency_vs"]) for s in scaling])


def plot(rows: list[Row], scaling: list[dict], path: str, meta: dict) -> None:
    """Ratios with their goals (left), updates/s per rank (right), to the PNG beside ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, right) = plt.subplots(1, 2, figsize=(16, max(6, 0.38 * len(rows) + 2)), gridspec_kw={"width_ratios": [3, 2]})
    short = [r.workload.split(": ")[-1].split(" (")[0] if r.case == "c" else r.workload.split(",")[0][:22] for r in rows]
    y = list(range(len(rows)))[::-1]
    ax.barh(y, [r.ratio for r in rows], color=["tab:gray" if r.met is None else ("tab:green" if r.met else "tab:red")
                                               for r in rows])
    ax.scatter([r.paired for r in rows], y, color="black", marker="|", s=120, zorder=3, label="paired ratio")
    for yi, r in zip(y, rows):
        if r.goal is not None:
            ax.plot([r.goal, r.goal], [yi - 0.4, yi + 0.4], color="tab:blue", lw=2)
    ax.axvline(1.0, color="black", lw=0.8)
    ax.set_yticks(y)
    ax.set_yticklabels([f"{r.case} {s}: {r.contender} / {r.baseline}"[:90] for r, s in zip(rows, short)], fontsize=7)
    ax.set_xlabel("ratio of medians (contender / hand-written); blue tick = goal; grey = no goal")
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title("learner vs hand-written (lower is better)")
    if scaling:
        x, w = range(len(scaling)), 0.27
        for dx, key, label in ((-w, "no_ddp_1proc_updates_per_s", "1 process, no DDP"), (0, "ddp_1rank_updates_per_s",
                               "DDP, 1 rank"), (w, "ddp_2rank_updates_per_s_per_rank", "DDP, 2 ranks (per rank)")):
            right.bar([i + dx for i in x], [s[key] or 0 for s in scaling], w, label=label)
        right.set_xticks(list(x))
        right.set_xticklabels([f"{s['workload']}\n{s['contender'].replace('FabricLearner', 'Learner')}"
                               for s in scaling], fontsize=7)
        right.set_ylabel("updates / second / rank")
        right.legend(fontsize=8)
    right.set_title("case f: scaling, 1 thread per rank")
    fig.suptitle(f"fabric_learner benchmarks, {meta['mode']} mode, {meta['date']}, {meta['machine']['cpus']} CPUs "
                 f"({meta['machine']['cpu']}), load {meta['loadavg_before'][0]:.1f}; torch {meta['machine']['torch']}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(os.path.splitext(path)[0] + ".png", dpi=110)
    plt.close(fig)
    print(f"wrote {os.path.splitext(path)[0]}.png")


def tables(rows: list[Row], scaling: list[dict]) -> str:
    return fmt_table(rows) + (f"\n\n{fmt_scaling(scaling)}" if scaling else "")


def listing() -> dict[str, dict]:
    """Every benchmark script (all of benchmarks/*.py but the harness and the shared workloads): its docstring's
    first line and, by path, the stored results under results/ whose ``command`` runs it."""
    scripts = {os.path.basename(p): {"what": (ast.get_docstring(ast.parse(open(p).read())) or "").split("\n")[0],
                                     "results": {}}
               for p in sorted(glob.glob(os.path.join(HERE, "*.py")))
               if os.path.basename(p) not in ("harness.py", "common.py")}
    for path in sorted(glob.glob(os.path.join(harness.RESULTS, "**", "*.json"), recursive=True)):
        relative = os.path.relpath(path, HERE)
        if "partial" in relative.split(os.sep) or relative.startswith("results/partial."):  # not stored (ignored)
            continue
        data = harness.read_json(path)
        command = data.get("command") if isinstance(data, dict) else None
        script = os.path.basename(shlex.split(command)[1]) if command else "(no command)"
        scripts.setdefault(script, {"what": "", "results": {}})["results"][relative] = command
    return scripts


def parser():
    p = harness.parser(__doc__)
    p.add_argument("--quick", action="store_true", help="fewer repetitions: about 2 minutes on 2 cores")
    p.add_argument("--smoke", action="store_true", help="2 repetitions: only checks that the suite runs")
    p.add_argument("--only", default="a,b,d,e,f," + ",".join(HOOKS),
                   help="comma-separated cases (b, DDP get_weights and f share one launch)")
    p.add_argument("--workloads", default=",".join(common.WORKLOADS), help="for cases a, b, f and compile")
    p.add_argument("--reps", type=int, default=None, help="repetitions of case a (default: the mode's)")
    p.add_argument("--set", default="", help="other settings of the mode, as name=value,... (Config's fields)")
    p.add_argument("--replot", metavar="JSON", help="only redraw the PNG beside a results JSON, and print its tables")
    p.add_argument("--list", action="store_true", help="every benchmark and the stored results it writes")
    p.add_argument("--ddp-worker", action="store_true", help="one rank of cases b, e, f (under torchrun)")
    return p


def config(p, args) -> Config:
    cfg = SMOKE if args.smoke else QUICK if args.quick else FULL
    if args.only != p.get_default("only"):
        cfg = replace(cfg, explicit=tuple(args.only.split(",")))
    workloads = tuple(w for w in args.workloads.split(",") if w)
    if not workloads or set(workloads) - set(common.WORKLOADS):
        p.error(f"--workloads {args.workloads!r}: choose from {', '.join(common.WORKLOADS)}")
    if args.reps is not None and args.reps < 2:
        p.error(f"--reps must be at least 2 (a median and an interval need repetitions), got {args.reps}")
    kinds = {f.name: f.type for f in fields(Config)}
    settings = dict(item.split("=", 1) for item in args.set.split(",") if item)
    if set(settings) - {k for k, t in kinds.items() if t == "int"}:
        p.error(f"--set {args.set!r}: integer settings are {', '.join(k for k, t in kinds.items() if t == 'int')}")
    return replace(cfg, **({"workloads": workloads} if workloads != common.WORKLOADS else {}),
                   **({"reps": args.reps} if args.reps is not None else {}), **{k: int(v) for k, v in settings.items()})


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.list:
        for script, entry in listing().items():
            print(f"{script}: {entry['what']}" + "".join(f"\n    {path}: {command}"
                                                         for path, command in entry["results"].items()))
        return 0
    if args.replot:
        saved = harness.read_json(args.replot)
        rows = [Row(**{**r, "ci": tuple(r["ci"])}) for r in saved["rows"]]
        print(tables(rows, saved["scaling"]))
        return plot(rows, saved["scaling"], args.replot, saved["meta"]) or 0
    cfg = config(p, args)
    if args.ddp_worker:
        return ddp_worker(cfg, args.out)
    # any change to the full configuration (mode, --only, --workloads, --reps, --set) makes the run partial
    args.out = args.out or os.path.join(harness.RESULTS, "latest.json" if cfg == FULL else "partial.json")
    only = set(args.only.split(","))
    harness.set_one_thread(quiet=True)
    t0, load_before = time.perf_counter(), os.getloadavg()
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
        ddp_rows, scaling = timed("b+e(ddp)+f", lambda: case_b_e_f(cfg, rows, with_e="e" in only, with_f="f" in only))
        rows += ddp_rows
    if "d" in only:
        rows += timed("d", lambda: case_d(cfg))
    if "e" in only:
        rows += timed("e", lambda: case_e(cfg))
    for key, hook in HOOKS.items():
        if key in only:
            got = timed(key, lambda hook=hook: hook(cfg))
            skipped += [key] if got is None else []
            rows += got or []
    rows.sort(key=lambda r: r.case)
    total = time.perf_counter() - t0
    meta = {"mode": "smoke" if args.smoke else "quick" if cfg.quick else "full", "config": asdict(cfg),
            "machine": harness.machine(), "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
            "wall_s": total, "case_wall_s": timings, "skipped_hooks": skipped, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    goals = [r for r in rows if r.goal is not None]
    print(f"\n{tables(rows, scaling)}\n\ngoals: {sum(r.met is True for r in goals)} met, "
          f"{sum(r.met is False for r in goals)} not met, {sum(r.met is None for r in goals)} undecided, of {len(goals)}"
          + "".join(f"\n  {'NOT MET' if r.met is False else 'UNDECIDED'}: {r.case} {r.workload}: {r.contender} / "
                    f"{r.baseline} = {r.ratio:.3f} [{r.ci[0]:.3f}, {r.ci[1]:.3f}] vs {r.goal}"
                    for r in goals if r.met is not True)
          + (f"\ncases skipped (quick mode runs c and compile only when named with --only): {', '.join(skipped)}"
             if skipped else "")
          + f"\nmode {meta['mode']}, {total:.0f}s, load average {load_before[0]:.1f} -> {meta['loadavg_after'][0]:.1f}, "
          f"{meta['machine']['cpus']} CPUs")
    harness.write_result(args.out, {"meta": meta, "rows": [asdict(r) for r in rows], "scaling": scaling,
                                    "table": fmt_table(rows), "scaling_table": fmt_scaling(scaling) if scaling else ""})
    print(f"wrote {args.out}")
    plot(rows, scaling, args.out, meta)
    return 0


if __name__ == "__main__":
    sys.exit(main())
