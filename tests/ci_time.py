"""What the test processes (pytest's, the ranks, the checkpoint runs) change in torch for CI time only; none of it
changes what a test checks.

- Inductor's C++ kernels of each generated module are built by one g++ run (kernel_batches.py;
  ``DPCOMPILE_TEST_KERNEL_BATCHES=0`` turns it off).
- Dynamo does not profile the guards it builds. At every frame it compiles, torch flushes the CPU's caches and
  times one run of the new guards, for a metric (``guard_latency_us``) that nothing here reads: 30-55 ms a compile
  on CI's 2 cores, 1.2% of the default tier's CPU samples (py-spy). The guards are still built and checked as
  torch does (``GuardManager.check`` on the frame that made them). ``DPCOMPILE_TEST_GUARD_PROFILE=1`` keeps it."""
import os

import kernel_batches

GUARD_PROFILE_ENV = "DPCOMPILE_TEST_GUARD_PROFILE"


def _no_guard_profile(*args, **kwargs) -> float:
    return 0.0


def install() -> None:
    kernel_batches.install()
    if os.environ.get(GUARD_PROFILE_ENV) == "1":
        return
    import torch._dynamo.guards as guards

    if hasattr(guards, "profile_guard_manager"):  # the name CheckFunctionManager calls (torch 2.11, 2.13)
        guards.profile_guard_manager = _no_guard_profile
