"""The CUDA tier (``make test-gpu``): every check trains on the tier's device and compares with one CPU process.

Run through ``benchmarks/gpu_tier.py``, never by ``make test`` (the name matches no ``test_*.py``).
The device is ``FL_TIER_DEVICE``: ``cuda`` on a GPU machine, ``cpu`` for the dry run that
``tests/test_gpu_tier.py`` runs in the ordinary suite, so that the first GPU minutes are not spent on
typos. On CPU the same code runs with the CPU as "the device"; what only CUDA has (fp16 autocast
with its GradScaler, NCCL) is skipped with the reason. A check records its figures with
``record_property``; the tier writes them into its report.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import tempfile
import time

import pytest
import torch
from tensordict import TensorDict

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
for path in (os.path.dirname(HERE), os.path.join(ROOT, "benchmarks")):
    if path not in sys.path:
        sys.path.insert(0, path)

import harness  # noqa: E402
from rl_cases import STEPS, flat_params, make_batch, make_loss  # noqa: E402

from fabric_learner import FabricLearner, LocalLearner, Stage, shard_loss  # noqa: E402
from fabric_learner.testing import grpo_batch, grpo_example  # noqa: E402

DEVICE = os.environ.get("FL_TIER_DEVICE", "cuda")
ACCELERATOR = "cuda" if DEVICE == "cuda" else "cpu"
DRY = DEVICE != "cuda"
TWO_GPUS = torch.cuda.device_count() >= 2
NEEDS_TWO = f"multi-rank NCCL needs 2 CUDA devices; torch.cuda.device_count() = {torch.cuda.device_count()}"
ONLY_CUDA = "fp16 autocast with a GradScaler is CUDA's: Fabric refuses 16-mixed on CPU"
LR = 1e-2
FP32 = {"atol": 1e-5, "rtol": 1e-4}  # CUDA's kernels sum in another order than the CPU's
LOW = {"bf16-mixed": 3e-2, "bf16-true": 6e-2, "16-mixed": 1e-2}  # what bf16/fp16 rounding moves after STEPS steps

if DEVICE == "cuda":
    # TF32 would round float32 matmuls to 10 mantissa bits: the comparison with the CPU is in float32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


ADAM = functools.partial(torch.optim.Adam, lr=LR)  # a checkpoint then carries optimizer state across devices


def sgd(params):
    return torch.optim.SGD(params, lr=LR)


def on_device(loss, optimizer=sgd, **kwargs) -> FabricLearner:
    return FabricLearner(loss, optimizer, accelerator=ACCELERATOR, devices=1, **kwargs)


def fsdp_on_device(loss, optimizer=sgd, parallelize_fn=shard_loss, **kwargs) -> FabricLearner:
    from lightning.fabric.strategies import ModelParallelStrategy

    return FabricLearner(loss, optimizer, accelerator=ACCELERATOR, devices=1,
                         strategy=ModelParallelStrategy(parallelize_fn=parallelize_fn), **kwargs)


@contextlib.contextmanager
def cpu_noise():
    """Normal noise drawn on the CPU and moved to the tensor's device: a sampling loss (SAC) draws the same
    actions on both devices, so the device's result can equal the CPU's."""
    import torch.distributions.normal as normal

    original = normal._standard_normal

    def drawn_on_cpu(shape, dtype, device):
        return original(shape, dtype=dtype, device=torch.device("cpu")).to(device)

    normal._standard_normal = drawn_on_cpu
    try:
        yield
    finally:
        normal._standard_normal = original


def train(learner, case: str, steps: int = STEPS) -> list[float]:
    """``rl_cases.run_steps``'s schedule with CPU noise; the grad norms as floats."""
    norms = []
    with cpu_noise():
        for step in range(steps):
            torch.manual_seed(1000 * step)
            out = learner.update(make_batch(case, n=16, seed=100 + step))
            norms += [float(out[k]) for k in sorted(out.keys()) if k.startswith("grad_norm")]
    return norms


