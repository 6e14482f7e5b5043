"""GRPO on a Qwen2-architecture model, 2 CPU ranks: the learner against the FSDP2 loop a user writes by hand.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/llm_update.py            # ~6 min on 2 quiet cores (876 s busy)
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/llm_update.py --quick    # tiny models: does it run? (~2.5 min)
    .venv/bin/python benchmarks/llm_update.py --strategy ddp --parts speed # against hand DDP; --reps N: more or fewer

Parts (speed, memory, capped, batching), each its own launches, and their goals: benchmarks/README.md, "LLM
post-training". Writes ``results/llm_update.json``.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import dataclasses
import functools
import gc
import os
import statistics
import time
from datetime import timedelta

import harness
import torch
import torch.distributed as dist
from common import SumLoss, grpo_loss, grpo_params, summed_loss
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from torchrl.modules.llm import TransformersWrapper  # noqa: F401  (every contender's imports, before a baseline)
from torchrl.objectives.llm import GRPOLoss  # noqa: F401
from transformers import Qwen2ForCausalLM  # noqa: F401

from fabric_learner import FabricLearner, LocalLearner
from fabric_learner.llm import pack_sequences, sample_lengths, share_of_rank, update_by_tokens
from fabric_learner.llm.batching import _groups
from fabric_learner.llm.packing import attention_crossover, packed_rows
from fabric_learner.testing import grpo_batch, tiny_tokenizer

LR, CLIP, ACCUM = 1e-5, 1.0, 2
CONTENDERS = ("learner", "hand")
CAPPED_KINDS = ("one_process", "learner", "hand")
TOKENS_GOAL, MEMORY_GOAL = 0.97, 1.05
SAME_STEP = 1e-4  # the largest relative gap of the contenders' pre-clip gradient norms, any step, any copy
# the memory parts: a fixed mmap threshold, so glibc returns freed tensors of 1 MiB and more (docs/fsdp.md)
MALLOC = {"MALLOC_MMAP_THRESHOLD_": "1048576"}


@dataclasses.dataclass(frozen=True)
class Mode:
    """The sizes of a run: the timed model and batches, and the larger model of the memory parts."""

    hidden: int = 384  # the timed model: hidden size and decoder layers (8.2M parameters)
    layers: int = 6
    samples: int = 4  # chats per micro-batch
    reply_words: tuple[int, int] = (12, 36)  # each reply's length in words: uniform in [lo, hi)
    pairs: int = 2  # distinct optimizer-step batches (2 micro-batches each) per rank
    copies: int = 3  # copies of each contender taking turns; coprime with pairs
    reps: int = 80
    warmup: int = 6  # a multiple of copies: repetition r is copy r % copies
    big_hidden: int = 1024  # memory and capped parts: 8 layers, 76.1M parameters, 290 MiB a copy
    big_layers: int = 8
    big_reply_words: tuple[int, int] = (8, 24)
    memory_updates: int = 2
    repeats: int = 2


FULL = Mode()
QUICK = Mode(hidden=64, layers=2, samples=2, reply_words=(3, 12), pairs=1, copies=2, reps=4, warmup=2,
             big_hidden=512, big_layers=8, big_reply_words=(3, 8), memory_updates=1, repeats=1)


# ---- batches and the contenders (run in the ranks) ----------------------------------------------------


def make_pairs(loss, rank: int, mode: Mode, words: tuple[int, int]) -> list[tuple]:
    """This rank's ``mode.pairs`` optimizer steps of 2 micro-batches of ``mode.samples`` chats with replies of
    ``words`` lengths; log-probs from ``loss``'s (unsharded) policy."""
    g = torch.Generator().manual_seed(1000 + rank)
    return [tuple(grpo_batch(loss.actor_network, torch.randint(*words, (mode.samples,), generator=g).tolist(),
                             seed=100 * rank + 10 * p + m) for m in range(ACCUM)) for p in range(mode.pairs)]


def trained_tokens(batch) -> int:
    """The tokens the loss averages over (``masking_strategy="rlhf"``: the assistant's)."""
    return sum(int(mask.sum()) for mask in batch.get(("masks", "all_assistant_mask"), as_list=True))


