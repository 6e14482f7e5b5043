"""DDP on 2 real gloo processes equals LocalLearner on the full batch; ranks agree."""

from __future__ import annotations

import functools
import os

import pytest
import torch
from multiproc import WORKERS, launch
from rl_cases import CASES, CLIP, LR, STEPS, TD_TOL, flat_params, make_batch, make_loss, one_process_td_errors, run_steps

from fabric_learner import LocalLearner


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    local = LocalLearner(make_loss("sac", seed=11)[0], clip_grad_norm=CLIP)
    for s in range(2):
        torch.manual_seed(s)
        local.update(make_batch("sac", seed=50 + s))
    local.save(out / "local_sac.pt")
    proc = launch(os.path.join(WORKERS, "ddp_checks.py"), out, out / "local_sac.pt", timeout=420)
    assert proc.returncode == 0, proc.stdout[-6000:]
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    return {"ranks": ranks, "dir": out, "local": local}


def reference(case):
    """LocalLearner on the full batch, on the schedule the ranks shared."""
    loss, _ = make_loss(case)
    learner = LocalLearner(loss, functools.partial(torch.optim.Adam, lr=LR), clip_grad_norm=CLIP)
    norms = run_steps(learner, case)
    return {"params": flat_params(loss), "grad_norm": norms}


def assert_same_optimizer_state(got, expected):
    """Every Adam field (step, exp_avg, exp_avg_sq) of every parameter, bit for bit, and the hyperparameters."""
    assert got["state"].keys() == expected["state"].keys() and len(expected["state"]) > 0
    for i, fields in expected["state"].items():
        assert got["state"][i].keys() == fields.keys() == {"step", "exp_avg", "exp_avg_sq"}, i
        for name, value in fields.items():
            assert torch.equal(got["state"][i][name], value), f"{i}.{name}"
    keep = ("lr", "betas", "eps", "weight_decay")
    assert [{k: g[k] for k in keep} for g in got["param_groups"]] == [{k: g[k] for k in keep}
                                                                      for g in expected["param_groups"]]


def assert_ranks_identical(a, b):
    for k in a:
        assert torch.equal(a[k], b[k]), f"ranks differ on {k}"


@pytest.mark.parametrize("case", [c for c, det in CASES.items() if det])
def test_deterministic_losses_equal_local_full_batch(ddp, case):
    r0, r1 = (r["cases"][case] for r in ddp["ranks"])
    assert ddp["ranks"][0]["world_size"] == 2
    assert_ranks_identical(r0["params"], r1["params"])
    ref = reference(case)
    torch.testing.assert_close(r0["grad_norm"], ref["grad_norm"], atol=1e-5, rtol=1e-5)
    for k, v in ref["params"].items():
        torch.testing.assert_close(r0["params"][k], v, atol=1e-5, rtol=0, msg=k)
    assert r0["num_updates"] == STEPS


@pytest.mark.parametrize("case", list(CASES))
def test_training_under_ddp_warns_nothing_about_gradient_strides(ddp, case):
    """SAC's and TD3's stacked critics used to trip DDP's "Grad strides do not match bucket view strides"."""
    for rank in ddp["ranks"]:
        assert not [w for w in rank["cases"][case]["warnings"] if "strides" in w], rank["cases"][case]["warnings"]


@pytest.mark.parametrize("case", ["sac", "td3"])
def test_stacked_critic_gradients_take_their_parameters_strides(case):
    """What DDP's bucket views need, in one process: without the hook the (2, 1, 16) weight's
    gradient comes back with strides (16, 1, 1) against the parameter's (16, 16, 1)."""
    from fabric_learner.backends.replicated import match_bucket_strides

    loss, _ = make_loss(case)
    assert match_bucket_strides(loss.parameters()) > 0
    out = loss(make_batch(case))
    sum(v for k, v in out.items() if k.startswith("loss")).backward()
    reference_loss, _ = make_loss(case)
    ref = reference_loss(make_batch(case))
    sum(v for k, v in ref.items() if k.startswith("loss")).backward()
    for (name, p), (_, r) in zip(loss.named_parameters(), reference_loss.named_parameters()):
        if p.grad is not None:
            assert p.grad.stride() == p.stride(), name
            torch.testing.assert_close(p.grad, r.grad, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("case", [c for c, det in CASES.items() if not det])
def test_stochastic_losses_ranks_agree_and_weights_move(ddp, case):
    r0, r1 = (r["cases"][case] for r in ddp["ranks"])
    assert_ranks_identical(r0["params"], r1["params"])
    start = flat_params(make_loss(case)[0])
    moved = [k for k in start if not torch.equal(start[k], r0["params"][k])]
    assert moved, "no parameter changed"
    assert torch.isfinite(r0["grad_norm"]).all()


@pytest.mark.parametrize("case", ["dqn", "ppo", "ddpg"])
def test_accumulation_syncs_once_and_equals_local(ddp, case):
    r0, r1 = (r["accum"][case] for r in ddp["ranks"])
    assert_ranks_identical(r0["params"], r1["params"])
    ref = reference(case)
    torch.testing.assert_close(r0["grad_norm"], ref["grad_norm"], atol=1e-5, rtol=1e-5)
    for k, v in ref["params"].items():
        torch.testing.assert_close(r0["params"][k], v, atol=1e-5, rtol=0, msg=k)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "bf16-true", "64-true"])
