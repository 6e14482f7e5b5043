"""The loss forward's error on a batch it cannot read, replaced by one naming the batch's problem.

A missing key (the loss's ``in_keys`` the batch lacks) or a floating entry of another dtype than the
loss's parameters; any other error (running out of memory included) passes as it is. Consulted only after
the forward failed, so a batch that works costs nothing here.
"""

from __future__ import annotations

import torch
from tensordict import TensorDictBase
from torch import nn


def input_error(err: Exception, batch: TensorDictBase, loss_module: nn.Module) -> Exception:
    """The loss forward's error, replaced by one naming the batch's problem when there is one.

    Running out of memory is never the batch's keys or dtypes: that error passes as it is.
    """
    if isinstance(err, torch.OutOfMemoryError) or "can't allocate memory" in str(err):
        return err
    if isinstance(err, RuntimeError) and not isinstance(err, NotImplementedError):
        typed = _dtype_error(err, batch, loss_module)
        if typed is not err:
            return typed
    return _missing_keys_error(err, batch, loss_module)


def _dtype_error(err: RuntimeError, batch: TensorDictBase, loss_module: nn.Module) -> Exception:
    """A ``TypeError`` naming the batch's floating entries whose dtype differs from the loss's."""
    if "dtype" not in str(err) and "scalar type" not in str(err):
        return err
    dtypes = {p.dtype for p in loss_module.parameters() if p.is_floating_point()}
    if len(dtypes) != 1:
        return err
    want = dtypes.pop()
    odd = {key: str(t.dtype).replace("torch.", "") for key, t in batch.items(include_nested=True, leaves_only=True)
           if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != want}
    if not odd:
        return err
    return TypeError(
        f"The batch's floating entries {odd} differ from the loss's parameter dtype "
        f"{str(want).replace('torch.', '')}, and the loss failed on the mismatch ({err}). Cast them "
        "(e.g. batch.float()) or train at a matching precision (FabricLearner(precision='64-true'))."
    )


def _missing_keys_error(err: Exception, batch: TensorDictBase, loss_module: nn.Module) -> Exception:
    """A ``KeyError`` naming the keys of ``loss_module.in_keys`` the batch lacks, else ``err``.

    Applies to the loss's ``KeyError``, to the ``AttributeError``/``TypeError`` on ``None`` that
    a loss reading a missing key with ``td.get(key)`` (``None`` by default) runs into, and to a
    ``RuntimeError`` (e.g. stacking tensordicts with different keys). ``in_keys``
    over-approximate what a loss reads (PPO lists ``("next", "reward")`` even when
    ``"advantage"`` is given), so they are consulted only after the forward failed.
    """
    if isinstance(err, (AttributeError, TypeError)) and "NoneType" not in str(err):
        return err
    in_keys = getattr(loss_module, "in_keys", None)
    try:
        present = set(batch.keys(include_nested=True, leaves_only=False))
        missing = [k for k in (in_keys or ()) if (k if isinstance(k, str) or len(k) > 1 else k[0]) not in present]
    except Exception:  # noqa: BLE001 - unusual in_keys: keep the loss's own error
        return err
    if not missing:
        return err
    said = (err.args[0] if isinstance(err, KeyError) and len(err.args) == 1 else str(err)).strip().splitlines()
    said = (said[0][:200] + ("..." if len(said[0]) > 200 or len(said) > 1 else "")) if said else ""
    return KeyError(  # the loss's own error is quoted (it travels without its chain, e.g. from a RemoteLearner rank)
        f"The loss failed on this batch ({type(err).__name__}: {said}), which lacks these keys from "
        f"loss_module.in_keys: {missing}; add them to the batch (nested keys as tuples, e.g. "
        "('next', 'reward')). Some in_keys are only read in some configurations, so not all of them may be needed."
    )
