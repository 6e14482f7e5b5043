import os
import sys
import warnings

import pytest

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("RL_WARNINGS", "False")
warnings.filterwarnings("ignore", message="No target network updater")


def make_learner(kind, loss, optimizer=None, **kwargs):
    from fabric_learner import FabricLearner, LocalLearner

    if kind == "local":
        return LocalLearner(loss, optimizer, **kwargs)
    return FabricLearner(loss, optimizer, accelerator="cpu", devices=1, **kwargs)


@pytest.fixture(params=["local", "fabric"])
def kind(request):
    return request.param


# `make test` runs two pytest-xdist workers, each taking whole modules in collection order (with
# --no-loadscope-reorder): the modules that take longest come first, so neither worker is left with a
# long one at the end. Measured with `--durations=0` under `make test` (2026-12-01), seconds per module.
LONGEST_FIRST = ["test_elastic.py", "test_launch.py", "test_reliability.py", "test_configs.py",  # 157 111 53 45
                 "test_trainer_envs.py", "test_launcher_options.py", "test_multinode.py",  # 40 36 34
                 "test_examples.py", "test_from_torchrl.py", "test_trainer.py", "test_compile.py",  # 30 29 24 19
                 "test_async.py", "test_stages.py", "test_async_save.py", "test_fsdp.py",  # 19 17 17 13
                 "test_zygote.py", "test_ppo_recipe.py", "test_ddp.py"]  # 12 12 7
# added 2026-12-04: the SAC recipe against torchrl's loop, 17 s alone
LONGEST_FIRST[-1:-1] = ["test_sac_recipe.py"]
# added 2026-12-02 (#35, #36), measured under load beside other runs: meshes ~100 s, the LLM modules 20-35 s each
LONGEST_FIRST[3:3] = ["test_meshes.py"]
LONGEST_FIRST[9:9] = ["test_llm_weights.py", "test_llm_fsdp.py", "test_llm.py", "test_grpo_recipe.py"]
# added 2026-12-02 (#37): two launches with collector processes, ~140 s beside other runs
LONGEST_FIRST[1:1] = ["test_remote.py"]
# added 2026-12-06 (#56): the GPU tier's dry run, one interpreter, ~35 s beside other runs
LONGEST_FIRST.insert(LONGEST_FIRST.index("test_trainer_envs.py"), "test_gpu_tier.py")
# added 2026-12-06 (#55, #58): docs/llm.md on 2 FSDP ranks (one launch, ~60 s), the token-budget tests (~40 s)
LONGEST_FIRST.insert(LONGEST_FIRST.index("test_trainer_envs.py"), "test_llm_docs.py")
LONGEST_FIRST.insert(LONGEST_FIRST.index("test_from_torchrl.py"), "test_llm_batching.py")
# added 2026-12-06 (#57): RemoteLearner's module, one Ray runtime and eight small groups, ~200 s under load
LONGEST_FIRST[2:2] = ["test_remote_learner.py"]


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(os.path.basename(str(item.fspath)), len(rank)))  # stable: order kept within
