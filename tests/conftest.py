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


# `make test` runs two pytest-xdist workers, each taking whole modules in this order (with
# --no-loadscope-reorder): the modules that take longest come first, so neither worker is left with a
# long one at the end; the first four pair a module that mostly computes with one that mostly waits or
# starts processes (test_launch beside test_remote's start-up made both slower). Seconds per module under
# `make test`, measured 2026-12-06 (a module not listed runs after these, in collection order; each took
# under 4 s).
LONGEST_FIRST = ["test_elastic.py", "test_remote.py", "test_remote_learner.py", "test_launch.py",  # 72 100 79 135
                 "test_reliability.py", "test_examples.py", "test_pipeline.py", "test_configs.py",  # 74 70 60 40
                 "test_trainer_envs.py",  # 34
                 "test_meshes.py", "test_zygote.py", "test_multinode.py", "test_results.py",  # 30 26 21 20
                 "test_from_torchrl.py", "test_launcher_options.py", "test_async.py", "test_trainer.py",  # 20 19 18 18
                 "test_ppo_recipe.py", "test_compile.py", "test_async_save.py", "test_gpu_tier.py",  # 15 12 12 10
                 "test_sac_recipe.py", "test_llm_fsdp.py", "test_fsdp.py", "test_llm.py", "test_llm_weights.py",  # 10 9 9 9 8
                 "test_stages.py", "test_llm_docs.py", "test_claims.py", "test_ddp.py", "test_docs.py"]  # 7 7 5 5 4


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(os.path.basename(str(item.fspath)), len(rank)))  # stable: order kept within
