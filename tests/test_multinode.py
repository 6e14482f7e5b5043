"""Two "nodes" on one machine: each launcher's multi-node mode trains one DDP/FSDP run on the loopback address.

Each node is its own launcher process with one rank, as on two machines; both must exit 0 with no
process left, and their ranks must agree, as in tests/test_launch.py.
"""

from __future__ import annotations

import os
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
from multiproc import RELAY, WORKERS, forked_ranks, free_port, run
from test_launch import problems

SCRIPT = os.path.join(WORKERS, "launch_script.py")
FABRIC = os.path.join(os.path.dirname(sys.executable), "fabric")


def node_command(how: str, node: int, port: int, first: str) -> list[str]:
    if how == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node}", "--nproc-per-node=1",
                "--master-addr=127.0.0.1", f"--master-port={port}", RELAY, SCRIPT]
    return [FABRIC, "run", "--accelerator=cpu", f"--strategy={first}", "--devices=1", "--num-nodes=2",
            f"--node-rank={node}", "--main-address=127.0.0.1", f"--main-port={port}", RELAY, SCRIPT]


@pytest.mark.parametrize("how,first", [("torchrun", "fsdp"), ("fabric-run", "ddp")])
def test_two_nodes_of_one_rank_train_like_two_local_ranks_and_exit_cleanly(how, first):
    port = free_port()
    env = {"FL_MODE": "external", "FL_FIRST": first, **({"FL_STRATEGY": first} if how == "torchrun" else {}),
           **forked_ranks()}  # each node's rank forked from the test zygote (tests/zygote_rank.py)
    with ThreadPoolExecutor(max_workers=2) as pool:
        nodes = list(pool.map(lambda node: run(node_command(how, node, port, first), timeout=240, **env), (0, 1)))
    for node, proc in enumerate(nodes):
        assert proc.returncode == 0 and proc.leftovers == 0, (node, proc.returncode, proc.stdout[-3000:])
    merged = nodes[0]
    merged.stdout = nodes[0].stdout + "\n" + nodes[1].stdout
    assert problems(merged, first) is None, (problems(merged, first), merged.stdout[-4000:])


def test_two_tasks_started_as_srun_starts_them_train_through_fabrics_slurm_environment():
    """``srun`` starts every task itself and describes the job in SLURM_* variables: Fabric's
    ``SLURMEnvironment`` reads them, and the learner (built with ``devices=2``, as under plain
    python) must then join that world instead of starting ranks of its own."""
    port = free_port()

    def task(rank: int):
        slurm = {"SLURM_NTASKS": "2", "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank), "SLURM_NODEID": "0",
                 "SLURM_NTASKS_PER_NODE": "2", "SLURM_NODELIST": "127.0.0.1", "SLURM_JOB_ID": "4242",
                 "SLURM_JOB_NAME": "train", "MASTER_PORT": str(port)}
        return run([sys.executable, SCRIPT], timeout=240, FL_MODE="plain", FL_FIRST="ddp", **slurm)

    with ThreadPoolExecutor(max_workers=2) as pool:
        tasks = list(pool.map(task, (0, 1)))
    for rank, proc in enumerate(tasks):
        assert proc.returncode == 0 and proc.leftovers == 0, (rank, proc.returncode, proc.stdout[-3000:])
        # one rank per task: a learner that started ranks itself would print both ranks here
        assert proc.stdout.count('RESULT {"rank": %d' % rank) == 2 and "RESULT {\"rank\": %d" % (1 - rank) not in proc.stdout
    merged = tasks[0]
    merged.stdout = tasks[0].stdout + "\n" + tasks[1].stdout
    assert problems(merged, "ddp") is None, (problems(merged, "ddp"), merged.stdout[-4000:])
