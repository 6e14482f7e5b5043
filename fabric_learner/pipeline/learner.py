"""A learner whose ranks are pipeline stages of one language model (torch.distributed.pipelining).

Each rank holds one stage of the policy's model (``PipelineStrategy.split_fn``) and receives the same batch.
``update(batch)`` cuts it into ``microbatches`` micro-batches and runs torch's schedule (GPipe or 1F1B) over
them: every stage runs torchrl's loss, unchanged, on each micro-batch, with the model's call redirected to its
stage (the first stage stops once its part has run and sends the hidden states; a later stage runs its part on
the hidden states it received; the last one finishes the loss). The last stage backpropagates each
micro-batch's *sum* (the loss's mean times the tokens or samples it averaged over, see ``llm.counts``) with
``scale_grads=False``; after the schedule the gradients of every stage are divided by the batch's count, read
on the last stage and shared with one all-reduce, then clipped by their norm over all stages, and each stage
steps its own optimizer. A stage that fails is named on every stage at once (``pipeline.faults``); checkpoints
are the whole model's, in the layout every learner reads (``pipeline.checkpoints``). See docs/pipeline.md.
"""

from __future__ import annotations

import contextlib
import math
import os
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tensordict import TensorDict, TensorDictBase
from torch import nn

from fabric_learner.launch import call_order as _call_order
from fabric_learner.launch import teardown as _teardown
from fabric_learner.launch.build import DEFAULT_TIMEOUT, apply_collective_timeout, as_timeout, build_fabric, launch
from fabric_learner.learner import Capabilities, Learner
from fabric_learner.optim import OptimizerLike, build_optimizer, optimizer_params
from fabric_learner.pipeline import checkpoints as _checkpoints
from fabric_learner.pipeline import faults as _faults
from fabric_learner.sharding.pipeline_split import Split, check_split, decoder_split
from fabric_learner.step.output import as_tensordict, detached, total_loss
from fabric_learner.step.parts import check_batch

SCHEDULES = ("1F1B", "GPipe")


@dataclass(frozen=True)
class PipelineStrategy:
    """Pipeline parallelism for ``FabricLearner``: one stage of the policy's model per rank.

    Args:
        split_fn: ``split_fn(model, stage, num_stages) -> model``, keeping in the model what ``stage`` runs
            (see ``sharding.pipeline_split``); default: ``decoder_split``, by decoder layer.
        schedule: ``"1F1B"`` (default) or ``"GPipe"``, torch.distributed.pipelining's schedules.
        microbatches: how many micro-batches each update's batch is cut into (default 2).
        scale_grads: ``False`` (default): exact, each micro-batch's sum divided by the batch's count.
            ``True``: torch's default, each micro-batch's mean and the gradients divided by the micro-batch
            count; not the step of one process when micro-batches hold different token counts (kept to compare).

    Examples:
        >>> from fabric_learner.pipeline import PipelineStrategy
        >>> PipelineStrategy(microbatches=4).schedule
        '1F1B'
    """

    split_fn: Split = decoder_split
    schedule: str = "1F1B"
    microbatches: int = 2
    scale_grads: bool = False

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}.")
        if isinstance(self.microbatches, bool) or not isinstance(self.microbatches, int) or self.microbatches < 1:
            raise ValueError(f"microbatches must be an integer >= 1, got {self.microbatches!r}.")
        if not callable(self.split_fn):
            raise TypeError("split_fn must be a callable split_fn(model, stage, num_stages) -> model.")


class _Handoff(Exception):
    """Raised out of the loss once a non-last stage's part of the model has run, carrying its hidden states."""

    def __init__(self, hidden: torch.Tensor) -> None:
        super().__init__("pipeline stage output")
        self.hidden = hidden


class _Shape(Exception):
    """Raised out of the loss by the shape pass: the token ids' ``[samples, length]``."""

    def __init__(self, shape: torch.Size) -> None:
        super().__init__("token shape")
        self.shape = shape


