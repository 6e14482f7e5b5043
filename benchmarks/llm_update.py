"""GRPO on a Qwen2-architecture model, 2 CPU ranks: the learner against the FSDP2 loop a user writes by hand.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/llm_update.py            # ~6 min on 2 quiet cores (estimated; 876 s busy)
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/llm_update.py --quick    # ~2.5 min on 2 busy cores: does it run?
    .venv/bin/python benchmarks/llm_update.py --strategy ddp --parts speed # against hand DDP; --reps N: more or fewer

Both contenders train torchrl's ``GRPOLoss`` (``masking_strategy="rlhf"``, token mean) over a
``TransformersWrapper`` around a ``Qwen2ForCausalLM`` built from a ``Qwen2Config`` (random weights,
seed 0, :func:`fabric_learner.testing.tiny_tokenizer`'s vocabulary of 300), AdamW (lr 1e-5), gradients
clipped at norm 1.0, 2 micro-batches per optimizer step on each rank. A micro-batch is a lazy stack of
chats of different lengths (:func:`fabric_learner.testing.grpo_batch`: the sample log-probs are the
policy's own), different on each rank; both contenders get the same ones.

- ``learner``: ``FabricLearner(loss, AdamW factory, strategy="fsdp", devices=2, accelerator="cpu",
  grad_accum_steps=2, clip_grad_norm=1.0)``.
- ``hand``: ``fully_shard`` on each of ``model.model.layers``, then on the model; AdamW over its
  parameters. Each micro-batch backpropagates its loss (the sum of the ``loss_*`` entries, token means)
  times its token count (the assistant tokens the loss averages over), that is its token sum, the
  first without gradient sync (``set_requires_gradient_sync(False)``); at the window's end the count is
  all-reduced over the ranks, the gradients scaled by ``world_size / total``, clipped
  (``clip_grad_norm_``), stepped, zeroed. That is the learner's token normalisation
  (``fabric_learner/llm/counts.py``), so both take the same step: the script checks that their pre-clip
  gradient norms agree at every step. With ``--strategy ddp`` the learner runs DDP and the hand loop is
  ``DistributedDataParallel`` (``no_sync`` for the first micro-batch), the same otherwise.

Four parts, each its own ``torchrun`` launches (``--parts``):

1. ``speed``: both contenders in one launch, ``--copies`` copies of each taking turns
   (``harness.rotating``); each repetition times one optimizer step of each, in a random order
   (``harness.interleaved``, barrier around every block). Reported: trained tokens per second over both
   ranks, and the ratio learner / hand: the median of the per-repetition ratios with its two-stage
   bootstrap interval, in wall time and in CPU time summed over the ranks; the goal (at least 0.97) is
   met only when both intervals are at or above it (as ``run.py``'s case b).
2. ``memory``: each contender its own launches (``--repeats`` each, rotated, as ``fsdp_peak.py``): a
   rank's peak resident memory (``VmHWM``) over its resident memory before the model is built, after
   ``--memory-updates`` optimizer steps on the larger model; a launch counts its worst rank. Ratio of
   the medians learner / hand (goal at most 1.05), decided on the range over launches (the largest
   and smallest ratio of one launch of each).
3. ``capped``: the larger model under a cap on each process's address space (``harness``'s memory cap,
   as ``fsdp_capped.py``: its address space before the model plus ``--cap-copies`` model copies,
   3.5 while parameters, gradients and AdamW's moments are 4): ``one_process`` (``LocalLearner``) is
   expected to fail to allocate, ``learner`` and ``hand`` on 2 ranks to train.

4. ``batching``: the same long-tailed global batches (the law is stated on :class:`Cut`: reply words
   log-normal, median 12, sigma 0.9, clipped to [2, 160]) stepped four ways by ``FabricLearner(strategy=
   "fsdp")`` on 2 ranks, one copy each, in one launch: ``fixed`` (halves by sample count, micro-batches of
   4 samples in the drawn order: torchrl's grpo-sync recipe), ``budget`` (``update_by_tokens``, halves by
   sample count), ``balanced`` (``share_of_rank`` by tokens, then ``update_by_tokens``), ``packed`` (the
   same with ``pack_sequences``). ``max_tokens`` is the fixed contender's largest possible micro-batch
   (4 x the longest sample). Reported per contender: the pad fraction (1 - real tokens / tokens the
   forwards ran on, counting padding, packed rows' unused tails and the empty work of a rank with fewer
   micro-batches), tokens/s
   (every token of the global batch over the step's wall time; ratio to ``fixed`` as the median of
   paired ratios, ``harness.interleaved``), a step's peak resident memory over the resident size before
   it (``VmHWM`` reset through ``/proc/self/clear_refs`` after ``malloc_trim``; the median of 3 rotated
   rounds; worst rank), the slowest rank's tokens over
   the mean, and a check that the four take the same step (pre-clip gradient norms). Goals: pad at
   most 15% (budget) and 3% (packed); tokens/s at least 1.5x fixed; peak memory not above fixed's.

Writes ``benchmarks/results/llm_update.json`` (``--out``): settings, machine and git provenance, every
sample and launch, the ratios and verdicts. Sizes: ``--quick`` trains tiny models with few repetitions
(its numbers say nothing). One thread per rank; no test asserts on timing.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import os
import statistics
import time

import harness

HERE = os.path.dirname(os.path.abspath(__file__))
LR, CLIP, ACCUM = 1e-5, 1.0, 2
CONTENDERS = ("learner", "hand")
CAPPED_KINDS = ("one_process", "learner", "hand")
TOKENS_GOAL, MEMORY_GOAL = 0.97, 1.05
SAME_STEP = 1e-4  # the largest relative gap of the contenders' pre-clip gradient norms, any step, any copy
# the memory parts' environment: a fixed mmap threshold, so that glibc returns freed tensors of 1 MiB and
# more (this model's weights are 1-8 MiB) instead of keeping them in its heap (docs/fsdp.md)
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


# ---- model, batches and the contenders (run in the ranks) -----------------------------------------


def _tokenizer():
    from fabric_learner.testing import tiny_tokenizer

    return tiny_tokenizer()


def _model(hidden: int, layers: int):
    """``tiny_causal_lm``'s Qwen2 (4 heads, 2 key/value heads, MLP 2x hidden, untied head) at this size, seed 0."""
    from fabric_learner.testing import tiny_causal_lm

    return tiny_causal_lm(0, tokenizer=_tokenizer(), hidden_size=hidden, num_layers=layers)