def test_tensordict_batches_survive_ddp_at_each_precision(ddp, precision):
    plain_ref, lazy_ref = one_process_td_errors(precision)
    tol = dict(atol=TD_TOL[precision], rtol=TD_TOL[precision])
    for rank, res in enumerate(r["integrity"][precision] for r in ddp["ranks"]):
        assert res["batch_size"] == (8,)
        assert res["device"] == "cpu"
        assert res["obs_dtype"] == torch.float32  # the caller's data is not cast
        assert res["lazy_is_lazy"] and res["lazy_batch_size"] == (8,)
        assert res["loss_dtype"] == torch.float32
        # what DQN wrote into the caller's batch is the one-process full-batch td_error of this rank's half
        assert res["td_error"].dtype == plain_ref.dtype and res["td_error"].shape == plain_ref[:8].shape
        torch.testing.assert_close(res["td_error"], plain_ref[8 * rank: 8 * rank + 8], **tol)
        torch.testing.assert_close(res["lazy_td_error"], lazy_ref[8 * rank: 8 * rank + 8], **tol)


def test_local_checkpoint_loads_under_ddp(ddp):
    local = ddp["local"]
    for rank in ddp["ranks"]:
        loaded = rank["loaded_local"]
        assert loaded["num_updates"] == local.num_updates
        for k, v in flat_params(local.loss_module).items():
            assert torch.equal(loaded["params"][k], v), k
        assert_same_optimizer_state(loaded["optimizer"], local.checkpoint()["optimizer"])


def test_error_under_ddp_leaves_it_usable(ddp):
    r0, r1 = ddp["ranks"]
    assert r0["error_type"].startswith("KeyError") and r1["error_type"].startswith("KeyError")
    assert_ranks_identical(r0["after_error"], r1["after_error"])


def test_ddp_checkpoint_loads_into_one_process(ddp):
    saved = ddp["ranks"][0]["saved_sac"]
    learner = LocalLearner(make_loss("sac", seed=4)[0], clip_grad_norm=CLIP)
    learner.load(ddp["dir"] / "ddp_sac.pt")
    assert learner.num_updates == STEPS
    for k, v in learner.loss_module.state_dict().items():
        assert torch.equal(v, saved["model"][k]), k
    assert_same_optimizer_state(learner.checkpoint()["optimizer"], saved["optimizer"])
    torch.manual_seed(0)
    out = learner.update(make_batch("sac"))
    assert torch.isfinite(out["grad_norm"])


def test_nonfinite_on_one_rank_skips_or_raises_on_every_rank(ddp):
    r0, r1 = (r["nonfinite"] for r in ddp["ranks"])
    for r in (r0, r1):
        assert r["skipped_updates"] == 1 and r["num_updates"] == 1
        assert not torch.isfinite(r["skip_grad_norm"])
        for k, v in r["before"].items():
            assert torch.equal(r["after_skip"][k], v), k
        assert torch.isfinite(r["next_grad_norm"]) and r["final_num_updates"] == 2
        assert r["raise_num_updates"] == 3
    assert "loss entries" in r1["raised"] and "(rank 1)" in r1["raised"]
    # rank 0's own loss was finite: the NaN reached it through the gradient sync, so its norm says it
    assert "Optimizer step 3 refused (rank 0): grad_norm is non-finite (nan) on every rank" in r0["raised"], r0["raised"]
    assert "Optimizer step 3 refused (rank 1): the loss entries" in r1["raised"], r1["raised"]
    assert_ranks_identical(r0["after_skip"], r1["after_skip"])
    assert_ranks_identical(r0["after_next"], r1["after_next"])
    assert_ranks_identical(r0["after_raise"], r1["after_raise"])
    assert any(not torch.equal(r0["after_next"][k], v) for k, v in r0["before"].items())