class LearnerSteps:
    """One optimizer step (``ACCUM`` calls) per ``update(pair)``: ``FabricLearner`` on 2 CPU ranks under
    ``strategy``, or ``LocalLearner`` for "one_process"; ``norms`` holds each step's pre-clip gradient norm."""

    def __init__(self, loss, strategy: str):
        optimizer = functools.partial(torch.optim.AdamW, lr=LR)
        self.learner = LocalLearner(loss, optimizer, grad_accum_steps=ACCUM, clip_grad_norm=CLIP) \
            if strategy == "one_process" else FabricLearner(
                loss, optimizer, strategy=strategy, devices=2, accelerator="cpu", grad_accum_steps=ACCUM,
                clip_grad_norm=CLIP, timeout=timedelta(minutes=5))
        self.norms = []

    def update(self, pair) -> None:
        for batch in pair:
            out = self.learner.update(batch)
        self.norms.append(out.get("grad_norm"))

    def close(self) -> None:
        getattr(self.learner, "close", lambda: None)()


class HandLoop:
    """The hand-written loop: per-layer FSDP2 (or DDP); each micro-batch backpropagates its token sum (the loss
    times its assistant tokens), the first without gradient sync; at the window's end the count is all-reduced,
    the gradients scaled by ``world_size / total``, clipped, stepped, zeroed: the learner's normalisation."""

    def __init__(self, loss, model, strategy: str):
        self.world = dist.get_world_size()
        if strategy == "fsdp":
            for layer in model.model.layers:
                fully_shard(layer)
            fully_shard(model)
            self.total, self.no_sync = lambda batch: summed_loss(loss(batch)), functools.partial(_unsynced, model)
        else:
            ddp = DistributedDataParallel(SumLoss(loss))
            self.total, self.no_sync = ddp, ddp.no_sync
        self.opt = torch.optim.AdamW(model.parameters(), lr=LR)
        self.params = [p for group in self.opt.param_groups for p in group["params"]]
        self.norms = []

    def update(self, pair) -> None:
        count = 0
        for i, batch in enumerate(pair):
            with self.no_sync() if i < len(pair) - 1 else contextlib.nullcontext():
                tokens = trained_tokens(batch)
                (self.total(batch) * tokens).backward()  # the micro-batch's token sum
            count += tokens
        total = torch.tensor(float(count))
        dist.all_reduce(total)
        factor = self.world / max(total.item(), 1.0)  # undoes the ranks' average, divides by every token
        for p in self.params:
            if p.grad is not None:
                p.grad.mul_(factor)
        self.norms.append(torch.nn.utils.clip_grad_norm_(self.params, CLIP))
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