def n_params(hidden: int, layers: int) -> int:
    """The model's parameter count, from a copy on the meta device (no memory)."""
    import torch
    from transformers import Qwen2ForCausalLM  # noqa: F401  (a first import under "meta" would run there)

    _tokenizer()
    with torch.device("meta"):
        return sum(p.numel() for p in _model(hidden, layers).parameters())


def grpo_loss(hidden: int, layers: int):
    """``(GRPOLoss, model)``: a fresh model with seed 0's weights, wrapped for the loss."""
    from torchrl.modules.llm import TransformersWrapper
    from torchrl.objectives.llm import GRPOLoss

    model = _model(hidden, layers)
    policy = TransformersWrapper(model, tokenizer=_tokenizer(), input_mode="history", generate=False,
                                 return_log_probs=True, pad_output=False)
    return GRPOLoss(policy, masking_strategy="rlhf"), model


def make_pairs(loss, rank: int, mode: Mode, words: tuple[int, int]) -> list[tuple]:
    """This rank's ``mode.pairs`` optimizer steps, each 2 micro-batches of ``mode.samples`` chats whose
    replies have ``words`` lengths, drawn per rank; log-probs from ``loss``'s policy (unsharded)."""
    import torch

    from fabric_learner.testing import grpo_batch

    generator = torch.Generator().manual_seed(1000 + rank)
    pairs = []
    for p in range(mode.pairs):
        pairs.append(tuple(
            grpo_batch(loss.actor_network, torch.randint(*words, (mode.samples,), generator=generator).tolist(),
                       seed=100 * rank + 10 * p + m) for m in range(ACCUM)))
    return pairs


def trained_tokens(batch) -> int:
    """The tokens the loss averages over (``masking_strategy="rlhf"``: the assistant's)."""
    return sum(int(mask.sum()) for mask in batch.get(("masks", "all_assistant_mask"), as_list=True))


def all_tokens(batch) -> int:
    return sum(int(tokens.numel()) for tokens in batch.get(("tokens", "full"), as_list=True))


