"""One command line under every launcher: the launcher decides, the script's options agree or are refused.

The rule is checked in process for each launcher's environment, then end to end: an example
takes the same ``--strategy``/``--precision`` options under ``torchrun`` and ``fabric run``.
"""

from __future__ import annotations

import argparse
import os

import pytest
from multiproc import RELAY, ROOT, child_pids, fabric_run, forked_ranks, run, torchrun

import fabric_learner
from fabric_learner.cli import add_launch_arguments, launch_kwargs
from fabric_learner.launch.build import agree_with_launcher

OPEN = {"accelerator": "auto", "strategy": "auto", "devices": "auto", "num_nodes": 1, "precision": "32-true"}
LAUNCH_ENV = ("LT_CLI_USED", "LT_ACCELERATOR", "LT_STRATEGY", "LT_DEVICES", "LT_NUM_NODES", "LT_PRECISION",
              "TORCHELASTIC_RUN_ID", "WORLD_SIZE", "LOCAL_WORLD_SIZE")


@pytest.fixture
def launched(monkeypatch):
    """Make this process look started by a launcher: ``launched("fabric", LT_DEVICES="2", ...)``."""
    for name in LAUNCH_ENV:
        monkeypatch.delenv(name, raising=False)

    def start(how, **env):
        if how == "fabric":
            monkeypatch.setenv("LT_CLI_USED", "1")
        elif how == "torchrun":
            monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
        for key, value in env.items():
            monkeypatch.setenv(key, value)

    return start


def test_launcher_names_how_the_process_was_started(launched):
    assert fabric_learner.launcher() == "python"
    launched("torchrun")
    assert fabric_learner.launcher() == "torchrun"
    launched("fabric")  # fabric run runs torchrun underneath: still "fabric"
    assert fabric_learner.launcher() == "fabric"


def test_under_plain_python_the_arguments_are_used_as_given(launched):
    given = dict(accelerator="cpu", strategy="fsdp", devices=2, num_nodes=1, precision="bf16-mixed")
    assert agree_with_launcher(**given) == tuple(given.values())


def test_under_fabric_run_open_arguments_take_the_launchers_settings(launched):
    launched("fabric", LT_ACCELERATOR="cpu", LT_STRATEGY="fsdp", LT_DEVICES="2", LT_NUM_NODES="1",
             LT_PRECISION="bf16-mixed")
    assert agree_with_launcher(**OPEN) == ("cpu", "fsdp", 2, 1, "bf16-mixed")
    # equal settings, spelled differently, agree
    assert agree_with_launcher(accelerator="CPU", strategy="fsdp2", devices=2, num_nodes=1,
                               precision="bf16-mixed")[1] == "fsdp2"


@pytest.mark.parametrize("name, value, flag", [("strategy", "ddp", "--strategy=fsdp"), ("devices", 4, "--devices=2"),
                                               ("precision", "16-mixed", "--precision=bf16-mixed"),
                                               ("accelerator", "cuda", "--accelerator=cpu")])
def test_under_fabric_run_a_disagreeing_argument_is_refused_naming_both(launched, name, value, flag):
    launched("fabric", LT_ACCELERATOR="cpu", LT_STRATEGY="fsdp", LT_DEVICES="2", LT_NUM_NODES="1",
             LT_PRECISION="bf16-mixed")
    with pytest.raises(ValueError, match=rf"{name}={value!r}.*`fabric run {flag}`.*Nothing was started"):
        agree_with_launcher(**{**OPEN, name: value})


def test_under_fabric_run_without_a_strategy_the_scripts_strategy_applies(launched):
    launched("fabric", LT_ACCELERATOR="cpu", LT_DEVICES="2", LT_NUM_NODES="1")
    assert agree_with_launcher(**{**OPEN, "strategy": "fsdp"})[1] == "fsdp"


def test_under_torchrun_devices_and_nodes_come_from_the_launched_world(launched):
    launched("torchrun", WORLD_SIZE="4", LOCAL_WORLD_SIZE="2")
    assert agree_with_launcher(**{**OPEN, "strategy": "ddp"}) == ("auto", "ddp", 2, 2, "32-true")
    assert agree_with_launcher(**{**OPEN, "devices": 2, "num_nodes": 2})[2:4] == (2, 2)
    with pytest.raises(ValueError, match=r"devices=3.*`torchrun --nproc-per-node=2`"):
        agree_with_launcher(**{**OPEN, "devices": 3})
    with pytest.raises(ValueError, match=r"num_nodes=3.*`torchrun --nnodes=2`"):
        agree_with_launcher(**{**OPEN, "num_nodes": 3})


def test_a_fabric_learner_that_disagrees_with_the_launcher_starts_nothing(launched):
    import torch.distributed as dist
    from rl_cases import make_loss

    launched("torchrun", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
    group = dist.group.WORLD if dist.is_initialized() else None  # earlier in-process tests may leave one
    children = child_pids()
    with pytest.raises(ValueError, match="devices=1"):
        fabric_learner.FabricLearner(make_loss("dqn")[0], accelerator="cpu", devices=1)
    assert (dist.group.WORLD if dist.is_initialized() else None) is group and child_pids() <= children


def test_script_defaults_apply_under_plain_python_only(launched):
    parser = add_launch_arguments(argparse.ArgumentParser(), accelerator="cpu", strategy="ddp", devices=2)
    assert launch_kwargs(parser.parse_args([])) == {"accelerator": "cpu", "strategy": "ddp", "devices": 2,
                                                    "num_nodes": 1, "precision": "32-true"}
    assert launch_kwargs(parser.parse_args(["--devices", "auto", "--num-nodes", "2"]))["devices"] == "auto"
    launched("torchrun", WORLD_SIZE="4", LOCAL_WORLD_SIZE="4")
    assert launch_kwargs(parser.parse_args([])) == {}
    assert launch_kwargs(parser.parse_args(["--strategy", "fsdp", "--devices", "4"])) == {"strategy": "fsdp",
                                                                                           "devices": 4}


SHORT_PPO = ["--frames", "3200", "--envs", "4", "--epochs", "1", "--minibatch", "400", "--logdir", "", "--no-progress"]


@pytest.mark.parametrize("how", ["torchrun", "fabric-run"])
def test_an_example_takes_the_same_options_under_torchrun_and_fabric_run(how):
    script = os.path.join(ROOT, "examples", "ppo_pendulum.py")
    if how == "torchrun":  # the launcher gives the world, the script's option the strategy
        cmd = torchrun(RELAY, script, *SHORT_PPO, "--strategy", "fsdp", "--devices", "2")
    else:  # the launcher gives everything; the script repeats some of it, in agreement
        cmd = fabric_run(RELAY, script, *SHORT_PPO, "--strategy", "fsdp", "--precision", "32-true", strategy="fsdp")
    proc = run(cmd, timeout=240, **forked_ranks())  # the ranks forked from the test zygote (tests/zygote_rank.py)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert proc.leftovers == 0
    done = [line for line in proc.stdout.splitlines() if line.startswith("done: 2 rank(s) sharded (FSDP)")]
    assert len(done) == 1, proc.stdout[-4000:]


def test_an_example_refuses_an_option_that_disagrees_with_the_launcher():
    script = os.path.join(ROOT, "examples", "ppo_pendulum.py")
    proc = run(torchrun(RELAY, script, *SHORT_PPO, "--devices", "3"), timeout=120, **forked_ranks())
    assert proc.returncode != 0 and proc.leftovers == 0
    assert "FabricLearner(devices=3) disagrees with the launcher" in proc.stdout, proc.stdout[-3000:]
