"""Reliability: non-finite steps, bad batches, process-group timeout, crash-consistent saves."""

from __future__ import annotations

import functools
import os
import re
from datetime import timedelta

import pytest
import torch
from conftest import make_learner
from rl_cases import WithConstantEntry, flat_params, make_batch, make_loss
from tensordict import TensorDict

from fabric_learner import LocalLearner


def snapshot(learner):
    return flat_params(learner.loss_module), repr(learner.optimizer.state_dict())


def assert_unchanged(learner, before):
    params, opt = before
    for k, v in flat_params(learner.loss_module).items():
        assert torch.equal(v, params[k]), k
    assert repr(learner.optimizer.state_dict()) == opt


def nan_batch(case, **kw):
    batch = make_batch(case, **kw)
    batch["observation"][0] = float("nan")
    return batch


# ---- non-finite values ---------------------------------------------------------------------


def test_on_nonfinite_is_validated(kind):
    with pytest.raises(ValueError, match="on_nonfinite.*'ignore'"):
        make_learner(kind, make_loss("dqn")[0], on_nonfinite="ignore")


@pytest.mark.parametrize("case", ["dqn", "ppo"])
def test_nonfinite_loss_raises_before_any_change_and_learner_stays_usable(kind, case):
    loss, _ = make_loss(case)
    learner = make_learner(kind, loss, clip_grad_norm=1.0)
    learner.update(make_batch(case, seed=1))
    before = snapshot(learner)
    with pytest.raises(FloatingPointError, match=r"loss.*non-finite.*on_nonfinite='skip'"):
        learner.update(nan_batch(case, seed=2))
    assert_unchanged(learner, before)
    assert learner.num_updates == 1 and learner.skipped_updates == 0 and learner._accum_step == 0
    assert all(p.grad is None for p in loss.parameters())
    out = learner.update(make_batch(case, seed=3))
    assert torch.isfinite(out["grad_norm"]) and learner.num_updates == 2


def test_nonfinite_loss_entry_without_gradient_is_refused(kind):
    """The gradients stay finite, so only the loss itself tells: one process checks it."""
    loss = WithConstantEntry(make_loss("dqn")[0])
    learner = make_learner(kind, loss, clip_grad_norm=1.0)
    learner.update(make_batch("dqn", seed=1))
    before = snapshot(learner)
    loss.value = float("inf")
    with pytest.raises(FloatingPointError, match=r"'loss_constant'.*non-finite"):
        learner.update(make_batch("dqn", seed=2))
    assert_unchanged(learner, before)
    assert learner.num_updates == 1


def test_a_skipped_nonfinite_loss_reports_a_nan_grad_norm_even_when_its_gradients_are_finite(kind):
    """One process backpropagates without the NaN seed several ranks use: the reported norm of a
    refused step is NaN all the same, so a skip reads alike under every strategy."""
    loss = WithConstantEntry(make_loss("dqn")[0])
    learner = make_learner(kind, loss, on_nonfinite="skip", clip_grad_norm=1.0)
    learner.update(make_batch("dqn", seed=1))
    before = snapshot(learner)
    loss.value = float("inf")
    out = learner.update(make_batch("dqn", seed=2))
    assert torch.isnan(out["grad_norm"]) and learner.skipped_updates == 1
    assert_unchanged(learner, before)


def test_nonfinite_loss_is_skipped(kind):
    loss, _ = make_loss("ppo")
    learner = make_learner(kind, loss, on_nonfinite="skip")
    learner.update(make_batch("ppo", seed=1))
    before = snapshot(learner)
    out = learner.update(nan_batch("ppo", seed=2))
    assert {"loss_objective", "loss_critic", "loss_entropy", "grad_norm"} <= set(out.keys())
    assert not torch.isfinite(out["grad_norm"])
    assert_unchanged(learner, before)
    assert learner.skipped_updates == 1 and learner.num_updates == 1 and learner._accum_step == 0
    assert all(p.grad is None for p in loss.parameters())
    learner.update(make_batch("ppo", seed=3))
    assert learner.num_updates == 2 and learner.skipped_updates == 1


def test_nonfinite_loss_on_first_micro_batch_skips_the_whole_window(kind):
    loss, _ = make_loss("dqn")
    learner = make_learner(kind, loss, on_nonfinite="skip", grad_accum_steps=2)
    before = snapshot(learner)
    first = learner.update(nan_batch("dqn", seed=1))
    assert "grad_norm" not in first.keys() and learner._accum_step == 1
    learner.update(make_batch("dqn", seed=2))
    assert_unchanged(learner, before)
    assert learner.skipped_updates == 1 and learner.num_updates == 0 and learner._accum_step == 0
    learner.update(make_batch("dqn", seed=3))
    learner.update(make_batch("dqn", seed=4))
    assert learner.num_updates == 1