class LearnerSteps:
    """One optimizer step of a learner per ``update(pair)``: ``ACCUM`` calls. ``strategy`` "fsdp" or "ddp":
    ``FabricLearner`` on 2 CPU ranks; "one_process": ``LocalLearner``."""

    def __init__(self, loss, strategy: str):
        from datetime import timedelta

        import torch

        from fabric_learner import FabricLearner, LocalLearner

        optimizer = functools.partial(torch.optim.AdamW, lr=LR)
        if strategy == "one_process":
            self.learner = LocalLearner(loss, optimizer, grad_accum_steps=ACCUM, clip_grad_norm=CLIP)
        else:
            self.learner = FabricLearner(loss, optimizer, strategy=strategy, devices=2, accelerator="cpu",
                                         grad_accum_steps=ACCUM, clip_grad_norm=CLIP, timeout=timedelta(minutes=5))
        self.norms = []  # pre-clip gradient norm of every step

    def update(self, pair) -> None:
        for batch in pair:
            out = self.learner.update(batch)
        self.norms.append(out.get("grad_norm"))

    def close(self) -> None:
        getattr(self.learner, "close", lambda: None)()


class HandLoop:
    """The hand-written loop (see the module's docstring): per-layer FSDP2, or DDP, with the learner's token
    normalisation."""

    def __init__(self, loss, model, strategy: str):
        import torch
        import torch.distributed as dist
        from common import SumLoss, summed_loss

        self.world = dist.get_world_size()
        if strategy == "fsdp":
            from torch.distributed.fsdp import fully_shard

            for layer in model.model.layers:
                fully_shard(layer)
            fully_shard(model)
            self.total = lambda batch: summed_loss(loss(batch))
            self.no_sync = functools.partial(_unsynced, model)
        else:
            from torch.nn.parallel import DistributedDataParallel

            ddp = DistributedDataParallel(SumLoss(loss))
            self.total, self.no_sync = ddp, ddp.no_sync
        self.opt = torch.optim.AdamW(model.parameters(), lr=LR)
        self.params = [p for group in self.opt.param_groups for p in group["params"]]
        self.norms = []

    def update(self, pair) -> None:
        import torch
        import torch.distributed as dist

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
        import torch.distributed as dist

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
    if kind == "hand":
        _init_group()
        return HandLoop(loss, model, strategy)
    return LearnerSteps(loss, "one_process" if kind == "one_process" else strategy)


def _init_group() -> None:
    """The process group for the hand loop when no learner has made it."""
    from datetime import timedelta

    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=timedelta(minutes=5))


def _floats(norms) -> list[float]:
    """Gradient norms as floats (a sharded norm is gathered: every rank calls this alike)."""
    from torch.distributed.tensor import DTensor

    return [float(n.full_tensor() if isinstance(n, DTensor) else n) for n in norms]


