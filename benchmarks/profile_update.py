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

import torch  # noqa: E402
from tensordict import TensorDict, TensorDictBase  # noqa: E402
from torch import nn  # noqa: E402

import common  # noqa: E402
from fabric_learner import FabricLearner, LocalLearner  # noqa: E402


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
          inner, "updates")
    results = {}
    for name in workloads:
        s = common.interleaved(null_contenders(name), reps=reps, inner=inner, warmup=20)
        base = common.median(s["hand torchrl loop"]) * 1e6
        base_f = common.median(s["hand Fabric loop"]) * 1e6
        print(f"-- {name}: {common.WORKLOAD_DESC[name]}")
        for c, xs in s.items():
            m = common.median(xs) * 1e6
            extra = m - base
            paired = common.median([(a - b) * 1e6 for a, b in zip(xs, s["hand torchrl loop"])])
            print(f"   {c:30s} {m:9.1f} us   - hand torchrl: {extra:+7.1f} us (paired {paired:+7.1f})"
                  + (f"   - hand Fabric: {m - base_f:+7.1f} us" if c.startswith("Fabric") else ""))
        results[name] = {c: [x * 1e6 for x in xs] for c, xs in s.items()}
    return results


def _us(fn, number: int = 2000, repeat: int = 7) -> float:
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6


def part_pieces(workloads) -> None:
    from lightning.fabric import Fabric

    from fabric_learner import _loss

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
            ("_batch._on_device(batch, cpu)  [LossForwarder]",
             lambda: __import__("fabric_learner._batch", fromlist=["_on_device"])._on_device(batch, torch.device("cpu"))),
            ("isinstance(batch, TensorDictBase)", lambda: isinstance(batch, TensorDictBase)),
            ("clip_grad_norm_(params, 1.0)  [both; for scale]", lambda: torch.nn.utils.clip_grad_norm_(params, 1.0)),
            ("clip_grad_norm_(..., foreach=True)  [LocalLearner]",
             lambda: torch.nn.utils.clip_grad_norm_(params, 1.0, error_if_nonfinite=False, foreach=True)),
            ("fabric.clip_gradients(opt, max_norm=1.0)",
             lambda: fabric.clip_gradients(loss, fab_opt, max_norm=1.0, error_if_nonfinite=False)),
        ]
        print(f"-- {name}: output keys {sorted(out.keys())}, {len(params)} parameter tensors")
        for label, fn in rows:
            n = 200 if "clip" in label else 2000
            print(f"   {label:55s} {_us(fn, number=n):8.2f} us")


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
             lambda: FabricLearner(common.make_loss(name)[0], clip_grad_norm=common.CLIP, accelerator="cpu", devices=1)),
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", default="overhead,pieces,cprofile")
    p.add_argument("--workloads", default=",".join(common.WORKLOADS))
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--inner", type=int, default=50)
    p.add_argument("--n", type=int, default=100, help="updates under cProfile")
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    common.set_one_thread()
    workloads = [w for w in args.workloads.split(",") if w]
    parts = set(args.part.split(","))
    if "overhead" in parts:
        part_overhead(workloads, args.reps, args.inner)
    if "pieces" in parts:
        part_pieces(workloads)
    if "cprofile" in parts:
        part_cprofile(workloads, args.n)


if __name__ == "__main__":
    main()