def test_nonfinite_loss_without_gradient_on_one_rank_is_skipped_on_every_rank(ddp):
    r0, r1 = (r["nonfinite_nograd"] for r in ddp["ranks"])
    for r in (r0, r1):
        assert r["skipped_updates"] == 1 and r["num_updates"] == 1, r
        assert not torch.isfinite(r["skip_grad_norm"])
        for k, v in r["before"].items():
            assert torch.equal(r["after_skip"][k], v), k
        assert r["final_num_updates"] == 2
    assert_ranks_identical(r0["after_skip"], r1["after_skip"])
    assert_ranks_identical(r0["after_next"], r1["after_next"])


def test_unequal_per_rank_sample_counts_are_warned_once_on_every_rank(ddp):
    for r in ddp["ranks"]:
        seen = r["unequal"]
        assert seen["step 1"] == [] and seen["step 100"] == [], seen
        assert len(seen["step 101"]) == 1, seen
        assert "different numbers of samples (from 6 to 10 per step)" in seen["step 101"][0]
        assert "up to step 101" in seen["step 101"][0] and "same number of samples" in seen["step 101"][0]




def test_a_strategy_objects_timeout_is_the_real_group_timeout(ddp):
    """docs/reliability.md, "the timeout itself": ddp_checks.py's DDPStrategy(timeout=90 s) bounds the
    group torch built (read from the gloo backend), not the learner's default 5 minutes."""
    for r in ddp["ranks"]:
        assert r["group_timeouts"] == [90.0], r["group_timeouts"]


def test_16_mixed_under_ddp_leaves_one_ranks_overflow_to_the_scaler_and_skips_its_nan_loss_on_every_rank(ddp):
    """docs/reliability.md, ``16-mixed``: under DDP, with fp16 autocast and a grad scaler given through
    ``fabric=`` (on CPU the name 16-mixed means bf16, without a scaler)."""
    r0, r1 = (r["mixed16"] for r in ddp["ranks"])
    for r in (r0, r1):
        # rank 1's inf gradients reached both ranks through the sync: the scaler skipped its step on both
        assert not torch.isfinite(r["overflow_grad_norm"]) and r["local_nonfinite"][0] > 0
        assert r["scale_after"] == r["scale_before"] / 2 and r["overflow_counts"] == (2, 0)
        assert_ranks_identical(r["before"], r["after_overflow"])
        # rank 1's NaN loss: the learner's all-reduced verdict made every rank skip, then raise
        assert r["nan_counts"] == (2, 1)
        assert_ranks_identical(r["before"], r["after_nan"])
        assert torch.isfinite(r["next_grad_norm"]) and r["final_counts"] == (3, 1)
        assert any(not torch.equal(r["after_next"][k], v) for k, v in r["before"].items())
    assert "Optimizer step 3 refused (rank 0): another rank saw a non-finite loss or grad norm" in r0["raised"]
    assert "Optimizer step 3 refused (rank 1): the loss entries ['loss'] are non-finite" in r1["raised"]
    for key in ("after_overflow", "after_nan", "after_next"):
        assert_ranks_identical(r0[key], r1[key])


def test_collectives_reduce_over_the_named_mesh_dimension_data_parallel_by_default(ddp):
    """A (dp=1, tp=2) mesh: "dp" holds one rank, so a global sum over it is the rank's own value, while
    "tp" sums both ranks; without a registered mesh, "dp" is the whole world."""
    for rank, result in enumerate(r["mesh"] for r in ddp["ranks"]):
        unknown = result.pop("unknown")
        assert result == {"no_mesh": 3.0, "dp": float(rank + 1), "tp": 3.0}
        assert "('dp', 'tp'), not 'pp'" in unknown and "nothing was reduced" in unknown


def test_any_mesh_dimension_is_this_process_alone_in_a_one_rank_world():
    from fabric_learner.collectives import global_sum

    assert global_sum(torch.ones(2), group="tp").item() == 2.0
