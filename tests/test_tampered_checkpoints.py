"""No code runs from a tampered checkpoint, on any load path, and nothing changes.

Every case starts from a real checkpoint written by this package (``tests/fixtures``), damages
it (``tamper``), and loads it: the load must raise a clear error naming the file, create no
marker file (a payload's unpickling would), and leave parameters, optimizer state, counters,
random state, replay buffer and collector exactly as they were. The same damaged copies are
loaded on 2 ranks under DDP and FSDP in ``tests/workers/fsdp_checks.py`` (see test_fsdp.py).
"""

from __future__ import annotations

import functools
import pickle

import pytest
import tamper
import torch
from conftest import make_learner
from rl_cases import CLIP, LR, make_batch, make_loss

from fabric_learner import LocalLearner
from fabric_learner.checkpoint.validate import clone_state

REFUSALS = (pickle.UnpicklingError, ValueError, FileNotFoundError)


def opt():
    return functools.partial(torch.optim.Adam, lr=LR)


def learner_state(learner):
    """Everything a load may change: weights, targets, optimizer state, counters, random state."""
    return {"model": {k: v.clone() for k, v in learner.loss_module.state_dict().items()},
            "optim": learner.checkpoint()["optimizer"], "num_updates": learner.num_updates,
            "rng": torch.get_rng_state()}


def assert_same(a, b, where=""):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.shape == b.shape, where
        torch.testing.assert_close(a, b, atol=0, rtol=0, equal_nan=True, msg=where)  # unwritten storage may be nan
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


@pytest.fixture
def marker(tmp_path, monkeypatch):
    path = tmp_path / "payload-ran"
    monkeypatch.setenv("FL_MARKER", str(path))
    return path


def trained_learner(kind):
    learner = make_learner(kind, make_loss("dqn", seed=3)[0], opt(), clip_grad_norm=CLIP)
    learner.update(make_batch("dqn", seed=7))
    return learner


@pytest.mark.parametrize("fixture", ["local.pt", "ddp.pt", "sharded"])
def test_the_fixtures_written_by_this_package_load(kind, fixture, tmp_path):
    learner = trained_learner(kind)
    learner.load(tamper.fresh_copy(fixture, tmp_path))
    assert learner.num_updates == 2
    reference = LocalLearner(make_loss("dqn")[0], opt())
    reference.load(tamper.FIXTURES / "local.pt")
    for k, v in reference.loss_module.state_dict().items():  # the three fixtures trained the same steps
        torch.testing.assert_close(learner.loss_module.state_dict()[k], v, atol=1e-6, rtol=0, msg=k)


@pytest.mark.parametrize("case", list(tamper.SHARDED))
def test_a_tampered_sharded_checkpoint_is_refused_in_one_process(kind, case, tmp_path, marker):
    ckpt = tamper.prepare({case: tamper.SHARDED[case]}, "sharded", tmp_path)[case]
    learner = trained_learner(kind)
    before = learner_state(learner)
    with pytest.raises(REFUSALS) as err:
        learner.load(ckpt)
    assert str(ckpt) in str(err.value), err.value  # the error names the checkpoint it is about
    assert not marker.exists(), "code from the checkpoint ran"
    assert_same(learner_state(learner), before)
    learner.update(make_batch("dqn", seed=8))  # still usable


@pytest.mark.parametrize("fixture", ["local.pt", "ddp.pt"])
@pytest.mark.parametrize("case", list(tamper.FILE))
def test_a_tampered_checkpoint_file_is_refused(kind, fixture, case, tmp_path, marker):
    ckpt = tamper.prepare({case: tamper.FILE[case]}, fixture, tmp_path)[case]
    learner = trained_learner(kind)
    before = learner_state(learner)
    with pytest.raises(REFUSALS) as err:
        learner.load(ckpt)
    assert str(ckpt) in str(err.value), err.value
    assert not marker.exists(), "code from the checkpoint ran"
    assert_same(learner_state(learner), before)


