"""The private Lightning, torch and torchrl APIs the package relies on still exist (see utils/compat.py)."""

from __future__ import annotations

import importlib

import pytest

from fabric_learner.utils import compat as _compat

# names the checkpoint metadata unpickler (checkpoint.dcp_folder) and the teardown (launch/teardown.py) build on
NAMES = [
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
    ("torch.serialization", "_get_layout"),
]


@pytest.mark.parametrize("where, owner, attribute", _compat.required(), ids=lambda x: x if isinstance(x, str) else "")
def test_a_private_api_in_use_is_still_there(where, owner, attribute):
    assert hasattr(owner, attribute), (
        f"{where} has no attribute {attribute!r} any more: fabric_learner/utils/compat.py relies on it; "
        "adapt the function there that uses it to the installed version."
    )


@pytest.mark.parametrize("module, name", NAMES)
def test_a_private_name_the_checkpoint_reader_allows_is_still_there(module, name):
    assert hasattr(importlib.import_module(module), name), f"{module}.{name} is gone: update checkpoint.dcp_folder's allow-list"
