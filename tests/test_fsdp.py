"""FSDP (FSDP2 over the loss's parameters) on 2 real gloo processes equals LocalLearner."""

from __future__ import annotations

import functools
import json
import os

import pytest
import tamper
import torch
from multiproc import WORKERS, launch
from rl_cases import CASES, CLIP, LR, STEPS, TD_TOL, make_batch, make_loss, one_process_td_errors, run_steps
from tensordict import TensorDict

from fabric_learner import LocalLearner

TAMPERED = {**{f"sharded: {c}": ("sharded", c, tamper.SHARDED[c]) for c in tamper.SHARDED},
            **{f"ddp.pt: {c}": ("ddp.pt", c, tamper.FILE[c]) for c in tamper.FILE}}


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    marker = out / "payload-ran"
    os.environ["FL_MARKER"] = str(marker)  # the tampering payloads name it when pickled
    cases = {name: str(tamper.prepare({c: change}, fixture, out / "tampered" / str(i))[c])
             for i, (name, (fixture, c, change)) in enumerate(TAMPERED.items())}
    (out / "tampered" / "cases.json").write_text(json.dumps(cases))
    proc = launch(os.path.join(WORKERS, "fsdp_checks.py"), out, timeout=480, FL_MARKER=str(marker))
    assert proc.returncode == 0, proc.stdout[-6000:]
    return {"ranks": [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)], "dir": out,
            "marker": marker}


def opt():
    return functools.partial(torch.optim.Adam, lr=LR)


def reference(case):
    """LocalLearner on the full batch, on the schedule the ranks shared."""
    loss, _ = make_loss(case)
    learner = LocalLearner(loss, opt(), clip_grad_norm=CLIP)
    norms = run_steps(learner, case)
    return {"model": learner.checkpoint()["model"], "grad_norm": norms}


def assert_equal_states(a, b, atol=0.0):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=0, msg=k)


def test_parameters_are_sharded(fsdp):
    for rank in fsdp["ranks"]:
        assert rank["sharded"] and rank["world_size"] == 2
        for case, fraction in rank["shard_fraction"].items():
            assert 0.4 <= fraction <= 0.65, (case, fraction)  # about 1/2; small tensors pad


def test_gradients_and_optimizer_state_are_sharded(fsdp):
    """docs/fsdp.md: each rank holds about 1/N of gradients (counted at the optimizer step) and of
    Adam's moments, as of parameters."""
    for rank in fsdp["ranks"]:
        for case, held in rank["held_fraction"].items():
            assert held.keys() == {"gradients", "optimizer_state"}, (case, held)
            for what, fraction in held.items():
                assert 0.4 <= fraction <= 0.65, (case, what, fraction)


@pytest.mark.parametrize("case", [c for c, det in CASES.items() if det])
def test_deterministic_losses_equal_local_full_batch(fsdp, case):
    r0, r1 = (r["cases"][case] for r in fsdp["ranks"])
    assert_equal_states(r0["model"], r1["model"])  # ranks agree bit for bit
    ref = reference(case)
    torch.testing.assert_close(r0["grad_norm"], ref["grad_norm"], atol=1e-5, rtol=1e-5)
    assert_equal_states(r0["model"], ref["model"], atol=1e-5)  # includes target networks
    assert r0["num_updates"] == STEPS


def test_fsdp2s_view_output_warning_is_silenced_where_it_is_harmless(fsdp):
    """DDPGLoss returns a view (pred_value) that FSDP2 warned about; the learner never writes into
    the loss output, and DDPG's gradients equal one process's (the test above), so it is silenced."""
    for rank in fsdp["ranks"]:
        for case, res in rank["cases"].items():
            assert not [w for w in res["warnings"] if "view tensor" in w], (case, res["warnings"])