def speed_worker(mode: Mode, strategy: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    harness.set_one_thread()
    rank = int(os.environ["RANK"])
    pairs = make_pairs(grpo_loss(mode.hidden, mode.layers)[0], rank, mode, mode.reply_words)
    built = {name: [] for name in CONTENDERS}

    def builder(kind):
        def make():
            built[kind].append(build(kind, *grpo_loss(mode.hidden, mode.layers), strategy))
            return built[kind][-1]
        return make

    # the learners first: the first of them starts the process group
    contenders = {kind: harness.rotating(builder(kind), pairs, mode.copies) for kind in CONTENDERS}
    cpu: dict[str, list[float]] = {}
    samples = harness.interleaved(contenders, reps=mode.reps, inner=1, warmup=mode.warmup, sync=dist.barrier, cpu=cpu)
    cpu = harness.summed_over_ranks(cpu)
    norms = {kind: [_floats(copy.norms) for copy in built[kind]] for kind in CONTENDERS}
    gap = max(abs(a - b) / max(abs(b), 1e-12) for la, lb in zip(norms["learner"], norms["hand"], strict=True)
              for a, b in zip(la, lb, strict=True))
    tokens = [[trained_tokens(b) for b in pair] for pair in pairs]
    every = [[all_tokens(b) for b in pair] for pair in pairs]
    result = {"rank": rank, "samples_s": samples, "cpu_s": cpu, "trained_tokens": tokens, "all_tokens": every,
              "grad_norm_max_rel_gap": gap, "grad_norms": norms, "threads": torch.get_num_threads(),
              "n_params": n_params(mode.hidden, mode.layers)}
    harness.write_gathered(out, result)
    for contender in built["learner"] + built["hand"][:1]:  # the learners, then the group if still there
        contender.close()


def _import_everything() -> None:
    """What every contender imports, loaded before a worker takes its baseline, so it is not counted."""
    import common  # noqa: F401
    from torch.distributed.fsdp import fully_shard  # noqa: F401
    from torch.nn.parallel import DistributedDataParallel  # noqa: F401
    from torchrl.modules.llm import TransformersWrapper  # noqa: F401
    from torchrl.objectives.llm import GRPOLoss  # noqa: F401
    from transformers import Qwen2ForCausalLM  # noqa: F401

    from fabric_learner import FabricLearner, LocalLearner  # noqa: F401
    from fabric_learner.testing import grpo_batch  # noqa: F401

    harness.set_one_thread()
    _tokenizer()


def memory_worker(kind: str, mode: Mode, strategy: str, out: str) -> None:
    _import_everything()
    rank = int(os.environ["RANK"])
    baseline = harness.status_mib("VmRSS")  # imports done, model not built yet
    loss, model = grpo_loss(mode.big_hidden, mode.big_layers)
    pairs = make_pairs(loss, rank, mode, mode.big_reply_words)
    contender = build(kind, loss, model, strategy)
    for step in range(mode.memory_updates):
        contender.update(pairs[step % len(pairs)])
    result = {"rank": rank, "baseline_mib": baseline, "peak_over_baseline_mib": harness.status_mib("VmHWM") - baseline,
              "n_params": n_params(mode.big_hidden, mode.big_layers)}
    harness.write_gathered(out, result)
    contender.close()


def capped_worker(kind: str, mode: Mode, strategy: str, cap_copies: float, out: str) -> None:
    _import_everything()
    rank = int(os.environ.get("RANK", 0))
    count = n_params(mode.big_hidden, mode.big_layers)  # before the baseline: what it loads is then counted in
    result = {"kind": kind, "rank": rank, "baseline_vmsize_mib": harness.status_mib("VmSize")}
    built = []

    def steps():
        result.update(harness.cap_address_space(result["baseline_vmsize_mib"], count, cap_copies))
        loss, model = grpo_loss(mode.big_hidden, mode.big_layers)
        pairs = make_pairs(loss, rank, mode, mode.big_reply_words)
        built.append(build(kind, loss, model, strategy))
        for step in range(mode.memory_updates):
            built[0].update(pairs[step % len(pairs)])
            yield step

    harness.train_under_cap(result, steps())
    harness.finish_capped(out, result)
    for contender in built:
        contender.close()


# ---- the batching part: four ways to cut the same long-tailed samples (run in the ranks) -----------

CUTS = ("fixed", "budget", "balanced", "packed")
PAD_GOAL = {"budget": 0.15, "balanced": 0.15, "packed": 0.03}
SPEEDUP_GOAL = 1.5  # tokens/s over the fixed-size micro-batches'
MEMORY_ROUNDS = 3  # measured steps per contender for the peak memory (median)


@dataclasses.dataclass(frozen=True)
class Cut:
    """The batching part's sizes. Reply lengths follow a long-tailed law: words drawn log-normal with median
    ``median_words`` and sigma ``sigma``, clipped to ``words`` (with the chat template and a 2-6 word prompt,
    about 3 tokens a word: samples of about 15 to 500 tokens)."""

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
    """One global batch's reply lengths in words, from the law stated on :class:`Cut`."""
    import torch

    g = torch.Generator().manual_seed(seed)
    drawn = (torch.randn(cut.samples, generator=g) * cut.sigma).exp() * cut.median_words
    return [int(w) for w in drawn.round().clamp(*cut.words)]


def max_tokens_for(lengths: list[int], cut: Cut) -> int:
    """The token budget: the fixed contender's largest possible micro-batch (``fixed`` x the longest sample),
    so that no budgeted micro-batch is larger than a fixed one can be."""
    return cut.fixed * max(lengths)


def shares(kind: str, batch, rank: int):
    """This rank's part of the global ``batch``: halves by sample count, or by tokens (``balanced``, ``packed``)."""
    from fabric_learner.llm import share_of_rank

    if kind in ("balanced", "packed"):
        return share_of_rank(batch, rank, 2)
    half = len(batch) // 2
    return batch[rank * half:(rank + 1) * half]


def processed_tokens(kind: str, share_lengths: list[list[int]], cut: Cut, max_tokens: int,
                     crossover: float) -> list[int]:
    """The tokens each rank's forward runs on in one step: padded (or packed) micro-batches, plus the empty
    work of a rank with fewer micro-batches (its shortest sample, once per missing micro-batch)."""
    from fabric_learner.llm.batching import _groups

    sizes = []
    for lengths in share_lengths:
        if kind == "fixed":
            groups = [list(range(i, min(i + cut.fixed, len(lengths)))) for i in range(0, len(lengths), cut.fixed)]
        else:
            groups = _groups(lengths, max_tokens, kind == "packed")
        sizes.append([_packed_size([lengths[i] for i in g], crossover) if kind == "packed"
                      else len(g) * max(lengths[i] for i in g) for g in groups])
    most = max(len(s) for s in sizes)
    return [sum(s) + (most - len(s)) * min(lengths) for s, lengths in zip(sizes, share_lengths)]


def _packed_size(lengths: list[int], crossover: float) -> int:
    """The tokens a packed micro-batch's forward runs on: its rows times their width (``packed_rows``, with the
    model's ``attention_crossover``, as the model's hook lays them out)."""
    from fabric_learner.llm.packing import packed_rows

    width, _, rows = packed_rows(lengths, crossover)
    return len(rows) * width


class CutSteps:
    """``FabricLearner(strategy="fsdp")`` on 2 CPU ranks stepping on one global batch per ``update``, cut as
    ``kind`` says: ``fixed`` micro-batches of ``cut.fixed`` samples in the drawn order (``grad_accum_steps``
    = share / fixed), or ``update_by_tokens`` (``packed``: through ``pack_sequences``)."""

    def __init__(self, kind: str, cut: Cut, max_tokens: int):
        from datetime import timedelta

        import torch

        from fabric_learner import FabricLearner
        from fabric_learner.llm import pack_sequences

        loss, _ = grpo_loss(cut.hidden, cut.layers)
        if kind == "packed":
            pack_sequences(loss.actor_network)
        self.kind, self.max_tokens, self.fixed = kind, max_tokens, cut.fixed
        self.learner = FabricLearner(loss, functools.partial(torch.optim.AdamW, lr=LR), strategy="fsdp", devices=2,
                                     accelerator="cpu", grad_accum_steps=cut.samples // 2 // cut.fixed,
                                     clip_grad_norm=CLIP, timeout=timedelta(minutes=5))
        self.norms = []

    def update(self, share) -> None:
        from fabric_learner.llm import update_by_tokens

        if self.kind == "fixed":
            for i in range(0, len(share), self.fixed):
                out = self.learner.update(share[i:i + self.fixed])
        else:
            out = update_by_tokens(self.learner, share, self.max_tokens, packed=self.kind == "packed")
        self.norms.append(out.get("grad_norm"))

    def close(self) -> None:
        self.learner.close()


def _reset_peak() -> None:
    """Start VmHWM afresh at the current resident size (Linux: ``clear_refs`` 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _trim_heap() -> None:
    """Hand the heap's free memory back to the system (glibc ``malloc_trim``; nothing elsewhere)."""
    import ctypes
    import ctypes.util

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)


