"""RemoteLearner against the same strategy and ranks run as an SPMD program, on the same batches.

    OMP_NUM_THREADS=1 python benchmarks/remote_learner.py --quick --out remote_learner.json

Contenders, each on the same global batches (2 ranks, gloo, CPU, one thread per rank, clipping at 1.0):
``--workload ppo`` / ``dqn``: ``common.make_batches``, Adam; ``--workload grpo``: torchrl's ``GRPOLoss``
(token mean) over a Qwen2-family model built from a config (``fabric_learner.testing.tiny_causal_lm``,
``--hidden`` / ``--layers``, no download), AdamW, global batches of ``--batch`` chats whose replies have
12 to 36 words, dealt to the ranks by tokens as ``RemoteLearner`` deals them (``remote._shares.split``):
- ``spmd``: ``FabricLearner(strategy="ddp")`` under torchrun, every rank updating on its half of
  each global batch (what a script that becomes an SPMD program runs); per-update wall time of rank 0,
  with a barrier around each timed block;
- ``remote``: ``RemoteLearner(strategy="ddp", num_learners=2)`` driven from this process,
  ``update(batch)`` on the whole batch (split; small shares inside the actor call, large ones through
  Ray's object store; combined);
- ``remote_stored`` (not for grpo): the same learner with every share sent through the object store
  (``ray.put``), as ``update`` did before small shares rode inside the call: the change, paired;
- ``spmd_in_actors``: the SPMD program run on the learner's own ranks, in its Ray actors (each rank
  updates on its own share of each batch, barrier around the block: ``rank_loop``), in blocks that
  alternate with ``remote``'s: the ratio remote / spmd_in_actors, paired block by block, is the
  controller's cost on the very same processes and group, with far less of the load's noise than
  the separate torchrun launches (which also differ by not hosting Ray's threads);
- ``remote_ranks_own``: within ``remote``'s own calls, the slower rank's time in ``FabricLearner.update``
  (``RemoteLearner.last_rank_seconds``): remote / remote_ranks_own is the controller's and Ray's
  share of the very same updates, whatever the load did to the step itself;
- ``remote_compiled`` (``--compiled``): ``update(batch)``'s same split, rank method and combining
  through a Ray compiled graph (``ray.dag``, ``experimental_compile``) over the same actors instead of
  Ray's task path: what that path would give (a measurement; the learner does not use it);
- ``remote_pipelined``: the same learner with ``update(batch, wait=False)`` (two in flight): the
  updates per second a controller gets when it does not wait for each one;
- ``torchrl_ray`` (``--torchrl``): torchrl 0.14.1's private Ray learner (``learner_backend="ray"``:
  ``_RayTrainerExecution``, DDP ranks as Ray actors, each sampling its half from a ``RayReplayBuffer``
  actor), one optimization step per ``step(1)``, against ``remote_sampled``: RemoteLearner fed by
  a replay buffer in this process (``rb.sample(batch)`` then ``update``), the same loss and batch size.

``--many``: many updates per call instead, ``update_minibatches`` (PPO: 10 epochs x 8 minibatches of each
global batch, seeded partitions, 80 updates a call; DQN: 16 in-order updates of ``--batch`` each, 16
sampled batches concatenated) against the same loop under torchrun (``spmd``: each rank
``FabricLearner.update_minibatches`` on the share ``RemoteLearner`` would send it) and on the learner's
own actors (``spmd_in_actors``); per-update times are a call's time over its updates.

SPMD launches and remote blocks take turns (``harness.rotation``), so both see the machine's load
alike; ratios are paired per repetition (``harness.bootstrap_ci``). Also reported: the bytes sent per
update (the shares) against the batch's own size, and the size Ray's object store holds for a share.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RL_WARNINGS", "False")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common
import harness
import torch

RANKS = 2


REPLY_WORDS = (12, 36)  # grpo: each reply's length in words, uniform in [lo, hi)


def optimizer(workload: str):
    if workload == "grpo":
        return functools.partial(torch.optim.AdamW, lr=1e-5)
    return functools.partial(torch.optim.Adam, lr=1e-3)


def grpo_loss(hidden: int, layers: int):
    """torchrl's ``GRPOLoss`` (token mean) over ``tiny_causal_lm``'s Qwen2 at this size, seed 0's weights."""
    from torchrl.modules.llm import TransformersWrapper
    from torchrl.objectives.llm import GRPOLoss

    from fabric_learner.testing import tiny_causal_lm, tiny_tokenizer

    tokenizer = tiny_tokenizer()
    policy = TransformersWrapper(tiny_causal_lm(0, tokenizer=tokenizer, hidden_size=hidden, num_layers=layers),
                                 tokenizer=tokenizer, input_mode="history", generate=False, return_log_probs=True,
                                 pad_output=False)
    return GRPOLoss(policy, masking_strategy="rlhf")


