import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(autouse=True)
def fresh_dynamo():
    # Each test compiles its own step; without a reset, dynamo's per-code
    # recompile limit would eventually run a step eagerly (without DP).
    torch._dynamo.reset()
    torch.manual_seed(0)
    yield
    torch._dynamo.reset()


def pytest_configure(config):
    # known to pytest-xdist (--dist loadgroup); registered so a run without xdist does not warn
    config.addinivalue_line("markers", "xdist_group(name): tests run on one xdist worker")
