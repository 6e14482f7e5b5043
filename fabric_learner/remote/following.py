"""The controller's copy of a ``RemoteLearner``'s loss follows the group's weights, with no line of the user's.

``LocalLearner`` trains the loss object the script holds, so a collector running the loss's actor,
a GAE reading its critic, or a target updater reading its networks always sees the trained weights.
A ``RemoteLearner`` trains copies on its ranks; :class:`Follower` makes the loss here behave as
the trained one where this process uses it:

- **pulled on first use**: a forward pre-hook on every module of the loss (and ``policy=``) checks
  whether the entries that module holds are at the group's current version; if not, it fetches
  them from rank 0 (gathered under FSDP) and copies them in place, together with whatever else this
  process fetched between the two previous updates (a collector's actor then GAE's critic: one call
  per iteration, not two). A module this process never runs costs nothing; one run twice between
  updates is fetched once.
- **pulled after each update while a target updater is built on the loss** (torchrl's
  ``SoftUpdate`` / ``HardUpdate`` read the networks' tensors directly, without a forward).
- **pushed before the next call**: buffers of the loss this process wrote in place (a target
  network moved by ``SoftUpdate``, an updater's initial copy) reach every rank before the next
  update, as they would be in the one trained loss. Parameters are the ranks' to train: writes to
  them here (publishing ``get_weights()`` back into the same module) are not sent.

A copy of a followed module taken after the learner was built (``copy.deepcopy``) keeps the hook
but holds none of the loss's tensors: running it warns once, naming the fix. A copy taken before
cannot be seen. ``RemoteLearner(follow=False)`` turns all of this off, for programs that publish
weights themselves.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from typing import Any

import numpy
import torch
from torch import nn

from fabric_learner.checkpoint.frozen import frozen_keys


class Follower:
    """Keeps ``loss`` (and ``policy``) in this process at the weights of ``learner``'s group, lazily.

    ``version`` is the group's weights version, bumped by the learner (:meth:`moved`) after every
    update, load and rebuild; each entry of the loss's state remembers the version it holds.
    """

    def __init__(self, learner: Any, loss: nn.Module, policy: nn.Module | None) -> None:
        self._learner = weakref.ref(learner)
        self.loss = loss
        frozen = frozen_keys(loss)  # never trained: the copy here is the ranks' own
        state = loss.state_dict(keep_vars=True)
        self.entries: dict[str, torch.Tensor] = {k: v for k, v in state.items()
                                                 if isinstance(v, torch.Tensor) and k not in frozen}
        self.version = 0
        self.held = dict.fromkeys(self.entries, 0)
        # the buffers' values as last fetched or sent: what this process wrote since shows against them
        # (torchrl's updaters write through .data, which no version counter sees)
        self._sent = {k: v.detach().clone() for k, v in self.entries.items() if not isinstance(v, nn.Parameter)}
        self.pulled_bytes = 0  # bytes fetched so far, and in how many calls
        self.pulls = 0
        # the entries fetched since the last update, and before it: what this process runs between two updates
        # (a collector's actor, then GAE's critic) is fetched at once, in one call, at its first use
        self._used: set[str] = set()
        self._used_before: set[str] = set()
        self._written_behind: list[str] | None = None  # buffers written during a pipelined update: judged then
        names_at: dict[tuple, list[str]] = {}
        for name, tensor in self.entries.items():
            names_at.setdefault(_place(tensor), []).append(name)
        self._names: dict[int, tuple[str, ...]] = {}  # id(module) -> the entries it runs on
        self._whole: set[int] = set()  # modules every tensor of which is an entry (their weights all follow)
        self._seen: dict[int, int] = {}  # id(module) -> the version it was last checked at
        self._warned: set[int] = set()
        self._handles = []
        self._has_targets = any(n.startswith("target_") for n, _ in loss.named_children())
        hook = _Hook(self)
        for module in _modules_of(loss, policy):
            tensors = list(_tensors(module))
            names = sorted({n for t in tensors for n in names_at.get(_place(t), ())})
            self._names[id(module)] = tuple(names)
            if names and all(_place(t) in names_at for t in tensors):
                self._whole.add(id(module))
            self._handles.append(module.register_forward_pre_hook(hook))

    # ---- what the learner tells ---------------------------------------------------------------

    def moved(self, *, while_running: bool = False) -> None:
        """The group's weights changed (an update, a load, a rebuild): every entry here is now behind.

        ``while_running``: this process ran code while the update was in flight (``wait=False``); buffers
        it wrote meanwhile are judged by the weights it held then, not by this update's.
        """
        if while_running and self._written_behind is None and self.written():
            self._written_behind = self._behind()
        self.version += 1
        if self._used:
            self._used_before, self._used = self._used, set()

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # ---- pulling --------------------------------------------------------------------------------

    def follows(self, module: nn.Module, *, whole: bool = False) -> bool:
        """Whether ``module`` runs on the loss's own tensors here (kept current); ``whole``: all of its tensors."""
        return id(module) in self._whole if whole else bool(self._names.get(id(module)))

    def names(self, module: nn.Module) -> tuple[str, ...]:
        return self._names.get(id(module), ())

    @contextlib.contextmanager
    def whole(self):
        """``RemoteLearner.full_parameters()``: every entry current inside; what the block wrote in place
        (parameters too) goes to every rank on leaving."""
        self.pull(remember=False)
        before = {n: t.detach().clone() for n, t in self.entries.items() if n not in self._sent}
        yield
        names = self.written() + [n for n, v in before.items() if not torch.equal(self.entries[n], v)]
        if names:
            self._send(names)

    def stale(self, names=None) -> list[str]:
        return [n for n in (self.entries if names is None else names) if self.held[n] != self.version]

    def pull(self, names=None, *, remember: bool = True) -> int:
        """Fetch the named entries (default: all) that are behind the group; returns the bytes fetched.

        ``remember``: count them in what this process uses between updates (not for a whole-loss fetch)."""
        learner = self._learner()
        learner._drain()  # updates in flight change the weights: wait for them, as one process would have
        self.push()  # what this process wrote goes first: a pull must not overwrite it
        stale = self.stale(names)
        if not stale:
            return 0
        got = learner._call("loss_entries", stale, what="fetching the group's weights for a module run here",
                            ranks=None if learner._sharded else [0])[0]
        fetched = 0
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # Ray's arrays are read-only: only read here, by copy_
            for name in stale:
                value = got[name]
                value = torch.from_numpy(value) if isinstance(value, numpy.ndarray) else value
                target = self.entries[name]
                target.data.copy_(value)
                fetched += value.numel() * value.element_size()
                if name in self._sent:
                    self._sent[name].copy_(value)
                self.held[name] = self.version
        if remember:
            self._used.update(stale)
        self.pulled_bytes += fetched
        self.pulls += 1
        return fetched

    def before_forward(self, module: nn.Module) -> None:
        key = id(module)
        if self._seen.get(key) == self.version:
            return
        names = self._names.get(key)
        if names is None:  # a deepcopy of a followed module: it kept the hook, not the tensors
            if key not in self._warned:
                self._warned.add(key)
                warnings.warn(
                    f"A {type(module).__name__} copied from the RemoteLearner's loss (or policy) runs in this process, "
                    "but only the loss's own modules follow the group's weights: this copy keeps the weights it had "
                    "when it was copied. Run the loss's own module, or load learner.get_weights() into the copy "
                    "after each update (and build the learner with follow=False to fetch nothing by itself).",
                    RuntimeWarning, stacklevel=3)
            return
        if self.stale(names):
            self.pull(self._used_before.union(names))
        self._seen[key] = self.version

    def after_update(self) -> None:
        """After the learner collected its updates: while a target updater is built on the loss, the whole
        loss follows at once (the updater reads the networks' tensors without running them)."""
        if self._has_targets and any(getattr(self.loss, "_has_update_associated", {}).values()):
            self.pull(remember=False)

    # ---- pushing --------------------------------------------------------------------------------

    def written(self) -> list[str]:
        """The buffers this process changed since they were last fetched or sent."""
        return [n for n, v in self._sent.items() if not torch.equal(self.entries[n], v)]

    def push(self) -> None:
        """Send the buffers written here to every rank (before the group's next call reads them).

        Raises:
            RuntimeError: they were written while the trained parameters here were behind the group
                (a target updater built, or stepped, on weights of an earlier update): nothing is sent,
                and the next use here fetches the group's values back.
        """
        names = self.written()
        behind, self._written_behind = (self._behind() if self._written_behind is None else self._written_behind), None
        if not names:
            return
        if behind:
            self._forget(names)
            raise RuntimeError(
                f"This process wrote the loss's entries {names[:4]} while its parameters ({behind[:2]}...) still held "
                "the weights of an earlier update: torchrl's target updaters (SoftUpdate, HardUpdate) read the "
                "networks' tensors directly, so what was written came from old weights. Nothing was sent, and the "
                "group's values come back here at the next use. Build the target updater before the first update, or "
                "inside `with learner.full_parameters():`; from then on the loss here follows the group after every "
                "update.")
        self._send(names)

    def _behind(self) -> list[str]:
        """The trained parameters here that do not hold the group's current weights."""
        return [n for n, t in self.entries.items() if isinstance(t, nn.Parameter) and self.held[n] != self.version]

    def _forget(self, names: list[str]) -> None:
        """What this process wrote to ``names`` is dropped: the next use fetches the group's values."""
        for n in names:
            self.held[n] = -1
            if n in self._sent:
                self._sent[n].copy_(self.entries[n].detach())
        self._seen.clear()

    def _send(self, names: list[str]) -> None:
        entries = {n: self.entries[n].detach().clone() for n in names}
        for n in names:
            if n in self._sent:
                self._sent[n].copy_(entries[n])
        try:
            self._learner()._call("load_loss_entries", entries, what="sending the loss's entries written here")
        except BaseException:
            self._forget(names)  # refused (or lost): the ranks kept theirs, which the next use here fetches back
            raise