def batching_worker(cut: Cut, out: str) -> None:
    import gc

    import torch.distributed as dist

    from fabric_learner.llm import sample_lengths
    from fabric_learner.llm.packing import attention_crossover
    from fabric_learner.testing import grpo_batch

    harness.set_one_thread()
    rank = int(os.environ["RANK"])
    policy = grpo_loss(cut.hidden, cut.layers)[0].actor_network
    batches = [grpo_batch(policy, reply_words(cut, 7 + s), seed=7 + s) for s in range(cut.steps)]  # same on both ranks
    lengths = [sample_lengths(b) for b in batches]
    max_tokens = max(max_tokens_for(x, cut) for x in lengths)
    per_kind = {kind: [shares(kind, b, rank) for b in batches] for kind in CUTS}
    built = {kind: CutSteps(kind, cut, max_tokens) for kind in CUTS}  # the first starts the process group
    # peak memory of one step over the resident size before it, each contender in turn after a warm-up step, in
    # MEMORY_ROUNDS rotated rounds (the median kept); the heap's free memory is handed back first (malloc_trim), so
    # that a step is not measured small for reusing what an earlier step freed
    rounds = {kind: [] for kind in CUTS}
    for kind in CUTS:
        built[kind].update(per_kind[kind][0])
    for r in range(MEMORY_ROUNDS):
        for kind in harness.rotation(r, CUTS):
            gc.collect()
            _trim_heap()
            dist.barrier()
            _reset_peak()
            before = harness.status_mib("VmRSS")
            built[kind].update(per_kind[kind][1 % cut.steps])
            rounds[kind].append(harness.status_mib("VmHWM") - before)
    peak = {kind: statistics.median(v) for kind, v in rounds.items()}
    contenders = {kind: (lambda i, k=kind: built[k].update(per_kind[k][i % cut.steps])) for kind in CUTS}
    samples = harness.interleaved(contenders, reps=cut.reps, inner=1, warmup=cut.warmup, sync=dist.barrier)
    norms = {kind: _floats(built[kind].norms) for kind in CUTS}
    shares_lengths = {kind: [sample_lengths(s) for s in per_kind[kind]] for kind in CUTS}
    harness.write_gathered(out, {"rank": rank, "samples_s": samples, "peak_step_mib": peak,
                                 "peak_step_mib_rounds": rounds, "grad_norms": norms,
                                 "lengths": lengths, "share_lengths": shares_lengths, "max_tokens": max_tokens,
                                 "crossover": attention_crossover(policy.model.config),
                                 "n_params": n_params(cut.hidden, cut.layers)})
    for kind in CUTS:
        built[kind].close()


