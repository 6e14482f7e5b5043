"""How a TensorDict crosses between the controller and a learner rank: only its own elements, fast.

The hazard: Ray pickles a torch tensor through torch's own reducer, which writes the tensor's whole
storage with ``torch.save``: about 0.4 ms a tensor here, and for a view (a share cut from the
caller's batch) the whole batch's storage, once per share. Cloning each share first fixes the size
and doubles the copying. Instead, CPU tensors of a numpy dtype cross as numpy arrays (about 0.015 ms
each; numpy pickles just the elements a view shows):

- a plain TensorDict on the CPU (every nested one with the root's batch size; a replay buffer's
  sample) as a dict of arrays by key, which Ray carries without pickling them (out-of-band buffers);
- any other TensorDict (a lazy stack of chats, tensorclasses, non-tensor data) as bytes from a
  pickler that reduces such tensors to arrays, and any other tensor (bfloat16, a GPU's, one that
  requires grad) that is a view to a copy of just its elements, and a memory-mapped tensor's
  elements, never its file's name; everything else as Ray pickles it.

For a GRPO share of four chats that is 0.4 ms to pickle and 0.2 ms to read back, against 1.7 ms
and 1.0 ms cloned and pickled as Ray does. Nothing is shared with the sender's tensors: what the
rank reads is writable and its own.
"""

from __future__ import annotations

import functools
import io
import pickle
from typing import Any

import torch
from tensordict import MemoryMappedTensor, TensorDict, TensorDictBase

_ARRAYS = "fabric_learner.packed"
_PICKLED = "fabric_learner.pickled"
_CPU = torch.device("cpu")
_NUMPY_DTYPES = {torch.float32, torch.float64, torch.float16, torch.int64, torch.int32, torch.int16, torch.int8,
                 torch.uint8, torch.uint16, torch.uint32, torch.uint64, torch.bool}


def packed(td: Any) -> Any:
    """``td`` ready to cross to another process (see the module's docstring); anything else as it is."""
    if not isinstance(td, TensorDictBase):
        return td
    arrays = _arrays(td)
    if arrays is not None:
        return (_ARRAYS, arrays, tuple(td.batch_size), None if td.device is None else "cpu")
    return (_PICKLED, _dumps(td))


def unpacked(obj: Any) -> Any:
    """What :func:`packed` made, as the TensorDict it was (tensors of their own: Ray's arrays are read-only)."""
    arrays, pickled = arrays_of(obj), _pickled_of(obj)
    if arrays is not None:
        return TensorDict({key: torch.from_numpy(array.copy()) for key, array in arrays.items()},
                          batch_size=obj[2], device=obj[3])
    if pickled is not None:
        return pickle.loads(pickled)
    return obj


def arrays_of(obj: Any) -> dict | None:
    """The arrays by key of what :func:`packed` made of a plain TensorDict, else ``None``."""
    return obj[1] if isinstance(obj, tuple) and len(obj) == 4 and obj[0] == _ARRAYS else None


def _pickled_of(obj: Any) -> bytes | None:
    return obj[1] if isinstance(obj, tuple) and len(obj) == 2 and obj[0] == _PICKLED else None


def with_arrays(obj: tuple, arrays: dict) -> tuple:
    """What :func:`packed` made of a plain TensorDict, with other arrays (same keys, batch size, device)."""
    return (obj[0], arrays, *obj[2:])


def wire_bytes(obj: Any) -> int:
    """The size of what :func:`packed` made, as Ray will carry it (arrays' elements, or the pickled bytes)."""
    arrays, pickled = arrays_of(obj), _pickled_of(obj)
    if arrays is not None:
        return sum(a.nbytes for a in arrays.values())
    return 0 if pickled is None else len(pickled)


def _arrays(td: TensorDictBase) -> dict | None:
    """A plain CPU TensorDict's leaves as numpy arrays by key, or ``None`` when the arrays and the root's
    batch size and device would not rebuild it exactly (names, a lock, an empty or different nested one)."""
    if type(td) is not TensorDict or td.device not in (None, _CPU) or td.is_locked or _named(td):
        return None
    arrays = {}
    for key, value in td.items(include_nested=True):
        if isinstance(value, TensorDictBase):
            if (type(value) is not TensorDict or value.batch_size != td.batch_size or value.device != td.device
                    or value.is_empty() or _named(value)):
                return None
            continue
        if not _as_array(value):
            return None
        arrays[key] = value.detach().numpy()
    return arrays


def _named(td: TensorDict) -> bool:
    return td.batch_dims > 0 and any(name is not None for name in td.names)


def _as_array(value: Any) -> bool:
    """A CPU tensor numpy holds as it is (a memory-mapped one too: its elements cross, not its file)."""
    return (type(value) in (torch.Tensor, MemoryMappedTensor) and value.device.type == "cpu"
            and value.dtype in _NUMPY_DTYPES and value.layout is torch.strided and not value.is_nested
            and not value.requires_grad)


def _dumps(obj: Any) -> bytes:
    out = io.BytesIO()
    _pickler()(out, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return out.getvalue()


@functools.cache
def _pickler() -> type:
    """Ray's own pickler (functions and classes by value where it would), tensors as above."""
    from ray import cloudpickle

    class _Pickler(cloudpickle.Pickler):
        def reducer_override(self, value):
            if isinstance(value, torch.Tensor):
                if _as_array(value):
                    return torch.from_numpy, (value.numpy(),)
                if isinstance(value, MemoryMappedTensor):  # its own reducer would send the file's name
                    return _same, (value.as_subclass(torch.Tensor).clone(),)
                if type(value) is torch.Tensor and _is_view(value):
                    return _same, (value.detach().clone().requires_grad_(value.requires_grad),)
            return super().reducer_override(value)

    return _Pickler


def _is_view(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` shows less than its whole storage (torch's reducer would pickle all of it)."""
    return tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size()


def _same(value: Any) -> Any:
    return value