class _Hook:
    """The forward pre-hook: the follower by weak reference. A deepcopy keeps it (so a copy is seen); a pickle
    (a collector sent to another process) carries a hook that does nothing."""

    def __init__(self, follower: Follower) -> None:
        self._follower = weakref.ref(follower)

    def __call__(self, module: nn.Module, args: Any) -> None:
        follower = self._follower()
        if follower is not None:
            follower.before_forward(module)

    def __deepcopy__(self, memo) -> _Hook:
        return self

    def __reduce__(self):
        return _inert, ()


def _inert() -> Any:
    return _Inert()


class _Inert:
    def __call__(self, module: nn.Module, args: Any) -> None:
        return None


def _place(tensor: torch.Tensor) -> tuple:
    return tensor.data_ptr(), tensor.numel(), tensor.dtype


def _tensors(module: nn.Module):
    yield from module.parameters()
    yield from module.buffers()


def _modules_of(loss: nn.Module, policy: nn.Module | None):
    """Every module of the loss this process might run: its submodules, the networks torchrl keeps outside
    its registered children (``actor_network``, ``critic_network``, ``value_network``...), and the policy."""
    seen: dict[int, nn.Module] = {}
    roots = [loss, *(v for v in vars(loss).values() if isinstance(v, nn.Module)), *([policy] if policy else [])]
    for root in roots:
        for module in root.modules():
            seen.setdefault(id(module), module)
    with contextlib.suppress(AttributeError):
        estimator = loss.__dict__.get("_value_estimator")
        if isinstance(estimator, nn.Module):
            for module in estimator.modules():
                seen.setdefault(id(module), module)
    return list(seen.values())