def assert_same(device_params: dict, cpu_params: dict, tol: dict) -> float:
    """Every parameter equal within ``tol``; returns the largest absolute gap (a figure of the report)."""
    assert device_params.keys() == cpu_params.keys()
    gap = 0.0
    for name, expected in cpu_params.items():
        got = device_params[name].detach().float().cpu()
        torch.testing.assert_close(got, expected.float(), **tol, msg=lambda m, name=name: f"{name}: {m}")
        gap = max(gap, float((got - expected.float()).abs().max()))
    return gap


def cpu_reference(case: str, **kwargs) -> tuple[dict, list[float]]:
    learner = LocalLearner(make_loss(case)[0], sgd, **kwargs)
    norms = train(learner, case)
    return flat_params(learner.loss_module), norms


# ---- the update on the device equals one CPU process ---------------------------------------------


@pytest.mark.parametrize("case", ["dqn", "ppo"])
def test_an_update_on_the_device_equals_the_cpu_update(case, record_property):
    expected, cpu_norms = cpu_reference(case)
    learner = on_device(make_loss(case)[0])
    norms = train(learner, case)
    assert next(learner.loss_module.parameters()).device.type == ACCELERATOR
    record_property("max_abs_gap", assert_same(flat_params(learner.loss_module), expected, FP32))
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(cpu_norms), **FP32)


def sac_stages():
    opt = functools.partial(torch.optim.SGD, lr=LR)
    return [Stage("critic", "qvalue_network_params", opt, loss="loss_qvalue"),
            Stage("actor", "actor_network_params", opt, loss="loss_actor"),
            Stage("alpha", "log_alpha", opt, loss="loss_alpha")]


def test_sac_with_stages_on_the_device_equals_the_cpu_update(record_property):
    reference = LocalLearner(make_loss("sac")[0], None, stages=sac_stages())
    train(reference, "sac")
    learner = FabricLearner(make_loss("sac")[0], None, stages=sac_stages(), accelerator=ACCELERATOR, devices=1)
    train(learner, "sac")
    record_property("max_abs_gap", assert_same(flat_params(learner.loss_module), flat_params(reference.loss_module), FP32))


def grpo_batches(steps: int = 2) -> list:
    """Each step's GRPO batch, its log-probs from the untrained policy (a sharded learner's policy holds no
    weights outside update())."""
    _, policy, _ = grpo_example()
    return [grpo_batch(policy, [3, 8, 5, 2], seed=step) for step in range(steps)]


def grpo_steps(learner, batches) -> None:
    for batch in batches:
        learner.update(batch.clone())


def test_grpo_on_the_device_equals_the_cpu_update(record_property):
    batches = grpo_batches()
    reference = LocalLearner(grpo_example()[0], sgd)
    grpo_steps(reference, batches)
    learner = on_device(grpo_example()[0])
    grpo_steps(learner, batches)
    record_property("max_abs_gap", assert_same(flat_params(learner.loss_module), flat_params(reference.loss_module),
                                               {"atol": 1e-4, "rtol": 1e-3}))


# ---- precisions --------------------------------------------------------------------------------------


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true", "16-mixed"])
def test_a_low_precision_update_on_the_device_stays_near_the_float32_cpu_update(precision, record_property):
    if precision == "16-mixed" and DRY:
        pytest.skip(ONLY_CUDA)
    expected, _ = cpu_reference("ppo")
    learner = on_device(make_loss("ppo")[0], precision=precision)
    train(learner, "ppo")
    if precision == "16-mixed":
        scaler = learner._scaler
        assert isinstance(scaler, torch.amp.GradScaler) and scaler.is_enabled(), scaler
        record_property("grad_scale", float(scaler.get_scale()))
    record_property("max_abs_gap", assert_same(flat_params(learner.loss_module), expected,
                                               {"atol": LOW[precision], "rtol": LOW[precision]}))


