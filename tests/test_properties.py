"""Property-based: whatever batch ``LocalLearner.update`` gets, it learns or refuses cleanly.

Over batch sizes, observation dtypes, extra keys and missing keys, an update either returns a
finite result with the loss entries and ``"grad_norm"``, or raises a clear error and leaves
parameters, optimizer state and the accumulation window exactly as they were.
"""

from __future__ import annotations

import pytest
import torch
from rl_cases import flat_params, make_batch, make_loss

from fabric_learner import LocalLearner

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

CLEAR_ERRORS = (ValueError, KeyError, TypeError, FloatingPointError)
LOSS_KEYS = {"dqn": {"loss"}, "ppo": {"loss_objective", "loss_critic", "loss_entropy"}}
LEAVES = {case: sorted(map(str, (k if isinstance(k, str) else "/".join(k) for k in
                                 make_batch(case).keys(True, True)))) for case in LOSS_KEYS}

extra_names = st.text(alphabet="abcdefghij_", min_size=1, max_size=6).filter(lambda s: not s.startswith("loss"))


@st.composite
def batches(draw):
    case = draw(st.sampled_from(sorted(LOSS_KEYS)))
    n = draw(st.integers(1, 32))
    batch = make_batch(case, n=n, seed=draw(st.integers(0, 1000)))
    dtype = draw(st.sampled_from([torch.float32, torch.float64, torch.float16]))
    batch["observation"] = batch["observation"].to(dtype)
    for name, width in draw(st.dictionaries(extra_names, st.integers(0, 3), max_size=3)).items():
        key = name if name not in batch.keys() else ("extra", name)
        batch.set(key, torch.randn(n, width) if width else torch.randint(5, (n,)))
    dropped = draw(st.lists(st.sampled_from(LEAVES[case]), max_size=2, unique=True))
    if dropped:
        batch = batch.exclude(*[tuple(k.split("/")) if "/" in k else k for k in dropped])
    accum = draw(st.sampled_from([1, 2]))
    return case, batch, dtype, dropped, accum


def state_of(learner):
    return flat_params(learner.loss_module), repr(learner.optimizer.state_dict()), learner._accum_step, \
        learner.num_updates


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches())
def test_update_learns_or_refuses_cleanly(drawn):
    case, batch, dtype, dropped, accum = drawn
    loss, _ = make_loss(case)
    learner = LocalLearner(loss, clip_grad_norm=1.0, grad_accum_steps=accum)
    if accum == 2:  # start mid-window, so an error must keep the first micro-batch's place
        learner.update(make_batch(case, n=4, seed=3))
    params, optim, accum_step, num_updates = state_of(learner)
    try:
        out = learner.update(batch)
    except CLEAR_ERRORS as err:
        assert str(err), "an error must say what went wrong"
        after = state_of(learner)
        for k, v in params.items():
            assert torch.equal(after[0][k], v), k
        assert after[1:] == (optim, accum_step, num_updates)
        assert dtype != torch.float32 or dropped, f"a well-formed batch was refused: {err!r}"
        return
    assert LOSS_KEYS[case] <= set(out.keys())
    assert "grad_norm" in out.keys() and torch.isfinite(out["grad_norm"])
    for key in LOSS_KEYS[case]:
        assert torch.isfinite(out[key]).all(), key
    assert learner.num_updates == num_updates + 1 and learner._accum_step == 0
