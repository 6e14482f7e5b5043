"""Each example runs unchanged on 2 real CPU ranks under a strategy given by --strategy alone.

Here the demo and the recipe run under DDP and the DQN example under FSDP; the demo under FSDP,
through torchrun and `fabric run`, is tests/test_launcher_options.py's (each launch costs seconds of CI).
The demo runs as a user runs it, ``python ppo_pendulum.py --strategy ddp`` (the learner starts rank 1, a
fresh interpreter; rank 0 is forked from tests/zygote.py through the relay, its imports done); the other two
have their ranks forked from tests/zygote.py, as a launcher starts them.
"""

from __future__ import annotations

import json
import os
import re

import pytest
from multiproc import ROOT, launch, plain_python

SHORT = {
    "ppo_pendulum.py": ["--frames", "3200", "--envs", "4", "--epochs", "1", "--minibatch", "400"],
    "dqn_replay_ddp.py": ["--frames", "2048", "--envs", "8", "--steps", "8", "--updates", "2", "--batch", "32"],
    "ppo_mujoco.py": ["--frames", "2048", "--frames-per-batch", "512", "--epochs", "1", "--minibatch", "256"],
}


@pytest.mark.parametrize("example,strategy", [("ppo_pendulum.py", "ddp"), ("dqn_replay_ddp.py", "fsdp"),
                                              ("ppo_mujoco.py", "ddp")])
def test_the_example_trains_under_the_strategy_with_nothing_else_changed(example, strategy):
    script = os.path.join(ROOT, "examples", example)
    args = [*SHORT[example], "--strategy", strategy, "--logdir", "", "--no-progress"]
    proc = (plain_python(script, *args, timeout=240) if example == "ppo_pendulum.py"
            else launch(script, *args, timeout=240))
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert proc.leftovers == 0
    done = [line for line in proc.stdout.splitlines() if line.startswith("done: 2 rank(s)")]
    assert len(done) == 1, proc.stdout[-4000:]
    assert ("sharded (FSDP)" in done[0]) == (strategy == "fsdp"), done[0]


GRPO_STRATEGY = "fsdp"  # the example's default


def test_grpo_countdown_trains_on_two_ranks_and_refreshes_its_generation_copy(tmp_path):
    """Two GRPO updates on Countdown: each rank samples its own group, the learner steps on micro-batches cut by
    its token budget (the default), the copy is refreshed."""
    script = os.path.join(ROOT, "examples", "grpo_countdown.py")
    curve = tmp_path / "curve.json"
    proc = launch(script, "--steps", "2", "--group", "4", "--max-tokens", "1000", "--max-new-tokens", "8",
                  "--strategy", GRPO_STRATEGY, "--no-progress", "--curve", str(curve), timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert proc.leftovers == 0
    done = [line for line in proc.stdout.splitlines() if line.startswith("done: 2 rank(s)")]
    assert len(done) == 1 and ", 2 updates, 16 completions," in done[0], proc.stdout[-4000:]
    points = json.loads(curve.read_text())["curve"]
    assert [p["update"] for p in points] == [1, 2]
    assert all(0.0 <= p["reward"] <= 2.1 and p["grad_norm"] > 0 for p in points), points


def test_grpo_countdown_takes_a_local_hugging_face_folder(tmp_path):
    """``--model PATH``: a model and tokenizer saved with ``save_pretrained`` train in one process (FSDP on one rank)."""
    from fabric_learner.testing import tiny_causal_lm, tiny_tokenizer

    tokenizer = tiny_tokenizer()
    tiny_causal_lm(seed=3, tokenizer=tokenizer).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    script = os.path.join(ROOT, "examples", "grpo_countdown.py")
    proc = launch(script, "--model", tmp_path / "model", "--devices", "1", "--steps", "1", "--group", "4",
                  "--micro-batch", "2", "--max-new-tokens", "8", "--no-progress", nproc=1, timeout=180)
    assert proc.returncode == 0, proc.stdout[-4000:]
    done = [line for line in proc.stdout.splitlines() if line.startswith("done: 1 rank(s)")]
    assert len(done) == 1 and ", 1 updates, 4 completions," in done[0], proc.stdout[-4000:]


def test_the_dqn_example_trains_with_its_collectors_apart_under_fsdp():
    """``--collectors 2 --local-collectors``: each FSDP rank is fed by a collector process of its own (docs/remote.md)."""
    from multiproc import free_port

    script = os.path.join(ROOT, "examples", "dqn_replay_ddp.py")
    args = [*SHORT["dqn_replay_ddp.py"], "--frames", "3072", "--strategy", "fsdp", "--collectors", "2",
            "--local-collectors", "--collect-address", f"127.0.0.1:{free_port()}", "--logdir", "", "--no-progress"]
    proc = launch(script, *args, timeout=240)  # ranks forked, as above; the collectors are commands of their own
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert proc.leftovers == 0
    done = [line for line in proc.stdout.splitlines() if line.startswith("done: 2 rank(s) sharded (FSDP)")]
    assert len(done) == 1, proc.stdout[-4000:]
    served = sorted(set(re.findall(r"serving learner rank (\d) of 2", proc.stdout)))
    assert served == ["0", "1"], proc.stdout[-4000:]  # one collector for each rank
    stats = re.search(r"collection: .*'admitted_frames': (\d+).*rank 0's collectors: .*'restarts': (\d+)", proc.stdout)
    assert stats and int(stats.group(1)) > 0 and stats.group(2) == "0", proc.stdout[-4000:]