def test_fsdp2s_view_output_warning_still_reaches_a_users_own_sharded_module():
    import warnings

    from fabric_learner.backends.sharded import quiet_view_output_warning

    quiet_view_output_warning()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_view_output_warning()
        warnings.warn("FSDP2-wrapped module (FSDPShardedLoss) returned a view tensor. ...", UserWarning)
        warnings.warn("FSDP2-wrapped module (FSDPLinear) returned a view tensor. ...", UserWarning)
    assert [str(w.message) for w in caught] == ["FSDP2-wrapped module (FSDPLinear) returned a view tensor. ..."]


@pytest.mark.parametrize("case", [c for c, det in CASES.items() if not det])
def test_stochastic_losses_ranks_agree_and_train(fsdp, case):
    r0, r1 = (r["cases"][case] for r in fsdp["ranks"])
    assert_equal_states(r0["model"], r1["model"])
    start = make_loss(case)[0].state_dict()
    assert any(not torch.equal(start[k], r0["model"][k]) for k in start)
    assert torch.isfinite(r0["grad_norm"]).all()


@pytest.mark.parametrize("case", ["dqn", "ppo", "ddpg"])
def test_accumulation_equals_local(fsdp, case):
    r0, r1 = (r["accum"][case] for r in fsdp["ranks"])
    assert_equal_states(r0["model"], r1["model"])
    ref = reference(case)
    torch.testing.assert_close(r0["grad_norm"], ref["grad_norm"], atol=1e-5, rtol=1e-5)
    assert_equal_states(r0["model"], ref["model"], atol=1e-5)


def test_get_weights_gathers_plain_tensors(fsdp):
    r0, r1 = fsdp["ranks"]
    _, actor = make_loss("sac")
    layout = TensorDict.from_module(actor)
    model = r0["weights_model"]
    assert set(r0["weights_offload"].keys(True, True)) == set(layout.keys(True, True))
    assert r1["weights_offload"].is_empty()  # cpu_offload=True: rank 0 only
    for rank in (r0, r1):
        full = rank["weights_full"]
        assert set(full.keys(True, True)) == set(layout.keys(True, True))
        for key, value in full.items(True, True):
            assert type(value) is torch.Tensor and not value.requires_grad
            assert value.shape == layout[key].shape
            name = "actor_network_params." + ".".join(key)
            assert torch.equal(value, model[name]), name
            assert torch.equal(value, r0["weights_offload"][key])


def test_full_parameters_lets_the_loss_modules_run(fsdp):
    for rank in fsdp["ranks"]:
        _, actor = make_loss("sac")
        rank["weights_full"].to_module(actor)
        with torch.no_grad():
            expected = actor(make_batch("sac", n=4, seed=9))["loc"]
        torch.testing.assert_close(rank["actor_loc"], expected, atol=1e-6, rtol=0)
        # the policy= actor is served: it keeps its full weights after the block (the critics do not)
        assert rank["actor_numel_after"] == sum(p.numel() for p in actor.parameters())
        assert rank["qvalue_numel_after"] == 0  # the full copies are dropped again


def test_round_trip_fsdp_ddp_local_fsdp_continues_training(fsdp):
    rt0, rt1 = (r["round_trip"] for r in fsdp["ranks"])
    assert_equal_states(rt0["model"], rt1["model"])
    assert rt0["num_updates"] == 5
    assert len([v for v in rt0["versions"] if v.startswith("v")]) == 1
    loss, _ = make_loss("dqn")
    learner = LocalLearner(loss, opt(), clip_grad_norm=CLIP)
    for step in range(5):
        learner.update(make_batch("dqn", n=16, seed=300 + step))
    expected = learner.checkpoint()
    assert_equal_states(rt0["model"], expected["model"], atol=1e-5)
    # the Adam moments came through FSDP -> DDP -> one process -> FSDP too, not only the weights
    assert rt0["optimizer"]["state"].keys() == expected["optimizer"]["state"].keys()
    for i, s in expected["optimizer"]["state"].items():
        assert s.keys() == rt0["optimizer"]["state"][i].keys()
        for field, value in s.items():
            torch.testing.assert_close(rt0["optimizer"]["state"][i][field], value, atol=1e-5, rtol=0,
                                       msg=f"{i}.{field}")