class GradBomb(torch.autograd.Function):
    """Identity forward, infinite gradient backward: a finite loss with a non-finite grad norm."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("inf")


class BombLoss(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(3, 1)

    def forward(self, td):
        return TensorDict({"loss": GradBomb.apply(self.net(td["x"])).mean()}, [])


def test_nonfinite_grad_norm_raises_naming_grad_norm(kind):
    learner = make_learner(kind, BombLoss(), functools.partial(torch.optim.Adam, lr=0.1))
    before = snapshot(learner)
    with pytest.raises(FloatingPointError, match="grad_norm is non-finite"):
        learner.update(TensorDict({"x": torch.ones(4, 3)}, [4]))
    assert_unchanged(learner, before)
    assert learner.num_updates == 0


def test_nonfinite_grad_norm_is_skipped(kind):
    learner = make_learner(kind, BombLoss(), functools.partial(torch.optim.Adam, lr=0.1), on_nonfinite="skip")
    before = snapshot(learner)
    out = learner.update(TensorDict({"x": torch.ones(4, 3)}, [4]))
    assert torch.isfinite(out["loss"]) and not torch.isfinite(out["grad_norm"])
    assert_unchanged(learner, before)
    assert learner.skipped_updates == 1 and learner.num_updates == 0


# ---- batch validation -----------------------------------------------------------------------


def test_empty_batch_is_refused_before_the_forward(kind):
    loss, _ = make_loss("dqn")
    learner = make_learner(kind, loss)
    before = snapshot(learner)
    with pytest.raises(ValueError, match=r"empty batch.*\(0,\)"):
        learner.update(make_batch("dqn")[:0])
    assert_unchanged(learner, before)
    assert learner._accum_step == 0


@pytest.mark.parametrize("case,drop,named", [
    ("dqn", ["action"], "'action'"),
    ("sac", ["action"], "'action'"),
    ("ppo", ["advantage", ("next", "reward")], "('next', 'reward')"),  # nested, read by the value estimator
])
def test_missing_keys_are_named(kind, case, drop, named):
    loss, _ = make_loss(case)
    learner = make_learner(kind, loss)
    before = snapshot(learner)
    with pytest.raises(KeyError) as info:
        learner.update(make_batch(case).exclude(*drop))
    message = str(info.value)
    assert "lacks these keys" in message and named in message and "add them to the batch" in message
    assert_unchanged(learner, before)


def test_running_out_of_memory_is_not_reported_as_missing_keys(kind):
    """An allocation failure inside the loss reaches the caller as it is, even on a batch that lacks an in_key."""
    loss, _ = make_loss("dqn")
    learner = make_learner(kind, loss)
    oom = RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory")

    def allocate(*_):
        raise oom

    loss.value_network.register_forward_pre_hook(allocate)
    with pytest.raises(RuntimeError) as info:
        learner.update(make_batch("dqn").exclude("action"))
    assert info.value is oom


def test_over_approximate_in_keys_are_not_required():
    loss, _ = make_loss("ppo")  # in_keys list ("next", "reward"), unused when "advantage" is given
    assert ("next", "reward") in loss.in_keys
    out = LocalLearner(loss).update(make_batch("ppo").exclude(("next", "reward")))
    assert torch.isfinite(out["grad_norm"])


# ---- process-group timeout -------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
@pytest.mark.parametrize("timeout,expected", [("omitted", timedelta(minutes=5)), (42, timedelta(seconds=42)),
                                              (timedelta(hours=1), timedelta(hours=1))])
def test_strategies_built_from_names_carry_the_timeout(strategy, timeout, expected):
    """The group starts with at least the default (the rendezvous); collectives get ``timeout``."""
    from fabric_learner.launch.build import DEFAULT_TIMEOUT, as_timeout, build_fabric

    fabric, owns = build_fabric(accelerator="cpu", strategy=strategy, devices=2, num_nodes=1, precision="32-true",
                                timeout=as_timeout(DEFAULT_TIMEOUT if timeout == "omitted" else timeout))
    assert fabric.strategy._timeout == max(expected, DEFAULT_TIMEOUT) and owns


def test_a_strategy_object_keeps_its_timeout():
    from lightning.fabric.strategies import DDPStrategy

    from fabric_learner.launch.build import build_fabric

    given = DDPStrategy(timeout=timedelta(seconds=90))
    fabric, owns = build_fabric(accelerator="cpu", strategy=given, devices=2, num_nodes=1, precision="32-true",
                                timeout=timedelta(seconds=3))
    assert fabric.strategy is given and given._timeout == timedelta(seconds=90) and not owns


OUT_OF_STEP = [
    ("returns", "ddp", "python"),  # rank 1 calls update() once fewer and ends its program
    ("busy", "fabric=", "torchrun"),  # through fabric= whose strategy has a 10 s timeout; the learner says 1 h
    ("busy", "fsdp", "python"),  # ... and works on elsewhere, past the timeout
    ("busy", "ddp", "fabric"),  # the same under `fabric run`, which builds the group inside Fabric()
    ("dies", "ddp", "python"),  # rank 1 is SIGKILLed
]


# rank 0 calls a collective method of the learner (get_weights, under DDP checkpoint) while rank 1 ... Which
# launcher starts the ranks does not matter here, so they are forked from the test zygote ("forked"), their
# imports done; "loop" fails rank 1 and needs rank 0 to outlive it long enough to say so, which the zygote,
# ending the others as soon as one fails, would not allow
OUT_OF_ORDER = [
    ("mismatch", "fsdp", "forked"),  # ... calls save()
    ("mismatch", "ddp", "forked"),
    ("closed", "fsdp", "forked"),  # ... has closed its learner
    ("closed", "ddp", "forked"),
    ("loop", "fsdp", "python"),  # ... calls update()
    ("loop", "ddp", "python"),
    ("trainer", "fsdp", "forked"),  # Trainer.save_checkpoint() on rank 0, the learner's call on rank 1
    ("trainer", "ddp", "forked"),
]


@pytest.fixture(scope="module")
def out_of_step_runs(tmp_path_factory):
    """Every launch below, three at a time (most of each is waiting out a collective timeout); a run that
    hangs is its own test's failure."""
    from multiproc import RELAY, WORKERS, fabric_run, forked_ranks, launch, plain_python, run, side_by_side, torchrun

    cases = OUT_OF_STEP + sorted(OUT_OF_ORDER, key=lambda case: case[2] == "forked")
    folders = {case: tmp_path_factory.mktemp(f"{case[0]}-{case[1]}") for case in cases}  # the factory is not thread-safe

    def one(case):
        scenario, strategy, launcher = case
        script = [os.path.join(WORKERS, "hang_checks.py"), scenario, strategy, str(folders[case])]
        if launcher == "forked":
            return launch(*script, timeout=150)
        # 5 s (10 s) collective timeout; the default 5 minutes (or torch's 30) would outlast this bound. Rank 0 under
        # plain python, every rank under torchrun and `fabric run`, is forked from the zygote through the relay
        if launcher == "python":  # rank 0 starts rank 1 itself, a fresh interpreter
            return plain_python(*script, timeout=150)
        # fabric=: the Fabric's own 10 s timeout must hold, not the learner's 1 h (docs/reliability.md)
        how = torchrun if launcher == "torchrun" else functools.partial(fabric_run, strategy=strategy)
        return run(how(RELAY, *script), timeout=150, **forked_ranks())

    # the launches that start interpreters first, so that the forked ones fill their waits
    return side_by_side(cases, one, at_once=3)


