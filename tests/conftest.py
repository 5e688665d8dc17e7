import os
import sys

# Inductor's C++ kernels without SIMD: g++ builds them about 2.5x faster and the tests check what dpcompile
# puts in the graphs, not Inductor's vector code (a fresh-cache GPT test: 44 s -> 33 s). Set before torch is
# imported so spawned rank processes inherit it; TORCHINDUCTOR_VEC_ISA_OK=1 tests the vector code.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")

import pytest  # noqa: E402
import torch  # noqa: E402

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
