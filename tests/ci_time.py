"""What the test processes (pytest's, the ranks, the checkpoint runs) change in torch for CI time only; none of it
changes what a test checks.

- Inductor's C++ kernels of each generated module are built by one g++ run (kernel_batches.py;
  ``DPCOMPILE_TEST_KERNEL_BATCHES=0`` turns it off).
- Dynamo does not profile the guards it builds. At every frame it compiles, torch flushes the CPU's caches and
  times one run of the new guards, for a metric (``guard_latency_us``) that nothing here reads: 30-55 ms a compile
  on CI's 2 cores, 1.2% of the default tier's CPU samples (py-spy). The guards are still built and checked as
  torch does (``GuardManager.check`` on the frame that made them). ``DPCOMPILE_TEST_GUARD_PROFILE=1`` keeps it.
- FX does not walk each new node's arguments for raw SymInts. torch 2.13's ``Graph.create_node`` flattens the
  arguments of every node it creates (every node copied by the partitioner, every node a pass adds) only to warn
  when one is a bare SymInt, a misuse nothing here commits: 2.3% of the default tier's CPU samples (py-spy of
  10c7f14), the walk alone. Nodes are created as before. ``DPCOMPILE_TEST_SYMINT_WALK=1`` keeps it.
- One intra-op thread in every test process (``OMP_NUM_THREADS=1``, which the ranks, the fork server and the
  subprocess runs inherit; as benchmarks/gpu_tests.sh runs the suite): the processes already fill the cores (two
  workers, and two or four ranks beside them on CI's 2 cores), and the tests' tensors are small, so a second thread
  only waits on the other processes' (OpenMP's barrier of each parallel kernel). The noise and convolution tests took
  325-337 CPU-s with torch's default of 2 threads, 272-286 with 1 (2 runs each, alternating). An
  ``OMP_NUM_THREADS`` already set is kept."""
import os

import kernel_batches

GUARD_PROFILE_ENV = "DPCOMPILE_TEST_GUARD_PROFILE"
SYMINT_WALK_ENV = "DPCOMPILE_TEST_SYMINT_WALK"
THREADS_ENV = "OMP_NUM_THREADS"


def _no_guard_profile(*args, **kwargs) -> float:
    return 0.0


class _PytreeWithoutArgWalk:
    """torch.utils._pytree for torch.fx.graph, whose only ``tree_iter`` is create_node's walk for raw SymInts (its
    generated code imports pytree itself): every other name is pytree's."""

    def __init__(self, pytree):
        self._pytree = pytree

    def __getattr__(self, name):
        return getattr(self._pytree, name)

    @staticmethod
    def tree_iter(tree, is_leaf=None):
        return iter(())


def _skip_raw_symint_walk() -> None:
    import inspect

    import torch.fx.graph as fx_graph

    if isinstance(fx_graph.pytree, _PytreeWithoutArgWalk):
        return  # installed before in this process
    source = inspect.getsource(fx_graph)
    if source.count("pytree.tree_iter(") != 1 or "pytree.tree_iter((args, kwargs))" not in source:
        return  # another torch: its graph.py walks trees for something else too
    fx_graph.pytree = _PytreeWithoutArgWalk(fx_graph.pytree)


def _one_intra_op_thread() -> None:
    if os.environ.get(THREADS_ENV) is not None:
        return  # the caller's choice (or this process already made it)
    os.environ[THREADS_ENV] = "1"  # before any rank, server or subprocess starts: they start with it
    import torch

    torch.set_num_threads(1)  # this process imported torch before


def install() -> None:
    kernel_batches.install()
    _one_intra_op_thread()
    if os.environ.get(SYMINT_WALK_ENV) != "1":
        _skip_raw_symint_walk()
    if os.environ.get(GUARD_PROFILE_ENV) == "1":
        return
    import torch._dynamo.guards as guards

    if hasattr(guards, "profile_guard_manager"):  # the name CheckFunctionManager calls (torch 2.11, 2.13)
        guards.profile_guard_manager = _no_guard_profile
