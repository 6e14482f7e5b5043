"""RemoteLearner against the same strategy and ranks run as an SPMD program, on the same batches.

    OMP_NUM_THREADS=1 python benchmarks/remote_learner.py --quick --out remote_learner.json
    python benchmarks/remote_learner.py --many --workload ppo    # update_minibatches: many updates per call
    python benchmarks/remote_learner.py --cartpole 30            # a hand-written PPO loop learning, local and remote
    python benchmarks/remote_learner.py --boundary --out benchmarks/results/remote_boundary.json   # no Ray

The contenders and workloads: benchmarks/README.md, "RemoteLearner"; ``--boundary``: docs/remote.md.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
from datetime import timedelta

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RL_WARNINGS", "False")

import common
import harness
import torch

RANKS = 2
REPLY_WORDS = (12, 36)  # grpo: each reply's length in words, uniform in [lo, hi)


def optimizer(workload: str):
    return functools.partial(torch.optim.AdamW, lr=1e-5) if workload == "grpo" else \
        functools.partial(torch.optim.Adam, lr=1e-3)


def grpo_loss(hidden: int, layers: int):
    return common.grpo_loss(hidden, layers)[0]


def make_loss(args, built: bool = False):
    """The workload's loss: for grpo (unless ``built``) a factory each rank calls, so no tokenizer is pickled."""
    if args.workload != "grpo":
        return common.make_loss(args.workload)[0]
    return grpo_loss(args.hidden, args.layers) if built else functools.partial(grpo_loss, args.hidden, args.layers)


def batches(args):
    """The global batches: ``common.make_batches``, or for grpo chats whose log-probs are seed 0's policy's own."""
    if args.workload != "grpo":
        return common.make_batches(args.workload, count=4, n=args.batch)
    from fabric_learner.testing import grpo_batch

    policy = make_loss(args, built=True).actor_network
    generator = torch.Generator().manual_seed(1000)
    return [grpo_batch(policy, torch.randint(*REPLY_WORDS, (args.batch,), generator=generator).tolist(), seed=10 + i)
            for i in range(2)]


