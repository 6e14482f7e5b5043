"""What a Trainer checkpoint holds per rank besides the learner: counters, random states and
the environments' own state, and the checks that run on them before anything is restored.

What can be saved of an environment is decided once, when the Trainer is built
(:class:`EnvPlan`): a collector's environment tree is walked for torch generators and for
stateless environments whose in-flight observation (the carrier) can be restored exactly.
"""

from __future__ import annotations

import inspect
import random
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase
from torchrl.envs import EnvBase

from fabric_learner.step import rng as _rng

#: The format of a Trainer checkpoint's rank states and of its folder's meta.json.
CHECKPOINT_FORMAT = "fabric_learner.trainer/1"
COUNTERS = ("collected_frames", "_last_save", "_optim_count")


def is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_rng_state(rng: Any, refuse) -> None:
    """The random states ``rng_state`` writes: torch, numpy's MT19937, python's, env generators."""
    torch_size = torch.get_rng_state().numel()

    def generator_state(t: Any, size: int | None = None) -> bool:
        return isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.dim() == 1 and size in (None, t.numel())

    n = rng.get("numpy") if isinstance(rng, dict) else None
    python = rng.get("python") if isinstance(rng, dict) else None
    ok = (isinstance(rng, dict) and generator_state(rng.get("torch"), torch_size)
          and isinstance(n, dict) and n.get("kind") == "MT19937" and isinstance(n.get("keys"), torch.Tensor)
          and n["keys"].dtype == torch.int64 and n["keys"].shape == (624,) and is_count(n.get("pos"))
          and is_count(n.get("has_gauss")) and isinstance(n.get("cached_gaussian"), float)
          and isinstance(python, (tuple, list)) and len(python) == 3 and python[0] == 3
          and isinstance(python[1], (tuple, list)) and len(python[1]) == 625 and all(is_count(x) for x in python[1])
          and (python[2] is None or isinstance(python[2], float))
          and isinstance(rng.get("env", []), list) and all(generator_state(g) for g in rng.get("env", []))
          and all(generator_state(g) for g in rng.get("cuda", [])))
    if not ok:
        raise refuse("'rng' is not the random states of torch, numpy, python and the environments")


def rng_state() -> dict[str, Any]:
    """The process's torch, numpy and python random states (CUDA: every device's)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "torch": _rng.local_state()["torch"],
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any], env_plan: EnvPlan) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"]))
    random.setstate(tuplify(state["python"]))
    gens = env_plan.generators()
    if len(gens) == len(state.get("env", [])):
        for g, s in zip(gens, state["env"]):
            g.set_state(s)
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def tuplify(x):
    return tuple(tuplify(v) for v in x) if isinstance(x, (list, tuple)) else x




# ---- what a checkpoint holds of the collector's environment ------------------------------------

MAX_ENV_NODES = 256  # envs reachable from one collector's env (wrappers, sub-envs) before we give up


class EnvPlan:
    """What a checkpoint saves of one collector's environment, decided once while the env is alive.

    The walk reads only instance dictionaries (``vars``) and class attributes: a batched env's
    ``__getattr__`` forwards unknown names to its workers (and restarts a closed ``ParallelEnv``),
    and a ``TransformedEnv`` forwards them to its base env, so ``hasattr``/``getattr`` on them can
    recurse, raise or loop. What the walk finds:

    - ``holders``: the envs living in this process (wrappers, base envs, ``SerialEnv`` sub-envs),
      whose ``torch.Generator`` attributes (e.g. ``PendulumEnv.rng``) are saved and restored;
      envs in worker processes (``ParallelEnv``, multi-process collectors) are out of reach.
    - ``stateless``: every env's whole state travels in the tensordict (torchrl's
      ``_supports_set_state``), so the collector's in-flight tensordict is saved and a resume
      continues the episodes under way; for any other env it would desync env and data, so a
      resume starts from the fresh collector's own reset.
    """

    def __init__(self, collector) -> None:
        self.holders: list[EnvBase] = []
        self.stateless = False
        env = vars(collector).get("env") if collector is not None else None
        if isinstance(env, EnvBase):
            seen: dict[int, EnvBase] = {}
            self.stateless = _walk_env(env, seen)
            self.holders = list(seen.values())

    def generators(self) -> list[torch.Generator]:
        found: list[torch.Generator] = []
        for env in self.holders:
            found.extend(v for v in vars(env).values() if isinstance(v, torch.Generator) and all(v is not f for f in found))
        return found


def _walk_env(env: EnvBase, seen: dict[int, EnvBase]) -> bool:
    """Record ``env`` and the envs inside it in ``seen``; whether they are all stateless.

    Stops with an error naming the env if the nesting looks unbounded (a cycle is skipped).
    """
    if id(env) in seen:
        return True
    if len(seen) >= MAX_ENV_NODES:
        raise RuntimeError(
            f"Trainer: the collector's environment holds more than {MAX_ENV_NODES} nested environments (reached "
            f"{type(env).__name__}); checkpointing cannot inspect it. Build the collector around a flatter "
            "environment, or pass collector=None and drive the trainer with optim_steps()."
        )
    seen[id(env)] = env
    own = vars(env)
    children = [m for m in (own.get("_modules") or {}).values() if isinstance(m, EnvBase)]  # TransformedEnv.base_env
    sub_envs = own.get("_envs")  # SerialEnv's in-process workers, once started
    if isinstance(sub_envs, (list, tuple)):
        children.extend(e for e in sub_envs if isinstance(e, EnvBase))
    meta = own.get("meta_data")  # a batched env: its workers' metadata, collected when it was built
    if meta is not None:
        metas = meta if isinstance(meta, (list, tuple)) else [meta]
        stateless = all(bool(getattr(m, "supports_set_state", False)) for m in metas)
    elif children:
        stateless = True  # a wrapper: stateless when everything it wraps is
    else:
        flag = inspect.getattr_static(type(env), "_supports_set_state", False)
        stateless = flag is True
    for child in children:
        stateless = _walk_env(child, seen) and stateless
    return stateless


def carrier_state(collector, plan: EnvPlan) -> dict[str, Any] | None:
    """The collector's in-flight tensordict, for stateless envs only (elsewhere it would desync)."""
    if not plan.stateless:
        return None
    carrier = vars(collector).get("_carrier")
    if not isinstance(carrier, TensorDictBase):
        return None
    leaves = dict(carrier.items(include_nested=True, leaves_only=True))
    if not all(isinstance(v, torch.Tensor) for v in leaves.values()):
        return None
    return {"data": carrier.to_dict(), "batch_size": list(carrier.batch_size)}