# ---- FSDP2 on one device -------------------------------------------------------------------------------


def test_fsdp2_with_a_unit_per_layer_on_the_device_equals_the_cpu_update(record_property):
    expected, _ = cpu_reference("ppo")
    learner = fsdp_on_device(make_loss("ppo")[0], parallelize_fn=functools.partial(shard_loss, min_unit_numel=1))
    train(learner, "ppo")
    assert learner.capabilities.sharded
    with learner.full_parameters():
        got = flat_params(learner.loss_module)
    record_property("max_abs_gap", assert_same(got, expected, FP32))


def test_fsdp2_decoder_units_with_activation_checkpointing_and_bf16_policy_stay_near_the_cpu_update(record_property):
    """GRPO on the tiny Qwen2: one FSDP2 unit per decoder layer, each recomputed in the backward, under the
    learner's bf16 MixedPrecisionPolicy; near the float32 CPU update."""
    batches = grpo_batches()
    reference = LocalLearner(grpo_example()[0], sgd)
    grpo_steps(reference, batches)
    learner = fsdp_on_device(grpo_example()[0], precision="bf16-mixed",
                             parallelize_fn=functools.partial(shard_loss, activation_checkpointing=True))
    units = learner.sharded_module.block_units()
    assert [unit.checkpointed for unit in units] == [True, True]  # the tiny model's two decoder layers
    calls, gathered = [0], set()
    units[0].register_forward_pre_hook(lambda unit, *_: gathered.update(str(p.dtype) for p in unit.parameters()))
    first_leaf = units[0].layers[next(iter(units[0].layers))].leaf
    first_leaf.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    grpo_steps(learner, batches)
    assert calls[0] == 2 * len(batches), calls  # each forward ran again in its backward
    assert gathered == {"torch.bfloat16"}, gathered  # FSDP2's policy gathers the float32 shards in bf16
    assert "param_dtype=torch.bfloat16, reduce_dtype=torch.float32" in repr(learner.sharded_module.mp_policy)
    with learner.full_parameters():
        got = flat_params(learner.loss_module)
    record_property("max_abs_gap", assert_same(got, flat_params(reference.loss_module), {"atol": 3e-2, "rtol": 3e-2}))


# ---- checkpoints and weights ----------------------------------------------------------------------------


@pytest.mark.parametrize("sharded", [False, True], ids=["file", "sharded"])
def test_a_checkpoint_written_on_the_device_loads_on_the_cpu_and_back(sharded):
    make = functools.partial(fsdp_on_device if sharded else on_device, optimizer=ADAM)
    learner = make(make_loss("ppo")[0])
    train(learner, "ppo", steps=1)
    with learner.full_parameters():
        trained = flat_params(learner.loss_module)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ckpt")
        learner.save(path)
        assert os.path.isdir(path) == sharded
        cpu = LocalLearner(make_loss("ppo", seed=7)[0], ADAM)
        cpu.load(path)
        assert_same(flat_params(cpu.loss_module), trained, {"atol": 0, "rtol": 0})
        assert cpu.num_updates == 1
        # one more step on each side lands on the same weights: Adam's moments and the step count came along
        train(cpu, "ppo", steps=1)
        train(learner, "ppo", steps=1)
        with learner.full_parameters():
            assert_same(flat_params(learner.loss_module), flat_params(cpu.loss_module), FP32)
        cpu_path = os.path.join(tmp, "from_cpu")
        cpu.save(cpu_path)
        back = make(make_loss("ppo", seed=9)[0])
        back.load(cpu_path)
        with back.full_parameters():
            assert_same(flat_params(back.loss_module), flat_params(cpu.loss_module), {"atol": 0, "rtol": 0})
        assert back.num_updates == 2


