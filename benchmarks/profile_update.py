"""Where the learner's time goes, beyond the loss itself (one process, one thread).

    python benchmarks/profile_update.py                 # all three parts, all workloads
    python benchmarks/profile_update.py --part overhead --workloads ppo

Parts:
- ``overhead``: each contender of case a with the loss's forward replaced by a near-free one
  (``NullLoss``: same parameters, same output keys, a gradient on every parameter). What is left
  is the per-update cost of the loop itself (backward of a tiny graph, clip, Adam step) plus what
  the learner adds, measured interleaved over many repetitions, so differences of a few
  microseconds resolve even on a busy machine. Reported in us/update and as a share of the real
  workload's update time.
- ``pieces``: each operation the learner adds to the hand-written loop, timed on its own
  (us per call), with the real loss output and batch.
- ``counts``: exact, noise-free: Python function calls (cProfile's count) and aten operations
  (a ``TorchDispatchMode`` counter) per update, the hand torchrl loop against each learner, with
  the operations the learner adds by name. Where a shared machine's timings cannot resolve a few
  tens of microseconds, these counts still tell what the learner does beyond the hand loop.
- ``cprofile``: cProfile of ``update`` with the real loss, restricted to fabric_learner and
  lightning frames (per-call us; cProfile inflates every Python call, so read these relative
  to each other, not as absolute costs), and of save/load (case d).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import tempfile
import timeit
import warnings

os.environ["OMP_NUM_THREADS"] = "1"
os.environ.setdefault("RL_WARNINGS", "False")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common
import harness
import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn

from fabric_learner import FabricLearner, LocalLearner


class NullLoss(nn.Module):
    """The real loss's parameters and output keys, with a near-free forward.

    Every loss entry is ``c + 0 * sum(p.sum())`` over all parameters, so backward reaches every
    parameter (clip and Adam then do their full work) while the forward costs almost nothing.
    """

    def __init__(self, real: nn.Module, template: TensorDictBase):
        super().__init__()
        self.real = real
        self.template = template.detach().clone()
        self.params = [p for p in real.parameters() if p.requires_grad]

    def forward(self, td):
        zero = torch.stack([p.sum() for p in self.params]).sum() * 0.0
        out = self.template.clone(recurse=False)
        for k in out.keys():
            if isinstance(k, str) and k.startswith("loss"):
                out.set(k, out.get(k) + zero)
        return out


def real_output(name: str) -> tuple[nn.Module, TensorDictBase, TensorDict]:
    loss = common.make_loss(name)[0]
    batch = common.make_batch(name)
    return loss, loss(batch), batch


def null_contenders(name: str):
    batches = common.make_batches(name)
    k = len(batches)

    def null_loss():
        real, out, _ = real_output(name)
        return NullLoss(real, out)

    hand = common.HandTorchrl(null_loss())
    hand_fabric = common.HandFabric(null_loss())
    local = LocalLearner(null_loss(), clip_grad_norm=common.CLIP)
    fabric = FabricLearner(null_loss(), clip_grad_norm=common.CLIP, accelerator="cpu", devices=1)
    return {
        "hand torchrl loop": lambda i: hand.update(batches[i % k]),
        "hand Fabric loop": lambda i: hand_fabric.update(batches[i % k]),
        "LocalLearner.update": lambda i: local.update(batches[i % k]),
        "FabricLearner(cpu,1).update": lambda i: fabric.update(batches[i % k]),
    }


def part_overhead(workloads, reps: int, inner: int) -> dict:
    print("== overhead: near-free loss forward; us/update, median over", reps, "interleaved repetitions of",
          inner, "updates;\n   cpu = process CPU time, wall = perf_counter; "
          "min = least disturbed block (the intrinsic cost on a shared machine)")
    results = {}
    for name in workloads:
        cpu: dict[str, list[float]] = {}
        wall = harness.interleaved(null_contenders(name), reps=reps, inner=inner, warmup=20, cpu=cpu)
        print(f"-- {name}: {common.WORKLOAD_DESC[name]}")
        for clock, s in (("cpu", cpu), ("wall", wall)):
            for stat, agg in (("min", min), ("median", harness.median)):
                base = agg(s["hand torchrl loop"]) * 1e6
                base_f = agg(s["hand Fabric loop"]) * 1e6
                for c, xs in s.items():
                    m = agg(xs) * 1e6
                    print(f"   {clock:4s} {stat:6s} {c:28s} {m:8.0f} us   vs hand torchrl {m - base:+6.0f} us"
                          + (f"   vs hand Fabric {m - base_f:+6.0f} us" if c.startswith("Fabric") else ""))
        results[name] = {"cpu_us": {c: [x * 1e6 for x in xs] for c, xs in cpu.items()},
                         "wall_us": {c: [x * 1e6 for x in xs] for c, xs in wall.items()}}
    return results


STAGES = ("batch checks", "forward", "sum losses", "backward", "detach output", "clip", "set grad_norm",
          "non-finite check", "optimizer step", "zero_grad", "rest + wrappers")


def _stage_steps(name: str):
    """Per contender, ``run(td) -> {stage: CPU ns}`` for one update (thread CPU time).

    The learners are timed running their real ``update``: the functions and hooks it calls are
    wrapped by a ``harness.StageClock`` (``_check_batch``, ``_forward``, ``total_loss``, ``_backward``,
    ``detached``, ``_clip_gradients``, ``_reported_norm`` and ``set_entry``, ``_refuse_step``,
    ``_optimizer_step``, ``zero_grad``), so no copy of its body can drift from it. "rest + wrappers"
    is what the update's total holds beyond its timed stages: its own bookkeeping between them
    (window start, counters), freeing its locals (the loss output and what remains of the autograd
    graph) on return, and the clock's own work (~0.6 us per clock read here, two per wrapped call);
    the hand loops get the same row (their stage marks and the freeing on return). Stage rows are
    what each piece costs inside a real update (caches cold, unlike the hot loops of ``pieces``).
    """
    import time

    import fabric_learner.learner as learner_module

    def hand(loop, backward, clip):
        h = loop(common.make_loss(name)[0])

        def update(td, marks):
            marks.append(time.thread_time_ns())
            out = (h.module if hasattr(h, "module") else h.loss)(td)
            marks.append(time.thread_time_ns())
            loss = common.summed_loss(out)
            marks.append(time.thread_time_ns())
            backward(h, loss)
            marks.append(time.thread_time_ns())
            clip(h)
            marks.append(time.thread_time_ns())
            h.opt.step()
            marks.append(time.thread_time_ns())
            h.opt.zero_grad()
            marks.append(time.thread_time_ns())

        def run(td):  # as for the learners, the total includes freeing the update's locals on return
            marks = []
            t = time.thread_time_ns()
            update(td, marks)
            total = time.thread_time_ns() - t
            stages = dict(zip(("forward", "sum losses", "backward", "clip", "optimizer step", "zero_grad"),
                              (b - a for a, b in zip(marks, marks[1:]))))
            return {**stages, "rest + wrappers": total - sum(stages.values())}
        return run

    def learner(make):
        lr = make()
        for td in common.make_batches(name, count=2):
            lr.update(td)  # past the one-time coverage check
        clock = harness.StageClock(ns=time.thread_time_ns)
        for attr, stage in (("_forward", "forward"), ("_backward", "backward"), ("_clip_gradients", "clip"),
                            ("_refuse_step", "non-finite check"), ("_optimizer_step", "optimizer step")):
            object.__setattr__(lr, attr, clock.wrap(stage, getattr(lr, attr)))
        lr._torch_optimizer.zero_grad = clock.wrap("zero_grad", lr._torch_optimizer.zero_grad)
        functions = {"_check_batch": "batch checks", "total_loss": "sum losses", "detached": "detach output",
                     "_reported_norm": "set grad_norm", "set_entry": "set grad_norm"}

        def run(td):
            originals = {f: getattr(learner_module, f) for f in functions}
            for f, stage in functions.items():
                setattr(learner_module, f, clock.wrap(stage, originals[f]))
            clock.ns = {}
            t = time.thread_time_ns()
            try:
                lr.update(td)
            finally:
                total = time.thread_time_ns() - t
                for f, fn in originals.items():
                    setattr(learner_module, f, fn)
            return {**clock.ns, "rest + wrappers": total - sum(clock.ns.values())}
        return run

    def torch_backward(h, loss):
        loss.backward()

    def torch_clip(h):
        torch.nn.utils.clip_grad_norm_(h.params, h.clip)

    return {
        "hand torchrl loop": hand(common.HandTorchrl, torch_backward, torch_clip),
        "hand Fabric loop": hand(common.HandFabric, lambda h, loss: h.fabric.backward(loss),
                                 lambda h: h.fabric.clip_gradients(h.module, h.opt, max_norm=h.clip)),
        "LocalLearner": learner(lambda: LocalLearner(common.make_loss(name)[0], clip_grad_norm=common.CLIP)),
        "FabricLearner(cpu,1)": learner(lambda: FabricLearner(common.make_loss(name)[0], clip_grad_norm=common.CLIP,
                                                              accelerator="cpu", devices=1)),
    }


def part_stages(workloads, n: int) -> dict:
    """Median CPU time of each stage over ``n`` interleaved updates; robust to preemption spikes."""
    print(f"== stages: median CPU us per call over {n} updates (contenders alternate update by update; the "
          "learners run their real update, timed by wrappers, see _stage_steps)")
    out = {}
    for name in workloads:
        steps = _stage_steps(name)
        batches = common.make_batches(name)
        samples = {c: {s: [] for s in STAGES} for c in steps}
        for i in range(n + 10):
            for c in harness.order_for(i, list(steps)):
                stages = steps[c](batches[i % len(batches)])
                if i >= 10:
                    for stage, ns in stages.items():
                        samples[c][stage].append(ns / 1e3)
        med = {c: {s: harness.median(v) for s, v in st.items() if v} for c, st in samples.items()}
        print(f"-- {name}: {common.WORKLOAD_DESC[name]}")
        cols = list(steps)
        print("   " + f"{'stage':16s}" + "".join(f"{c:>22s}" for c in cols))
        for s in STAGES:
            print("   " + f"{s:16s}" + "".join(f"{med[c][s]:22.1f}" if s in med[c] else f"{'-':>22s}" for c in cols))
        totals = {c: sum(med[c].values()) for c in cols}
        print("   " + f"{'sum of stages':16s}" + "".join(f"{totals[c]:22.1f}" for c in cols))
        base = totals["hand torchrl loop"]
        print("   " + f"{'vs hand torchrl':16s}" + "".join(f"{totals[c] - base:+21.1f} " for c in cols))
        out[name] = med
    return out


def _us(fn, number: int = 2000, repeat: int = 7) -> float:
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6


def part_pieces(workloads) -> None:
    from lightning.fabric import Fabric

    from fabric_learner import _loss
    from fabric_learner.learner import _backward_seed

    print("== pieces: what the learner adds, us per call (min of 7 x 2000 calls)")
    for name in workloads:
        loss, out, batch = real_output(name)
        out_detached = out.detach()
        opt = torch.optim.Adam(loss.parameters())
        params = [p for g in opt.param_groups for p in g["params"]]
        common.summed_loss(out).backward(retain_graph=True)
        gn = torch.nn.utils.clip_grad_norm_(params, 1.0)
        fabric = Fabric(accelerator="cpu", devices=1)
        fab_opt = fabric.setup_optimizers(torch.optim.Adam(loss.parameters()))
        rows = [
            ("sum of loss keys (hand: sum(...))", lambda: common.summed_loss(out)),
            ("_loss.total_loss(output)", lambda: _loss.total_loss(out)),
            ("output.detach()  [learner returns a detached copy]", lambda: out.detach()),
            ("result.set('grad_norm', ...)", lambda: out_detached.set(
                "grad_norm", gn.detach().reshape(()).to(out_detached.device or gn.device))),
            ("optimizer_params(optimizer)", lambda: [p for g in opt.param_groups for p in g["params"]]),
            ("tuple(output.values(leaves))  [LossForwarder]",
             lambda: tuple(out.values(include_nested=True, leaves_only=True))),
            ("_carrier._on_device(batch, cpu)  [LossForwarder]",
             lambda: __import__("fabric_learner._carrier", fromlist=["_on_device"])._on_device(
                 batch, torch.device("cpu"))),
            ("isinstance(batch, TensorDictBase)", lambda: isinstance(batch, TensorDictBase)),
            ("clip_grad_norm_(params, 1.0)  [both; for scale]", lambda: torch.nn.utils.clip_grad_norm_(params, 1.0)),
            ("clip_grad_norm_(..., foreach=True)  [LocalLearner]",
             lambda: torch.nn.utils.clip_grad_norm_(params, 1.0, error_if_nonfinite=False, foreach=True)),
            ("fabric.clip_gradients(opt, max_norm=1.0)",
             lambda: fabric.clip_gradients(loss, fab_opt, max_norm=1.0, error_if_nonfinite=False)),
        ]
        learner = LocalLearner(common.make_loss(name)[0], clip_grad_norm=common.CLIP)
        learner.update(batch)
        l_loss = _loss.total_loss(out)
        rows += [
            ("Learner._refuse_step(gn)  [non-finite check]", lambda: learner._refuse_step(gn)),
            ("_backward_seed(loss)", lambda: _backward_seed(l_loss)),
        ]
        print(f"-- {name}: output keys {sorted(out.keys())}, {len(params)} parameter tensors")
        for label, fn in rows:
            n = 200 if "clip" in label else 2000
            print(f"   {label:55s} {_us(fn, number=n):8.2f} us")
        _fabric_wrapper_cost(name)
    _overwrite_check_cost()


def _fabric_wrapper_cost(name: str) -> None:
    """What ``_FabricModule.forward`` adds around ``LossForwarder``, with a near-free loss."""
    import time

    from fabric_learner._carrier import Carrier

    real, out, batch = real_output(name)
    null = NullLoss(real, out)
    learner = FabricLearner(null, accelerator="cpu", devices=1)
    forwarder = learner._module._forward_module
    calls = {
        "loss(batch)": lambda: null(batch),
        "LossForwarder(Carrier(batch))": lambda: forwarder(Carrier(batch)),
        "_FabricModule(Carrier(batch))": lambda: learner._module(Carrier(batch)),
    }
    best = {k: float("inf") for k in calls}
    for rep in range(30):
        for k in harness.order_for(rep, list(calls)):
            t = time.thread_time_ns()
            for _ in range(100):
                calls[k]()
            best[k] = min(best[k], (time.thread_time_ns() - t) / 100 / 1e3)
    base = best["loss(batch)"]
    for k, v in best.items():
        print(f"   {k + '  [near-free loss, min of 30 x 100]':55s} {v:8.2f} us  (+{v - base:.1f} over the loss)")


def _overwrite_check_cost() -> None:
    """``_checkpoint._is_checkpoint_file`` on the case-d checkpoint vs reading only the pickle's head."""
    import pickletools
    import zipfile
    from pathlib import Path

    from fabric_learner.checkpoint import files as _checkpoint

    if not hasattr(_checkpoint, "_is_checkpoint_file"):
        return

    def head_check(path: Path) -> bool:
        with zipfile.ZipFile(path) as archive:
            name = next((n for n in archive.namelist() if n.endswith("/data.pkl")), None)
            if name is None:
                return False
            with archive.open(name) as f:
                head = f.read(256)
        strings = []
        try:
            for _op, arg, _pos in pickletools.genops(head):
                if isinstance(arg, str):
                    strings.append(arg)
                    if len(strings) == 2:
                        break
        except Exception:  # noqa: BLE001 - a truncated head ends the scan
            pass
        return strings == ["format", _checkpoint.FORMAT]

    learner = LocalLearner(common.make_loss("ppo", cells=(1024, 1024, 1024))[0])
    learner.update(common.make_batch("ppo"))
    tmp = tempfile.mkdtemp(prefix="fl_prof_")
    path = Path(tmp) / "ckpt.pt"
    try:
        learner.save(path)
        assert _checkpoint._is_checkpoint_file(path) and head_check(path)
        print("-- overwrite check before save (case d checkpoint), ms per call (min of 5 x 10)")
        for label, fn in (("_checkpoint._is_checkpoint_file(path)", lambda: _checkpoint._is_checkpoint_file(path)),
                          ("proposed: first two strings of data.pkl", lambda: head_check(path))):
            print(f"   {label:55s} {_us(fn, number=10, repeat=5) / 1e3:8.2f} ms")
    finally:
        path.unlink(missing_ok=True)
        os.rmdir(tmp)