class Plan:
    """What one call is: ``update(batch)`` on the global batch (one update), or with ``--many`` (PPO: 10 epochs x 8
    minibatches, seeded partitions; DQN: 16 in-order updates of 16 batches concatenated) ``update_minibatches``;
    ``share`` cuts a call's batch for a rank exactly as ``RemoteLearner`` does."""

    def __init__(self, args):
        self.calls = batches(args)
        self.many = None
        self.steps = 1
        if args.many and args.workload == "ppo":
            self.many, self.steps = (args.batch // 8, 10, True), 80
        elif args.many:
            self.calls = [torch.cat([self.calls[(c + k) % len(self.calls)] for k in range(16)]) for c in range(2)]
            self.many, self.steps = (args.batch, 1, False), 16

    def share(self, batch, rank: int):
        from fabric_learner.remote import _shares

        if self.many is None or self.many[2]:
            return _shares.split(batch, RANKS)[0][rank]
        part = self.many[0] // RANKS
        steps = torch.arange(batch.batch_size[0] // self.many[0]).unsqueeze(1) * self.many[0]
        return batch[(steps + rank * part + torch.arange(part)).reshape(-1)]

    def call(self, learner, batch, seed: int):
        return call(learner, batch, seed, self.many)


def call(learner, batch, seed: int, many: tuple | None, ranks: int = 1):
    """One call: ``update``, or ``update_minibatches`` as ``many`` says (its minibatch shared by ``ranks``)."""
    if many is None:
        return learner.update(batch)
    size, epochs, shuffle = many
    return learner.update_minibatches(batch, size // ranks, epochs=epochs, shuffle=shuffle, seed=seed)


def rank_loop(rank_learner, shares, order, many) -> float:
    """The SPMD program on the learner's own ranks (in its Ray actors): each rank calls on its own share of each
    batch, barrier before and after; seconds per call."""
    import time

    import torch.distributed as dist

    mine = [share[rank_learner.global_rank] for share in shares]
    dist.barrier()
    t0 = time.perf_counter()
    for i in order:
        call(rank_learner, mine[i], i, many, RANKS)
    dist.barrier()
    return (time.perf_counter() - t0) / len(order)


def spmd(args) -> None:
    """One torchrun rank of the SPMD program: blocks of ``inner`` calls on its shares; rank 0 writes seconds per
    update."""
    from fabric_learner import FabricLearner

    learner = FabricLearner(make_loss(args, built=True), optimizer(args.workload), strategy=args.strategy,
                            accelerator="cpu", clip_grad_norm=common.CLIP)
    plan = Plan(args)
    shares = [plan.share(b, learner.global_rank) for b in plan.calls]
    for i in range(args.warmup):
        call(learner, shares[i % len(shares)], i, plan.many, RANKS)
    samples = harness.blocks(lambda i: call(learner, shares[i % len(shares)], i % len(shares), plan.many, RANKS),
                             args.blocks, args.inner, torch.distributed.barrier)
    out = [s / plan.steps for s in samples]
    if args.many and args.workload == "dqn":  # also the same updates, each rank sampling its own buffer
        buffer = rank_buffer(args.batch // RANKS)
        buffer.extend(torch.cat(shares))
        sampled = harness.blocks(lambda i: [learner.update(buffer.sample()) for _ in range(plan.steps)],
                                 args.blocks, args.inner, torch.distributed.barrier)
        out = {"calls": out, "sampled": [s / plan.steps for s in sampled]}
    if learner.global_rank == 0:
        harness.write_json(args.spmd_out, out)
    learner.close()


def compiled_updater(learner):
    """``update(batch)`` through a Ray compiled graph over the learner's own actors: the same split, rank method and
    combining, Ray's task path replaced by compiled-graph channels (a measurement, not a learner: no fault
    handling, write-back or transfer report). Returns ``(update, teardown)``."""
    import ray
    from ray.dag import InputNode, MultiOutputNode

    from fabric_learner.remote import _shares
    from fabric_learner.remote._wire import packed, unpacked
    from fabric_learner.remote.learner import combine

    with InputNode() as shares:
        dag = MultiOutputNode([actor.update.bind(shares[r]) for r, actor in enumerate(learner._actors)])
    graph = dag.experimental_compile()

    def update(batch):
        answers = ray.get(graph.execute(*[packed(s) for s in _shares.split(batch, RANKS)[0]]), timeout=600)
        return combine([unpacked(a[0]) for a in answers], [a[3] for a in answers])

    return update, graph.teardown


def torchrl_ray(args, data):
    """torchrl's own Ray learner (private in 0.14.1) over a Ray replay buffer holding ``data``: ``step(i)``."""
    from torchrl.data import LazyTensorStorage, RayReplayBuffer
    from torchrl.trainers._ray_execution import _RayTrainerExecution

    loss = common.make_loss(args.workload)[0]
    rb = RayReplayBuffer(storage=LazyTensorStorage(data.batch_size[0]), batch_size=args.batch // RANKS)
    rb.extend(data)
    execution = _RayTrainerExecution(
        loss_module=loss, optimizer=torch.optim.Adam(loss.parameters(), lr=1e-3), optimization_stepper=None,
        target_net_updater=None, replay_buffer=rb, global_batch_size=args.batch, seed=0, clip_grad_norm=True,
        clip_norm=common.CLIP, update_replay_priority=False,
        options={"world_size": RANKS, "resources_per_rank": {"num_cpus": 1, "num_gpus": 0}})
    execution.start()
    return execution, rb


def rank_buffer(batch_size: int):
    """A rank's replay buffer for ``--many --workload dqn``: uniform sampling, ``batch_size`` rows a sample."""
    from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

    return TensorDictReplayBuffer(storage=LazyTensorStorage(100_000), batch_size=batch_size)


def start_ray(ray) -> None:
    """Logical CPUs for scheduling only (the contenders take turns on the machine's cores); the ranks at the
    controller's priority, as the embedded runtime starts them (Ray's default, 15 nicer, favours torchrun's ranks)."""
    ray.init(num_cpus=16, include_dashboard=False, log_to_driver=False, logging_level="ERROR",
             _system_config={"worker_niceness": 0})


def timed(calls, per: int = 1) -> float:
    """Seconds per unit of ``calls()`` run once, over ``per`` units."""
    t0 = time.perf_counter()
    calls()
    return (time.perf_counter() - t0) / per


def measure(args) -> None:
    """The SPMD launches and the remote blocks in turns; every contender's seconds per update and the ratios."""
    import ray

    from fabric_learner import RemoteLearner
    from fabric_learner.remote import learner as remote_module

    start_ray(ray)
    plan, many = Plan(args), args.many
    calls, per_call = plan.calls, args.inner * plan.steps
    sampled = many and args.workload == "dqn"  # also K updates sampled from buffers beside the ranks
    learner = RemoteLearner(make_loss(args), optimizer(args.workload), strategy=args.strategy, num_learners=RANKS,
                            clip_grad_norm=common.CLIP, **({} if many else {"max_in_flight": 2}),
                            **({"replay_buffer": functools.partial(rank_buffer, args.batch // RANKS)} if sampled else {}))
    for i in range(args.warmup):
        plan.call(learner, calls[i % len(calls)], i)
    if sampled:
        learner.extend(torch.cat(calls))
        learner.update_from_buffer(plan.steps)
    stored = not many and args.workload != "grpo"
    if args.compiled:
        compiled_update, teardown = compiled_updater(learner)
        for i in range(args.warmup):
            compiled_update(calls[i % len(calls)])
    times = {k: [] for k in ("spmd", "remote", "remote_pipelined", "spmd_in_actors") if not (many and k == "remote_pipelined")}
    times.update({"remote_stored": []} if stored else {})
    times.update({"from_buffer": [], "spmd_sampled": []} if sampled else {})
    blocks = {k: [] for k in (("remote", "spmd_in_actors", "remote_ranks_own", "single_follow", "single_no_follow",
                               "from_buffer") if many
                              else ("remote", "spmd_in_actors", "remote_pipelined", "remote_stored", "remote_ranks_own",
                                    "remote_compiled"))}
    rank_shares = [[plan.share(b, r) for r in range(RANKS)] for b in calls]
    singles, follower = batches(args) if many else None, learner._follower  # --many: update(batch), following or not
    names = ["spmd", "remote"]
    if args.torchrl:
        from torchrl.data import LazyTensorStorage, ReplayBuffer

        data = torch.cat(calls)
        execution, ray_rb = torchrl_ray(args, data)
        local_rb = ReplayBuffer(storage=LazyTensorStorage(data.batch_size[0]), batch_size=args.batch)
        local_rb.extend(data)
        for _ in range(args.warmup):
            execution.step(1)
        names.append("torchrl")
        times.update(torchrl_ray=[], remote_sampled=[])
    for rep in range(args.reps):
        for name in harness.rotation(rep, names):
            if name == "torchrl":
                def theirs():
                    for _ in range(args.inner):
                        execution.step(1)

                def ours():
                    for _ in range(args.inner):
                        learner.update(local_rb.sample())

                pairs = [(timed(theirs, args.inner), timed(ours, args.inner)) for _ in range(args.blocks)]
                times["torchrl_ray"].append(harness.median([a for a, _ in pairs]))
                times["remote_sampled"].append(harness.median([b for _, b in pairs]))
                continue
            if name == "spmd":
                with harness.scratch_path() as path:
                    harness.run_bounded([*harness.torchrun(RANKS, os.path.abspath(__file__)), "--spmd-out", path,
                                         *(["--many"] if many else []), "--workload", args.workload, "--batch",
                                         str(args.batch), "--blocks", str(args.blocks), "--inner", str(args.inner),
                                         "--warmup", str(args.warmup), "--strategy", args.strategy, "--hidden",
                                         str(args.hidden), "--layers", str(args.layers)], 600, "the SPMD program")
                    got = harness.read_json(path)
                    times["spmd"].append(harness.median(got["calls"] if sampled else got))
                    if sampled:
                        times["spmd_sampled"].append(harness.median(got["sampled"]))
                continue
            got = {k: [] for k in blocks}
            for block in range(args.blocks):
                order = [(block * args.inner + i) % len(calls) for i in range(args.inner)]
                # the remote call and the same ranks' own SPMD loop alternate who goes first, block by block
                for turn in (("remote", "actors") if block % 2 == 0 else ("actors", "remote")):
                    if turn == "actors":
                        got["spmd_in_actors"].append(
                            learner.call_on_ranks(rank_loop, rank_shares, order, plan.many)[0] / plan.steps)
                        continue
                    t0, ranks = time.perf_counter(), 0.0
                    for c in order:
                        plan.call(learner, calls[c], c)
                        ranks += max(learner.last_rank_seconds)  # the slower rank's own time in this call
                        transfer = dict(learner.last_transfer)
                    got["remote"].append((time.perf_counter() - t0) / per_call)
                    got["remote_ranks_own"].append(ranks / per_call)
                    if sampled:  # the same number of updates, each rank sampling its share from its own buffer
                        got["from_buffer"].append(timed(lambda: [learner.update_from_buffer(plan.steps) for _ in order],
                                                        per_call))
                if many:  # update(batch), one step a call, following and not, in alternating blocks of 10
                    for follow in ((True, False) if block % 2 == 0 else (False, True)):
                        learner._follower = follower if follow else None
                        got["single_follow" if follow else "single_no_follow"].append(timed(
                            lambda: [learner.update(singles[i % len(singles)]) for i in range(10)], 10))
                    learner._follower = follower
                    continue
                if args.compiled:
                    got["remote_compiled"].append(timed(lambda: [compiled_update(calls[i]) for i in order], args.inner))
                if stored:
                    inline, remote_module.INLINE_BYTES = remote_module.INLINE_BYTES, -1
                    got["remote_stored"].append(timed(lambda: [learner.update(calls[i]) for i in order], args.inner))
                    remote_module.INLINE_BYTES = inline
                got["remote_pipelined"].append(timed(
                    lambda: [learner.update(calls[i], wait=False) for i in order][-1].result(), args.inner))
            for key, values in got.items():
                blocks[key] += values
                if key in times and values:
                    times[key].append(harness.median(values))
    paired = harness.paired
    result = {"settings": vars(args), "machine": harness.machine(), "provenance": harness.provenance()}
    if many:
        goal = 1.05
        result.update({
            "updates_per_call": plan.steps, "minibatch_size": plan.many[0], "epochs": plan.many[1],
            "shuffle": plan.many[2], "seconds_per_update": times, "transfer_per_call": transfer,
            "seconds_per_block": blocks, "remote_over_spmd": paired(times["remote"], times["spmd"], goal=goal),
            "remote_over_spmd_in_actors": paired(blocks["remote"], blocks["spmd_in_actors"], goal=goal),
            "remote_over_its_ranks_own_time": paired(blocks["remote"], blocks["remote_ranks_own"]),
            "from_buffer_over_spmd": sampled and paired(times["from_buffer"], times["spmd"], goal=goal),
            # against the SPMD ranks sampling their own buffers too: the comparison for update_from_buffer
            "from_buffer_over_spmd_sampled": sampled and paired(times["from_buffer"], times["spmd_sampled"], goal=goal),
            "from_buffer_over_remote": sampled and paired(blocks["from_buffer"], blocks["remote"]),
            # what following (a check for buffers written, nothing run here) adds to the single-step path
            "single_step_follow_over_no_follow": paired(blocks["single_follow"], blocks["single_no_follow"])})
    else:
        from fabric_learner.remote.actors import packed

        goal = 1.02 if args.workload == "grpo" else 1.10
        transfer = dict(learner.last_transfer)
        ref = ray.put(packed(plan.share(calls[0], 0)))  # as update() puts a share too large to ride in the call
        transfer["object_store_bytes_per_share_if_stored"] = ray.experimental.get_object_locations([ref])[ref]["object_size"]
        result.update({
            "seconds_per_update": times, "transfer_per_update": transfer,
            "remote_over_spmd": paired(times["remote"], times["spmd"], goal=goal),
            "remote_stored_over_spmd": stored and paired(times["remote_stored"], times["spmd"]),
            "remote_over_remote_stored": stored and paired(times["remote"], times["remote_stored"]),
            "remote_over_spmd_in_actors": paired(blocks["remote"], blocks["spmd_in_actors"], goal=goal),
            "remote_over_its_ranks_own_time": paired(blocks["remote"], blocks["remote_ranks_own"]),
            "remote_compiled_over_spmd_in_actors": args.compiled and paired(blocks["remote_compiled"],
                                                                            blocks["spmd_in_actors"]),
            "remote_compiled_over_remote": args.compiled and paired(blocks["remote_compiled"], blocks["remote"]),
            "remote_stored_over_spmd_in_actors": stored and paired(blocks["remote_stored"], blocks["spmd_in_actors"]),
            "pipelined_updates_per_s_over_spmd_in_actors": paired(blocks["spmd_in_actors"], blocks["remote_pipelined"],
                                                                  goal=0.95),
            "seconds_per_block": blocks,
            "pipelined_updates_per_s_over_spmd": paired(times["spmd"], times["remote_pipelined"], goal=0.95)})
        if args.torchrl:
            result["remote_over_torchrl_ray"] = paired(times["remote_sampled"], times["torchrl_ray"], goal="< 1 (faster)")
    if args.compiled:
        teardown()
    learner.close()
    if args.torchrl:
        execution.shutdown()
        ray_rb.close()
    harness.show({k: v for k, v in result.items() if k not in ("settings", "machine", "provenance", "seconds_per_block")})
    if args.out:
        harness.write_result(args.out, result)


def cartpole(args) -> None:
    """``--cartpole N``: a hand-written PPO loop on CartPole-v1 (torchrl ``Collector`` running the loss's actor, GAE
    here on its critic, ``update(minibatch)``), N iterations of 512 frames, 4 epochs of 8 minibatches, on
    ``LocalLearner``, ``RemoteLearner(strategy="fsdp", num_learners=2)``, the same with ``follow=False`` and
    ``RemoteLearner.update_minibatches``; same seeds for all: episode lengths per iteration and wall time."""
    import ray
    from tensordict.nn import TensorDictModule
    from torch.distributions import OneHotCategorical
    from torchrl.collectors import Collector
    from torchrl.envs import GymEnv, StepCounter, TransformedEnv
    from torchrl.modules import MLP, ProbabilisticActor, ValueOperator
    from torchrl.objectives import ClipPPOLoss
    from torchrl.objectives.value import GAE

    from fabric_learner import LocalLearner, RemoteLearner

    start_ray(ray)
    adam = functools.partial(torch.optim.Adam, lr=3e-4)
    frames, minibatch, epochs = 512, 64, 4
    results = {}
    for kind in ("local", "remote", "remote_follow_false", "remote_update_minibatches"):
        torch.manual_seed(0)
        env = TransformedEnv(GymEnv("CartPole-v1"), StepCounter())
        env.set_seed(0)
        actor = ProbabilisticActor(TensorDictModule(MLP(in_features=4, out_features=2, num_cells=[64, 64]),
                                                    ["observation"], ["logits"]),
                                   in_keys=["logits"], distribution_class=OneHotCategorical, return_log_prob=True,
                                   spec=env.action_spec)
        critic = ValueOperator(MLP(in_features=4, out_features=1, num_cells=[64, 64]), in_keys=["observation"])
        loss = ClipPPOLoss(actor, critic, entropy_coeff=0.01, normalize_advantage=False)
        learner = LocalLearner(loss, adam, policy=actor, clip_grad_norm=1.0) if kind == "local" else RemoteLearner(
            loss, adam, policy=actor, strategy="fsdp", num_learners=2, clip_grad_norm=1.0,
            follow=kind != "remote_follow_false")
        gae = GAE(gamma=0.99, lmbda=0.95, value_network=critic, average_gae=True)
        torch.manual_seed(1)  # the collection's draws, whatever building the learner drew
        collector = Collector(env, actor, frames_per_batch=frames, total_frames=frames * args.cartpole,
                              auto_register_policy_transforms=False)
        lengths, start = [], time.perf_counter()
        for i, data in enumerate(collector):
            ended = data["next", "done"].squeeze(-1)
            lengths.append(float(data["next", "step_count"][ended].float().mean()) if ended.any() else float("nan"))
            with torch.no_grad():
                gae(data)
            flat = data.reshape(-1)
            if kind == "remote_update_minibatches":
                learner.update_minibatches(flat, minibatch, epochs=epochs, seed=i)
                continue
            generator = torch.Generator().manual_seed(i)
            for _ in range(epochs):
                for index in torch.randperm(frames, generator=generator).split(minibatch):
                    learner.update(flat[index])
        results[kind] = {"episode_length": lengths, "seconds": time.perf_counter() - start,
                         "first_3": harness.median(lengths[:3]), "last_3": harness.median(lengths[-3:])}
        print(kind, results[kind]["first_3"], "->", results[kind]["last_3"], f"{results[kind]['seconds']:.0f} s",
              flush=True)
        collector.shutdown()
        learner.close()
    if args.out:
        harness.write_result(args.out, {"settings": vars(args), "machine": harness.machine(),
                                        "provenance": harness.provenance(), "iterations": args.cartpole,
                                        "frames_per_iteration": frames, "epochs": epochs, "minibatch_size": minibatch,
                                        "results": results})


BOUNDARY = {"weights_21M": 21_000_000, "ppo_batch_2048": 2048 * (2 * 17 + 6 + 1 + 1 + 1 + 1 + 1)}  # floats


def _peer(conn, port: int, shared: dict[str, torch.Tensor]) -> None:
    """The boundary's other process: receives each payload as told and answers with its first float."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=1, world_size=2,
                            timeout=timedelta(seconds=120))
    buffers = {k: torch.empty(n) for k, n in BOUNDARY.items()}
    for how, name in iter(conn.recv, None):
        if how == "shared":
            value = float(shared[name][0])  # read through the mapping: the bytes are already here
        elif how in ("pipe", "torch_mp"):
            value = float(conn.recv()[0])
        else:
            dist.recv(buffers[name], src=0)
            value = float(buffers[name][0])
        conn.send(value)
    dist.destroy_process_group()


def boundary(args) -> None:
    """Between two CPU processes, medians of 9 interleaved repetitions (the first warms up): ``shared`` (a copy into
    shared memory the peer maps, then a one-byte notification), ``pipe`` (the bytes pickled through a pipe),
    ``torch_mp`` (a fresh tensor through ``torch.multiprocessing``) and ``gloo`` (``send``/``recv``), for the 21M
    policy's weights and a PPO batch of 2048 MuJoCo-like frames."""
    import torch.distributed as dist
    import torch.multiprocessing as mp

    port, reps = harness.free_port(), 9
    shared = {k: torch.zeros(n).share_memory_() for k, n in BOUNDARY.items()}
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    peer = ctx.Process(target=_peer, args=(there, port, shared), daemon=True)
    peer.start()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=2,
                            timeout=timedelta(seconds=120))
    data = {k: torch.randn(n) for k, n in BOUNDARY.items()}
    times: dict[str, list[float]] = {}
    try:
        for rep in range(reps):
            for name, tensor in data.items():
                for how in harness.rotation(rep, ["shared", "pipe", "torch_mp", "gloo"]):
                    tensor[0] = float(rep)
                    start = time.perf_counter()
                    if how == "shared":
                        shared[name].copy_(tensor)
                    here.send((how, name))
                    if how == "pipe":
                        here.send(tensor.numpy())  # bytes through the pipe, as a plain RPC would send them
                    elif how == "torch_mp":
                        here.send(tensor.clone())  # torch's reducer moves the storage to shared memory, sends a handle
                    elif how == "gloo":
                        dist.send(tensor, dst=1)
                    assert here.recv() == float(rep)  # the peer holds this repetition's payload
                    times.setdefault(f"{name}/{how}", []).append(time.perf_counter() - start)
    finally:
        here.send(None)
        peer.join(timeout=60)
        dist.destroy_process_group()
    result = {}
    for key, ts in times.items():
        ms = statistics.median(ts[1:]) * 1e3  # the first repetition warms up
        result[key] = {"median_ms": round(ms, 2), "MB_per_s": round(BOUNDARY[key.split("/")[0]] * 4 / 1e6 / (ms / 1e3))}
    harness.show(result)
    if args.out:
        harness.write_result(args.out, {"reps": reps, "payload_floats": BOUNDARY, "results": result})


def parser():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", default="ppo", choices=["ppo", "dqn", "grpo"])
    p.add_argument("--strategy", default="ddp", choices=["ddp", "fsdp"])
    p.add_argument("--batch", type=int, help="global batch (each rank gets half): default 512, grpo 8 chats")
    p.add_argument("--hidden", type=int, default=512, help="grpo: the model's hidden size")
    p.add_argument("--layers", type=int, default=8, help="grpo: the model's decoder layers")
    p.add_argument("--reps", type=int, default=4)
    p.add_argument("--blocks", type=int, default=5)
    p.add_argument("--inner", type=int, default=10)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--quick", action="store_true", help="2 repetitions of 3 blocks")
    p.add_argument("--torchrl", action="store_true", help="also time torchrl's private Ray learner")
    p.add_argument("--compiled", action="store_true",
                   help="also time update() through a Ray compiled graph over the same actors (a measurement)")
    p.add_argument("--many", action="store_true",
                   help="many updates per call (update_minibatches: PPO 10 epochs x 8 minibatches, DQN 16 updates, "
                        "also update_from_buffer with buffers beside the ranks)")
    p.add_argument("--cartpole", type=int, metavar="N",
                   help="a hand-written PPO loop on CartPole-v1 for N iterations, local and remote (learning)")
    p.add_argument("--boundary", action="store_true", help="what crossing a process boundary costs, without Ray")
    p.add_argument("--out")
    p.add_argument("--spmd-out", help=argparse.SUPPRESS)
    return p


def main() -> None:
    p = parser()
    args = p.parse_args()
    harness.set_one_thread()
    if args.boundary:
        return boundary(args)
    if args.cartpole:
        return cartpole(args)
    if args.batch is None:
        args.batch = 8 if args.workload == "grpo" else 512
    if args.spmd_out:
        return spmd(args)
    if args.quick:
        args.reps, args.blocks = 2, 3
        if args.workload == "grpo" or args.many:  # steps of about a second: fewer of them
            args.inner, args.warmup = 2, 2
    if args.workload == "grpo" and (args.torchrl or args.many):
        p.error("--torchrl and --many time PPO / DQN batches, not grpo")
    measure(args)


if __name__ == "__main__":
    main()
