"""Pipeline parallelism (2 stages on 2 gloo ranks) for torchrl's LLM losses, in one launch (tests/test_pipeline.py).

Usage: python pipeline_checks.py OUT_DIR
Writes OUT_DIR/rank{r}.pt: per case, this stage's parameters after STEPS SGD steps (lr 1, clipping that bites),
the learner's outputs, and the refusals' messages. Every rank passes the whole batch (the stages share it).
Then checkpoints across layouts (``checkpoints``): the stages save, FSDP on the same 2 ranks loads and saves, the
stages load FSDP's folder and one process's file, each learner training on from what it loaded; rank 0's
``"ckpt"`` entry holds the whole model's parameters and momenta at each point, the checkpoints stay in OUT_DIR.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch

from fabric_learner import FabricLearner, LocalLearner
from fabric_learner.pipeline import PipelineStrategy
from fabric_learner.testing import dqn_example, grpo_batch, grpo_example

TIMEOUT = timedelta(seconds=60)
REPLIES = (3, 9, 5, 2, 12, 4, 7)  # 7 samples of unequal lengths: micro-batches of unequal token counts
STEPS = 2
CLIP = 0.05  # below every step's gradient norm (checked in the test): clipping bites
# case: (loss, schedule, micro-batches, scale_grads)
CASES = {
    "grpo": ("grpo", "1F1B", 3, False),
    "sft": ("sft", "GPipe", 2, False),
    "grpo_scaled": ("grpo", "1F1B", 3, True),
}


def sgd():
    return functools.partial(torch.optim.SGD, lr=1.0)


# checkpoints: SGD with momentum, so that a load that lost the optimizer's state trains on differently
MOMENTUM = functools.partial(torch.optim.SGD, lr=0.5, momentum=0.9)
CKPT_REPLIES = (3, 9, 5, 2, 12, 4)  # 6 samples: FSDP's two ranks take 3 each


def build(kind):
    """``(loss, policy)``: GRPO (token mean) or SFT on the tiny Qwen2 (2 decoder layers), seed 0."""
    from torchrl.objectives.llm import SFTLoss

    loss, policy, _ = grpo_example(REPLIES)
    if kind == "sft":
        return SFTLoss(policy, reduction="mean"), policy
    return loss, policy


def batches(policy):
    """The STEPS batches, built from the initial policy (before any split)."""
    return [grpo_batch(policy, list(REPLIES), seed=step) for step in range(STEPS)]


def ckpt_batches(policy):
    """Three batches of CKPT_REPLIES, built from the initial policy."""
    return [grpo_batch(policy, list(CKPT_REPLIES), seed=10 + step) for step in range(3)]


def state(learner):
    """The whole model's parameters and momenta by name, and the update count (a collective on several ranks)."""
    ckpt = learner.checkpoint()
    names = ckpt["param_names"]
    return {"num_updates": learner.num_updates,
            "model": {k: v.detach().cpu().clone() for k, v in ckpt["model"].items()},
            "momentum": {names[int(i)]: f["momentum_buffer"].cpu().clone() for i, f in ckpt["optimizer"]["state"].items()}}


def refused(call, *args):
    """``call(*args)``'s error as ``"Type: message"``, or None when it did not raise."""
    try:
        call(*args)
    except Exception as err:  # noqa: BLE001 - the message is what the test reads
        return f"{type(err).__name__}: {err}"
    return None


@contextlib.contextmanager
def failing_writes(fail):
    """With ``fail``, this rank's checkpoint writes stop half-way with a full disk (a crash mid-save of one stage)."""
    from torch.distributed.checkpoint import FileSystemWriter

    real = FileSystemWriter.write_data

    def half_then_full(self, plan, planner):
        (Path(self.path) / "__1_0.distcp").write_bytes(b"half a shard")
        raise OSError(28, "No space left on device (simulated mid-write)")

    if fail:
        FileSystemWriter.write_data = half_then_full
    try:
        yield
    finally:
        FileSystemWriter.write_data = real


def pipeline(loss, policy):
    return FabricLearner(loss, MOMENTUM, policy=policy, strategy=PipelineStrategy(microbatches=3),
                         accelerator="cpu", devices=2, timeout=TIMEOUT)