class _StageRunner(nn.Module):
    """What ``PipelineStage`` runs: the loss on the next micro-batch, the model's call redirected to this stage."""

    def __init__(self, loss_module: nn.Module, model: nn.Module, counts, first: bool, last: bool,
                 scale_grads: bool) -> None:
        super().__init__()
        self.loss_module = loss_module
        object.__setattr__(self, "_counts", counts)
        self.first, self.last, self.scale_grads = first, last, scale_grads
        self.micro_batches: list[TensorDictBase] = []
        self.padded: tuple[int, int] = (0, 0)  # [samples, length] every hidden state is sent as
        self.results: list[tuple[TensorDictBase, torch.Tensor]] = []  # last stage: (output, count) per micro-batch
        self.mode = "off"  # the hooks act only inside update(): "shape" (the shape pass) or "run" (the schedule)
        self.failure: tuple[str, BaseException] | None = None  # where this stage's own code failed, and its error
        self._next = 0
        self._received: torch.Tensor | None = None
        model.register_forward_pre_hook(self._before_model, with_kwargs=True)
        model.register_forward_hook(self._after_model, with_kwargs=True)

    def start(self, micro_batches: list[TensorDictBase], padded: tuple[int, int]) -> None:
        self.micro_batches, self.padded, self.results, self._next = micro_batches, padded, [], 0
        self.failure = None

    def shape_of(self, micro_batch: TensorDictBase) -> torch.Size:
        """The token ids' shape the policy gives the model for ``micro_batch`` (its tokenisation, no model run)."""
        self.mode = "shape"
        try:
            with torch.no_grad():
                self.loss_module(micro_batch)
        except _Shape as shape:
            return shape.shape
        finally:
            self.mode = "off"
        raise RuntimeError("The loss never called the policy's model, so the pipeline has nothing to split. "
                           "Give PipelineStrategy a loss whose policy (policy=) runs a transformers model.")

    def forward(self, *received: torch.Tensor) -> torch.Tensor:
        micro_batch = self.micro_batches[self._next]
        self._next += 1
        self._received = None if self.first else received[0]
        counts = self._counts
        counts.reset()
        try:
            output = self.loss_module(micro_batch)
        except _Handoff as handoff:
            hidden = handoff.hidden
            samples, length = self.padded
            return F.pad(hidden, (0, 0, 0, length - hidden.shape[1], 0, samples - hidden.shape[0]))
        except BaseException as err:  # torch wraps it; the learner names it (pipeline.faults)
            self.failure = (f"forward of micro-batch {self._next - 1}", err)
            raise
        finally:
            self._received = None
        output = as_tensordict(output) if type(output) is not TensorDict else output
        loss = total_loss(output)
        count = counts.take(micro_batch).to(loss.device)
        self.results.append((detached(output), count))
        return loss if self.scale_grads else loss * count  # the mean, or the micro-batch's sum

    def _before_model(self, module, args, kwargs):
        if self.mode == "off":
            return None
        ids = args[0] if args else kwargs.get("input_ids")
        if self.mode == "shape":
            raise _Shape(ids.shape)
        if self.first:
            return None
        samples, length = ids.shape
        hidden = self._received[:samples, :length]
        if args:
            return (None, *args[1:]), {**kwargs, "inputs_embeds": hidden}
        return (), {**kwargs, "input_ids": None, "inputs_embeds": hidden}

    def _after_model(self, module, args, kwargs, output):
        if self.last or self.mode != "run":
            return None
        hidden = getattr(output, "logits", None)
        raise _Handoff(hidden if hidden is not None else output[0])