def test_a_file_with_a_scalar_parameter_loads_into_fsdp_and_the_folder_it_then_writes_reloads(tmp_path):
    """SAC's temperature is a scalar, sharded as (1,): its Adam moments take that shape on a load from a
    file, its step stays (), so the learner's own next folder loads again (one FSDP rank, in process)."""
    from fabric_learner import FabricLearner

    local = LocalLearner(make_loss("sac")[0], opt(), clip_grad_norm=CLIP)
    torch.manual_seed(0)
    local.update(make_batch("sac", n=16, seed=1))
    local.save(tmp_path / "local.pt")

    def fsdp_learner(seed):
        return FabricLearner(make_loss("sac", seed=seed)[0], opt(), clip_grad_norm=CLIP, accelerator="cpu",
                             strategy="fsdp", devices=1)

    a = fsdp_learner(4)
    a.load(tmp_path / "local.pt")
    assert_equal_states(a.checkpoint()["model"], local.checkpoint()["model"])
    torch.manual_seed(1)
    a.update(make_batch("sac", n=16, seed=2))
    a.save(tmp_path / "folder")
    b = fsdp_learner(5)
    b.load(tmp_path / "folder")
    saved, loaded = a.checkpoint()["optimizer"]["state"], b.checkpoint()["optimizer"]["state"]
    assert saved.keys() == loaded.keys()
    for i, s in saved.items():
        assert_equal_states(loaded[i], s)
    assert_equal_states(b.checkpoint()["model"], a.checkpoint()["model"])


def test_an_optimizer_without_state_loads_into_fsdp_from_a_file_and_from_its_own_folder(tmp_path):
    """Plain SGD keeps no per-parameter state: a load into an FSDP learner takes the weights and the
    groups' settings (torch's full-state loader, given no state, cannot tell the device and used to fail)."""
    from fabric_learner import FabricLearner

    sgd = functools.partial(torch.optim.SGD, lr=0.05)
    local = LocalLearner(make_loss("dqn")[0], sgd)
    local.update(make_batch("dqn", n=16, seed=1))
    local.save(tmp_path / "local.pt")
    a = FabricLearner(make_loss("dqn", seed=4)[0], functools.partial(torch.optim.SGD, lr=0.5), accelerator="cpu",
                      strategy="fsdp", devices=1)
    a.load(tmp_path / "local.pt")
    assert_equal_states(a.checkpoint()["model"], local.checkpoint()["model"])
    assert a.checkpoint()["optimizer"]["param_groups"][0]["lr"] == 0.05
    a.update(make_batch("dqn", n=16, seed=2))
    local.update(make_batch("dqn", n=16, seed=2))
    assert_equal_states(a.checkpoint()["model"], local.checkpoint()["model"], atol=1e-6)
    a.save(tmp_path / "folder")
    b = FabricLearner(make_loss("dqn", seed=5)[0], sgd, accelerator="cpu", strategy="fsdp", devices=1)
    b.load(tmp_path / "folder")
    assert_equal_states(b.checkpoint()["model"], a.checkpoint()["model"])


def test_sharded_resume_equals_uninterrupted_run(fsdp):
    for rank in fsdp["ranks"]:
        res = rank["resume"]
        assert res["loaded_updates"] == 2
        assert_equal_states(res["a"]["model"], res["b"]["model"], atol=1e-6)
        for i, s in res["a"]["optimizer"]["state"].items():
            for field, value in s.items():
                torch.testing.assert_close(value, res["b"]["optimizer"]["state"][i][field], atol=1e-6, rtol=0)