def _print_stats(pr: cProfile.Profile, n: int, title: str, filt=("fabric_learner", "lightning"), top: int = 30):
    s = io.StringIO()
    st = pstats.Stats(pr, stream=s)
    rows = []
    for (file, line, fn), (cc, nc, tt, ct, _callers) in st.stats.items():
        if any(f in file for f in filt):
            short = file.split("site-packages/")[-1].replace(os.path.dirname(os.path.dirname(__file__)) + "/", "")
            rows.append((ct / n * 1e6, tt / n * 1e6, nc / n, f"{short}:{line}({fn})"))
    total = sum(r[1] for r in rows)
    print(f"-- {title}: self time in {'/'.join(filt)} frames {total:.1f} us per call; top by cumulative:")
    print(f"   {'cum us/call':>11s} {'self us':>8s} {'calls':>6s}  function")
    for ct, tt, nc, label in sorted(rows, reverse=True)[:top]:
        print(f"   {ct:11.1f} {tt:8.1f} {nc:6.1f}  {label}")


def part_cprofile(workloads, n: int) -> None:
    print("== cprofile: real loss, per update (cProfile overhead included)")
    for name in workloads:
        batches = common.make_batches(name)
        for label, make in (
            ("LocalLearner.update", lambda: LocalLearner(common.make_loss(name)[0], clip_grad_norm=common.CLIP)),
            ("FabricLearner(cpu,1).update",
             lambda: FabricLearner(common.make_loss(name)[0], clip_grad_norm=common.CLIP, accelerator="cpu",
                                   devices=1)),
        ):
            learner = make()
            for i in range(5):
                learner.update(batches[i % 4])
            pr = cProfile.Profile()
            pr.enable()
            for i in range(n):
                learner.update(batches[i % 4])
            pr.disable()
            _print_stats(pr, n, f"{name} {label}", top=18)

    print("== cprofile: checkpoints (case d model)")
    cells = (1024, 1024, 1024)
    local = LocalLearner(common.make_loss("ppo", cells=cells)[0])
    fabric = FabricLearner(common.make_loss("ppo", cells=cells)[0], accelerator="cpu", devices=1)
    for td in common.make_batches("ppo", count=2):
        local.update(td)
        fabric.update(td)
    tmp = tempfile.mkdtemp(prefix="fl_prof_")
    try:
        for label, fn in (
            ("LocalLearner.save", lambda: local.save(os.path.join(tmp, "l.pt"))),
            ("FabricLearner.save", lambda: fabric.save(os.path.join(tmp, "f.pt"))),
            ("LocalLearner.load", lambda: local.load(os.path.join(tmp, "l.pt"))),
            ("FabricLearner.load", lambda: fabric.load(os.path.join(tmp, "f.pt"))),
        ):
            fn()
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(5):
                fn()
            pr.disable()
            _print_stats(pr, 5, label, filt=("fabric_learner", "lightning", "serialization", "posix", "fsspec",
                                             "_io", "shutil", "module.py", "optimizer.py"), top=14)
    finally:
        for f in os.listdir(tmp):
            os.unlink(os.path.join(tmp, f))
        os.rmdir(tmp)


