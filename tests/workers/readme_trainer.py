"""The README's Trainer example, run as written on 2 ranks under DDP, then FSDP, in one launch (forked from
tests/zygote.py; plain ``python`` runs it too).

Usage: python readme_trainer.py OUT_DIR   -> OUT_DIR/rank{r}.pt, checked by tests/test_docs.py

The README's block builds the learner and the trainer from what a reader brings (``loss``,
``optim_factory``, ``qnet``, ``collector``, ``rb``): those are built here, DQN on CartPole. In the
block's own text only the strategy (and the CPU), the run's length and its log and checkpoint folders
change; the order (learner, then ``SoftUpdate`` on its loss) is the README's.
"""

from __future__ import annotations

import functools
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch
from torchrl.collectors import Collector
from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer
from torchrl.envs import GymEnv
from torchrl.modules import MLP, QValueActor
from torchrl.objectives import DQNLoss

README = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")
FRAMES, FRAMES_PER_BATCH, STEPS = 256, 64, 8


def readme_block() -> str:
    text = open(README).read()
    return re.search(r"```python\n(.*?)```", text[text.index("## Training loops"):], re.S).group(1)


def run(strategy: str, out_dir: str) -> dict:
    torch.manual_seed(0)  # the same networks on every rank, as a script seeded once would build them
    qnet = QValueActor(MLP(in_features=4, out_features=2, num_cells=[32]), in_keys=["observation"],
                       action_space="categorical")
    loss = DQNLoss(qnet, action_space="categorical", delay_value=True)
    optim_factory = functools.partial(torch.optim.Adam, lr=1e-3)
    collector = Collector(GymEnv("CartPole-v1"), qnet, frames_per_batch=FRAMES_PER_BATCH, total_frames=-1,
                          auto_register_policy_transforms=False)
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(1000), batch_size=32)
    code = readme_block()
    for old, new in (('strategy="ddp", devices=2', f'strategy="{strategy}", devices=2, accelerator="cpu"'),
                     ("total_frames=30_000", f"total_frames={FRAMES}"),
                     ("optim_steps_per_batch=8", f"optim_steps_per_batch={STEPS}"),
                     ('TensorBoardLogger("runs")', f"TensorBoardLogger({os.path.join(out_dir, strategy + '_runs')!r})"),
                     ('save_trainer_file="ckpt"', f"save_trainer_file={os.path.join(out_dir, strategy + '_ckpt')!r}")):
        assert old in code, f"the README's Trainer example no longer reads {old!r}: update this worker"
        code = code.replace(old, new)
    scope = {"loss": loss, "optim_factory": optim_factory, "qnet": qnet, "collector": collector, "rb": rb}
    targets_before = loss.target_value_network_params.clone()
    exec(compile(code, "README.md (Trainer example)", "exec"), scope)
    learner, trainer = scope["learner"], scope["trainer"]
    with learner.full_parameters():
        moved = any(not torch.equal(a, b) for a, b in zip(targets_before.values(True, True),
                                                            loss.target_value_network_params.values(True, True)))
    return {"num_updates": learner.num_updates, "frames": trainer.collected_frames, "targets_moved": moved,
            "weights": learner.get_weights(cpu_offload=False).flatten_keys(".").to_dict(),
            "sharded": learner.capabilities.sharded}


def main(out_dir: str) -> None:
    rank = int(os.environ.get("LOCAL_RANK", 0))
    results = {strategy: run(strategy, out_dir) for strategy in ("ddp", "fsdp")}
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
