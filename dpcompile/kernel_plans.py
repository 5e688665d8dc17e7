"""What the launches of dpcompile's Triton kernels share (dpcompile.conv_sq_norms, dpcompile.gram_sq_norms): the
operands' dtype in a kernel, and launch arguments kept per call signature (a step repeats the same few calls, and
these steps are launch-bound: host time counts)."""
from __future__ import annotations

from typing import Any, Callable

import torch

PLAN_LIMIT = 4096  # signatures kept per kernel: every batch size of a sampled batch is one


def kernel_dtype(x_dtype: torch.dtype, y_dtype: torch.dtype) -> torch.dtype:
    """The operands' dtype in a kernel: theirs when both are one of fp16, bf16, fp32; else fp32."""
    return x_dtype if x_dtype == y_dtype and x_dtype in (torch.float16, torch.bfloat16, torch.float32) else \
        torch.float32


def cached_plan(plans: dict, key: Any, make: Callable[[], Any]) -> Any:
    """plans[key], made by make() on a miss (plans emptied first when it holds PLAN_LIMIT)."""
    plan = plans.get(key)
    if plan is None:
        if len(plans) >= PLAN_LIMIT:
            plans.clear()
        plan = plans[key] = make()
    return plan