def part_batching(args, mode: Mode) -> dict:
    cut = QUICK_CUT if args.quick else Cut()
    if args.reps:
        cut = dataclasses.replace(cut, reps=args.reps)
    with harness.scratch_path() as out:
        start = time.monotonic()
        harness.run_bounded(harness.torchrun(2, *_worker_argv(args, "batching"), "--out", out), 1800,
                            "batching part", **MALLOC)
        ranks = harness.read_json(out)
    seconds = time.monotonic() - start
    r0, max_tokens = ranks[0], ranks[0]["max_tokens"]
    real = sum(sum(x) for x in r0["lengths"])  # every token of every step's global batch
    steps = len(r0["lengths"])
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
            "median_step_s": statistics.median(times),
            "peak_step_mib": max(r["peak_step_mib"][kind] for r in ranks),
        }
    for kind in CUTS:
        row = rows[kind]
        row["speedup"] = harness.paired_ratio(r0["samples_s"]["fixed"], r0["samples_s"][kind])
        row["speedup_ci"] = harness.bootstrap_ci(r0["samples_s"]["fixed"], r0["samples_s"][kind])
        row["memory_ratio"] = row["peak_step_mib"] / rows["fixed"]["peak_step_mib"]
        if kind != "fixed":
            row["pad_met"] = row["pad_fraction"] <= PAD_GOAL[kind]
            row["speed_verdict"] = harness.verdict(row["speedup_ci"], SPEEDUP_GOAL, at_least=True)
            row["memory_met"] = row["memory_ratio"] <= 1.0
    gaps = [abs(a - b) / max(abs(b), 1e-12) for kind in CUTS for a, b in zip(r0["grad_norms"][kind],
                                                                           r0["grad_norms"]["fixed"], strict=True)]
    result = {"what": "GRPO steps on the same long-tailed global batches, 2 FSDP ranks, four ways of cutting them",
              "law": " ".join(Cut.__doc__.split("Reply lengths ")[1].split()), "settings": dataclasses.asdict(cut),
              "n_params": r0["n_params"], "max_tokens": max_tokens, "tokens_per_step": [sum(x) for x in r0["lengths"]],
              "rows": rows, "grad_norm_max_rel_gap": max(gaps), "seconds": seconds, "ranks": ranks}
    for kind in CUTS:
        row = rows[kind]
        print(f"batching: {kind:8s} pad {row['pad_fraction']:6.1%}  tokens/s {row['tokens_per_s']:8.0f} "
              f"(x{row['speedup']:.2f} [{row['speedup_ci'][0]:.2f}, {row['speedup_ci'][1]:.2f}] of fixed)  "
              f"peak step {row['peak_step_mib']:7.1f} MiB (x{row['memory_ratio']:.2f})  slowest rank's tokens / mean "
              f"{row['slowest_rank_over_mean']:.3f}", flush=True)
    print(f"batching: {r0['n_params'] / 1e6:.1f}M parameters, max_tokens {max_tokens}; the four take the same step "
          f"(pre-clip grad norms within {max(gaps):.1e}) ({seconds:.0f} s)", flush=True)
    return result