@contextlib.contextmanager
def _unsynced(model):
    """FSDP2's ``no_sync``: gradients kept unsharded and unreduced until a backward with sync."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def build(kind: str, loss, model, strategy: str):
    """Contender ``kind`` ("learner", "hand", "one_process") on ``loss`` and its ``model``."""
    if kind != "hand":
        return LearnerSteps(loss, "one_process" if kind == "one_process" else strategy)
    if not dist.is_initialized():  # no learner has made the group
        dist.init_process_group("gloo", timeout=timedelta(minutes=5))
    return HandLoop(loss, model, strategy)


def _floats(norms) -> list[float]:
    """Gradient norms as floats (a sharded norm is gathered: every rank calls this alike)."""
    return [float(n.full_tensor() if isinstance(n, DTensor) else n) for n in norms]


def _rel_gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True))


def speed_worker(mode: Mode, strategy: str, out: str) -> None:
    harness.set_one_thread()
    rank = int(os.environ["RANK"])
    pairs = make_pairs(grpo_loss(mode.hidden, mode.layers)[0], rank, mode, mode.reply_words)
    built = {name: [] for name in CONTENDERS}

    def builder(kind):
        return lambda: built[kind].append(build(kind, *grpo_loss(mode.hidden, mode.layers), strategy)) or built[kind][-1]

    # the learners first: the first of them starts the process group
    contenders = {kind: harness.rotating(builder(kind), pairs, mode.copies) for kind in CONTENDERS}
    cpu: dict[str, list[float]] = {}
    samples = harness.interleaved(contenders, reps=mode.reps, inner=1, warmup=mode.warmup, sync=dist.barrier, cpu=cpu)
    norms = {kind: [_floats(copy.norms) for copy in built[kind]] for kind in CONTENDERS}
    harness.write_gathered(out, {
        "rank": rank, "samples_s": samples, "cpu_s": harness.summed_over_ranks(cpu),
        "trained_tokens": [[trained_tokens(b) for b in pair] for pair in pairs],
        "all_tokens": [[sum(int(t.numel()) for t in b.get(("tokens", "full"), as_list=True)) for b in pair]
                       for pair in pairs],
        "grad_norm_max_rel_gap": max(_rel_gap(a, b) for a, b in zip(norms["learner"], norms["hand"], strict=True)),
        "grad_norms": norms, "threads": torch.get_num_threads(), "n_params": grpo_params(mode.hidden, mode.layers)})
    for contender in built["learner"] + built["hand"][:1]:  # the learners, then the group if still there
        contender.close()


def big_worker(part: str, kind: str, mode: Mode, strategy: str, cap_copies: float, out: str) -> None:
    """One rank (or the one process) of the memory or the capped part: ``mode.memory_updates`` steps of the large
    model, after every contender's imports; its peak over its pre-model memory, or trained under the cap."""
    harness.set_one_thread()
    tiny_tokenizer()
    rank = int(os.environ.get("RANK", 0))
    built = []

    def steps():
        loss, model = grpo_loss(mode.big_hidden, mode.big_layers)
        pairs = make_pairs(loss, rank, mode, mode.big_reply_words)
        built.append(build(kind, loss, model, strategy))
        for step in range(mode.memory_updates):
            built[0].update(pairs[step % len(pairs)])
            yield step

    if part == "memory":
        baseline = harness.status_mib("VmRSS")  # imports done, model not built yet
        for _ in steps():
            pass
        harness.write_gathered(out, {**harness.peak(baseline), "n_params": grpo_params(mode.big_hidden, mode.big_layers)})
    else:
        count = grpo_params(mode.big_hidden, mode.big_layers)  # before the baseline: what it loads is then counted in
        result = {"kind": kind, "rank": rank, "baseline_vmsize_mib": harness.status_mib("VmSize")}

        def capped():
            result.update(harness.cap_address_space(result["baseline_vmsize_mib"], count, cap_copies))
            yield from steps()

        harness.train_capped(out, result, capped())
    for contender in built:
        contender.close()


# ---- the batching part: four ways to cut the same long-tailed samples (run in the ranks) -----------

CUTS = ("fixed", "budget", "balanced", "packed")
PAD_GOAL = {"budget": 0.15, "balanced": 0.15, "packed": 0.03}
SPEEDUP_GOAL = 1.5  # tokens/s over the fixed-size micro-batches'
MEMORY_ROUNDS = 3  # measured steps per contender for the peak memory (median)
LAW = ("follow a long-tailed law: words drawn log-normal with median ``median_words`` and sigma ``sigma``, clipped "
       "to ``words`` (with the chat template and a 2-6 word prompt, about 3 tokens a word: samples of about 15 to 500 "
       "tokens).")


@dataclasses.dataclass(frozen=True)
class Cut:
    """The batching part's sizes; reply lengths ``LAW``."""

    hidden: int = 256
    layers: int = 4
    samples: int = 32  # one optimizer step's global batch, dealt over 2 ranks
    fixed: int = 4  # samples per micro-batch of the fixed contender (torchrl's grpo-sync recipe: 32 / 8)
    median_words: float = 12.0
    sigma: float = 0.9
    words: tuple[int, int] = (2, 160)
    steps: int = 2  # distinct global batches, taken in turn
    reps: int = 12
    warmup: int = 2


QUICK_CUT = Cut(hidden=128, layers=2, samples=16, reps=4, warmup=1)


