"""A DP step that dynamo ran eagerly fails instead of writing non-private gradients.

``torch.compile(step, backend="dp_fsdp")`` only reaches dpcompile when dynamo compiles a frame. Past dynamo's
recompile limit, or after a fallback, dynamo runs the step as plain Python: its ``loss.backward()`` then
accumulates unclipped, noiseless gradients into ``.grad``, and nothing in dpcompile runs. (``private_step``
checks this around every call; the plain form has no wrapper to check in.)

Two guards:

- The recompile limit: while dynamo compiles a frame of a DP step, ``fail_on_recompile_limit_hit`` is on and
  the limit at least RECOMPILE_LIMIT (dpcompile/step_frames.py): dynamo raises where it would have run the
  frame eagerly, also for a model no DP graph has seen yet (one step function compiled for many models).
- Any other eager run of a model a DP graph trains (a fallback, the uncompiled function called by mistake):
  every DP graph gives one of its trainable parameters, the sentinel, a post-accumulate-grad hook. Each run
  of a DP graph's forward arms it; the gradient its backward accumulates disarms it. A gradient that arrives
  unarmed came from a backward no DP graph produced: the hook clears that ``.grad`` and raises
  ``DPCompileError``. An eager step accumulates into every trainable parameter, the sentinel included, so
  one hook per graph suffices (a hook per parameter would cost a Python call per parameter per step).

A frame of the step that dynamo gives up on before any DP graph exists (nothing to watch yet) is refused
where dynamo compiles it: dpcompile/step_frames.py.

Inside ``with dpcompile.non_private():`` gradients are not checked (a non-private phase on the same model).
"""
from __future__ import annotations

import contextlib
import threading
import weakref

import torch
from torch.utils.weak import WeakIdKeyDictionary

from dpcompile.errors import DPCompileError

# past the limit dynamo would run a step eagerly. The limit also counts the frames dynamo compiles inside a
# sharded step's eager backward: DTensor.__tensor_unflatten__ once per gradient rank (1-D biases ... 5-D Conv3d
# weights), one recompile each, which passed 8 on a model with every layer kind; those are not DP steps
RECOMPILE_LIMIT = 64


class _NonPrivate:
    depth = 0  # process-wide, not per thread: autograd runs a CUDA backward's hooks on its device threads


_state = _NonPrivate()
_lock = threading.Lock()
_guards: WeakIdKeyDictionary = WeakIdKeyDictionary()  # sentinel parameter -> its Sentinel


def in_non_private() -> bool:
    """Inside ``with dpcompile.non_private():``."""
    return _state.depth > 0


@contextlib.contextmanager
def non_private():
    """Backward passes inside run without dpcompile's check that a DP graph produced the gradients: for a
    non-private phase of training on a model that DP steps also train. Gradients produced here are not
    private; never mix them into a DP step's."""
    with _lock:
        _state.depth += 1
    try:
        yield
    finally:
        with _lock:
            _state.depth -= 1


class Sentinel:
    """The guard of one parameter: armed by DP forwards, disarmed by the gradient their backward delivers."""

    def __init__(self, name: str):
        self.name = name
        self.armed = 0
        self.trained: dict[int, weakref.ref] = {}  # id -> every parameter the sentinel's DP graphs train

    def arm(self) -> None:
        # a forward whose backward never ran (an exception between them) leaves one arm at most: the next
        # DP forward re-arms, not stacks
        self.armed = 1

    def __call__(self, param: torch.Tensor) -> None:
        if self.armed:
            self.armed = 0
            return
        if _state.depth > 0:
            return
        # the eager backward has accumulated into some of them already (those it reached before the
        # sentinel); DP gradients of earlier micro-batches in them are mixed with it and go too
        for ref in self.trained.values():
            p = ref()
            if p is not None:
                p.grad = None
        raise DPCompileError(
            f"parameter {self.name!r} received a gradient that no dp_fsdp graph produced: the step ran eagerly "
            f"(a skipped frame, a fallback, or the uncompiled function called), so its gradients are neither "
            f"clipped nor noised. The .grad of every parameter its DP step trains was cleared. Run with "
            f"TORCH_LOGS=recompiles,graph_breaks to see why dynamo did not compile the step, or use "
            f"@dpcompile.private_step, which raises before the step runs. For a deliberately non-private "
            f"backward on this model, wrap it in `with dpcompile.non_private():`.")


def sentinel(params: list[tuple[str, torch.Tensor]]) -> Sentinel:
    """The sentinel of a DP graph training ``params`` (name, parameter): the first parameter's, its hook
    registered once (every DP graph it is the first of shares it)."""
    name, first = params[0]
    guard = _guards.get(first)
    if guard is None:
        guard = _guards[first] = Sentinel(name)
        first.register_post_accumulate_grad_hook(guard)
    for _, p in params:
        ref = guard.trained.get(id(p))
        if ref is None or ref() is not p:  # (an id a dead parameter left)
            guard.trained[id(p)] = weakref.ref(p)
    return guard
