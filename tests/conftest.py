import os
import sys

# Inductor's C++ kernels without SIMD: g++ builds them about 2.5x faster and the tests check what dpcompile
# puts in the graphs, not Inductor's vector code (a fresh-cache GPT test: 44 s -> 33 s). Set before torch is
# imported so spawned rank processes inherit it; TORCHINDUCTOR_VEC_ISA_OK=1 tests the vector code.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")

import pytest  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))

import ci_time  # noqa: E402
import tiers  # noqa: E402

ci_time.install()  # CI time only (ci_time.py: kernel batches, no guard profile or SymInt walk, one thread)


def _keep_pytest_off_torchs_trace_log() -> None:
    """pytest's log capture hangs its handlers on every logger, torch's trace log too; torch then builds every
    TORCH_TRACE artifact of every compile (each graph printed at every stage, Inductor's code, dpcompile's
    graph after each pass) for pytest to keep in memory (a compile of every layer kind side by side: 22 s with
    such a handler, 15 s without; no measurable change for small models). Only torch's own
    trace handler (TORCH_TRACE) may hang there; the tests of the artifacts run TORCH_TRACE in a subprocess."""
    from torch._logging._internal import LazyTraceHandler, trace_log

    add = trace_log.addHandler
    trace_log.addHandler = lambda h: add(h) if isinstance(h, LazyTraceHandler) else None


_keep_pytest_off_torchs_trace_log()


@pytest.fixture(scope="session")
def shared_ranks(tmp_path_factory):
    """shared_ranks(ranks, job): the output folder of a job of a ranks.SharedRanks table, its group run first."""
    return lambda ranks, job: ranks.out_dir(job, tmp_path_factory)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    # Each test compiles its own step; without a reset, dynamo's per-code
    # recompile limit would eventually run a step eagerly (without DP).
    torch._dynamo.reset()
    torch.manual_seed(0)
    yield
    torch._dynamo.reset()


def pytest_addoption(parser):
    parser.addoption("--extended", action="store_true",
                     help="also run the extended tier (tests/tiers.py): CI runs the default tier only")


def pytest_configure(config):
    # known to pytest-xdist (--dist loadgroup); registered so a run without xdist does not warn
    config.addinivalue_line("markers", "xdist_group(name): tests run on one xdist worker")
    config.addinivalue_line("markers", "extended: a test of the extended tier (tests/tiers.py)")
    if config.getoption("extended"):
        # before the test modules are imported: the shared rank groups build their job tables from it
        os.environ[tiers.ENV] = "1"


_UNGROUPED = []


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist with --dist loadgroup, a test with an xdist_group mark must carry its group in its id
    (the scheduler keeps a group on one worker by it). When it does not (pytest 9.2 with xdist 3.8), the
    groups are split across workers and each worker recomputes the sharded matrix's shared results: CI time
    doubles and concurrent identical compiles race on the compile cache. Those tests fail at setup instead
    (an error raised here would be lost in xdist's internal error)."""
    _skip_upstream_bugs(items)
    if not tiers.extended_tier():
        for item in items:
            if item.get_closest_marker("extended"):
                item.add_marker(pytest.mark.skip(reason=tiers.REASON))
    if os.environ.get("PYTEST_XDIST_WORKER") and getattr(config.option, "loadgroup", False):
        _UNGROUPED.extend(item for item in items if item.get_closest_marker("xdist_group") and "@" not in item.nodeid)


def pytest_runtest_setup(item):
    if item in _UNGROUPED:
        pytest.fail(f"pytest-xdist's --dist loadgroup did not tag this test with its xdist_group: this pytest "
                    f"({pytest.__version__}) and pytest-xdist do not work together; install the test extra's "
                    f"versions (pip install -e '.[test]') or run with -n 0", pytrace=False)


# torch bugs that fail stock torch.compile the same way (checked on the device's torch 2.11, without dpcompile):
# (case, test modules it fails in, torch versions before which it fails, why)
_UPSTREAM_BUGS = [
    ("fourier_mixer", ("test_per_sample_clipping", "test_aligned_contractions"), (2, 13),
     "torch < 2.13: Inductor on CPU asserts the strides of _fft_r2c's meta kernel, which differ from the CPU "
     "kernel's for a transform over a dim other than the last (stock torch.compile of the model fails the same way)"),
]


def _skip_upstream_bugs(items):
    version = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        for case, modules, fixed_in, why in _UPSTREAM_BUGS:
            if (version < fixed_in and params.get("case") == case and item.module.__name__.rsplit(".", 1)[-1] in modules
                    and params.get("compiler", "inductor") == "inductor"):
                item.add_marker(pytest.mark.skip(reason=why))