class PipelineLearner(Learner):
    """The Learner step with the policy's model split into pipeline stages, one per rank.

    Built by ``FabricLearner(loss, optimizer, policy=policy, strategy=PipelineStrategy(...), devices=N)``: the
    ``N`` ranks are the ``N`` stages (pipeline parallelism alone: no data parallelism in this version). Every
    rank calls ``update`` with the same batch; the step equals one process's on that batch (see the module).
    For torchrl's LLM losses (``GRPOLoss``, ``SFTLoss``, ...) over a ``TransformersWrapper`` given as ``policy=``.
    ``save``/``load``/``checkpoint``/``load_checkpoint`` are the whole model's, in the layout every learner reads
    (``pipeline.checkpoints``).

    Raises:
        ValueError, TypeError: before any rank starts, for a split that does not cover the model exactly once
            or settings this learner does not take; in ``update``, on every rank and before any stage runs, for a
            batch the schedule cannot carry (fewer samples than micro-batches, different batches on the ranks, or
            one a stage cannot read).
        RuntimeError: in ``update``, on every stage, when a stage fails mid-schedule (its loss raises, its process
            dies), naming it (``pipeline.faults``); the learner then refuses further updates.

    Examples:
        On 2 ranks (``devices=2``) the stages train as docs/pipeline.md shows; what is refused is refused before
        any rank starts:

        >>> from fabric_learner import FabricLearner
        >>> from fabric_learner.pipeline import PipelineStrategy
        >>> from fabric_learner.testing import grpo_example
        >>> loss, policy, batch = grpo_example()
        >>> FabricLearner(loss, policy=policy, strategy=PipelineStrategy(), accelerator="cpu", devices=1)
        Traceback (most recent call last):
        ...
        ValueError: PipelineStrategy needs devices= the number of stages (an integer >= 2), got 1. Nothing was launched.
    """

    capabilities = Capabilities(sharded=True, distributed=True)

    def __init__(self, loss_module: nn.Module, optimizer: OptimizerLike = None, *, policy: nn.Module | None = None,
                 strategy: PipelineStrategy, clip_grad_norm: float | None = None, grad_accum_steps: int = 1,
                 accelerator: str = "auto", devices: Any = "auto", num_nodes: int = 1, precision: Any = "32-true",
                 on_nonfinite: str = "raise", timeout: timedelta | float | None = DEFAULT_TIMEOUT,
                 compile: bool = False, stages=None, fabric=None) -> None:
        super().__init__(loss_module, policy=policy, clip_grad_norm=clip_grad_norm, on_nonfinite=on_nonfinite)
        refused = {"grad_accum_steps": grad_accum_steps != 1, "compile": compile, "stages": stages is not None,
                   "fabric": fabric is not None, "precision": precision not in ("32-true", "32", 32)}
        named = [k for k, v in refused.items() if v]
        if named:
            raise ValueError(f"PipelineStrategy does not take {named} in this version: the micro-batches are the "
                             "schedule's (PipelineStrategy(microbatches=...)), one optimizer per stage, float32. "
                             "Nothing was launched; leave them at their defaults.")
        if self._counts is None:
            raise ValueError(f"PipelineStrategy trains torchrl's LLM losses (GRPOLoss, DAPO, CISPOLoss, SFTLoss), "
                             f"whose normalisation it keeps exact over micro-batches; {type(loss_module).__name__} "
                             "is not one. Nothing was launched.")
        model = getattr(policy, "model", None)
        if not isinstance(model, nn.Module) or not any(model is m for m in loss_module.modules()):
            raise ValueError("PipelineStrategy needs policy= the TransformersWrapper the loss trains (its .model is "
                             "what the stages split). Nothing was launched.")
        if devices in ("auto", None) or isinstance(devices, bool) or not isinstance(devices, int) or devices < 2:
            raise ValueError(f"PipelineStrategy needs devices= the number of stages (an integer >= 2), got "
                             f"{devices!r}. Nothing was launched.")
        check_split(model, strategy.split_fn, devices)  # every rank refuses a bad split alike, before the launch
        timeout = as_timeout(timeout)
        group_existed = dist.is_available() and dist.is_initialized()
        fabric, owns_timeout = build_fabric(accelerator=accelerator, strategy="ddp", devices=devices,
                                            num_nodes=num_nodes, precision="32-true", timeout=timeout)
        launch(fabric)
        if owns_timeout and not group_existed:
            apply_collective_timeout(fabric, timeout)
        if fabric.world_size != devices:
            raise ValueError(f"PipelineStrategy runs one stage per rank: {devices} stages on {fabric.world_size} "
                             "ranks. Launch as many ranks as devices=.")
        object.__setattr__(self, "fabric", fabric)
        object.__setattr__(self, "strategy", strategy)
        self._closed = False
        stage, stages_n = fabric.global_rank, fabric.world_size
        # the whole policy's names, as get_weights() gives them (before the split removes the other stages')
        object.__setattr__(self, "_policy_names", list(TensorDict.from_module(policy).flatten_keys(".").keys()))
        # ... and the whole loss's checkpoint layout, which every stage's checkpoint part belongs to
        object.__setattr__(self, "_whole", _checkpoints.WholeModel.of(loss_module))
        strategy.split_fn(model, stage, stages_n)
        loss_module.to(fabric.device)
        self.optimizer = build_optimizer(optimizer, loss_module.parameters())
        object.__setattr__(self, "_torch_optimizer", self.optimizer)
        object.__setattr__(self, "_runner", _StageRunner(loss_module, model, self._counts, stage == 0,
                                                         stage == stages_n - 1, strategy.scale_grads))
        object.__setattr__(self, "_schedules", {})
        self._hidden_size = None
        self._poison_gradients = False  # the window's loss is shared over the stages (_window_mark): same verdict
        # the schedule's transfers get a group of their own: a failed schedule's unmatched transfers stay in it
        transfers = dist.new_group(**({} if timeout is None else {"timeout": timeout}))
        object.__setattr__(self, "_transfers", transfers)
        object.__setattr__(self, "_watch", _faults.StageWatch(transfers.group_name, timeout))
        # gloo's sends and receives wait without a timeout: watched (NCCL's waits do not block the host; untested)
        self._watched = dist.get_backend(transfers) == "gloo"
        self._failure: str | None = None  # what stopped a schedule: the learner cannot go on
        _teardown.register(self, group_existed)

    # ---- the step ---------------------------------------------------------------------------

    def update(self, batch: TensorDictBase) -> TensorDictBase:
        """One optimizer step of every stage on ``batch`` (the same batch on every rank); see the class.

        A batch a stage cannot cut or read is refused on every stage before any runs. A stage that fails during
        the schedule (its loss raises, its process dies) is named on every stage at once (``pipeline.faults``),
        and the learner cannot go on after it.
        """
        if self._closed:
            raise RuntimeError("This learner is closed; build a new one to keep training.")
        if self._failure is not None:
            raise RuntimeError(f"This learner stopped in an earlier update(): {self._failure} It cannot go on: close "
                               "it on every rank and build a new one (load a checkpoint into it to resume).")
        micro_batches, padded = self._agreed_micro_batches(batch)
        call = self.num_updates + self.skipped_updates + 1  # this update() call, counted as FabricLearner does
        runner = self._runner
        try:
            self._run_schedule(micro_batches, padded)
        except BaseException as err:
            stopped = _faults.stopped(err, self._watch, self.stage, self.world_size, call, runner.failure)
            self._failure = str(stopped)
            if stopped is err:
                raise
            raise stopped from stopped.__cause__
        try:
            result = self._shared_result(runner.results)
            state = self.__dict__
            state["_window_results"] = [result]
            return self._step(result.exclude("_count"))
        except RuntimeError as err:
            lost = _faults.lost_in_collective(err, self._watch, self.stage, call)
            if lost is None:
                raise
            self._failure = str(lost)
            raise lost from err

    def _agreed_micro_batches(self, batch: TensorDictBase) -> tuple[list[TensorDictBase], tuple[int, int]]:
        """``batch`` cut into the schedule's micro-batches and the hidden states' padded ``[samples, length]``,
        once every stage has done the same (one all-reduce); raises on every stage otherwise, before any runs."""
        micro = self.strategy.microbatches
        samples, micro_batches, padded, error = 0, [], (0, 0), None
        try:
            samples = check_batch(batch)
            if samples >= micro:
                cuts = torch.arange(samples).tensor_split(micro)
                micro_batches = [batch[int(c[0]):int(c[-1]) + 1] for c in cuts]
                shapes = [self._runner.shape_of(mb) for mb in micro_batches]  # the policy's tokenisation
                padded = (max(s[0] for s in shapes), max(s[1] for s in shapes))
        except Exception as err:  # noqa: BLE001 - every stage learns of it below, before any stage runs
            error = err
        failed = self.global_rank + 1 if error is not None else 0
        seen = torch.tensor([failed, samples, -samples, *padded, -padded[0], -padded[1]], device=self.fabric.device)
        dist.all_reduce(seen, op=dist.ReduceOp.MAX)
        failed, most, fewest = int(seen[0]), int(seen[1]), -int(seen[2])
        if error is not None:
            raise error
        if failed:
            raise ValueError(f"Stage {failed - 1} (rank {failed - 1}) could not read this batch (its own error says "
                             "why). No stage ran; pass every rank the same batch, holding what the loss reads.")
        if most != fewest:
            raise ValueError(f"The ranks passed batches of {fewest} to {most} samples: every pipeline stage must get "
                             "the same batch. No stage ran; pass every rank the same batch.")
        if samples < micro:
            raise ValueError(f"A batch of {samples} samples cannot be cut into the schedule's {micro} micro-batches "
                             f"(at least one sample each). No stage ran; pass at least {micro} samples, or build "
                             "the strategy with fewer microbatches.")
        if (int(seen[3]), int(seen[4])) != (-int(seen[5]), -int(seen[6])):
            raise ValueError(f"The ranks' batches give tokens of shapes [{-int(seen[5])}, {-int(seen[6])}] to "
                             f"[{int(seen[3])}, {int(seen[4])}] (the largest micro-batch): every pipeline stage must "
                             "get the same batch. No stage ran; pass every rank the same batch.")
        return micro_batches, padded

    def _run_schedule(self, micro_batches: list[TensorDictBase], padded: tuple[int, int]) -> None:
        """Every stage's part of the schedule over ``micro_batches``; the last stage's outputs in the runner."""
        runner = self._runner
        runner.start(micro_batches, padded)
        schedule = self._schedule(padded)
        self._torch_optimizer.zero_grad(set_to_none=True)
        stage = self.fabric.global_rank
        numbers = torch.arange(len(micro_batches), device=self.fabric.device)
        runner.mode = "run"
        try:
            with self._watch.watching() if self._watched else contextlib.nullcontext():
                if stage == 0:
                    schedule.step(numbers, return_outputs=False)
                elif stage == self.world_size - 1:
                    schedule.step(target=numbers, return_outputs=False)
                else:
                    schedule.step(return_outputs=False)
        finally:
            runner.mode = "off"

    def _schedule(self, padded: tuple[int, int]):
        """The stage and schedule for hidden states of ``padded`` ``[samples, length]`` (built once per shape)."""
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        schedule = self._schedules.get(padded)
        if schedule is not None:
            return schedule
        stage, stages_n, device = self.fabric.global_rank, self.world_size, self.fabric.device
        dtype = next(p.dtype for p in self.loss_module.parameters() if p.is_floating_point())
        # the hidden states carry gradients back: their metadata says so (the receiving buffers are built from it)
        hidden = torch.empty(*padded, self._model_width(), dtype=dtype, device=device, requires_grad=True)
        inputs = torch.zeros(1, dtype=torch.long, device=device) if stage == 0 else hidden
        outputs = torch.empty((), dtype=dtype, device=device) if stage == stages_n - 1 else hidden
        pipe_stage = PipelineStage(self._runner, stage, stages_n, device, input_args=inputs, output_args=outputs,
                                   group=self._transfers)
        kind = Schedule1F1B if self.strategy.schedule == "1F1B" else ScheduleGPipe
        schedule = kind(pipe_stage, self.strategy.microbatches, loss_fn=lambda output, target: output,
                        scale_grads=self.strategy.scale_grads)
        self._schedules[padded] = schedule
        return schedule

    def _model_width(self) -> int:
        config = getattr(self.policy.model, "config", None)
        width = getattr(config, "hidden_size", None)
        if not isinstance(width, int):
            raise ValueError("The policy's model has no config.hidden_size: the pipeline cannot size the hidden "
                             "states its stages exchange. Use a transformers model.")
        return width

    def _shared_result(self, results: list[tuple[TensorDictBase, torch.Tensor]]) -> TensorDictBase:
        """The batch's loss output on every rank: the last stage's micro-batch outputs, weighed by their counts."""
        last = self.world_size - 1
        summary = [None]
        if self.global_rank == last:
            total = sum(float(count) for _, count in results)
            weights = [1.0 / len(results)] * len(results) if self.strategy.scale_grads else \
                [float(count) / max(total, 1.0) for _, count in results]
            keys = list(results[0][0].keys(include_nested=True, leaves_only=True))
            values = {k: sum(w * td.get(k).float() for w, (td, _) in zip(weights, results)) for k in keys}
            summary = [{"values": {k: v.cpu() for k, v in values.items()}, "count": total}]
        dist.broadcast_object_list(summary, src=last)
        shared = summary[0]
        out = TensorDict({}, batch_size=[], device=self.fabric.device)
        for key, value in shared["values"].items():
            out.set(key, value.to(self.fabric.device))
        out.set("_count", torch.tensor(shared["count"], device=self.fabric.device))
        return out

    def _step(self, result: TensorDictBase) -> TensorDictBase:
        state = self.__dict__
        count = float(self._window_results[0].get("_count"))
        state["_window_count"] = torch.tensor(count, device=self.fabric.device)
        state["_window_mark"] = total_loss(result)
        return super()._step(result)

    def _normalize_gradients(self) -> None:
        if self.strategy.scale_grads:  # torch's own scaling (by the micro-batch count) was applied
            return
        factor = 1.0 / max(float(self._window_count), 1.0)
        for param in optimizer_params(self._torch_optimizer):
            if param.grad is not None:
                param.grad.mul_(factor)

    def _clip_gradients(self, max_norm: float, optimizer=None) -> torch.Tensor:
        """Clip every stage's gradients by their norm over all stages; return that norm (one all-reduce)."""
        params = [p for p in optimizer_params(self._torch_optimizer) if p.grad is not None]
        local = torch.nn.utils.get_total_norm([p.grad for p in params], error_if_nonfinite=False) if params else \
            torch.zeros((), device=self.fabric.device)
        squared = local.double().pow(2)
        dist.all_reduce(squared)
        norm = squared.sqrt().to(local.dtype)
        if not math.isinf(max_norm) and params:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return norm

    # ---- attributes and lifecycle ------------------------------------------------------------

    @property
    def global_rank(self) -> int:
        return self.fabric.global_rank

    @property
    def world_size(self) -> int:
        return self.fabric.world_size

    @property
    def stage(self) -> int:
        """This rank's pipeline stage."""
        return self.fabric.global_rank

    def close(self) -> None:
        """Release the process group's hold (every rank closes, as every rank built the learner); idempotent."""
        if self._closed:
            return
        self._closed = True
        self._watch.close()
        if self._failure is None and dist.is_initialized():  # a failed schedule's transfers may still be posted
            dist.destroy_process_group(self._transfers)
        _teardown.close(self)

    def get_weights(self, *, cpu_offload: bool = True) -> TensorDictBase:
        """The whole policy's weights, gathered from the stages under its own names; a collective.

        Laid out as ``TensorDict.from_module(policy)`` of the unsplit model. ``cpu_offload=True``: on rank 0,
        an empty TensorDict elsewhere (as under FSDP); ``False``: on every rank, on the learner's device.
        The stages' tensors travel as pickled objects (``gather_object``): fine for small models, slow for
        large ones.
        """
        mine = {k: v.detach().to("cpu", copy=True)
                for k, v in TensorDict.from_module(self.policy).flatten_keys(".").items()}
        parts: list[Any] = [None] * self.world_size
        if cpu_offload:
            dist.gather_object(mine, parts if self.global_rank == 0 else None, dst=0)
            if self.global_rank != 0:
                return TensorDict({}, batch_size=[])
        else:
            dist.all_gather_object(parts, mine)
        merged: dict[str, torch.Tensor] = {}
        for part in parts:  # buffers every stage holds (rotary frequencies) are equal: the first is kept
            for key, value in part.items():
                merged.setdefault(key, value)
        missing = [k for k in self._policy_names if k not in merged]
        if missing:
            raise RuntimeError(f"The stages hold no tensor named {missing[:4]} of the policy: the split removed "
                               "them from every stage. Check split_fn.")
        out = TensorDict({}, batch_size=[])
        for key in self._policy_names:
            value = merged[key]
            out.set(tuple(key.split(".")), value if cpu_offload else value.to(self.fabric.device))
        return out

    # ---- checkpoints (collectives): the whole model's, see pipeline.checkpoints -------------------------

    def _collective(self, name: str) -> contextlib.AbstractContextManager:
        """Checks, before the call's first collective, that every rank is making this same call."""
        return _call_order.collective_call(name, self.global_rank, self.world_size, self._watch.timeout)

    def save(self, path: str | os.PathLike, blocking: bool = True) -> Future | None:
        """Write the whole model's sharded checkpoint folder at ``path``; every rank calls it.

        The layout FSDP writes (``checkpoint.dcp_folder``), under the whole model's names: each stage writes its
        own parameters and optimizer moments, rank 0 the whole model's ``meta.json``; ``LATEST`` switches to the
        new version only once every stage's part is on disk, so a save that fails or dies mid-write leaves the
        previous checkpoint current. LocalLearner, DDP and FSDP learners load it, and this learner loads theirs.
        ``blocking=False`` saves synchronously too and returns a finished future.

        Raises:
            FileExistsError: ``path`` holds something this package did not write (nothing is written).
            ValueError: the stages' optimizers have different param groups or settings (nothing is written).
            RuntimeError: a stage failed to write its part (``LATEST`` still names the previous version).
        """
        with self._collective("save"):
            self.wait_for_save()
            _checkpoints.save(self, path)
        return None if blocking else self._track_save(path, None)

    def load(self, path: str | os.PathLike) -> None:
        """Restore a checkpoint of the whole model written by any learner (folder or file); every rank calls it.

        Each stage reads only its own part. Every stage checks it (the model's keys and shapes, the optimizer's
        parameters and groups, the counters) and the stages share their verdicts before any changes anything:
        a checkpoint refused on one stage is refused on all, and nothing changes.
        """
        with self._collective("load"):
            self.wait_for_save()
            _checkpoints.load(self, path)

    def checkpoint(self) -> dict[str, Any]:
        """The whole model's checkpoint on every rank, as ``LocalLearner.checkpoint()`` has it (a collective)."""
        with self._collective("checkpoint"):
            return _checkpoints.checkpoint(self)

    def load_checkpoint(self, checkpoint) -> None:
        """Restore a whole model's checkpoint (any learner's ``checkpoint()``) into every stage (a collective)."""
        with self._collective("load_checkpoint"):
            _checkpoints.load_checkpoint(self, checkpoint)
