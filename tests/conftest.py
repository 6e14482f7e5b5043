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