@pytest.mark.parametrize("scenario,strategy,launcher", OUT_OF_STEP)
def test_a_rank_out_of_step_fails_its_peers_instead_of_hanging(out_of_step_runs, scenario, strategy, launcher):
    from multiproc import finished

    proc = finished(out_of_step_runs[scenario, strategy, launcher])
    assert proc.returncode != 0 and proc.leftovers == 0, proc.stdout[-4000:]
    # the bound torch's group really has (timeout=5, or the fabric= strategy's 10 s over the learner's 1 h)
    seconds = 10 if strategy == "fabric=" else 5
    assert f"rank 0 group timeouts [{seconds:.1f}]" in proc.stdout, proc.stdout[-4000:]
    failing_call = 2 if scenario == "dies" else 3  # rank 1 dies before its second update
    assert f"rank 0 finished update {failing_call - 1}" in proc.stdout
    assert f"rank 0 finished update {failing_call}" not in proc.stdout
    assert f"Rank 0: update() call {failing_call} could not complete a collective with the other ranks" \
        in proc.stdout, proc.stdout[-4000:]
    if scenario == "busy":
        assert "it timed out waiting for them" in proc.stdout and f"(0:00:{seconds:02d})" in proc.stdout
    if scenario == "returns":  # what rank 1 last announced, as one phrase ("Rank 1 is has ended" before)
        assert re.search(r"Rank 1 (has ended \(closed its learner\)|has announced no collective call of the learner)\. "
                         r"Another rank", proc.stdout), proc.stdout[-4000:]
    if launcher == "python":  # rank 0 names each rank it started that exited non-zero or that it killed
        assert re.search(r"fabric_learner: rank 1 (exited with status -?[1-9]|was still running and was killed)",
                         proc.stdout), proc.stdout[-4000:]
    else:  # the launcher's summary gives every rank's status: rank 0's own 1, rank 1 ended by the launcher
        from multiproc import elastic_exit_codes

        codes = elastic_exit_codes(proc.stdout)
        assert codes.keys() == {0, 1} and codes[0] == 1 and codes[1] != 0, (codes, proc.stdout[-4000:])