@pytest.mark.parametrize("into", ["local", "ddp on one rank"])
def test_sharded_checkpoint_loads_into_one_process_and_ddp_on_one_rank(fsdp, into):
    from fabric_learner import FabricLearner

    path = fsdp["dir"] / "sac_resume"
    learner = LocalLearner(make_loss("sac", seed=3)[0], opt(), clip_grad_norm=CLIP) if into == "local" else \
        FabricLearner(make_loss("sac", seed=3)[0], opt(), clip_grad_norm=CLIP, accelerator="cpu", strategy="ddp",
                      devices=1)
    learner.load(path)
    assert learner.num_updates == 2
    assert (path / "LATEST").is_file()
    state, saved = learner.checkpoint(), fsdp["ranks"][0]["resume"]["saved"]
    assert_equal_states(state["model"], saved["model"])  # bit for bit what the 2 ranks held at the save
    assert state["optimizer"]["state"].keys() == saved["optimizer"]["state"].keys()
    for i, s in saved["optimizer"]["state"].items():
        assert_equal_states(state["optimizer"]["state"][i], s)
    def hyper(groups):  # meta.json stores betas as a list
        return [{k: tuple(g[k]) if isinstance(g[k], list) else g[k] for k in ("lr", "betas", "eps", "weight_decay")}
                for g in groups]
    assert hyper(state["optimizer"]["param_groups"]) == hyper(saved["optimizer"]["param_groups"])
    torch.manual_seed(0)
    assert torch.isfinite(learner.update(make_batch("sac"))["grad_norm"])


@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
@pytest.mark.parametrize("case", list(TAMPERED))
def test_a_tampered_checkpoint_is_refused_on_two_ranks_and_changes_nothing(fsdp, strategy, case):
    """The one-process refusals of test_tampered_checkpoints.py hold on 2 ranks under FSDP and DDP."""
    assert not fsdp["marker"].exists(), "code from a checkpoint ran"
    for rank in fsdp["ranks"]:
        got = rank["tampered"][(strategy, case)]
        assert got["error"] is not None, f"rank loaded {case} without an error"
        kind, message = got["error"]
        assert kind in ("UnpicklingError", "ValueError", "FileNotFoundError"), (kind, message)
        assert got["path"] in message, message
        assert got["unchanged"], f"{case}: the learner changed although the load was refused"


def test_the_policy_runs_outside_update_with_the_last_steps_weights_on_every_rank(fsdp):
    """policy= under FSDP: the same program as under DDP (the actor is used in place, no copy)."""
    loss, actor = make_loss("ppo")
    reference = LocalLearner(loss, opt(), clip_grad_norm=CLIP)
    probe = make_batch("ppo", n=4, seed=9)
    expected = []
    for step in range(3):
        reference.update(make_batch("ppo", seed=500 + step))
        expected.append(actor(probe.clone())["loc"].detach())
    for rank in fsdp["ranks"]:
        got = rank["served"]
        for step in range(3):
            torch.testing.assert_close(got[f"loc_{step}"], expected[step], atol=1e-5, rtol=1e-5)
        for key, value in got["weights"].items(True, True):  # the served module is what the shards say
            assert torch.equal(got["actor"][key], value), key