# ---- the parts (run from the command) ---------------------------------------------------------------


def _worker_argv(args, part: str, *extra: str) -> list[str]:
    return [__file__, "--worker", part, "--strategy", args.strategy, *(["--quick"] if args.quick else []),
            "--cap-copies", str(args.cap_copies), *(["--reps", str(args.reps)] if args.reps else []), *extra]


def part_speed(args, mode: Mode) -> dict:
    with harness.scratch_path() as out:
        start = time.monotonic()
        harness.run_bounded(harness.torchrun(2, *_worker_argv(args, "speed"), "--out", out), 1200, "speed part")
        ranks = harness.read_json(out)
    seconds = time.monotonic() - start
    samples, cpu = ranks[0]["samples_s"], ranks[0]["cpu_s"]
    # repetition r of every contender ran call warmup + r, on pair (warmup + r) % pairs, on every rank
    per_pair = [sum(sum(r["trained_tokens"][p]) for r in ranks) for p in range(mode.pairs)]
    per_pair_all = [sum(sum(r["all_tokens"][p]) for r in ranks) for p in range(mode.pairs)]
    rep_tokens = [per_pair[(mode.warmup + r) % mode.pairs] for r in range(mode.reps)]
    tokens_per_s = {k: statistics.median(t / s for t, s in zip(rep_tokens, samples[k])) for k in CONTENDERS}
    # tokens/s learner / hand = hand's time / learner's time, repetition by repetition
    wall = (harness.paired_ratio(samples["hand"], samples["learner"]),
            harness.bootstrap_ci(samples["hand"], samples["learner"], copies=mode.copies))
    cpu_r = (harness.paired_ratio(cpu["hand"], cpu["learner"]),
             harness.bootstrap_ci(cpu["hand"], cpu["learner"], copies=mode.copies))
    wall_met, cpu_met = (harness.decide(ci, TOKENS_GOAL, at_least=True) for _, ci in (wall, cpu_r))
    met = wall_met if wall_met is cpu_met else (False if False in (wall_met, cpu_met) else None)
    gap = max(r["grad_norm_max_rel_gap"] for r in ranks)
    if gap > SAME_STEP:
        met = False
    result = {
        "what": "trained tokens per second over 2 ranks, one optimizer step (2 micro-batches per rank) per sample",
        "n_params": ranks[0]["n_params"], "tokens_per_step": per_pair, "all_tokens_per_step": per_pair_all,
        "median_step_s": {k: statistics.median(samples[k]) for k in CONTENDERS},
        "tokens_per_s": tokens_per_s, "ratio": wall[0], "ci": wall[1], "cpu_ratio": cpu_r[0], "cpu_ci": cpu_r[1],
        "goal": TOKENS_GOAL, "met": met,
        "verdict": f"invalid: the contenders' gradient norms differ by {gap:.1e}" if gap > SAME_STEP else
        harness.verdict(wall[1], TOKENS_GOAL, at_least=True) if wall_met is cpu_met else
        ("NOT met" if met is False else "undecided") + f" (wall {wall[1][0]:.3f}-{wall[1][1]:.3f}, "
                                                        f"cpu {cpu_r[1][0]:.3f}-{cpu_r[1][1]:.3f})",
        "grad_norm_max_rel_gap": gap, "same_step": gap <= SAME_STEP, "seconds": seconds,
        "samples_s": samples, "cpu_s": cpu, "ranks": ranks,
    }
    print(f"speed: {result['n_params'] / 1e6:.1f}M parameters, {statistics.mean(per_pair):.0f} trained tokens a step; "
          f"tokens/s learner {tokens_per_s['learner']:.0f}, hand {tokens_per_s['hand']:.0f}; "
          f"learner / hand {wall[0]:.3f} [{wall[1][0]:.3f}, {wall[1][1]:.3f}] wall, {cpu_r[0]:.3f} "
          f"[{cpu_r[1][0]:.3f}, {cpu_r[1][1]:.3f}] cpu (goal >= {TOKENS_GOAL}): {result['verdict']}; "
          f"pre-clip grad norms agree within {gap:.1e} ({seconds:.0f} s)", flush=True)
    return result