def test_random_bytes_are_named_as_no_readable_checkpoint_and_a_hostile_pickle_as_one_whose_unpickling_could_run_code(
        tmp_path, marker):
    """Random bytes were refused as "an object other than tensors and plain containers, whose unpickling could run
    code"."""
    ckpts = tamper.prepare({c: tamper.FILE[c] for c in ("random bytes", "plain pickle payload", "payload in the pickle")},
                           "local.pt", tmp_path)
    learner = LocalLearner(make_loss("dqn")[0], opt())
    with pytest.raises(ValueError, match=r"is not a readable checkpoint \(damaged, or a file of another format\)") as err:
        learner.load(ckpts["random bytes"])
    assert "run code" not in str(err.value)
    for hostile in ("plain pickle payload", "payload in the pickle"):
        with pytest.raises(pickle.UnpicklingError, match="whose unpickling could run code") as err:
            learner.load(ckpts[hostile])
        assert "Check the documentation" not in str(err.value), err.value  # torch's reason, not its closing line
    assert not marker.exists()


def test_a_bytes_entry_is_named_with_what_was_expected(tmp_path, marker):
    ckpt = tamper.prepare({"bytes": tamper.SHARDED["entry re-saved as a pickled object"]}, "sharded", tmp_path)["bytes"]
    with pytest.raises(pickle.UnpicklingError, match=r"entry 'model/.*' is stored as pickled bytes.*expected a tensor"):
        LocalLearner(make_loss("dqn")[0], opt()).load(ckpt)
    assert not marker.exists()


def test_latest_outside_the_checkpoint_is_named(tmp_path, marker):
    ckpt = tamper.prepare({"out": tamper.SHARDED["LATEST names ../elsewhere"]}, "sharded", tmp_path)["out"]
    with pytest.raises(ValueError, match=r"LATEST names '\.\./elsewhere', expected a version folder name"):
        LocalLearner(make_loss("dqn")[0], opt()).load(ckpt)


# ---- the Trainer's folder ---------------------------------------------------------------------


def trainer_state(trainer, learner, rb, collector):
    return clone_state({"learner": learner_state(learner), "rb": rb.state_dict(), "collector": collector.state_dict(),
                        "counters": dict(trainer._get_state()), "rb_len": len(rb)})


def build_trainer():
    import sys

    from multiproc import WORKERS

    sys.path.insert(0, WORKERS) if WORKERS not in sys.path else None
    import trainer_common as tc

    trainer, learner, _, _, rb, collector = tc.build_dqn(
        lambda loss, o, policy: LocalLearner(loss, o, policy=policy, clip_grad_norm=CLIP),
        total_frames=4 * tc.FRAMES_PER_BATCH)
    # some state to lose: a filled replay buffer, moved weights and optimizer state, collector counters
    rb.extend(next(iter(collector)).reshape(-1))
    learner.update(make_batch("dqn", seed=7))
    return trainer, learner, rb, collector


def test_the_trainer_fixture_loads(tmp_path):
    trainer, learner, rb, _ = build_trainer()
    trainer.load_from_file(tamper.fresh_copy("trainer", tmp_path))
    assert learner.num_updates == 6 and len(rb) == 48  # where the fixture's run stopped


@pytest.mark.parametrize("case", list(tamper.TRAINER))
def test_a_tampered_trainer_checkpoint_is_refused_and_changes_nothing(case, tmp_path, marker):
    ckpt = tamper.prepare({case: tamper.TRAINER[case]}, "trainer", tmp_path)[case]
    trainer, learner, rb, collector = build_trainer()
    before = trainer_state(trainer, learner, rb, collector)
    with pytest.raises(REFUSALS) as err:
        trainer.load_from_file(ckpt)
    assert str(ckpt) in str(err.value), err.value
    assert not marker.exists(), "code from the checkpoint ran"
    assert_same(trainer_state(trainer, learner, rb, collector), before)