def reply_words(cut: Cut, seed: int) -> list[int]:
    """One global batch's reply lengths in words, from ``LAW``."""
    drawn = (torch.randn(cut.samples, generator=torch.Generator().manual_seed(seed)) * cut.sigma).exp() * cut.median_words
    return [int(w) for w in drawn.round().clamp(*cut.words)]


def shares(kind: str, batch, rank: int):
    """This rank's part of the global ``batch``: halves by sample count, or by tokens (``balanced``, ``packed``)."""
    if kind in ("balanced", "packed"):
        return share_of_rank(batch, rank, 2)
    half = len(batch) // 2
    return batch[rank * half:(rank + 1) * half]


def processed_tokens(kind: str, share_lengths: list[list[int]], cut: Cut, max_tokens: int,
                     crossover: float) -> list[int]:
    """The tokens each rank's forward runs on in one step: padded (or packed: rows times their width, as the
    model's hook lays them out) micro-batches, plus the empty work of a rank with fewer micro-batches (its
    shortest sample, once per missing micro-batch)."""
    sizes = []
    for lengths in share_lengths:
        groups = [list(range(i, min(i + cut.fixed, len(lengths)))) for i in range(0, len(lengths), cut.fixed)] \
            if kind == "fixed" else _groups(lengths, max_tokens, kind == "packed")
        if kind == "packed":
            rows = [packed_rows([lengths[i] for i in g], crossover) for g in groups]
            sizes.append([len(r[2]) * r[0] for r in rows])
        else:
            sizes.append([len(g) * max(lengths[i] for i in g) for g in groups])
    most = max(len(s) for s in sizes)
    return [sum(s) + (most - len(s)) * min(lengths) for s, lengths in zip(sizes, share_lengths)]


class CutSteps:
    """``FabricLearner(strategy="fsdp")`` on 2 CPU ranks stepping on one global batch per ``update``, cut as
    ``kind`` says: ``fixed`` micro-batches in the drawn order, or ``update_by_tokens`` (``packed``: packed)."""

    def __init__(self, kind: str, cut: Cut, max_tokens: int):
        loss, _ = grpo_loss(cut.hidden, cut.layers)
        if kind == "packed":
            pack_sequences(loss.actor_network)
        self.kind, self.max_tokens, self.fixed = kind, max_tokens, cut.fixed
        self.learner = FabricLearner(loss, functools.partial(torch.optim.AdamW, lr=LR), strategy="fsdp", devices=2,
                                     accelerator="cpu", grad_accum_steps=cut.samples // 2 // cut.fixed,
                                     clip_grad_norm=CLIP, timeout=timedelta(minutes=5))
        self.norms = []

    def update(self, share) -> None:
        if self.kind == "fixed":
            for i in range(0, len(share), self.fixed):
                out = self.learner.update(share[i:i + self.fixed])
        else:
            out = update_by_tokens(self.learner, share, self.max_tokens, packed=self.kind == "packed")
        self.norms.append(out.get("grad_norm"))