def part_counts(workloads, n: int) -> dict:
    import collections

    from torch.utils._python_dispatch import TorchDispatchMode

    class CountOps(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[str(func)] += 1
            return func(*args, **(kwargs or {}))

    print(f"== counts: per update over {n} updates (exact)")
    out = {}
    for name in workloads:
        batches = common.make_batches(name)
        contenders = {
            "hand torchrl loop": common.HandTorchrl(common.make_loss(name)[0]),
            "LocalLearner.update": LocalLearner(common.make_loss(name)[0], clip_grad_norm=common.CLIP),
            "FabricLearner(cpu,1).update": FabricLearner(common.make_loss(name)[0], clip_grad_norm=common.CLIP,
                                                         accelerator="cpu", devices=1),
        }
        rows = {}
        for label, m in contenders.items():
            for i in range(5):
                m.update(batches[i % 4])
            pr = cProfile.Profile()
            pr.enable()
            for i in range(n):
                m.update(batches[i % 4])
            pr.disable()
            with CountOps() as counter:
                for i in range(n):
                    m.update(batches[i % 4])
            rows[label] = (pstats.Stats(pr).total_calls / n, counter.ops)
        hand_calls, hand_ops = rows["hand torchrl loop"]
        print(f"-- {name}: {common.WORKLOAD_DESC[name]}")
        for label, (calls, ops) in rows.items():
            extra = {op: (ops[op] - hand_ops[op]) / n for op in set(ops) | set(hand_ops) if ops[op] != hand_ops[op]}
            print(f"   {label:28s} Python calls {calls:8.1f} ({calls - hand_calls:+6.1f})   aten ops "
                  f"{sum(ops.values()) / n:6.1f} ({(sum(ops.values()) - sum(hand_ops.values())) / n:+5.1f})"
                  + (f"   {dict(sorted(extra.items()))}" if extra else ""))
        out[name] = {label: {"python_calls": c, "aten_ops": sum(o.values()) / n} for label, (c, o) in rows.items()}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", default="stages,pieces,cprofile", help="any of stages,overhead,pieces,counts,cprofile")
    p.add_argument("--workloads", default=",".join(common.WORKLOADS))
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--inner", type=int, default=20)
    p.add_argument("--n", type=int, default=100, help="updates under cProfile")
    p.add_argument("--stage-n", type=int, default=300, help="updates per contender in the stages part")
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    harness.set_one_thread()
    workloads = [w for w in args.workloads.split(",") if w]
    parts = set(args.part.split(","))
    if "stages" in parts:
        part_stages(workloads, args.stage_n)
    if "overhead" in parts:
        part_overhead(workloads, args.reps, args.inner)
    if "pieces" in parts:
        part_pieces(workloads)
    if "counts" in parts:
        part_counts(workloads, min(args.n, 50))
    if "cprofile" in parts:
        part_cprofile(workloads, args.n)


if __name__ == "__main__":
    main()
