"""The Trainer with torchrl's standard environments runs from start to a clean exit (issue #21).

GymEnv, SerialEnv, ParallelEnv (worker processes), TransformedEnv stacks, torchrl's pure-torch
PendulumEnv, and multi-process collectors, each for two batches: once with a collector that
runs dry before the Trainer's total_frames and once with a Trainer that stops first. All cases
run in one process (one launch), and again on 2 gloo ranks (a second launch), each case under DDP
or FSDP in turn so that both strategies see every kind (tests/workers/env_matrix.py). Each case is bounded in
time inside the launch, so a hang fails fast and names its case; the launch itself must exit 0 with no process left behind.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
from multiproc import WORKERS, launch

pytest.importorskip("gymnasium")
sys.path.insert(0, WORKERS)

import env_matrix as em

LAUNCH_LIMIT = {1: 180, 2: 300}  # seconds for a whole launch; each case has em.CASE_LIMIT inside it


def _launch(tmp_path_factory, world: int):
    out = tmp_path_factory.mktemp(f"env_matrix_{world}")
    proc = launch(os.path.join(WORKERS, "env_matrix.py"), out, world, nproc=world,
                  timeout=LAUNCH_LIMIT[world])
    return proc, out


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    return _launch(tmp_path_factory, 1)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return _launch(tmp_path_factory, 2)


LAUNCHES = {1: "one_process", 2: "two_ranks"}
CASES = [(world, mode, case, env, end) for world, modes in em.MODES.items() for mode in modes
         for case, env, end in em.cases(mode)]


def results(request, world: int, mode: str, case: str) -> list[dict]:
    """Every rank's result of ``case``; fails with the launch's output if a rank has none."""
    proc, out = request.getfixturevalue(LAUNCHES[world])
    found = []
    for rank in range(world):
        path = out / f"{mode}-{case}-rank{rank}.pt"
        assert path.exists(), f"{mode} {case}: rank {rank} never finished (rc {proc.returncode}):\n{proc.stdout[-6000:]}"
        found.append(torch.load(path, weights_only=False))
    return found


@pytest.mark.parametrize("world", sorted(LAUNCHES))
def test_a_launch_of_every_environment_kind_exits_0_with_no_process_left(request, world):
    proc, _ = request.getfixturevalue(LAUNCHES[world])
    assert proc.returncode == 0, proc.stdout[-6000:]
    assert proc.leftovers == 0, f"{proc.leftovers} process(es) of the launch outlived it"


@pytest.mark.parametrize("world,mode,case,env,end", [c for c in CASES if c[4] is not None],
                         ids=[f"{c[1]}-{c[2]}" for c in CASES if c[4] is not None])
def test_trainer_trains_two_batches_and_ends_cleanly(request, world, mode, case, env, end):
    ranks = results(request, world, mode, case)
    for r in ranks:
        assert r["collected_frames"] == 2 * em.FRAMES * world, r["collected_frames"]
        assert r["num_updates"] == 2 * em.OPTIM_STEPS
        assert r["state_after_train"] == sorted(r["state_after_train"]) and "collector" in r["state_after_train"]
    for key, value in ranks[0]["params"].items():  # every rank trained the same weights
        assert all(torch.equal(value, other["params"][key]) for other in ranks[1:]), key


@pytest.mark.parametrize("world,mode,case,env,end", [c for c in CASES if c[4] is None],
                         ids=[f"{c[1]}-{c[2]}" for c in CASES if c[4] is None])
def test_resume_with_a_batched_env_continues_where_the_checkpoint_stopped(request, world, mode, case, env, end):
    stateless = em.ENVS[env][3]
    for r in results(request, world, mode, case):
        assert r["C_loaded"] == {"collected_frames": r["B"]["collected_frames"], "num_updates": r["B"]["num_updates"]}
        assert r["B"]["collected_frames"] == 2 * em.FRAMES * world
        assert r["C"]["collected_frames"] == r["A"]["collected_frames"] == 4 * em.FRAMES * world
        assert r["C"]["num_updates"] == r["A"]["num_updates"] == 4 * em.OPTIM_STEPS
        # the in-flight tensordict is saved only for stateless envs, with the in-process envs' generators
        assert r["saved_carrier"] is stateless
        assert r["saved_env_rng"] == (em.WORKERS if stateless else 0)
        if stateless:  # everything the run depends on was restored: the resumed run is the uninterrupted one
            for key, value in r["A"]["params"].items():
                assert torch.equal(value, r["C"]["params"][key]), key


# ---- what the trainer inspects of an env, in this process ------------------------------------


def test_inspecting_a_batched_env_neither_starts_it_nor_forwards_to_its_workers():
    from types import SimpleNamespace

    from torchrl.envs import ParallelEnv, PendulumEnv, SerialEnv

    from fabric_learner.checkpoint.trainer_state import EnvPlan as _EnvPlan

    for env in (ParallelEnv(2, PendulumEnv, mp_start_method="fork"), SerialEnv(2, em.gym)):
        assert env.is_closed
        plan = _EnvPlan(SimpleNamespace(env=env, _carrier=None))
        assert env.is_closed, f"inspecting a {type(env).__name__} started it"
        assert plan.stateless is isinstance(env, ParallelEnv)  # from the workers' metadata, not their attributes
        assert plan.holders == [env] and plan.generators() == []


def test_an_env_nested_without_end_fails_with_an_error_naming_it():
    from types import SimpleNamespace

    from torchrl.envs import EnvBase

    from fabric_learner.checkpoint.trainer_state import MAX_ENV_NODES as _MAX_ENV_NODES
    from fabric_learner.checkpoint.trainer_state import EnvPlan as _EnvPlan

    class Wrapper(EnvBase):
        def __init__(self, inner=None):
            super().__init__()
            if inner is not None:
                self.inner = inner

        _reset = _step = _set_seed = None

    env = Wrapper()
    for _ in range(_MAX_ENV_NODES):
        env = Wrapper(env)
    with pytest.raises(RuntimeError, match=f"more than {_MAX_ENV_NODES} nested environments.*Wrapper"):
        _EnvPlan(SimpleNamespace(env=env))
