"""Tensor parallel x FSDP2 on a 2 x 2 mesh (examples/ppo_tensor_parallel.py), in one 4-rank launch.

The oracle is the project's: one SGD step on the mesh equals one process on the two data-parallel
ranks' batches; ranks of a tensor-parallel group agree bit for bit; checkpoints move between the
mesh, FSDP and DDP on 4 ranks and one process, both ways.
"""

from __future__ import annotations

import functools
import os
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from multiproc import RELAY, ROOT, WORKERS, forked_ranks, free_port, launch, run
from tensordict import TensorDict

sys.path.insert(0, os.path.join(ROOT, "examples"))

from ppo_tensor_parallel import TP_PLAN, make_batch, make_loss

from fabric_learner import LocalLearner
from fabric_learner.sharding import ShardedLoss, check_sharded, parallelize_layers
from fabric_learner.sharding.agreement import batch_digest

N, LR = 8, 0.1


@pytest.fixture(scope="module")
def mesh_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("mesh")
    proc = launch(os.path.join(WORKERS, "mesh_checks.py"), out, nproc=4, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert proc.leftovers == 0
    return out


@pytest.fixture(scope="module")
def mesh(mesh_dir):
    return [torch.load(mesh_dir / f"rank{r}.pt", weights_only=False) for r in range(4)]


@pytest.fixture(scope="module")
def two_ranks_dir(mesh_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("reshard")
    proc = launch(os.path.join(WORKERS, "mesh_reshard_checks.py"), mesh_dir, out, nproc=2, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert proc.leftovers == 0
    return out


@pytest.fixture(scope="module")
def two_ranks(two_ranks_dir):
    return [torch.load(two_ranks_dir / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.fixture(scope="module")
def trainer_run(two_ranks_dir, tmp_path_factory):
    """The Trainer on the 2 x 2 mesh, then the 2-rank saves loaded into the mesh: one 4-rank launch."""
    out = tmp_path_factory.mktemp("mesh_trainer")
    proc = launch(os.path.join(WORKERS, "mesh_trainer_checks.py"), out, two_ranks_dir, nproc=4, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert proc.leftovers == 0
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(4)]


def largest_difference(a, b):
    assert sorted(a) == sorted(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_parameters_are_sharded_over_both_dimensions(mesh):
    params = mesh[0]["step"]["params"]
    assert len(params) == 8
    for name, p in params.items():
        assert p["mesh"] == ("data_parallel", "tensor_parallel"), name
    first = params["actor_network_params.module.0.module.0.0.weight"]
    assert first["placements"][1] == "S(0)"  # ColwiseParallel: output features
    assert params["critic_network_params.module.2.weight"]["placements"][1] == "S(1)"  # RowwiseParallel: inputs
    assert tuple(first["local"].shape) == (4, 4)  # 16 x 4 cut in 2 by tp, then in 2 by dp


def test_collectives_reduce_over_the_data_parallel_ranks_only(mesh):
    for rank, res in enumerate(mesh):
        red = res["step"]["reductions"]
        assert red["dp_size"] == 2 and red["tp_size"] == 2
        assert red["dp_rank"] == rank // 2
        assert red["tp_group"] == [2 * (rank // 2), 2 * (rank // 2) + 1]
        assert red["dp_group"] == [rank % 2, rank % 2 + 2]
        assert red["count"] == 2.0 and red["mean"] == 0.5  # sums over 2 ranks, not 4


def test_one_step_on_the_mesh_equals_one_process_on_the_whole_batch(mesh):
    learner = LocalLearner(make_loss()[0], functools.partial(torch.optim.SGD, lr=LR))
    out = learner.update(torch.cat([make_batch(N, seed=0), make_batch(N, seed=1)]))
    expected = dict(learner.get_weights().items(True, True))
    for res in mesh:
        assert res["step"]["weights_plain"]
        assert largest_difference(res["step"]["weights"], expected) < 1e-5
    torch.testing.assert_close(mesh[0]["step"]["out"]["grad_norm"], out["grad_norm"], atol=1e-5, rtol=0)


def test_the_ranks_of_a_tensor_parallel_group_agree_bit_for_bit(mesh):
    for a, b in ((0, 1), (2, 3)):
        outs = mesh[a]["step"]["out"], mesh[b]["step"]["out"]
        assert all(torch.equal(outs[0][k], outs[1][k]) for k in outs[0])
        for name, p in mesh[a]["step"]["params"].items():
            if p["placements"][1] == "R":  # left whole on the tensor-parallel dimension: equal shards
                assert torch.equal(p["local"], mesh[b]["step"]["params"][name]["local"]), name
    assert not torch.equal(mesh[0]["step"]["out"]["loss_objective"], mesh[2]["step"]["out"]["loss_objective"])


def test_get_weights_are_full_plain_tensors_equal_on_every_rank(mesh):
    shapes = {k: tuple(v.shape) for k, v in mesh[0]["step"]["weights"].items()}
    assert shapes[("actor_network_params", "module", "0", "module", "0", "0", "weight")] == (16, 4)
    for res in mesh[1:]:
        assert largest_difference(res["step"]["weights"], mesh[0]["step"]["weights"]) == 0


def test_different_batches_in_a_tensor_parallel_group_are_refused_on_every_rank_before_anything_changes(mesh):
    initial = dict(LocalLearner(make_loss()[0]).get_weights().items(True, True))
    for res in mesh:
        refused = res["mismatch"]
        assert refused is not None
        err = refused["error"]
        assert "tensor-parallel group(s) [[0, 1], [2, 3]]" in err
        assert "mesh (data_parallel=2, tensor_parallel=2)" in err and "data_parallel_rank()" in err
        assert largest_difference(refused["weights_after_refusal"], initial) == 0
        # and the learner still trains: the right batches then give the step a fresh learner takes
        assert largest_difference(refused["weights"], res["step"]["weights"]) < 1e-6


def test_fully_shard_over_lightnings_own_mesh_is_refused_as_hsdp_in_disguise(mesh):
    for res in mesh:
        err = res["hsdp_over_lightning"]
        assert err is not None and "that is HSDP over Lightning's mesh" in err
        assert "mesh_dim_names=('replicate', 'shard')" in err


def test_checkpoints_move_between_the_mesh_fsdp_ddp_and_one_process_both_ways(mesh):
    res = mesh[0]["checkpoints"]
    # the mesh's folder, loaded elsewhere, continues as the mesh did (momentum state included)
    for other in ("fsdp", "ddp", "local"):
        assert largest_difference(res[other], res["mesh"]) < 1e-5, other
    # and back: each one's checkpoint loads into the mesh as it was, and steps alike
    for other in ("fsdp", "ddp", "local"):
        assert largest_difference(res[f"{other}_loaded"], res[other]) == 0, other
        assert largest_difference(res[f"{other}_back"], res["fsdp_back"]) < 1e-5, other
    for rank in range(1, 4):
        assert largest_difference(mesh[rank]["checkpoints"]["mesh"], res["mesh"]) == 0


def test_grpo_on_the_mesh_equals_one_process_and_tensor_parallel_ranks_agree_bit_for_bit(mesh):
    from fabric_learner.testing import grpo_batch, grpo_example

    replies = (3, 8, 5, 2)
    loss, policy, _ = grpo_example(replies)
    learner = LocalLearner(loss, functools.partial(torch.optim.SGD, lr=1.0), policy=policy)
    out = learner.update(grpo_batch(policy, list(replies), seed=0))
    expected = dict(learner.get_weights().items(True, True))
    for res in mesh:
        assert largest_difference(res["llm"]["weights"], expected) < 1e-5
    torch.testing.assert_close(mesh[0]["llm"]["out"]["grad_norm"], out["grad_norm"], atol=1e-5, rtol=1e-6)
    for a, b in ((0, 1), (2, 3)):
        assert all(torch.equal(mesh[a]["llm"]["out"][k], mesh[b]["llm"]["out"][k]) for k in mesh[a]["llm"]["out"])
    placements = mesh[0]["llm"]["placements"]
    assert all(dims == ("data_parallel", "tensor_parallel") for dims, _ in placements.values())
    layer = "actor_network.model.model.layers.0."
    assert placements[layer + "self_attn.q_proj.weight"][1][1] == "S(0)"  # heads split
    assert placements[layer + "mlp.down_proj.weight"][1][1] == "S(1)"
    assert placements["actor_network.model.model.embed_tokens.weight"][1][1] == "R"  # whole on each TP rank


def test_the_meshs_checkpoint_loads_into_fsdp_and_ddp_on_two_ranks(mesh, two_ranks):
    # a step on each rank's half of the global batch after the load continues as the mesh did
    for res in two_ranks:
        for name in ("fsdp2", "ddp2"):
            assert largest_difference(res[name], mesh[0]["checkpoints"]["mesh"]) < 1e-5, name


def test_two_rank_fsdp_and_ddp_saves_load_into_the_mesh_and_step_as_one_process(two_ranks, two_ranks_dir,
                                                                               trainer_run):
    for name, path in (("fsdp2", "fsdp2"), ("ddp2", "ddp2.pt")):
        local = LocalLearner(make_loss(seed=7)[0], functools.partial(torch.optim.SGD, lr=LR, momentum=0.9))
        local.load(two_ranks_dir / path)  # momentum buffers included
        local.update(torch.cat([make_batch(N, seed=50), make_batch(N, seed=51)]))
        expected = dict(local.get_weights().items(True, True))
        for rank, res in enumerate(trainer_run):
            saves = res["two_rank_saves"]
            assert largest_difference(saves[f"{name}_loaded"], two_ranks[0][name]) == 0, (name, rank)
            assert largest_difference(saves[f"{name}_stepped"], expected) < 1e-5, (name, rank)


# ---- the Trainer on the mesh ---------------------------------------------------------------------

FRAMES_PER_BATCH, STOP_AFTER = 32, 3  # tests/workers/mesh_trainer_checks.py


def test_the_trainer_counts_frames_over_the_data_parallel_ranks_and_stops_everywhere(trainer_run):
    for rank, res in enumerate(trainer_run):
        assert res["dp_rank"] == rank // 2
        # global rank 1 (tensor-parallel rank 1 of its group, which counts no frames) asked for the stop
        assert len(res["batches"]) == STOP_AFTER, rank
        assert res["collected_frames"] == STOP_AFTER * FRAMES_PER_BATCH * 2  # 2 data-parallel ranks, not 4
        assert [u["frames"] for u in res["updates"]][::4] == [b * FRAMES_PER_BATCH * 2 for b in (1, 2, 3)]
        assert res["num_updates"] == len(res["updates"]) == STOP_AFTER * 4  # 2 epochs of 2 minibatches a batch


def test_the_trainers_tensor_parallel_groups_collect_sample_and_train_alike(trainer_run):
    for a, b in ((0, 1), (2, 3)):
        assert trainer_run[a]["batches"] == trainer_run[b]["batches"]  # same seed: same rollouts
        for x, y in zip(trainer_run[a]["updates"], trainer_run[b]["updates"], strict=True):
            assert x["digest"] == y["digest"]  # same minibatches: the learner's batch check never fired
            assert all(torch.equal(x[k], y[k]) for k in x if k not in ("digest", "frames"))
        for name, (local, placements) in trainer_run[a]["local"].items():
            if placements[1] == "R":  # whole on the tensor-parallel dimension: the same shard, bit for bit
                assert torch.equal(local, trainer_run[b]["local"][name][0]), name
        assert all(torch.equal(v, trainer_run[b]["actor"][k]) for k, v in trainer_run[a]["actor"].items())
    # the two data-parallel ranks explore differently
    assert set(trainer_run[0]["batches"]).isdisjoint(trainer_run[2]["batches"])
    for res in trainer_run[1:]:
        assert largest_difference(res["weights"], trainer_run[0]["weights"]) == 0


def test_the_trainer_logs_loss_averages_over_the_data_parallel_ranks(trainer_run):
    from fabric_learner.trainer.trainer import _mean

    logged = trainer_run[0]["logged"]
    assert logged and all(not res["logged"] for res in trainer_run[1:])  # rank 0's logger only
    for name, value, step in logged:
        steps = [[u[name] for u in trainer_run[r]["updates"] if u["frames"] == step] for r in (0, 2)]
        assert value == pytest.approx(((_mean(steps[0]) + _mean(steps[1])) / 2).item(), abs=1e-6), (name, step)


def test_trainer_checkpoints_move_between_the_mesh_and_ddp_on_the_same_ranks(trainer_run):
    frames = STOP_AFTER * FRAMES_PER_BATCH * 2
    for rank, res in enumerate(trainer_run):
        ddp, mesh = res["relaid"]["ddp"], res["relaid"]["mesh"]
        # 2 data-parallel ranks -> 4: the learner loads as saved, then one batch of 4 x 32 frames
        assert ddp["warnings"] and "written by 2 rank(s) and this run has 4" in ddp["warnings"][0]
        assert largest_difference(ddp["loaded"], trainer_run[0]["weights"]) == 0
        assert ddp["collected_frames"] == frames + 4 * FRAMES_PER_BATCH and len(ddp["batches"]) == 1
        # and back: 4 -> 2, the ranks of each tensor-parallel group resume alike (else the batch check fires)
        assert mesh["warnings"] and "written by 4 rank(s) and this run has 2" in mesh["warnings"][0]
        assert largest_difference(mesh["loaded"], ddp["weights"]) == 0
        assert mesh["collected_frames"] == frames + 6 * FRAMES_PER_BATCH and len(mesh["batches"]) == 1
    for a, b in ((0, 1), (2, 3)):
        x, y = trainer_run[a]["relaid"]["mesh"], trainer_run[b]["relaid"]["mesh"]
        assert x["batches"] == y["batches"] and [u["digest"] for u in x["updates"]] == [u["digest"] for u in y["updates"]]
    assert trainer_run[0]["relaid"]["mesh"]["batches"] != trainer_run[2]["relaid"]["mesh"]["batches"]


@pytest.fixture(scope="module")
def hsdp(tmp_path_factory):
    """Two "nodes" of 2 ranks on this machine, each started by its own torchrun, as on two machines."""
    out, port = tmp_path_factory.mktemp("hsdp"), free_port()

    def node(rank):
        return run([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={rank}",
                    "--nproc-per-node=2", "--master-addr=127.0.0.1", f"--master-port={port}",
                    RELAY, os.path.join(WORKERS, "hsdp_checks.py"), str(out)], timeout=240, **forked_ranks())

    with ThreadPoolExecutor(max_workers=2) as pool:
        nodes = list(pool.map(node, (0, 1)))
    for rank, proc in enumerate(nodes):
        assert proc.returncode == 0 and proc.leftovers == 0, (rank, proc.stdout[-3000:])
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(4)]


def test_hsdp_on_two_nodes_of_two_ranks_equals_one_process(hsdp):
    learner = LocalLearner(make_loss()[0], functools.partial(torch.optim.SGD, lr=LR))
    out = learner.update(make_batch(16, seed=0))  # the four ranks' quarters
    expected = dict(learner.get_weights().items(True, True))
    for res in hsdp:
        assert largest_difference(res["weights"], expected) < 1e-5
        torch.testing.assert_close(res["grad_norm"], out["grad_norm"], atol=1e-5, rtol=0)
        # every rank feeds its own batch: counts reduce over all 4, not over a node
        assert res["dp_size"] == 4 and res["count"] == 4.0
    for dims, placements, ranks in hsdp[0]["params"].values():
        # replicated across the nodes (rows), sharded within each
        assert dims == ("replicate", "shard") and placements == ["R", "S(0)"] and ranks == [[0, 1], [2, 3]]


# ---- without ranks -------------------------------------------------------------------------------


def test_batch_digest_tells_batches_apart_and_equal_ones_alike():
    batch = make_batch(N, seed=0)
    assert batch_digest(batch) == batch_digest(batch.clone())
    assert batch_digest(batch) != batch_digest(make_batch(N, seed=1))
    swapped = batch.clone()
    swapped["advantage"] = batch["value_target"]
    swapped["value_target"] = batch["advantage"]
    assert batch_digest(batch) != batch_digest(swapped)  # keys count, not only values
    assert batch_digest(TensorDict({"x": torch.tensor([0.0])}, [1])) != \
        batch_digest(TensorDict({"x": torch.tensor([-0.0])}, [1]))  # bits, not values


def test_a_plan_naming_a_missing_or_non_linear_layer_is_refused_before_anything_changes():
    owner = ShardedLoss(make_loss()[0], torch.device("cpu"))
    before = {n: p.clone() for n, p in owner.named_loss_parameters()}
    with pytest.raises(ValueError, match=r"names layers the loss does not have: \['actor_network.module.9'\]"):
        parallelize_layers(owner, None, {**TP_PLAN, "actor_network.module.9": TP_PLAN["critic_network.module.0"]})
    with pytest.raises(ValueError, match="ColwiseParallel or RowwiseParallel"):
        parallelize_layers(owner, None, {"critic_network.module.0": object()})
    assert all(type(p) is torch.nn.Parameter and torch.equal(p, before[n]) for n, p in owner.named_loss_parameters())
    with pytest.raises(RuntimeError, match="left these parameters unsharded"):
        check_sharded(owner, world_size=1)