@pytest.mark.parametrize("cpu_offload", [True, False])
def test_get_weights_from_the_device_equal_the_cpu_weights(cpu_offload):
    expected, _ = cpu_reference("ppo")
    loss, policy = make_loss("ppo")
    learner = on_device(loss, policy=policy)
    train(learner, "ppo")
    weights = learner.get_weights(cpu_offload=cpu_offload)
    reference = TensorDict.from_module(policy)
    assert sorted(weights.keys(True, True)) == sorted(reference.keys(True, True))
    for key, value in weights.items(True, True):
        assert value.device.type == ("cpu" if cpu_offload else ACCELERATOR), (key, value.device)
        assert value.data_ptr() != reference[key].data_ptr()  # a copy, not the live parameter
    for name, value in TensorDict.from_module(policy).items(True, True):
        torch.testing.assert_close(weights[name].cpu(), value.detach().cpu(), atol=0, rtol=0)
    assert_same({k: v for k, v in flat_params(learner.loss_module).items()}, expected, FP32)


# ---- speed, as ratios against hand-written loops on the same device -------------------------------------


def _sync():
    if ACCELERATOR == "cuda":
        torch.cuda.synchronize()


class HandLoop:
    """The update a user writes by hand on the device: forward, summed loss terms, backward, SGD step."""

    def __init__(self, loss):
        self.loss = loss.to(ACCELERATOR)
        self.opt = sgd(self.loss.parameters())

    def update(self, batch):
        out = self.loss(batch.to(ACCELERATOR))
        sum(out.get(k) for k in out.keys() if k.startswith("loss")).backward()
        self.opt.step()
        self.opt.zero_grad()


def test_the_update_on_the_device_against_a_hand_written_loop_interleaved(record_property):
    """The benchmark harness's ratio (learner / hand loop, interleaved, copies taking turns) on PPO; both
    contenders end on the same weights, since they trained on the same batches."""
    batches = [make_batch("ppo", n=256, seed=s) for s in range(4)]
    reps, warmup = (6, 2) if DRY else (120, 10)
    built = {"learner": [], "hand": []}

    def build(kind):
        copy = on_device(make_loss("ppo")[0]) if kind == "learner" else HandLoop(make_loss("ppo")[0])
        built[kind].append(copy)
        return copy

    contenders = {kind: harness.rotating(functools.partial(build, kind), batches, instances=2) for kind in built}
    samples = harness.interleaved(contenders, reps=reps, warmup=warmup, inner=1, sync=_sync)
    ratio = harness.paired_ratio(samples["learner"], samples["hand"])
    ci = harness.bootstrap_ci(samples["learner"], samples["hand"], copies=2)
    record_property("ratio_learner_over_hand", round(ratio, 4))
    record_property("ci95", [round(ci[0], 4), round(ci[1], 4)])
    record_property("median_ms", {k: round(1e3 * harness.median(v), 4) for k, v in samples.items()})
    record_property("verdict_goal_1.05", harness.verdict(ci, 1.05))
    for mine, theirs in zip(built["learner"], built["hand"]):  # ~65 steps each: the loss terms summed in another order
        assert_same(flat_params(mine.loss_module), flat_params(theirs.loss), {"atol": 1e-4, "rtol": 1e-3})


