"""The step of a learner with several optimizers (``stages=``): each due stage's backward, clip and step.

``Learner.update`` hands a staged learner's batches here; the backend hooks it calls (forward,
backward, sync, clip, optimizer step) are the same ones the single-optimizer step uses.
"""

from __future__ import annotations

import math

from tensordict import TensorDictBase

from fabric_learner.step.parts import backward_seed, check_batch, reported_norm
from fabric_learner.step.stages import as_output, groups


def update_staged(learner, batch: TensorDictBase) -> TensorDictBase:
    """``update`` for a learner with stages: each due stage's backward, clip and step, in order.

    The first group of stages (see ``stages.groups``) runs on each micro-batch as it comes,
    with the window's starting weights; later groups run when the window ends, over all of
    its micro-batches, after the groups before them have stepped. So two accumulated halves
    equal one full batch, and a method stage sees the weights its predecessors just stepped.
    """
    check_batch(batch)
    k = learner.grad_accum_steps
    stepping = learner._accum_step + 1 == k
    plan = groups([s for s in learner.stages if s.due(learner.num_updates)])
    if learner._accum_step == 0:
        learner.optimizer.zero_grad(set_to_none=True)
        learner._window_batches, learner._window_results, learner._window_samples = [], [], 0
        learner._group_seeds = [None] * len(plan)
    learner._window_samples += batch.batch_size.numel()
    result = _stage_backward(learner, plan, 0, batch, sync=stepping)
    learner._accum_step += 1
    if len(plan) > 1:
        learner._window_batches.append(batch)
    if not stepping:
        return result
    learner._accum_step = 0
    micro, learner._window_batches = learner._window_batches, []
    stepped: list[str] = []
    skipped = False
    for index, group in enumerate(plan):
        if index:
            for i, each in enumerate(micro):
                result.update(_stage_backward(learner, plan, index, each, sync=i == len(micro) - 1))
        for stage in group:
            optimizer = learner.optimizer.by_stage[stage.name]
            clip = math.inf if stage.clip_grad_norm is None else stage.clip_grad_norm
            grad_norm = learner._clip_gradients(clip, optimizer)
            result.set(f"grad_norm_{stage.name}", reported_norm(grad_norm, result.device))
            loss_bad = learner.world_size == 1 and not math.isfinite(learner._group_seeds[index].item())
            if not math.isfinite(grad_norm.item()) or loss_bad:
                if learner.on_nonfinite == "raise":
                    learner._abandon_window()
                    raise FloatingPointError(
                        f"Optimizer step {learner.num_updates + 1}, stage {stage.name!r} refused: its "
                        f"{'loss' if loss_bad else 'grad_norm'} is non-finite. Its parameters and optimizer "
                        f"state did not change; stages {stepped} had already stepped in this update and later "
                        "stages did not run. Check the batch for nan/inf, lower the learning rate or set the "
                        "stage's clip_grad_norm, or build the learner with on_nonfinite='skip'."
                    )
                skipped = True
                continue
            learner._optimizer_step(optimizer)
            stepped.append(stage.name)
        learner.optimizer.zero_grad(set_to_none=True)
    learner.skipped_updates += int(skipped)
    if stepped:
        learner.num_updates += 1
        learner._weights_changed()
    return result


def _stage_backward(learner, plan, index: int, batch: TensorDictBase, sync: bool) -> TensorDictBase:
    """Forward (shared, or the group's method) and backward of one group's loss terms on ``batch``."""
    group = plan[index]
    method = group[0].method
    with learner._sync_context(sync):
        output = learner._forward(batch, method)
        if method is not None:
            output = as_output(output, group[0])
        loss = group[0].terms(output)
        for stage in group[1:]:
            loss = loss + stage.terms(output)
        seed = backward_seed(loss)
        previous = learner._group_seeds[index]
        learner._group_seeds[index] = seed if previous is None else previous * seed
        if learner.grad_accum_steps > 1:
            loss = loss / learner.grad_accum_steps
        learner._backward(loss, seed)
    return output.detach()