def restore_carrier(collector, state: dict[str, Any] | None) -> None:
    if state is None or not isinstance(vars(collector).get("_carrier"), TensorDictBase):
        return
    current = collector._carrier
    collector._carrier = TensorDict(state["data"], batch_size=state["batch_size"], device=current.device)


def check_rank_state(state: Any, modules: dict[str, Any], world_size: int, source: str = "the trainer state",
                 resizing: bool = False) -> None:
    """Raise, before anything is loaded, if a rank's saved ``state`` cannot be restored into a trainer with
    these registered hook ``modules`` and ``world_size`` ranks.

    ``resizing``: the state comes from a run with another number of ranks (see ``checkpoint.resize``).
    """
    def refuse(what: str) -> ValueError:
        return ValueError(f"{source}: {what}; nothing was loaded. Pass a checkpoint folder written by "
                          "fabric_learner's Trainer.save_checkpoint.")

    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        found = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise refuse(f"format is {found!r}, expected {CHECKPOINT_FORMAT!r}")
    if not is_count(state.get("world_size")) or state["world_size"] < 1:
        raise refuse(f"'world_size' is {state.get('world_size')!r}, expected a positive integer")
    if state["world_size"] != world_size and not resizing:
        raise ValueError(
            f"This rank's state was saved by {state['world_size']} rank(s) and this run has {world_size}; "
            "load the whole checkpoint folder with Trainer.load_from_file, which redistributes it."
        )
    counters = state.get("state")
    if not isinstance(counters, dict) or not all(is_count(counters.get(k)) for k in COUNTERS) \
            or not isinstance(counters.get("_last_log"), dict) \
            or not all(isinstance(v, (int, float)) for v in counters["_last_log"].values()):
        raise refuse(f"'state' is not the trainer's counters ({', '.join(COUNTERS)}, _last_log)")
    saved_modules = state.get("modules")
    if not isinstance(saved_modules, dict):
        raise refuse("'modules' is not a mapping of hook names to their states")
    missing = [name for name in modules if name not in saved_modules]
    if missing:
        raise ValueError(f"The checkpoint has no state for the registered hooks {missing}; register the same "
                         "hooks as the run that saved it.")
    for name, module in modules.items():
        saved = saved_modules[name]
        expected = set(module.state_dict())
        # a hook whose state grew may still read what an earlier release wrote
        earlier = [set(keys) for keys in getattr(module, "earlier_state_keys", ())]
        if not isinstance(saved, dict) or (set(saved) != expected and set(saved) not in earlier):
            found = sorted(saved) if isinstance(saved, dict) else type(saved).__name__
            raise refuse(f"the state of hook {name!r} has entries {found}, expected {sorted(expected)}")
    if state.get("collector") is not None and not isinstance(state["collector"], dict):
        raise refuse("'collector' is not a collector state dict")
    carrier = state.get("carrier")
    if carrier is not None and not (isinstance(carrier, dict) and isinstance(carrier.get("data"), dict)
                                    and isinstance(carrier.get("batch_size"), list)
                                    and all(is_count(d) for d in carrier["batch_size"])):
        raise refuse("'carrier' is not a collector's in-flight tensordict")
    check_rng_state(state.get("rng"), refuse)
