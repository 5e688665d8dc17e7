"""Host time of kernel_plans.launch's direct path (what each of dpcompile's own kernel launches costs a
launch-bound step beside the launch itself), for a Gram norm launch's arguments: 3 tensors, 6 integers, 11
constexprs. Looked up by the full key (every argument's and constexpr's value) or by a cached plan's id
(kernel_plans.launch_id). A stand-in compiled kernel whose launcher does nothing, so it runs on any machine:

    python3 benchmarks/launch_host.py
"""
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's dpcompile
from dpcompile import kernel_plans  # noqa: E402

NAMES = ["a", "g", "out", "s1", "s2", "s3", "s4", "s5", "s6", "S", "P", "M", "TILES", "SPLITS", "KS", "BLOCK_S",
         "BLOCK_K", "PRECISION"]


class _Param:
    def __init__(self, name):
        self.name, self.default = name, None


class _Compiled:
    function, packed_metadata = "fn", "meta"

    def launch_metadata(self, grid, stream, *args):
        return None

    def run(self, *call):
        pass


class _Kernel:
    arg_names = NAMES
    params = [_Param(n) for n in NAMES]

    def __getitem__(self, grid):
        return lambda *args, **consts: _Compiled()


def main(calls: int = 20000) -> None:
    kernel_plans._stream = lambda device: 0
    kernel_plans._device = lambda: None  # the CPU tensors' device index
    kernel = _Kernel()
    a, g, out = torch.zeros(4, 8), torch.zeros(4, 8), torch.zeros(4)
    args = (a, g, out, 196608, 768, 1, 589824, 2304, 1)
    consts = dict(S=256, P=768, M=2304, TILES=2, SPLITS=1, KS=2304, PRECISION=None, BLOCK_S=128, BLOCK_K=64,
                  num_warps=8, num_stages=3)
    plan_id = kernel_plans.launch_id()
    for label, pid in (("full key", None), ("plan id", plan_id)) * 2:
        kernel_plans.launch(kernel, (128,), args, consts, pid)
        t = time.perf_counter()
        for _ in range(calls):
            kernel_plans.launch(kernel, (128,), args, consts, pid)
        print(f"launch, {label:8s}: {(time.perf_counter() - t) / calls * 1e6:6.2f} us")
    assert len(kernel_plans._COMPILED) == 2, "the stand-in kernel was not launched directly"
    try:
        kernel_plans._hooks()
    except ImportError:
        return
    t = time.perf_counter()
    for _ in range(calls):
        kernel_plans._hooks()
    print(f"launch hooks      : {(time.perf_counter() - t) / calls * 1e6:6.2f} us")


if __name__ == "__main__":
    main()