def _fresh_peak() -> None:
    """The heap's free memory handed back (glibc ``malloc_trim``), then VmHWM started afresh (``clear_refs`` 5)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def batching_worker(cut: Cut, out: str) -> None:
    harness.set_one_thread()
    rank = int(os.environ["RANK"])
    policy = grpo_loss(cut.hidden, cut.layers)[0].actor_network
    batches = [grpo_batch(policy, reply_words(cut, 7 + s), seed=7 + s) for s in range(cut.steps)]  # same on both ranks
    lengths = [sample_lengths(b) for b in batches]
    max_tokens = max(cut.fixed * max(x) for x in lengths)  # no budgeted micro-batch larger than a fixed one can be
    per_kind = {kind: [shares(kind, b, rank) for b in batches] for kind in CUTS}
    built = {kind: CutSteps(kind, cut, max_tokens) for kind in CUTS}  # the first starts the process group
    rounds = {kind: [] for kind in CUTS}  # one step's peak over the size before it, after a warm-up step each
    for kind in CUTS:
        built[kind].update(per_kind[kind][0])
    for r in range(MEMORY_ROUNDS):
        for kind in harness.rotation(r, CUTS):
            gc.collect()
            _fresh_peak()  # so that a step is not measured small for reusing what an earlier step freed
            dist.barrier()
            before = harness.status_mib("VmRSS")
            built[kind].update(per_kind[kind][1 % cut.steps])
            rounds[kind].append(harness.status_mib("VmHWM") - before)
    contenders = {kind: (lambda i, k=kind: built[k].update(per_kind[k][i % cut.steps])) for kind in CUTS}
    samples = harness.interleaved(contenders, reps=cut.reps, inner=1, warmup=cut.warmup, sync=dist.barrier)
    harness.write_gathered(out, {
        "rank": rank, "samples_s": samples, "peak_step_mib": {k: statistics.median(v) for k, v in rounds.items()},
        "peak_step_mib_rounds": rounds, "grad_norms": {kind: _floats(built[kind].norms) for kind in CUTS},
        "lengths": lengths, "share_lengths": {kind: [sample_lengths(s) for s in per_kind[kind]] for kind in CUTS},
        "max_tokens": max_tokens, "crossover": attention_crossover(policy.model.config),
        "n_params": grpo_params(cut.hidden, cut.layers)})
    for kind in CUTS:
        built[kind].learner.close()


def cut_of(args) -> Cut:
    cut = QUICK_CUT if args.quick else Cut()
    return dataclasses.replace(cut, reps=args.reps) if args.reps else cut


# ---- the parts (run from the command) ---------------------------------------------------------------


def _worker_argv(args, part: str, *extra: str) -> list[str]:
    return [__file__, "--worker", part, "--strategy", args.strategy, *(["--quick"] if args.quick else []),
            "--cap-copies", str(args.cap_copies), *(["--reps", str(args.reps)] if args.reps else []), *extra]


def part_batching(args, mode: Mode) -> dict:
    cut, start = cut_of(args), time.monotonic()
    ranks = harness.launch(_worker_argv(args, "batching"), ranks=2, timeout_s=1800, what="batching part", **MALLOC)
    seconds = time.monotonic() - start
    r0, max_tokens = ranks[0], ranks[0]["max_tokens"]
    real, steps = sum(sum(x) for x in r0["lengths"]), len(r0["lengths"])  # every token of every step's global batch
    rows = {}
    for kind in CUTS:
        per_step = [[r["share_lengths"][kind][s] for r in ranks] for s in range(steps)]
        processed = [processed_tokens(kind, share, cut, max_tokens, r0["crossover"]) for share in per_step]
        rank_tokens = [[sum(x) for x in share] for share in per_step]
        times = r0["samples_s"][kind]
        rep_tokens = [sum(r0["lengths"][(cut.warmup + i) % steps]) for i in range(len(times))]
        rows[kind] = {
            "pad_fraction": 1 - real / sum(sum(p) for p in processed),
            "slowest_rank_over_mean": statistics.mean(max(t) / (sum(t) / len(t)) for t in rank_tokens),
            "slowest_processed_over_mean": statistics.mean(max(p) / (sum(p) / len(p)) for p in processed),
            "tokens_per_s": statistics.median(t / s for t, s in zip(rep_tokens, times)),
            "median_step_s": statistics.median(times), "peak_step_mib": max(r["peak_step_mib"][kind] for r in ranks)}
    for kind, row in rows.items():
        row["speedup"] = harness.paired_ratio(r0["samples_s"]["fixed"], r0["samples_s"][kind])
        row["speedup_ci"] = harness.bootstrap_ci(r0["samples_s"]["fixed"], r0["samples_s"][kind])
        row["memory_ratio"] = row["peak_step_mib"] / rows["fixed"]["peak_step_mib"]
        if kind != "fixed":
            row.update(pad_met=row["pad_fraction"] <= PAD_GOAL[kind], memory_met=row["memory_ratio"] <= 1.0,
                       speed_verdict=harness.verdict(row["speedup_ci"], SPEEDUP_GOAL, at_least=True))
    gap = max(_rel_gap(r0["grad_norms"][kind], r0["grad_norms"]["fixed"]) for kind in CUTS)
    harness.show({"batching": rows, "max_tokens": max_tokens, "grad_norm_max_rel_gap": gap})
    return {"what": "GRPO steps on the same long-tailed global batches, 2 FSDP ranks, four ways of cutting them",
            "law": LAW, "settings": dataclasses.asdict(cut), "n_params": r0["n_params"], "max_tokens": max_tokens,
            "tokens_per_step": [sum(x) for x in r0["lengths"]], "rows": rows, "grad_norm_max_rel_gap": gap,
            "seconds": seconds, "ranks": ranks}


def part_speed(args, mode: Mode) -> dict:
    """Trained tokens/s over both ranks, learner / hand, paired, in wall and CPU time (met when both are)."""
    start = time.monotonic()
    ranks = harness.launch(_worker_argv(args, "speed"), ranks=2, timeout_s=1200, what="speed part")
    seconds = time.monotonic() - start
    samples, cpu = ranks[0]["samples_s"], ranks[0]["cpu_s"]
    # repetition r of every contender ran call warmup + r, on pair (warmup + r) % pairs, on every rank
    per_pair = [sum(sum(r["trained_tokens"][p]) for r in ranks) for p in range(mode.pairs)]
    rep_tokens = [per_pair[(mode.warmup + r) % mode.pairs] for r in range(mode.reps)]
    tokens_per_s = {k: statistics.median(t / s for t, s in zip(rep_tokens, samples[k])) for k in CONTENDERS}
    # tokens/s learner / hand = hand's time / learner's time, repetition by repetition
    wall, cpu_r = (harness.paired(x["hand"], x["learner"], copies=mode.copies) for x in (samples, cpu))
    met, text = harness.both(wall["ci"], cpu_r["ci"], TOKENS_GOAL, at_least=True, detail=(
        f" (wall {wall['ci'][0]:.3f}-{wall['ci'][1]:.3f}, cpu {cpu_r['ci'][0]:.3f}-{cpu_r['ci'][1]:.3f})"))
    gap = max(r["grad_norm_max_rel_gap"] for r in ranks)
    if gap > SAME_STEP:
        met, text = False, f"invalid: the contenders' gradient norms differ by {gap:.1e}"
    result = {"what": "trained tokens per second over 2 ranks, one optimizer step (2 micro-batches per rank) per sample",
              "n_params": ranks[0]["n_params"], "tokens_per_step": per_pair,
              "all_tokens_per_step": [sum(sum(r["all_tokens"][p]) for r in ranks) for p in range(mode.pairs)],
              "median_step_s": {k: statistics.median(samples[k]) for k in CONTENDERS}, "tokens_per_s": tokens_per_s,
              "ratio": wall["ratio"], "ci": wall["ci"], "cpu_ratio": cpu_r["ratio"], "cpu_ci": cpu_r["ci"],
              "goal": TOKENS_GOAL, "met": met, "verdict": text, "grad_norm_max_rel_gap": gap,
              "same_step": gap <= SAME_STEP, "seconds": seconds, "samples_s": samples, "cpu_s": cpu, "ranks": ranks}
    harness.show({k: result[k] for k in ("tokens_per_s", "ratio", "ci", "cpu_ratio", "cpu_ci", "verdict", "same_step")})
    return result


def part_memory(args, mode: Mode) -> dict:
    """Peak memory per rank over the pre-model baseline, learner / hand, decided on the range over launches."""
    runs, median = harness.peak_launches(CONTENDERS, mode.repeats, lambda kind: _worker_argv(
        args, "memory", "--kind", kind), ranks=2, **MALLOC)
    peaks = {k: [r["worst_peak_mib"] for r in runs if r["kind"] == k] for k in CONTENDERS}
    span = (min(peaks["learner"]) / max(peaks["hand"]), max(peaks["learner"]) / min(peaks["hand"]))
    n = runs[0]["ranks"][0]["n_params"]
    result = {"what": f"peak resident memory over the pre-model baseline, worst of 2 ranks, {mode.memory_updates} "
                      "optimizer steps", "n_params": n, "copy_mib": n * 4 / 2**20, "median_peak_mib": median,
              "ratio": median["learner"] / median["hand"], "range": span, "goal": MEMORY_GOAL,
              "met": harness.decide(span, MEMORY_GOAL), "verdict": harness.verdict(span, MEMORY_GOAL), "runs": runs}
    harness.show({k: result[k] for k in ("median_peak_mib", "ratio", "range", "verdict")})
    return result


def part_capped(args, mode: Mode) -> dict:
    """The large model under ``RLIMIT_AS``: one process must fail to allocate, the sharded contenders train."""
    runs = [harness.launch_capped(kind, _worker_argv(args, "capped", "--kind", kind),
                                  1 if kind == "one_process" else 2, **MALLOC) for kind in CAPPED_KINDS]
    trained = harness.capped_summary(runs, mode.memory_updates)
    # under DDP every rank holds the whole training state, as one process does
    expected = {"one_process": False, "learner": args.strategy == "fsdp", "hand": args.strategy == "fsdp"}
    print(f"capped: trained under the cap {trained} (expected {expected})", flush=True)
    return {"what": f"RLIMIT_AS = VmSize before the model + {args.cap_copies} model copies, per process",
            "cap_copies": args.cap_copies, "updates": mode.memory_updates, "trained_under_cap": trained,
            "as_expected": trained == expected, "runs": runs}


PARTS = {"speed": part_speed, "memory": part_memory, "capped": part_capped, "batching": part_batching}


def parser():
    p = harness.parser(__doc__, "llm_update.json")
    p.add_argument("--quick", action="store_true", help="tiny models, few repetitions: does it run?")
    p.add_argument("--strategy", choices=("fsdp", "ddp"), default="fsdp",
                   help="the learner's strategy and the hand loop's (per-layer FSDP2, or DDP)")
    p.add_argument("--parts", default=",".join(PARTS), help="some of: " + ",".join(PARTS))
    p.add_argument("--cap-copies", type=float, default=3.5, help="the capped part's cap, in model copies")
    p.add_argument("--reps", type=int, help="the speed (or batching) part's repetitions (default: the mode's)")
    p.add_argument("--merge", action="store_true", help="keep the other parts of an existing --out file")
    p.add_argument("--worker", choices=tuple(PARTS), help="one rank of a part (under torchrun)")
    p.add_argument("--kind", choices=CAPPED_KINDS, help="the worker's contender")
    return p


def main(argv=None) -> None:
    p = parser()
    args = p.parse_args(argv)
    mode = dataclasses.replace(QUICK if args.quick else FULL, **({"reps": args.reps} if args.reps else {}))
    if args.worker == "speed":
        return speed_worker(mode, args.strategy, args.out)
    if args.worker in ("memory", "capped"):
        return big_worker(args.worker, args.kind, mode, args.strategy, args.cap_copies, args.out)
    if args.worker == "batching":
        return batching_worker(cut_of(args), args.out)
    parts = [x for x in args.parts.split(",") if x]
    if set(parts) - set(PARTS):
        p.error(f"unknown parts {sorted(set(parts) - set(PARTS))}: choose from {','.join(PARTS)}")
    start = time.monotonic()
    result = {"what": __doc__.split("\n")[0], "mode": "quick" if args.quick else "full", "strategy": args.strategy,
              "settings": dataclasses.asdict(mode), "lr": LR, "clip": CLIP, "grad_accum_steps": ACCUM,
              "machine": harness.machine(), "load_before": os.getloadavg()}
    for part in parts:
        result[part] = PARTS[part](args, mode)
    result.update(load_after=os.getloadavg(), seconds=time.monotonic() - start)
    if args.merge and os.path.exists(args.out):  # the parts run now replace theirs; the file's command stays
        merged = harness.read_json(args.out)
        result = {**merged, **{part: result[part] for part in parts},
                  "merged_commands": [*merged.get("merged_commands", []), harness.command_line()]}
    harness.write_result(args.out, result)
    print(f"wrote {args.out} ({result['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