@pytest.mark.parametrize("scenario,strategy,launcher", OUT_OF_ORDER)
def test_a_collective_method_called_out_of_order_is_named_on_every_rank_that_can_still_speak(
        out_of_step_runs, scenario, strategy, launcher):
    from multiproc import finished

    proc = finished(out_of_step_runs[scenario, strategy, launcher])
    out = proc.stdout
    call = "get_weights" if strategy == "fsdp" else "checkpoint"  # get_weights is no collective under DDP
    assert proc.leftovers == 0 and "rank 0 passed the third call" not in out, out[-4000:]
    if scenario == "mismatch":  # both ranks name both calls before any collective, and train on together
        assert proc.returncode == 0, out[-4000:]
        assert f"rank 0 raised: Rank 0: {call}() (collective call 1 of this process) does not match rank 1, which " \
               "called save() at the same point. Nothing was gathered, written or changed." in out, out[-4000:]
        assert f"rank 1 raised: Rank 1: save() (collective call 1 of this process) does not match rank 0, which " \
               f"called {call}() at the same point." in out, out[-4000:]
        assert "rank 0 trained on" in out and "rank 1 trained on" in out
        assert os.listdir(proc.args[-1]) == []  # the refused save wrote nothing
    elif scenario == "closed":  # from rank 1's announcement, not after waiting out a timeout
        assert proc.returncode == 0, out[-4000:]
        assert f"rank 0 raised: Rank 0: {call}() (collective call 1 of this process) cannot complete: rank 1 has " \
               "ended (closed its learner) and will not join it." in out, out[-4000:]
    elif scenario == "trainer":  # the Trainer's checkpoint is named like the learner's own calls
        assert proc.returncode == 0, out[-4000:]
        assert "rank 0 raised: Rank 0: Trainer.save_checkpoint() (collective call 1 of this process) does not match " \
               f"rank 1, which called {call}() at the same point." in out, out[-4000:]
        assert f"rank 1 raised: Rank 1: {call}() (collective call 1 of this process) does not match rank 0, which " \
               "called Trainer.save_checkpoint() at the same point." in out, out[-4000:]
        assert "rank 0 trained on" in out and "rank 1 trained on" in out
    else:  # rank 1's update names rank 0's call; rank 0 then learns rank 1 failed
        assert proc.returncode != 0, out[-4000:]
        assert "Rank 1: update() call 3 could not complete a collective with the other ranks (it timed out waiting " \
               f"for them). Rank 0 is in {call}() (collective call 1)." in out, out[-4000:]
        assert f"CallOrderError: Rank 0: {call}() (collective call 1 of this process) cannot complete: rank 1 has " \
               "failed (in update() call 3) and will not join it." in out, out[-4000:]


@pytest.mark.parametrize("timeout,error", [(0, ValueError), (-1.0, ValueError), ("5m", TypeError), (True, TypeError)])
def test_bad_timeout_is_refused(timeout, error):
    from fabric_learner import FabricLearner

    with pytest.raises(error, match="timeout"):
        FabricLearner(make_loss("dqn")[0], accelerator="cpu", devices=1, timeout=timeout)


# ---- saves: crash consistency and never replacing foreign files -------------------------------

