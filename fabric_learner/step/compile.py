"""``compile=True``: the loss forward through ``torch.compile``, eagerly wherever it does not compile.

Compiled is ``loss_module(batch)``: its forward graph and, through AOTAutograd, its backward. The
rest of the step is unchanged (loss sum, clipping, the non-finite check, accumulation), and the
default optimizer becomes fused Adam. Guarantees, for ``CompiledLoss``:

- the output equals eager's up to float rounding, random draws included: inductor samples with
  eager's generator (``fallback_random``), so SAC's actions or a TanhNormal entropy estimate see
  the same numbers under the same seed;
- nothing is registered on the loss or the learner, so ``state_dict`` keys do not change (no
  ``_orig_mod.`` prefix);
- where the compiled call fails and the eager one succeeds, one warning naming the loss class and
  the error, then eager for good.
"""

from __future__ import annotations

import types
import warnings
import weakref
from collections.abc import Iterable
from typing import Callable

import torch
from tensordict import TensorDictBase
from torch import nn

_OPTIONS = {"fallback_random": True}  # random ops draw from eager's generator
_BY_CLASS: weakref.WeakKeyDictionary[type, Callable] = weakref.WeakKeyDictionary()


def _loss_forward(loss_module: nn.Module, batch: TensorDictBase) -> TensorDictBase:
    return loss_module(batch)


def _compiled_forward(cls: type) -> Callable:
    """The compiled ``_loss_forward`` for losses of class ``cls``, built once per class.

    Dynamo caches graphs per code object, guarded on the module's structure rather than its
    identity. A code object per class lets losses of one class and shape share a graph (local and
    Fabric learners alike) while each class keeps torch's recompile limit (8) to itself.
    """
    fn = _BY_CLASS.get(cls)
    if fn is None:
        name = f"{cls.__name__}_forward"
        code = _loss_forward.__code__.replace(co_name=name, co_qualname=name)
        fn = torch.compile(types.FunctionType(code, _loss_forward.__globals__, name), options=_OPTIONS)
        _BY_CLASS[cls] = fn
    return fn


class CompiledLoss:
    """Calls ``loss_module(batch)`` compiled; a drop-in for calling the loss itself.

    The first call runs eagerly: torchrl losses set lazy state on it (in_keys, spec shapes,
    buffers), which would force a second compilation at once. When a compiled call raises, the
    loss runs eagerly on the same batch: if that fails too, its error is raised (the batch is at
    fault, and compiling goes on); if it succeeds, a warning names the loss class and the compile
    error, ``fallback`` holds the reason and every later call is eager. That one call draws its
    random numbers anew.
    """

    def __init__(self, loss_module: nn.Module) -> None:
        self.loss_module = loss_module
        self.fallback: str | None = None
        self._warm = False

    def __call__(self, batch: TensorDictBase) -> TensorDictBase:
        if self.fallback is not None or not self._warm:
            self._warm = True
            return self.loss_module(batch)
        try:
            return _compiled_forward(type(self.loss_module))(self.loss_module, batch)
        except Exception as err:  # noqa: BLE001 - whatever failed, the eager call below decides
            failure = err
        output = self.loss_module(batch)  # outside the handler: a bad batch's error stays unchained
        self.fallback = f"{type(failure).__name__}: {_first_lines(str(failure))}"
        warnings.warn(
            f"compile=True: {type(self.loss_module).__name__} did not compile ({self.fallback}). This learner "
            "runs the loss eagerly from now on: same results, no speed-up.",
            RuntimeWarning,
            stacklevel=2,
        )
        return output


def _first_lines(text: str, limit: int = 400) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    joined = " ".join(lines[:2])
    return joined if len(joined) <= limit else joined[: limit - 3] + "..."


def fused_adam(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """Adam (default hyper-parameters) with the fused kernel where every parameter allows it.

    Fused needs floating parameters on CPU or CUDA; otherwise plain ``Adam``. A state dict loaded
    into it keeps it fused, whichever optimizer saved it (the flag and ``step`` are restored).
    """
    params = list(params)
    if not params or not all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params):
        return torch.optim.Adam(params)
    optimizer = torch.optim.Adam(params, fused=True)
    optimizer.register_load_state_dict_post_hook(_keep_fused)
    return optimizer


def _keep_fused(optimizer: torch.optim.Optimizer) -> None:
    for group in optimizer.param_groups:
        group["fused"], group["foreach"] = True, None  # the two are exclusive
        for p in group["params"]:
            step = optimizer.state.get(p, {}).get("step")
            if isinstance(step, torch.Tensor):
                optimizer.state[p]["step"] = step.to(device=p.device, dtype=torch.float32)