class HandFSDP2:
    """GRPO by hand on one rank: ``fully_shard`` on each decoder layer then the model, AdamW, the loss's token
    mean summed back over the step's micro-batches and divided by their tokens (the learner's normalisation)."""

    def __init__(self, loss, model, lr):
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        self.loss, self.opt = loss, torch.optim.AdamW(model.parameters(), lr=lr)
        self.params = list(model.parameters())

    def update(self, pair):
        count = 0
        for batch in pair:
            tokens = sum(int(m.sum()) for m in batch.get(("masks", "all_assistant_mask"), as_list=True))
            out = self.loss(batch)
            (sum(out.get(k) for k in out.keys() if k.startswith("loss")) * tokens).backward()
            count += tokens
        for p in self.params:
            p.grad.div_(count)
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def test_grpo_tokens_per_second_on_the_device_against_hand_fsdp2_on_one_rank(record_property):
    import llm_update

    # the dry run: llm_update.py's QUICK sizes; on the GPU its full ones (8.2M parameters, replies of 12-36 words)
    hidden, layers, samples, words, reps, warmup = (64, 2, 2, (3, 12), 4, 2) if DRY else (384, 6, 4, (12, 36), 30, 4)
    loss, model = llm_update.grpo_loss(hidden, layers)
    generator = torch.Generator().manual_seed(0)
    pairs = [tuple(grpo_batch(loss.actor_network, torch.randint(*words, (samples,), generator=generator).tolist(),
                              seed=10 * p + m) for m in range(2)) for p in range(2)]
    tokens = [sum(int(m.sum()) for b in pair for m in b.get(("masks", "all_assistant_mask"), as_list=True))
              for pair in pairs]
    learner = fsdp_on_device(loss, functools.partial(torch.optim.AdamW, lr=llm_update.LR), grad_accum_steps=2,
                             clip_grad_norm=1.0)
    hand_loss, hand_model = llm_update.grpo_loss(hidden, layers)
    hand = HandFSDP2(hand_loss.to(ACCELERATOR), hand_model, llm_update.LR)

    def learner_step(i):
        for batch in pairs[i % 2]:
            learner.update(batch)

    def hand_step(i):
        hand.update(tuple(b.to(ACCELERATOR) for b in pairs[i % 2]))

    start = time.perf_counter()
    samples = harness.interleaved({"learner": learner_step, "hand": hand_step}, reps=reps, warmup=warmup, inner=1,
                                  sync=_sync)
    per_rep = [tokens[(warmup + r) % 2] for r in range(reps)]
    rate = {k: harness.median(t / s for t, s in zip(per_rep, v)) for k, v in samples.items()}
    ratio = harness.paired_ratio(samples["hand"], samples["learner"])  # tokens/s learner / hand
    ci = harness.bootstrap_ci(samples["hand"], samples["learner"])
    record_property("tokens_per_s", {k: round(v, 1) for k, v in rate.items()})
    record_property("tokens_per_s_learner_over_hand", round(ratio, 4))
    record_property("ci95", [round(ci[0], 4), round(ci[1], 4)])
    record_property("verdict_goal_0.97", harness.verdict(ci, 0.97, at_least=True))
    record_property("model", {"hidden": hidden, "layers": layers, "seconds": round(time.perf_counter() - start, 1)})
    with learner.full_parameters():
        mine = flat_params(learner.loss_module)
    # the hand loop's DTensors gathered on the device (a collective of its group), then copied to the CPU
    theirs = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu()
              for k, v in hand.loss.named_parameters()}
    assert_same(mine, theirs, {"atol": 1e-3, "rtol": 1e-2})  # the same steps, kernels in another order


# ---- several CUDA ranks ------------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_cuda_ranks_under_nccl_equal_one_cpu_process_on_the_full_batch(strategy, tmp_path, record_property):
    if not TWO_GPUS and not os.environ.get("FL_TIER_MULTIRANK_ON_CPU"):
        pytest.skip(NEEDS_TWO)
    accelerator = "cuda" if TWO_GPUS else "cpu"
    out = tmp_path / "rank0.pt"
    start = time.perf_counter()
    harness.run_bounded(harness.torchrun(2, os.path.join(HERE, "multirank_worker.py"), strategy, accelerator, str(out)),
                        240, f"2 {accelerator} ranks under {strategy}")
    record_property("launch_seconds", round(time.perf_counter() - start, 1))
    result = torch.load(out, weights_only=True)
    reference = LocalLearner(make_loss("ppo")[0], sgd)
    for step in range(STEPS):
        torch.manual_seed(1000 * step)
        reference.update(make_batch("ppo", n=16, seed=100 + step))
    record_property("max_abs_gap", assert_same(result["params"], flat_params(reference.loss_module), FP32))
    assert result["ranks_agree"], "the two ranks' weights differ"