def test_an_interrupted_save_leaves_the_previous_checkpoint_and_nothing_in_the_temp_folder(
        kind, tmp_path, monkeypatch):
    """In process, for both backends (FabricLearner saves through Fabric's checkpoint IO); the
    SIGKILLed saves of one process, DDP and FSDP are in the kill-and-resume tests below."""
    import io
    import tempfile

    temp = tmp_path / "system_temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    loss, _ = make_loss("dqn")
    learner = make_learner(kind, loss)
    learner.update(make_batch("dqn"))
    path = tmp_path / "ckpt.pt"
    learner.save(path)
    saved = path.read_bytes()
    learner.update(make_batch("dqn", seed=2))
    real_save = torch.save

    def half_then_interrupt(obj, f, *args, **kwargs):
        buffer = io.BytesIO()
        real_save(obj, buffer, *args, **kwargs)
        f.write(buffer.getvalue()[: buffer.tell() // 2])
        raise KeyboardInterrupt("interrupted mid-save")

    monkeypatch.setattr(torch, "save", half_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        learner.save(path)
    monkeypatch.setattr(torch, "save", real_save)
    assert path.read_bytes() == saved
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt", "system_temp"]  # the temp file removed
    assert list(temp.iterdir()) == []
    fresh = make_learner(kind, make_loss("dqn", seed=3)[0])
    fresh.load(path)
    assert fresh.num_updates == 1


@pytest.mark.parametrize("content", ["text", "torch_dict", "torch_tensor"])
def test_save_never_replaces_a_file_it_did_not_write(kind, tmp_path, content):
    path = tmp_path / "precious.pt"
    if content == "text":
        path.write_text("my notes")
    elif content == "torch_dict":
        torch.save({"model": {}, "optimizer": {}}, path)
    else:
        torch.save(torch.ones(3), path)
    data = path.read_bytes()
    learner = make_learner(kind, make_loss("dqn")[0])
    with pytest.raises(FileExistsError, match="precious.pt.*not a fabric_learner checkpoint"):
        learner.save(path)
    assert path.read_bytes() == data
    assert sorted(p.name for p in tmp_path.iterdir()) == ["precious.pt"]


def test_save_replaces_its_own_checkpoint_from_either_backend(kind, tmp_path):
    path = tmp_path / "c.pt"
    other = "fabric" if kind == "local" else "local"
    make_learner(other, make_loss("dqn")[0]).save(path)
    learner = make_learner(kind, make_loss("dqn")[0])
    learner.update(make_batch("dqn"))
    learner.save(path)
    fresh = make_learner(kind, make_loss("dqn", seed=4)[0])
    fresh.load(path)
    assert fresh.num_updates == 1


# ---- kill and resume ------------------------------------------------------------------------


def _resume_results(tmp_path, world):
    """Run resume_checks.py: ``first`` dies mid-save, leaving only what a crash may leave."""
    from multiproc import WORKERS, launch

    script = os.path.join(WORKERS, "resume_checks.py")
    temp = tmp_path / "system_temp"  # the workers' TMPDIR: a save must not leave files there
    temp.mkdir()
    first = launch(script, "first", world, tmp_path, nproc=world, timeout=300, TMPDIR=str(temp))
    assert first.returncode != 0 and first.leftovers == 0, first.stdout[-4000:]
    assert "was not interrupted" not in first.stdout and list(temp.iterdir()) == []
    if world == 1:
        strays = [p.name for p in tmp_path.iterdir() if p.name.startswith(".local.ckpt.")]
        assert len(strays) == 1 and strays[0].endswith(".partial")  # the killed write, beside the file
    else:
        assert len([p for p in (tmp_path / "fsdp.ckpt").iterdir() if p.is_dir()]) == 2  # complete + killed
    if world == 2:
        ddp_file = (tmp_path / "ddp.ckpt").read_bytes()
    resumed = launch(script, "resume", world, tmp_path, nproc=world, timeout=300)
    assert resumed.leftovers == 0, resumed.stdout[-4000:]
    if world == 1:
        assert resumed.returncode == 0, resumed.stdout[-4000:]
    else:  # killed in a second DDP save, after writing its results
        assert resumed.returncode != 0 and "was not interrupted" not in resumed.stdout, resumed.stdout[-4000:]
        # the resumed FSDP learner saved again: only that version is left, the killed folder removed
        assert len([p for p in (tmp_path / "fsdp.ckpt").iterdir() if p.is_dir()]) == 1
        assert (tmp_path / "ddp.ckpt").read_bytes() == ddp_file
        assert len([p for p in tmp_path.iterdir() if p.name.startswith(".ddp.ckpt.")]) == 1
        fresh = LocalLearner(make_loss("sac", seed=8)[0])
        fresh.load(tmp_path / "ddp.ckpt")
        assert fresh.num_updates == 2
    return lambda name: torch.load(tmp_path / name, weights_only=True)


def _assert_same_run(a, b, atol=0.0):
    assert a["num_updates"] == b["num_updates"] == 4
    assert torch.equal(a["rng_after"], b["rng_after"])  # the resumed run drew exactly the same numbers
    torch.testing.assert_close(a["grad_norm"], b["grad_norm"], atol=atol, rtol=0)
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        torch.testing.assert_close(a["model"][k], b["model"][k], atol=atol, rtol=0, msg=k)


def test_killed_and_resumed_run_is_bit_identical_in_one_process(tmp_path):
    load = _resume_results(tmp_path, world=1)
    _assert_same_run(load("local_first_rank0.pt"), load("local_resume_rank0.pt"))
    learner = LocalLearner(make_loss("sac")[0])
    learner.save(tmp_path / "local.ckpt")  # the next save replaces the file and clears the killed one's
    assert sorted(p.name for p in tmp_path.iterdir() if "local.ckpt" in p.name) == ["local.ckpt"]


def test_killed_and_resumed_run_matches_under_ddp_and_fsdp(tmp_path):
    load = _resume_results(tmp_path, world=2)
    for rank in (0, 1):
        _assert_same_run(load(f"ddp_first_rank{rank}.pt"), load(f"ddp_resume_rank{rank}.pt"))
        _assert_same_run(load(f"fsdp_first_rank{rank}.pt"), load(f"fsdp_resume_rank{rank}.pt"), atol=1e-6)
    first = [load(f"ddp_first_rank{r}.pt")["rng_after"] for r in (0, 1)]
    assert not torch.equal(*first)  # each rank restored its own generator, not rank 0's


def test_the_random_state_is_what_makes_a_stochastic_resume_exact():
    """Control for the kill-and-resume tests: without the saved random state, SAC diverges."""
    loss, _ = make_loss("sac", seed=3)
    learner = LocalLearner(loss)
    torch.manual_seed(0)
    learner.update(make_batch("sac", seed=1))
    saved = learner.checkpoint()
    learner.update(make_batch("sac", seed=2))
    expected = flat_params(loss)
    for keep_rng in (True, False):
        fresh = LocalLearner(make_loss("sac", seed=4)[0])
        torch.manual_seed(5)
        fresh.load_checkpoint(saved if keep_rng else {k: v for k, v in saved.items() if k != "rng"})
        fresh.update(make_batch("sac", seed=2))
        same = all(torch.equal(v, expected[k]) for k, v in flat_params(fresh.loss_module).items())
        assert same is keep_rng


def test_random_state_from_another_world_size_is_left_alone_with_a_warning():
    learner = LocalLearner(make_loss("dqn")[0])
    saved = learner.checkpoint()
    saved["rng"] = saved["rng"] * 2
    torch.manual_seed(3)
    before = torch.get_rng_state()
    with pytest.warns(UserWarning, match="random state of 2 rank.*this run has 1"):
        learner.load_checkpoint(saved)
    assert torch.equal(torch.get_rng_state(), before)


def test_a_malformed_random_state_is_refused_before_anything_loads():
    learner = LocalLearner(make_loss("dqn")[0])
    learner.update(make_batch("dqn"))
    saved = learner.checkpoint()
    saved["rng"] = [{"torch": "not a tensor"}]
    fresh = LocalLearner(make_loss("dqn", seed=9)[0])
    before = snapshot(fresh)
    with pytest.raises(ValueError, match=r"checkpoint\['rng'\]"):
        fresh.load_checkpoint(saved)
    assert_unchanged(fresh, before)


# ---- rows of docs/reliability.md's table checked here in one process ----------------------


def test_a_batch_with_no_entries_is_refused_before_the_forward(kind):
    learner = make_learner(kind, make_loss("dqn")[0])
    before = snapshot(learner)
    for empty in (TensorDict({}, [16]), TensorDict({"next": TensorDict({}, [16])}, [16])):  # nested: no leaf either
        with pytest.raises(ValueError, match=r"empty batch \(batch_size \(16,\)"):
            learner.update(empty)
    assert_unchanged(learner, before)
    assert learner._accum_step == 0 and learner.num_updates == 0


def test_float64_entries_for_a_float32_loss_raise_a_type_error_naming_them(kind):
    learner = make_learner(kind, make_loss("dqn")[0])
    before = snapshot(learner)
    batch = make_batch("dqn")
    batch["observation"] = batch["observation"].double()
    with pytest.raises(TypeError) as info:
        learner.update(batch)
    message = str(info.value)
    assert "'observation': 'float64'" in message and "float32" in message, message
    assert "precision" in message and "cast" in message.lower(), message
    assert_unchanged(learner, before)


def test_saving_a_file_checkpoint_onto_a_folder_raises_is_a_directory_error(kind, tmp_path):
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "mine.txt").write_text("keep")
    learner = make_learner(kind, make_loss("dqn")[0])
    with pytest.raises(IsADirectoryError, match=r"folder is a (directory|folder); a single-file checkpoint would replace it"):
        learner.save(tmp_path / "folder")
    assert [p.name for p in (tmp_path / "folder").iterdir()] == ["mine.txt"]


def test_saving_a_sharded_checkpoint_onto_a_foreign_folder_or_file_raises_file_exists_error(tmp_path):
    from fabric_learner import FabricLearner

    learner = FabricLearner(make_loss("dqn")[0], accelerator="cpu", strategy="fsdp", devices=1)
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "mine.txt").write_text("keep")
    (tmp_path / "file.pt").write_text("keep")
    with pytest.raises(FileExistsError, match="non-empty folder that is not a fabric_learner sharded checkpoint"):
        learner.save(tmp_path / "folder")
    with pytest.raises(FileExistsError, match="file.pt is a file"):
        learner.save(tmp_path / "file.pt")
    assert [p.name for p in (tmp_path / "folder").iterdir()] == ["mine.txt"]
    assert (tmp_path / "file.pt").read_text() == "keep"


def test_timeout_none_leaves_the_strategy_at_torchs_default():
    """``timeout=None``: the learner does not touch the strategy's timeout (torch's 30 minutes for gloo).
    The real group's timeout is read in tests/test_launch.py (runs with FL_TIMEOUT=none)."""
    import torch.distributed as dist

    from fabric_learner.launch.build import as_timeout, build_fabric

    for strategy in ("ddp", "fsdp"):
        fabric, owns = build_fabric(accelerator="cpu", strategy=strategy, devices=2, num_nodes=1,
                                    precision="32-true", timeout=as_timeout(None))
        assert fabric.strategy._timeout == dist.default_pg_timeout == timedelta(minutes=30) and not owns


def test_16_mixed_leaves_inf_gradients_to_the_scaler_and_still_refuses_a_nonfinite_loss():
    """Fabric turns precision="16-mixed" into bf16 on CPU, so the same plugin (fp16 autocast and a
    grad scaler) is given through ``fabric=``; on a GPU the name alone builds it."""
    from lightning.fabric import Fabric
    from lightning.fabric.plugins.precision import MixedPrecision

    from fabric_learner import FabricLearner

    loss, _ = make_loss("dqn")
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    learner = FabricLearner(loss, fabric=Fabric(accelerator="cpu", devices=1, plugins=[plugin]), on_nonfinite="skip")
    scaler = learner.fabric.strategy.precision.scaler
    assert scaler is not None
    learner.update(make_batch("dqn", seed=1))
    assert learner.num_updates == 1
    # an overflow in the scaled gradients: the scaler skips its step and lowers its scale; not a refusal
    scale = scaler.get_scale()
    before = snapshot(learner)
    hook = loss.value_network_params.values(True, True).__iter__().__next__().register_hook(
        lambda g: torch.full_like(g, float("inf")))
    out = learner.update(make_batch("dqn", seed=2))
    hook.remove()
    assert learner.skipped_updates == 0 and learner.num_updates == 2 and not torch.isfinite(out["grad_norm"])
    assert scaler.get_scale() < scale
    assert_unchanged_params(learner, before)
    # a non-finite loss is still the learner's to skip
    out = learner.update(nan_batch("dqn", seed=3))
    assert learner.skipped_updates == 1 and learner.num_updates == 2
    assert_unchanged_params(learner, before)
    out = learner.update(make_batch("dqn", seed=4))
    assert torch.isfinite(out["grad_norm"]) and learner.num_updates == 3


def test_16_mixed_by_name_under_fsdp_is_refused_before_anything_is_launched():
    """docs/reliability.md, ``16-mixed``: Fabric's FSDP2 strategy takes no ``16-mixed`` by name (on any
    device); the error names the precisions it takes, and no rank was started, no group changed."""
    import torch.distributed as dist
    from multiproc import child_pids

    from fabric_learner import FabricLearner

    group = dist.group.WORLD if dist.is_initialized() else None  # earlier in-process tests may leave one
    children = child_pids()
    with pytest.raises(ValueError, match=r"does not support .*'16-mixed'.*32-true, bf16-mixed, bf16-true, 16-true"):
        FabricLearner(make_loss("dqn")[0], accelerator="cpu", strategy="fsdp", devices=2, precision="16-mixed")
    assert (dist.group.WORLD if dist.is_initialized() else None) is group
    assert child_pids() <= children  # Fabric's launcher would have started rank 1 as a child


def test_ddp_static_graph_is_refused_before_anything_is_launched():
    """DDP's ``static_graph=True`` synchronises gradients through hooks on the tensors its module returns,
    which the learner's loss output does not pass through: 2 gloo ranks trained apart from the first
    step when it was let through. It is refused by name; no rank was started, no group changed."""
    import torch.distributed as dist
    from lightning.fabric.strategies import DDPStrategy
    from multiproc import child_pids

    from fabric_learner import FabricLearner

    group = dist.group.WORLD if dist.is_initialized() else None
    children = child_pids()
    with pytest.raises(ValueError, match=r"static_graph=True is not supported.*Nothing was launched"):
        FabricLearner(make_loss("dqn")[0], accelerator="cpu", strategy=DDPStrategy(static_graph=True), devices=2)
    assert (dist.group.WORLD if dist.is_initialized() else None) is group
    assert child_pids() <= children


def assert_unchanged_params(learner, before):
    for k, v in flat_params(learner.loss_module).items():
        assert torch.equal(v, before[0][k]), k


class _HostReads:
    """Counts the ways Python code reads a tensor's value on the host (each one a sync on a GPU)."""

    NAMES = ("item", "tolist", "__bool__", "__float__", "__int__")

    def __init__(self, monkeypatch):
        self.count = 0
        for name in self.NAMES:
            real = getattr(torch.Tensor, name)

            def counted(t, *a, _real=real, **k):
                self.count += 1
                return _real(t, *a, **k)

            monkeypatch.setattr(torch.Tensor, name, counted)


def test_accumulation_calls_read_nothing_on_the_host(kind, monkeypatch):
    """docs/reliability.md, "cost of the check": host reads happen on the step call only."""
    learner = make_learner(kind, ToyLoss(), clip_grad_norm=1.0, grad_accum_steps=3)
    batches = [TensorDict({"x": torch.randn(8, 3, generator=torch.Generator().manual_seed(i))}, [8])
               for i in range(6)]
    learner.update(batches[0]), learner.update(batches[1]), learner.update(batches[2])  # warm-up window
    reads = _HostReads(monkeypatch)
    per_call = []
    for batch in batches[3:]:
        before = reads.count
        learner.update(batch)
        per_call.append(reads.count - before)
    assert per_call[0] == per_call[1] == 0, per_call
    assert per_call[2] >= 1, per_call  # the step call reads the verdict


class ToyLoss(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(3, 2)

    def forward(self, td):
        return TensorDict({"loss": self.net(td["x"]).pow(2).mean()}, [])


def test_fsdp_refuses_an_optimizer_instance_and_asks_for_a_factory():
    from fabric_learner import FabricLearner

    loss, _ = make_loss("dqn")
    with pytest.raises(ValueError, match=r"needs a factory, not an instance.*functools.partial"):
        FabricLearner(loss, torch.optim.Adam(loss.parameters()), accelerator="cpu", strategy="fsdp", devices=1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a batch on another device needs a second device (CUDA)")
def test_a_batch_on_another_device_is_moved_for_the_forward_and_keeps_its_device():
    """docs/reliability.md: a CPU batch fed to a learner on a GPU; what DQN writes (td_error) comes back
    to the CPU, equal to one CPU process on the same batch."""
    from fabric_learner import FabricLearner

    reference = LocalLearner(make_loss("dqn")[0])
    learner = FabricLearner(make_loss("dqn")[0], accelerator="cuda", devices=1)
    expected, batch = make_batch("dqn", n=16, seed=5), make_batch("dqn", n=16, seed=5)
    reference.update(expected)
    learner.update(batch)
    assert batch["observation"].device == torch.device("cpu")
    assert batch["td_error"].device == torch.device("cpu")
    torch.testing.assert_close(batch["td_error"], expected["td_error"], atol=1e-5, rtol=1e-5)
    for k, v in flat_params(reference.loss_module).items():
        torch.testing.assert_close(flat_params(learner.loss_module)[k].cpu(), v, atol=1e-5, rtol=1e-5, msg=k)