def part_memory(args, mode: Mode) -> dict:
    runs = []
    for rep in range(mode.repeats):
        for kind in harness.rotation(rep, CONTENDERS):
            with harness.scratch_path() as out:
                start = time.monotonic()
                harness.run_bounded(harness.torchrun(2, *_worker_argv(args, "memory", "--kind", kind), "--out", out),
                                    600, f"memory part, {kind}", **MALLOC)
                ranks = harness.read_json(out)
            runs.append({"kind": kind, "seconds": time.monotonic() - start, "ranks": ranks,
                         "worst_peak_mib": max(r["peak_over_baseline_mib"] for r in ranks)})
            print(f"memory: {kind:8s} worst-rank peak {runs[-1]['worst_peak_mib']:8.1f} MiB "
                  f"({runs[-1]['seconds']:.0f} s)", flush=True)
    peaks = {k: [r["worst_peak_mib"] for r in runs if r["kind"] == k] for k in CONTENDERS}
    median = {k: statistics.median(v) for k, v in peaks.items()}
    ratio = median["learner"] / median["hand"]
    span = (min(peaks["learner"]) / max(peaks["hand"]), max(peaks["learner"]) / min(peaks["hand"]))
    n = runs[0]["ranks"][0]["n_params"]
    result = {"what": f"peak resident memory over the pre-model baseline, worst of 2 ranks, {mode.memory_updates} "
                      "optimizer steps", "n_params": n, "copy_mib": n * 4 / 2**20, "median_peak_mib": median,
              "ratio": ratio, "range": span, "goal": MEMORY_GOAL, "met": harness.decide(span, MEMORY_GOAL),
              "verdict": harness.verdict(span, MEMORY_GOAL), "runs": runs}
    print(f"memory: {n / 1e6:.1f}M parameters; learner / hand {ratio:.3f} (launches {span[0]:.3f}-{span[1]:.3f}, "
          f"goal <= {MEMORY_GOAL}): {result['verdict']}", flush=True)
    return result


def part_capped(args, mode: Mode) -> dict:
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny models, few repetitions: does it run?")
    parser.add_argument("--strategy", choices=("fsdp", "ddp"), default="fsdp",
                        help="the learner's strategy and the hand loop's (per-layer FSDP2, or DDP)")
    parser.add_argument("--parts", default=",".join(PARTS), help="some of: " + ",".join(PARTS))
    parser.add_argument("--cap-copies", type=float, default=3.5, help="the capped part's cap, in model copies")
    parser.add_argument("--reps", type=int, help="the speed part's repetitions (default: the mode's)")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "llm_update.json"))
    parser.add_argument("--worker", choices=tuple(PARTS), help=argparse.SUPPRESS)
    parser.add_argument("--kind", choices=CAPPED_KINDS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    mode = QUICK if args.quick else FULL
    if args.reps:
        mode = dataclasses.replace(mode, reps=args.reps)
    if args.worker == "speed":
        return speed_worker(mode, args.strategy, args.out)
    if args.worker == "memory":
        return memory_worker(args.kind, mode, args.strategy, args.out)
    if args.worker == "capped":
        return capped_worker(args.kind, mode, args.strategy, args.cap_copies, args.out)
    if args.worker == "batching":
        cut = QUICK_CUT if args.quick else Cut()
        return batching_worker(dataclasses.replace(cut, reps=args.reps) if args.reps else cut, args.out)
    parts = [p for p in args.parts.split(",") if p]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.error(f"unknown parts {unknown}: choose from {','.join(PARTS)}")
    start = time.monotonic()
    result = {"what": __doc__.split("\n")[0], "mode": "quick" if args.quick else "full", "strategy": args.strategy,
              "settings": dataclasses.asdict(mode), "lr": LR, "clip": CLIP, "grad_accum_steps": ACCUM,
              "machine": harness.machine(), "load_before": os.getloadavg()}
    for part in parts:
        result[part] = PARTS[part](args, mode)
    result.update(load_after=os.getloadavg(), seconds=time.monotonic() - start)
    harness.write_json(args.out, result)
    print(f"wrote {args.out} ({result['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