def checkpoints(out_dir, rank, foreign):
    """Checkpoints across layouts; ``foreign``: the folder of another model's pipeline (the SFT case's)."""
    import torch.distributed as dist

    out = Path(out_dir)
    got, learners = {}, []
    loss, policy = build("grpo")
    data = ckpt_batches(policy)
    stages = pipeline(loss, policy)
    learners.append(stages)
    stages.update(data[0])
    stages.save(out / "pipeline.ckpt")
    got["pipeline_saved"] = state(stages)
    # refused on both stages before anything changes
    got["missing"] = refused(stages.load, out / "nothing.ckpt")
    got["foreign_folder"] = refused(stages.load, foreign)
    got["foreign_file"] = refused(stages.load, out / "dqn.ckpt")
    got["unchanged_after_refusals"] = state(stages)
    stages.update(data[1])
    got["pipeline_trained_on"] = state(stages)
    with failing_writes(rank == 1):  # stage 1's part stops half-way: LATEST keeps the first save
        got["failed_save"] = refused(stages.save, out / "pipeline.ckpt")
    got["latest_after_failed_save"] = (out / "pipeline.ckpt" / "LATEST").read_text()
    got["versions_after_failed_save"] = sorted(p.name for p in (out / "pipeline.ckpt").iterdir() if p.is_dir())

    # FSDP on the same two ranks loads the stages' checkpoint, trains on, saves
    loss, policy = build("grpo")
    fsdp = FabricLearner(loss, MOMENTUM, policy=policy, strategy="fsdp", accelerator="cpu", devices=2,
                         timeout=TIMEOUT)
    learners.append(fsdp)
    fsdp.load(out / "pipeline.ckpt")
    got["fsdp_loaded"] = state(fsdp)
    fsdp.update(data[1][3 * rank:3 * rank + 3])
    got["fsdp_trained_on"] = state(fsdp)
    fsdp.save(out / "fsdp.ckpt")
    fsdp.update(data[2][3 * rank:3 * rank + 3])
    got["fsdp_trained_further"] = state(fsdp)

    def stages_from(name, path, batch):
        """Fresh stages load ``path``, then train on ``batch``: their state after each, under ``name``."""
        stages = pipeline(*build("grpo"))
        learners.append(stages)
        stages.load(path)
        got[f"{name}_loaded"] = state(stages)
        stages.update(batch)
        got[f"{name}_trained_on"] = state(stages)

    # the stages load FSDP's checkpoint and train on as FSDP did
    stages_from("from_fsdp", out / "fsdp.ckpt", data[2])

    # one process's file (rank 0 trains and writes it), loaded by the stages
    if rank == 0:
        loss, policy = build("grpo")
        one = LocalLearner(loss, MOMENTUM, policy=policy)
        one.update(data[0])
        one.save(out / "local.ckpt")
        got["local_saved"] = state(one)
        one.update(data[1])
        got["local_trained_on"] = state(one)
    dist.barrier()
    stages_from("from_local", out / "local.ckpt", data[1])
    return (got if rank == 0 else {k: v for k, v in got.items() if isinstance(v, (str, list, type(None)))}), learners


def train(learner, data):
    outs = [learner.update(batch) for batch in data]
    return {"model": {k: v.detach().clone() for k, v in learner.loss_module.state_dict().items()},
            "params": sorted(n for n, _ in learner.loss_module.named_parameters()),
            "losses": [{k: float(v) for k, v in o.items()} for o in outs]}


def main(out_dir):
    rank = int(os.environ.get("LOCAL_RANK", 0))
    results = {}
    learners = []
    if rank == 0:  # another model's checkpoint file, for the refusals (checkpoints())
        dqn_loss, net, _ = dqn_example()
        LocalLearner(dqn_loss, sgd(), policy=net).save(os.path.join(out_dir, "dqn.ckpt"))
    for case, (kind, schedule, micro, scaled) in CASES.items():
        loss, policy = build(kind)
        data = batches(policy)
        strategy = PipelineStrategy(schedule=schedule, microbatches=micro, scale_grads=scaled)
        learner = FabricLearner(loss, sgd(), policy=policy, strategy=strategy, accelerator="cpu", devices=2,
                                clip_grad_norm=CLIP, timeout=TIMEOUT)
        learners.append(learner)
        results[case] = {"type": type(learner).__name__, "stage": learner.stage}
        if case == "grpo":  # a batch the schedule cannot carry: refused on every rank before any stage runs
            before = {k: v.clone() for k, v in learner.loss_module.state_dict().items()}
            try:
                learner.update(data[0][:2])
            except ValueError as err:
                results[case]["too_small"] = str(err)
            try:  # different batches on the two stages: refused on both, before any stage runs
                learner.update(data[0][:5 - rank])
            except ValueError as err:
                results[case]["unequal"] = str(err)
            # a batch stage 1 cannot read (no advantages there): refused on both, before any stage runs
            results[case]["unreadable"] = refused(learner.update, data[0].exclude("advantage") if rank else data[0])
            results[case]["unchanged"] = all(torch.equal(before[k], v)
                                             for k, v in learner.loss_module.state_dict().items())
            results[case]["updates_after_refusal"] = learner.num_updates
        results[case].update(train(learner, data))
        if case == "grpo":  # the whole policy's weights, gathered from the stages on rank 0
            results[case]["weights"] = learner.get_weights()
            results[case]["weights_everywhere"] = learner.get_weights(cpu_offload=False)
        if case == "sft":  # another model's checkpoint folder (no GRPO clipping constants), for the refusals
            learner.save(os.path.join(out_dir, "sft.ckpt"))
    results["ckpt"], more = checkpoints(out_dir, rank, os.path.join(out_dir, "sft.ckpt"))
    learners += more
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    for learner in learners:  # every learner closed on every rank: the last one ends the group, at once
        learner.close()


if __name__ == "__main__":
    main(sys.argv[1])