def make_loss(args):
    """The workload's loss: an object for ppo / dqn, for grpo a factory each rank calls (no tokenizer pickled)."""
    if args.workload == "grpo":
        return functools.partial(grpo_loss, args.hidden, args.layers)
    return common.make_loss(args.workload)[0]


def built_loss(args):
    loss = make_loss(args)
    return loss() if args.workload == "grpo" else loss


def share_of(batch, rank: int):
    """Rank ``rank``'s share of a global batch, exactly as ``RemoteLearner.update`` cuts it."""
    from fabric_learner.remote import _shares

    return _shares.split(batch, RANKS)[0][rank]


def many_plan(args):
    """``--many``: ``(minibatch_size, epochs, shuffle, the calls' global batches, updates per call)``."""
    batches = _batches(args)
    if args.workload == "ppo":
        return args.batch // 8, 10, True, batches, 80
    calls = [torch.cat([batches[(c + k) % len(batches)] for k in range(16)]) for c in range(2)]
    return args.batch, 1, False, calls, 16


def many_share(batch, rank: int, minibatch_size: int, shuffle: bool):
    """Rank ``rank``'s share of a call's batch, as ``RemoteLearner.update_minibatches`` cuts it."""
    if shuffle:
        return share_of(batch, rank)
    part = minibatch_size // RANKS
    steps = torch.arange(batch.batch_size[0] // minibatch_size).unsqueeze(1) * minibatch_size
    return batch[(steps + rank * part + torch.arange(part)).reshape(-1)]


def rank_loop_many(rank_learner, shares, order, minibatch_size, epochs, shuffle) -> float:
    """``rank_loop`` for ``--many``: each rank's own ``update_minibatches`` on its share; seconds per call."""
    import time

    import torch.distributed as dist

    mine = [share[rank_learner.global_rank] for share in shares]
    dist.barrier()
    t0 = time.perf_counter()
    for i in order:
        rank_learner.update_minibatches(mine[i], minibatch_size, epochs=epochs, shuffle=shuffle, seed=i)
    dist.barrier()
    return (time.perf_counter() - t0) / len(order)


def spmd_many(args) -> None:
    """One torchrun rank, ``--many``: time blocks of ``inner`` calls of ``update_minibatches`` on its shares."""
    from fabric_learner import FabricLearner

    harness.set_one_thread()
    learner = FabricLearner(built_loss(args), optimizer(args.workload), strategy=args.strategy, accelerator="cpu",
                            clip_grad_norm=common.CLIP)
    rank = learner.global_rank
    minibatch, epochs, shuffle, calls, steps = many_plan(args)
    shares = [many_share(b, rank, minibatch, shuffle) for b in calls]
    barrier = torch.distributed.barrier
    for i in range(args.warmup):
        learner.update_minibatches(shares[i % len(shares)], minibatch // RANKS, epochs=epochs, shuffle=shuffle, seed=i)
    samples = []
    for block in range(args.blocks):
        barrier()
        t0 = time.perf_counter()
        for i in range(args.inner):
            c = (block * args.inner + i) % len(shares)
            learner.update_minibatches(shares[c], minibatch // RANKS, epochs=epochs, shuffle=shuffle, seed=c)
        barrier()
        samples.append((time.perf_counter() - t0) / (args.inner * steps))
    if rank == 0:
        harness.write_json(args.spmd_out, samples)
    learner.close()


def main_many(args) -> None:
    """``--many``: RemoteLearner.update_minibatches against the same loop as SPMD, per update."""
    import ray

    from fabric_learner import RemoteLearner

    ray.init(num_cpus=16, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    minibatch, epochs, shuffle, calls, steps = many_plan(args)
    learner = RemoteLearner(make_loss(args), optimizer(args.workload), strategy=args.strategy, num_learners=RANKS,
                            clip_grad_norm=common.CLIP)
    for i in range(args.warmup):
        learner.update_minibatches(calls[i % len(calls)], minibatch, epochs=epochs, shuffle=shuffle, seed=i)
    rank_shares = [[many_share(b, r, minibatch, shuffle) for r in range(RANKS)] for b in calls]
    times: dict[str, list[float]] = {"spmd": [], "remote": [], "spmd_in_actors": []}
    blocks: dict[str, list[float]] = {"remote": [], "spmd_in_actors": [], "remote_ranks_own": [],
                                      "single_follow": [], "single_no_follow": []}
    singles = _batches(args)  # update(batch), one step a call: with the loss here following, and without (paired)
    follower = learner._follower
    for rep in range(args.reps):
        for name in harness.rotation(rep, ["spmd", "remote"]):
            if name == "spmd":
                with harness.scratch_path() as path:
                    argv = [*harness.torchrun(RANKS, os.path.abspath(__file__)), "--spmd-out", path, "--many",
                            "--workload", args.workload, "--batch", str(args.batch), "--blocks", str(args.blocks),
                            "--inner", str(args.inner), "--warmup", str(args.warmup), "--strategy", args.strategy]
                    harness.run_bounded(argv, 600, "the SPMD program")
                    times["spmd"].append(harness.median(harness.read_json(path)))
                continue
            sync, in_actors, own = [], [], []
            for block in range(args.blocks):
                order = [(block * args.inner + i) % len(calls) for i in range(args.inner)]
                for turn in (("remote", "actors") if block % 2 == 0 else ("actors", "remote")):
                    if turn == "actors":
                        per_call = learner.call_on_ranks(rank_loop_many, rank_shares, order, minibatch // RANKS,
                                                         epochs, shuffle)[0]
                        in_actors.append(per_call / steps)
                        continue
                    t0, ranks = time.perf_counter(), 0.0
                    for c in order:
                        learner.update_minibatches(calls[c], minibatch, epochs=epochs, shuffle=shuffle, seed=c)
                        ranks += max(learner.last_rank_seconds)
                        transfer = dict(learner.last_transfer)  # a call's: its batch, its steps' outputs
                    sync.append((time.perf_counter() - t0) / (args.inner * steps))
                    own.append(ranks / (args.inner * steps))
                for follow in ((True, False) if block % 2 == 0 else (False, True)):
                    learner._follower = follower if follow else None
                    t0 = time.perf_counter()
                    for i in range(10):
                        learner.update(singles[i % len(singles)])
                    blocks["single_follow" if follow else "single_no_follow"].append((time.perf_counter() - t0) / 10)
                learner._follower = follower
            blocks["remote"] += sync
            blocks["spmd_in_actors"] += in_actors
            blocks["remote_ranks_own"] += own
            times["remote"].append(harness.median(sync))
            times["spmd_in_actors"].append(harness.median(in_actors))
    learner.close()
    goal = 1.05
    result = {
        "settings": vars(args), "machine": harness.machine(), "provenance": harness.provenance(),
        "updates_per_call": steps, "minibatch_size": minibatch, "epochs": epochs, "shuffle": shuffle,
        "seconds_per_update": times, "transfer_per_call": transfer, "seconds_per_block": blocks,
        "remote_over_spmd": {"ratio": harness.paired_ratio(times["remote"], times["spmd"]),
                             "ci": harness.bootstrap_ci(times["remote"], times["spmd"]), "goal": goal},
        "remote_over_spmd_in_actors": {"ratio": harness.paired_ratio(blocks["remote"], blocks["spmd_in_actors"]),
                                       "ci": harness.bootstrap_ci(blocks["remote"], blocks["spmd_in_actors"]),
                                       "goal": goal},
        "remote_over_its_ranks_own_time": {"ratio": harness.paired_ratio(blocks["remote"], blocks["remote_ranks_own"]),
                                           "ci": harness.bootstrap_ci(blocks["remote"], blocks["remote_ranks_own"])},
        # update(batch) one step a call, the loss here following (nothing run here: a check for buffers written)
        # against follow=False, in alternating blocks of 10: what following adds to the single-step path
        "single_step_follow_over_no_follow": {
            "ratio": harness.paired_ratio(blocks["single_follow"], blocks["single_no_follow"]),
            "ci": harness.bootstrap_ci(blocks["single_follow"], blocks["single_no_follow"])},
    }
    print(json.dumps({k: v for k, v in result.items() if k not in ("settings", "machine", "provenance",
                                                                    "seconds_per_block")}, indent=1))
    if args.out:
        harness.write_result(args.out, result)


def cartpole(args) -> None:
    """``--cartpole N``: a hand-written PPO loop on CartPole-v1 (torchrl ``Collector`` running the loss's actor,
    GAE in the script on the loss's critic, ``learner.update(minibatch)``, no hooks, nothing published), N
    iterations of 512 frames, 4 epochs of 8 minibatches, on ``LocalLearner``; on ``RemoteLearner(strategy="fsdp",
    num_learners=2)`` (the one line swapped); the same with ``follow=False`` (the loss here stays as built, as
    before #67); and ``RemoteLearner.update_minibatches`` (one call an iteration). Same seeds for all: episode
    lengths per iteration and wall time."""
    import ray
    from tensordict.nn import TensorDictModule
    from torch.distributions import OneHotCategorical
    from torchrl.collectors import Collector
    from torchrl.envs import GymEnv, StepCounter, TransformedEnv
    from torchrl.modules import MLP, ProbabilisticActor, ValueOperator
    from torchrl.objectives import ClipPPOLoss
    from torchrl.objectives.value import GAE

    from fabric_learner import LocalLearner, RemoteLearner

    ray.init(num_cpus=16, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
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
        if kind == "local":
            learner = LocalLearner(loss, adam, policy=actor, clip_grad_norm=1.0)
        else:
            learner = RemoteLearner(loss, adam, policy=actor, strategy="fsdp", num_learners=2, clip_grad_norm=1.0,
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
    result = {"settings": vars(args), "machine": harness.machine(), "provenance": harness.provenance(),
              "iterations": args.cartpole, "frames_per_iteration": frames, "epochs": epochs,
              "minibatch_size": minibatch, "results": results}
    if args.out:
        harness.write_result(args.out, result)


def spmd(args) -> None:
    """One torchrun rank: time ``inner``-update blocks of FabricLearner(strategy="ddp") on its halves."""
    from fabric_learner import FabricLearner

    harness.set_one_thread()
    learner = FabricLearner(built_loss(args), optimizer(args.workload), strategy=args.strategy, accelerator="cpu",
                            clip_grad_norm=common.CLIP)
    rank = learner.global_rank
    batches = [share_of(b, rank) for b in _batches(args)]
    barrier = torch.distributed.barrier
    for i in range(args.warmup):
        learner.update(batches[i % len(batches)])
    samples = []
    for block in range(args.blocks):
        barrier()
        t0 = time.perf_counter()
        for i in range(args.inner):
            learner.update(batches[(block * args.inner + i) % len(batches)])
        barrier()
        samples.append((time.perf_counter() - t0) / args.inner)
    if rank == 0:
        harness.write_json(args.spmd_out, samples)
    learner.close()


def rank_loop(rank_learner, shares, order) -> float:
    """The SPMD program on the learner's own ranks (in its Ray actors): each rank updates on its own
    share of each batch, with a barrier before and after; seconds per update. What the ranks do when
    nothing stands between them and their data, on the same processes, group and learner."""
    import time

    import torch.distributed as dist

    mine = [share[rank_learner.global_rank] for share in shares]
    dist.barrier()
    t0 = time.perf_counter()
    for i in order:
        rank_learner.update(mine[i])
    dist.barrier()
    return (time.perf_counter() - t0) / len(order)


def compiled_updater(learner):
    """``update(batch)`` through a Ray compiled graph over the learner's own actors (``--compiled``): the
    same split, the same rank method and the same combining, with Ray's task path replaced by its
    compiled-graph channels. A measurement of what that path would give, not a learner: no fault
    handling, no write-back, no transfer report. Returns ``(update, teardown)``."""
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


def _batches(args):
    if args.workload != "grpo":
        return common.make_batches(args.workload, count=4, n=args.batch)
    from fabric_learner.testing import grpo_batch

    policy = built_loss(args).actor_network  # seed 0's weights: the log-probs are the policy's own
    generator = torch.Generator().manual_seed(1000)
    return [grpo_batch(policy, torch.randint(*REPLY_WORDS, (args.batch,), generator=generator).tolist(), seed=10 + i)
            for i in range(2)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="ppo", choices=["ppo", "dqn", "grpo"])
    parser.add_argument("--strategy", default="ddp", choices=["ddp", "fsdp"])
    parser.add_argument("--batch", type=int, help="global batch (each rank gets half): default 512, grpo 8 chats")
    parser.add_argument("--hidden", type=int, default=512, help="grpo: the model's hidden size")
    parser.add_argument("--layers", type=int, default=8, help="grpo: the model's decoder layers")
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=5)
    parser.add_argument("--inner", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="2 repetitions of 3 blocks")
    parser.add_argument("--torchrl", action="store_true", help="also time torchrl's private Ray learner")
    parser.add_argument("--compiled", action="store_true",
                        help="also time update() through a Ray compiled graph over the same actors (a measurement)")
    parser.add_argument("--many", action="store_true",
                        help="many updates per call (update_minibatches: PPO 10 epochs x 8 minibatches, DQN 16 updates)")
    parser.add_argument("--cartpole", type=int, metavar="N",
                        help="a hand-written PPO loop on CartPole-v1 for N iterations, local and remote (learning)")
    parser.add_argument("--out")
    parser.add_argument("--spmd-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.cartpole:
        harness.set_one_thread()
        return cartpole(args)
    if args.spmd_out:
        return spmd_many(args) if args.many else spmd(args)
    if args.batch is None:
        args.batch = 8 if args.workload == "grpo" else 512
    if args.quick:
        args.reps, args.blocks = 2, 3
        if args.workload == "grpo":  # steps of about a second: fewer of them
            args.inner, args.warmup = 2, 2
    if args.workload == "grpo" and args.torchrl:
        parser.error("--torchrl times PPO / DQN batches from a replay buffer, not grpo")
    harness.set_one_thread()
    if args.many:
        if args.workload == "grpo":
            parser.error("--many times PPO's epochs and DQN's K updates, not grpo")
        if args.quick:
            args.inner, args.warmup = 2, 2
        return main_many(args)
    import ray

    from fabric_learner import RemoteLearner
    from fabric_learner.remote import learner as remote_module

    # logical CPUs for scheduling only (the contenders take turns on the machine's cores)
    ray.init(num_cpus=16, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    batches = _batches(args)
    learner = RemoteLearner(make_loss(args), optimizer(args.workload), strategy=args.strategy, num_learners=RANKS,
                            clip_grad_norm=common.CLIP, max_in_flight=2)
    for i in range(args.warmup):
        learner.update(batches[i % len(batches)])
    if args.compiled:
        compiled_update, teardown = compiled_updater(learner)
        for i in range(args.warmup):
            compiled_update(batches[i % len(batches)])
    times: dict[str, list[float]] = {"spmd": [], "remote": [], "remote_pipelined": [], "spmd_in_actors": []}
    blocks: dict[str, list[float]] = {"remote": [], "spmd_in_actors": [], "remote_pipelined": [], "remote_stored": [],
                                      "remote_ranks_own": [], "remote_compiled": []}
    rank_shares = [[share_of(b, r) for r in range(RANKS)] for b in batches]
    stored = args.workload != "grpo"
    if stored:
        times["remote_stored"] = []
    names = ["spmd", "remote"]
    if args.torchrl:
        from torchrl.data import LazyTensorStorage, ReplayBuffer

        data = torch.cat(batches)
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
                theirs, ours = [], []
                for _ in range(args.blocks):
                    t0 = time.perf_counter()
                    for _ in range(args.inner):
                        execution.step(1)
                    theirs.append((time.perf_counter() - t0) / args.inner)
                    t0 = time.perf_counter()
                    for _ in range(args.inner):
                        learner.update(local_rb.sample())
                    ours.append((time.perf_counter() - t0) / args.inner)
                times["torchrl_ray"].append(harness.median(theirs))
                times["remote_sampled"].append(harness.median(ours))
                continue
            if name == "spmd":
                with harness.scratch_path() as path:
                    argv = [*harness.torchrun(RANKS, os.path.abspath(__file__)), "--spmd-out", path,
                            "--workload", args.workload, "--batch", str(args.batch), "--blocks", str(args.blocks),
                            "--inner", str(args.inner), "--warmup", str(args.warmup), "--strategy", args.strategy,
                            "--hidden", str(args.hidden), "--layers", str(args.layers)]
                    harness.run_bounded(argv, 600, "the SPMD program")
                    times["spmd"].append(harness.median(harness.read_json(path)))
                continue
            sync, piped, through_store, in_actors, own, through_graph = [], [], [], [], [], []
            for block in range(args.blocks):
                order = [(block * args.inner + i) % len(batches) for i in range(args.inner)]
                # the remote call and the same ranks' own SPMD loop alternate who goes first, block by block
                for turn in (("remote", "actors") if block % 2 == 0 else ("actors", "remote")):
                    if turn == "actors":
                        in_actors.append(learner.call_on_ranks(rank_loop, rank_shares, order)[0])
                        continue
                    t0, ranks = time.perf_counter(), 0.0
                    for i in order:
                        learner.update(batches[i])
                        ranks += max(learner.last_rank_seconds)  # the slower rank's own time in this update
                    sync.append((time.perf_counter() - t0) / args.inner)
                    own.append(ranks / args.inner)
                if args.compiled:
                    t0 = time.perf_counter()
                    for i in order:
                        compiled_update(batches[i])
                    through_graph.append((time.perf_counter() - t0) / args.inner)
                if stored:
                    inline, remote_module.INLINE_BYTES = remote_module.INLINE_BYTES, -1
                    t0 = time.perf_counter()
                    for i in order:
                        learner.update(batches[i])
                    through_store.append((time.perf_counter() - t0) / args.inner)
                    remote_module.INLINE_BYTES = inline
                t0 = time.perf_counter()
                handles = [learner.update(batches[i], wait=False) for i in order]
                handles[-1].result()
                piped.append((time.perf_counter() - t0) / args.inner)
            blocks["remote"] += sync
            blocks["spmd_in_actors"] += in_actors
            blocks["remote_ranks_own"] += own
            blocks["remote_compiled"] += through_graph
            blocks["remote_pipelined"] += piped
            times["remote"].append(harness.median(sync))
            times["spmd_in_actors"].append(harness.median(in_actors))
            times["remote_pipelined"].append(harness.median(piped))
            if stored:
                blocks["remote_stored"] += through_store
                times["remote_stored"].append(harness.median(through_store))
    transfer = dict(learner.last_transfer)
    from fabric_learner.remote.actors import packed

    ref = ray.put(packed(share_of(batches[0], 0)))  # as update() puts a share too large to ride in the call
    transfer["object_store_bytes_per_share_if_stored"] = ray.experimental.get_object_locations([ref])[ref]["object_size"]
    if args.compiled:
        teardown()
    learner.close()
    if args.torchrl:
        execution.shutdown()
        ray_rb.close()
    result = {
        "settings": vars(args), "machine": harness.machine(), "provenance": harness.provenance(),
        "seconds_per_update": times, "transfer_per_update": transfer,
        "remote_over_spmd": {
            "ratio": harness.paired_ratio(times["remote"], times["spmd"]),
            "ci": harness.bootstrap_ci(times["remote"], times["spmd"]),
            "goal": 1.02 if args.workload == "grpo" else 1.10},
        "remote_stored_over_spmd": stored and {
            "ratio": harness.paired_ratio(times["remote_stored"], times["spmd"]),
            "ci": harness.bootstrap_ci(times["remote_stored"], times["spmd"])},
        "remote_over_remote_stored": stored and {
            "ratio": harness.paired_ratio(times["remote"], times["remote_stored"]),
            "ci": harness.bootstrap_ci(times["remote"], times["remote_stored"])},
        "remote_over_spmd_in_actors": {  # paired block by block: the controller's cost on the very same ranks
            "ratio": harness.paired_ratio(blocks["remote"], blocks["spmd_in_actors"]),
            "ci": harness.bootstrap_ci(blocks["remote"], blocks["spmd_in_actors"]),
            "goal": 1.02 if args.workload == "grpo" else 1.10},
        "remote_over_its_ranks_own_time": {  # the same calls: the controller's wall time over the slower rank's update
            "ratio": harness.paired_ratio(blocks["remote"], blocks["remote_ranks_own"]),
            "ci": harness.bootstrap_ci(blocks["remote"], blocks["remote_ranks_own"])},
        "remote_compiled_over_spmd_in_actors": args.compiled and {
            "ratio": harness.paired_ratio(blocks["remote_compiled"], blocks["spmd_in_actors"]),
            "ci": harness.bootstrap_ci(blocks["remote_compiled"], blocks["spmd_in_actors"])},
        "remote_compiled_over_remote": args.compiled and {
            "ratio": harness.paired_ratio(blocks["remote_compiled"], blocks["remote"]),
            "ci": harness.bootstrap_ci(blocks["remote_compiled"], blocks["remote"])},
        "remote_stored_over_spmd_in_actors": stored and {
            "ratio": harness.paired_ratio(blocks["remote_stored"], blocks["spmd_in_actors"]),
            "ci": harness.bootstrap_ci(blocks["remote_stored"], blocks["spmd_in_actors"])},
        "pipelined_updates_per_s_over_spmd_in_actors": {
            "ratio": harness.paired_ratio(blocks["spmd_in_actors"], blocks["remote_pipelined"]),
            "ci": harness.bootstrap_ci(blocks["spmd_in_actors"], blocks["remote_pipelined"]), "goal": 0.95},
        "seconds_per_block": blocks,
        "pipelined_updates_per_s_over_spmd": {
            "ratio": harness.paired_ratio(times["spmd"], times["remote_pipelined"]),
            "ci": harness.bootstrap_ci(times["spmd"], times["remote_pipelined"]), "goal": 0.95},
    }
    if args.torchrl:
        result["remote_over_torchrl_ray"] = {
            "ratio": harness.paired_ratio(times["remote_sampled"], times["torchrl_ray"]),
            "ci": harness.bootstrap_ci(times["remote_sampled"], times["torchrl_ray"]), "goal": "< 1 (faster)"}
    print(json.dumps({k: v for k, v in result.items() if k not in ("settings", "machine", "provenance")}, indent=1))
    if args.out:
        harness.write_result(args.out, result)


if __name__ == "__main__":
    main()