def test_a_loss_network_the_learner_does_not_serve_names_itself_and_the_fix(fsdp):
    for rank in fsdp["ranks"]:
        got = rank["served"]
        assert "'critic_network'" in got["critic_error"] and "full_parameters" in got["critic_error"]
        assert "policy=" in got["critic_error"]
        assert got["critic_served"] is True
        torch.testing.assert_close(got["critic_value"], got["critic_inside"], atol=0, rtol=0)
        assert not torch.equal(got["critic_after_step"], got["critic_value"])  # refreshed by the step
    loss, _ = make_loss("ppo")
    reference = LocalLearner(loss, opt(), clip_grad_norm=CLIP)
    for step in range(3):
        reference.update(make_batch("ppo", seed=500 + step))
    probe = make_batch("ppo", n=4, seed=9)
    with torch.no_grad():
        value = loss.critic_network(probe)["state_value"]
    for rank in fsdp["ranks"]:
        torch.testing.assert_close(rank["served"]["critic_after_step"], value, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_bf16_under_fsdp_trains_a_loss_with_target_buffers_like_one_process(fsdp, precision):
    """DQN's target network is a buffer of the loss, outside the sharded module: bf16-true casts it too."""
    plain_ref, lazy_ref = one_process_td_errors(precision)
    tol = dict(atol=TD_TOL[precision], rtol=TD_TOL[precision])
    for rank, res in enumerate(r["integrity"][precision] for r in fsdp["ranks"]):
        assert res["loss_dtype"] == torch.float32 and res["obs_dtype"] == torch.float32
        torch.testing.assert_close(res["td_error"], plain_ref[8 * rank: 8 * rank + 8], **tol)
        torch.testing.assert_close(res["lazy_td_error"], lazy_ref[8 * rank: 8 * rank + 8], **tol)


def test_nonfinite_on_one_rank_skips_or_raises_on_every_rank_under_fsdp(fsdp):
    r0, r1 = (r["nonfinite"] for r in fsdp["ranks"])
    for r in (r0, r1):
        assert r["skipped_updates"] == 1 and r["num_updates"] == 1
        assert not torch.isfinite(r["skip_grad_norm"])
        assert_equal_states(r["after_skip"], r["before"])
        assert torch.isfinite(r["next_grad_norm"]) and r["final_num_updates"] == 2
        assert r["raise_num_updates"] == 3
    assert "loss entries" in r1["raised"] and "(rank 1)" in r1["raised"]
    assert "Optimizer step 3 refused (rank 0): grad_norm is non-finite (nan) on every rank" in r0["raised"], r0["raised"]
    for key in ("after_skip", "after_next", "after_raise"):
        assert_equal_states(r0[key], r1[key])
    assert any(not torch.equal(r0["after_next"][k], v) for k, v in r0["before"].items())


@pytest.mark.parametrize("scaler", ["sharded scaler", "plain scaler"])
def test_16_mixed_under_fsdp_skips_one_ranks_overflow_and_its_nan_loss_on_every_rank(fsdp, scaler):
    """docs/reliability.md, ``16-mixed``: FSDP2 with fp16 autocast and a grad scaler given through
    ``fabric=`` (torch's ``ShardedGradScaler``, as Fabric's FSDP plugin builds, or ``torch.amp.GradScaler``).
    Rank 1's overflow sits in its own gradient shard only; every rank still skips."""
    r0, r1 = (r["mixed16"][scaler] for r in fsdp["ranks"])
    assert r0["scaler_type"] == {"sharded scaler": "ShardedGradScaler", "plain scaler": "GradScaler"}[scaler]
    assert r0["local_nonfinite"] == [0] and r1["local_nonfinite"] == [5]  # weight row (4) and bias (1)
    for r in (r0, r1):
        assert not torch.isfinite(r["overflow_grad_norm"])
        # the scaler's verdict, reduced over the ranks: it skipped its step and halved its scale on both
        assert r["scale_after"] == r["scale_before"] / 2 and r["overflow_counts"] == (2, 0)
        assert_equal_states(r["after_overflow"], r["before"])
        # rank 1's NaN loss: the learner's all-reduced verdict made every rank skip, then raise
        assert r["nan_counts"] == (2, 1)
        assert_equal_states(r["after_nan"], r["before"])
        assert torch.isfinite(r["next_grad_norm"]) and r["final_counts"] == (3, 1)
        assert any(not torch.equal(r["after_next"][k], v) for k, v in r["before"].items())
    assert r0["scale_final"] == r1["scale_final"]
    assert "Optimizer step 3 refused (rank 0): another rank saw a non-finite loss or grad norm" in r0["raised"]
    assert "Optimizer step 3 refused (rank 1): the loss entries ['loss'] are non-finite" in r1["raised"]
    for key in ("after_overflow", "after_nan", "after_next"):
        assert_equal_states(r0[key], r1[key])


def test_unequal_per_rank_sample_counts_are_warned_under_fsdp(fsdp):
    for r in fsdp["ranks"]:
        seen = r["unequal_first_step"]
        assert len(seen) == 1 and "different numbers of samples (from 6 to 10 per step)" in seen[0], seen
        # as under DDP: unequal steps 2-3 are reported at the comparison of step 101, once
        seen = r["unequal"]
        assert seen["step 1"] == [] and seen["step 100"] == [], seen
        assert len(seen["step 101"]) == 1 and "(from 6 to 10 per step)" in seen["step 101"][0], seen
        assert "up to step 101" in seen["step 101"][0], seen


def test_a_users_parallelize_fn_sharding_over_whole_world_trains_like_the_default(fsdp):
    """The nonfinite and unequal-count checks above ran with such a function (fsdp_checks.user_parallelize)."""
    for r in fsdp["ranks"]:
        assert r["user_sharded"] == [("ShardedLoss", 2), ("ShardedLoss", 2)]


def test_each_layer_is_its_own_fsdp_unit_gathered_only_while_it_runs(fsdp):
    """Per-layer units: while one layer runs (forward, inside the loss), every other layer is sharded."""
    for rank in fsdp["ranks"]:
        for kind in ("ppo", "ppo_nonfunctional", "dqn", "sac", "sac_loop", "td3"):  # every layer its own unit
            got = rank["per_layer"][kind]
            assert got["at_rest_sharded"], kind
            linears = {"ppo": 4, "ppo_nonfunctional": 4, "dqn": 2}.get(kind, 4)  # 2 per MLP it unitizes
            assert len(got["units"]) == linears, (kind, got["units"])
            called = {path for path, _ in got["seen"]}
            assert called == set(got["units"]), kind  # every layer went through its unit
            for path, full in got["seen"]:
                assert full == [path], (kind, path, full)
    assert fsdp["ranks"][0]["per_layer"]["dqn"]["whole"] == []


@pytest.mark.parametrize("kind", ["sac", "sac_loop", "td3"])
def test_each_layer_of_a_critic_ensemble_is_gathered_only_while_it_runs_forward_and_backward(fsdp, kind):
    """SAC's and TD3's critics are one stacked ensemble that torchrl vmaps over (or, with
    deactivate_vmap=True, loops over): each of its layers, all members together, is one unit."""
    for rank in fsdp["ranks"]:
        got = rank["per_layer"][kind]
        critic = [u for u in got["units"] if u.startswith("qvalue_network.")]
        assert critic == ["qvalue_network.module.0", "qvalue_network.module.2"], got["units"]
        assert {u: got["members"][u] for u in critic} == dict.fromkeys(critic, 2)  # two critics stacked
        assert got["whole"] == (["log_alpha"] if kind.startswith("sac") else [])  # a scalar stays in the root
        # backward: each critic layer re-gathered by its own unit's hook, beside it at most the
        # layer FSDP prefetches for the next backward step (the loop calls each critic layer once per
        # critic, so FSDP keeps a layer whose other calls' backward is still to come)
        regathered = {path for path, _ in got["backward"]}
        assert set(critic) <= regathered, got["backward"]
        for path, full in got["backward"]:
            assert path in full and len(full) <= (3 if kind == "sac_loop" else 2), (path, full)


@pytest.mark.parametrize("kind", ["sac", "sac_loop", "td3"])
def test_per_layer_critic_ensembles_train_like_ddp_and_ranks_agree(fsdp, kind):
    """Stochastic losses: the ranks end bit-identical, and equal DDP on the same seeds within 1e-5."""
    r0, r1 = (r["per_layer"][kind] for r in fsdp["ranks"])
    assert_equal_states(r0["model"], r1["model"])
    for r in (r0, r1):
        torch.testing.assert_close(r["grad_norm"], r["ddp"]["grad_norm"], atol=1e-5, rtol=1e-5)
        assert_equal_states(r["model"], r["ddp"]["model"], atol=1e-5)


def test_layers_under_the_size_threshold_share_the_loss_unit_and_train_the_same(fsdp):
    for rank in fsdp["ranks"]:
        default, seventy = rank["per_layer"]["default"], rank["per_layer"]["threshold_70"]
        assert not any(default["own_unit"].values())  # 16-unit layers: far under MIN_UNIT_NUMEL
        assert seventy["own_unit"] == {p: n >= 70 for p, n in seventy["numel"].items()}
        assert any(seventy["own_unit"].values()) and not all(seventy["own_unit"].values())
    loss, _ = make_loss("ppo")
    learner = LocalLearner(loss, opt(), clip_grad_norm=CLIP)
    norms = run_steps(learner, "ppo")
    for kind in ("default", "threshold_70"):
        got = fsdp["ranks"][0]["per_layer"][kind]
        assert_equal_states(got["model"], fsdp["ranks"][1]["per_layer"][kind]["model"])
        torch.testing.assert_close(got["grad_norm"], norms, atol=1e-5, rtol=1e-5)
        assert_equal_states(got["model"], learner.checkpoint()["model"], atol=1e-5)


@pytest.mark.parametrize("kind", ["ppo", "ppo_nonfunctional", "dqn"])
def test_per_layer_units_train_like_one_process(fsdp, kind):
    r0, r1 = (r["per_layer"][kind] for r in fsdp["ranks"])
    assert_equal_states(r0["model"], r1["model"])
    loss, _ = make_loss("ppo" if kind.startswith("ppo") else kind, functional=kind != "ppo_nonfunctional")
    assert r0["loss_params"] == [n for n, _ in loss.named_parameters()]
    learner = LocalLearner(loss, opt(), clip_grad_norm=CLIP)
    norms = run_steps(learner, "ppo" if kind.startswith("ppo") else kind)
    torch.testing.assert_close(r0["grad_norm"], norms, atol=1e-5, rtol=1e-5)
    assert_equal_states(r0["model"], learner.checkpoint()["model"], atol=1e-5)


def test_a_strategy_objects_timeout_bounds_every_group_it_uses(fsdp):
    """docs/reliability.md, "the timeout itself": fsdp_checks.py's ModelParallelStrategy(timeout=90 s)
    bounds the group of both ranks torch built for it (read from its gloo backend)."""
    for r in fsdp["ranks"]:
        assert r["group_timeouts"] == [90.0], r["group_timeouts"]


def _sharded_grads(loss, batch, seed):
    """One process, no FSDP: the ShardedLoss's routing alone (units hold full parameters)."""
    from fabric_learner.sharding import ShardedLoss
    from fabric_learner.step.carrier import Carrier

    wrapper = ShardedLoss(loss, torch.device("cpu"))
    torch.manual_seed(seed)
    carried, _ = wrapper(Carrier(batch))
    out = carried.value
    sum(v for k, v in out.items() if k.startswith("loss_")).backward()
    return wrapper, {n: p.grad.reshape(wrapper.shapes[n]) for n, p in wrapper.named_loss_parameters()}


def _plain_grads(loss, batch, seed):
    torch.manual_seed(seed)
    out = loss(batch)
    sum(v for k, v in out.items() if k.startswith("loss_")).backward()
    return {n: p.grad for n, p in loss.named_parameters()}


@pytest.mark.parametrize("case,loop", [("sac", False), ("sac", True), ("td3", False)])
def test_ensemble_layers_routed_through_their_units_give_the_losss_own_gradients(case, loop):
    def build():
        loss, _ = make_loss(case)
        if loop:
            loss.deactivate_vmap = True
            loss._make_vmap()
        return loss

    batch = make_batch(case)
    wrapper, got = _sharded_grads(build(), batch.clone(), seed=5)
    assert {u.path: u.members for u in wrapper.layer_units() if u.members} == \
        {"qvalue_network.module.0": 2, "qvalue_network.module.2": 2}
    want = _plain_grads(build(), batch.clone(), seed=5)
    assert got.keys() == want.keys()
    for n in want:
        torch.testing.assert_close(got[n], want[n], atol=1e-6, rtol=1e-6, msg=n)


def test_a_loss_that_concatenates_its_ensemble_keeps_it_whole_and_trains_the_same():
    import rl_cases
    from torchrl.data import Bounded
    from torchrl.objectives import CQLLoss

    def build():
        torch.manual_seed(0)
        actor = rl_cases._gaussian_actor(rl_cases.TanhNormal)
        return CQLLoss(actor, rl_cases._qvalue(), action_spec=Bounded(-1.0, 1.0, shape=(rl_cases.ACT,)))

    batch = make_batch("sac")
    wrapper, got = _sharded_grads(build(), batch.clone(), seed=5)
    assert not any(u.members for u in wrapper.layer_units())
    assert any(n.startswith("qvalue_network_params.") for n in wrapper._whole)
    want = _plain_grads(build(), batch.clone(), seed=5)
    for n in want:
        torch.testing.assert_close(got[n], want[n], atol=1e-6, rtol=1e-6, msg=n)


def test_an_ensemble_changed_before_the_call_names_the_layer_and_the_fix():
    from torchrl.objectives import SACLoss

    class CatSAC(SACLoss):  # evaluates its critics on a concatenated copy of their parameters
        def qvalue_v2_loss(self, tensordict):
            params = torch.cat([self.qvalue_network_params, self.qvalue_network_params], 0)[:2]
            td = self._vmap_qnetworkN0(tensordict.select(*self.qvalue_network.in_keys, strict=False), params)
            return td.get("state_action_value").sum(), {}

    loss, _ = make_loss("sac")
    loss.__class__ = CatSAC
    with pytest.raises(RuntimeError, match=r"'qvalue_network.module.0'.*torch.cat.*strategy='ddp'"):
        _sharded_grads(loss, make_batch("sac"), seed=5)


def _discrete_sac():
    from tensordict.nn import TensorDictModule
    from torchrl.modules import MLP, OneHotCategorical, ProbabilisticActor, ValueOperator
    from torchrl.objectives import DiscreteSACLoss

    torch.manual_seed(0)
    logits = TensorDictModule(MLP(in_features=4, out_features=3, num_cells=[16]), ["observation"], ["logits"])
    actor = ProbabilisticActor(logits, in_keys=["logits"], distribution_class=OneHotCategorical, return_log_prob=True)
    critic = ValueOperator(MLP(in_features=4, out_features=3, num_cells=[16]), in_keys=["observation"],
                           out_keys=["action_value"])
    return DiscreteSACLoss(actor, critic, action_space="one-hot", num_actions=3)


def _iql():
    import rl_cases
    from torchrl.modules import MLP, ValueOperator
    from torchrl.objectives import IQLLoss

    torch.manual_seed(0)
    value = ValueOperator(MLP(in_features=4, out_features=1, num_cells=[16]), in_keys=["observation"])
    return IQLLoss(rl_cases._gaussian_actor(rl_cases.TanhNormal), rl_cases._qvalue(), value)


@pytest.mark.parametrize("build,case", [(_discrete_sac, "dqn"), (_iql, "sac")])
def test_discrete_sac_and_iql_ensembles_are_per_layer_units_too(build, case):
    batch = make_batch(case)
    wrapper, got = _sharded_grads(build(), batch.clone(), seed=5)
    assert {u.path: u.members for u in wrapper.layer_units() if u.members} == \
        {"qvalue_network.module.0": 2, "qvalue_network.module.2": 2}
    want = _plain_grads(build(), batch.clone(), seed=5)
    for n in want:
        torch.testing.assert_close(got[n], want[n], atol=1e-6, rtol=1e-6, msg=n)
