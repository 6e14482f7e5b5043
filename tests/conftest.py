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


# `make test` runs two pytest-xdist workers, each taking whole modules in collection order: the
# modules whose launches take longest come first, so neither worker is left with one at the end
LONGEST_FIRST = ["test_launch.py", "test_elastic.py", "test_reliability.py", "test_configs.py", "test_examples.py",
                 "test_launcher_options.py", "test_trainer_envs.py", "test_multinode.py", "test_async.py",
                 "test_from_torchrl.py", "test_fsdp.py", "test_trainer.py", "test_compile.py"]


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(os.path.basename(str(item.fspath)), len(rank)))  # stable: order kept within
