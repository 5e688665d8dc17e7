"""Checkpoint and resume of a whole private training run.

One call saves, one restores: the model and the optimizer (torch.distributed
checkpoint, DCP: sharded parameters are saved shard by shard and may be
loaded on another number of ranks), the privacy accountant, the sampler's
seed and position, and every rank's noise stream.

A checkpoint is committed by renaming a finished temporary directory to
``step_<t>``: a run killed at any point, also in the middle of a save, finds
only complete checkpoints, the newest of which it resumes from. The model,
the accountant and the noise stream of one checkpoint are of the same step,
so a resumed run counts each step once and continues the noise stream where
it stopped: a step redone after a crash draws the noise the lost step drew
(it is the same computation again, never a second draw for one gradient).

The checkpoint holds the noise and sampling seeds: knowing them reveals the
noise of every step. Keep checkpoints as private as the training data and
release only the trained weights.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import warnings
from typing import Any

import torch

from dpcompile.accounting import PrivacyAccountant, atomic_write_json
from dpcompile.sampling import PoissonBatchSampler

_COMMITTED = re.compile(r"^step_(\d{9})$")
_FORMAT = 1


def _dist():
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist
    return None


def _resolve_backend(backend: Any):
    from dpcompile.backend import DPBackend, get_backend

    if backend is None or isinstance(backend, DPBackend):
        return backend
    if isinstance(backend, dict):  # the options of torch.compile(step, backend="dp_fsdp", options=...)
        return get_backend(backend)
    found = getattr(backend, "dp_backend", None)  # a private_step function
    if isinstance(found, DPBackend):
        return found
    raise ValueError(
        f"Checkpointer: backend must be the DPBackend, a @dpcompile.private_step function or the options dict "
        f"given to torch.compile(..., backend='dp_fsdp', options=...), got {type(backend).__name__}")


class Checkpointer:
    """Saves and restores a private training run in ``directory``.

    ``model`` and ``optimizer`` are saved with DCP (``get_state_dict``), also
    when sharded with ``dpcompile.fully_shard``; ``backend`` (the DPBackend, a
    ``private_step`` function, or the ``options`` dict of
    ``torch.compile(..., backend="dp_fsdp")``) gives the noise stream;
    ``accountant`` and ``sampler`` are optional. Every rank constructs one and
    calls ``save``/``restore`` together. ``keep`` committed checkpoints are
    kept (the newest).
    """

    def __init__(self, directory: str | os.PathLike, *, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer | None = None, backend: Any = None,
                 accountant: PrivacyAccountant | None = None, sampler: PoissonBatchSampler | None = None,
                 keep: int = 2):
        if not isinstance(model, torch.nn.Module):
            raise ValueError(f"Checkpointer: model must be an nn.Module, got {type(model).__name__}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(f"Checkpointer: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if accountant is not None and not isinstance(accountant, PrivacyAccountant):
            raise ValueError("Checkpointer: accountant must be a dpcompile.PrivacyAccountant")
        if sampler is not None and not isinstance(sampler, PoissonBatchSampler):
            raise ValueError("Checkpointer: sampler must be a dpcompile.PoissonBatchSampler")
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"Checkpointer: keep must be an int >= 1, got {keep!r}")
        self.directory = os.fspath(directory)
        self.model, self.optimizer, self.accountant, self.sampler, self.keep = model, optimizer, accountant, \
            sampler, keep
        self.backend = _resolve_backend(backend)

    # ------------------------------------------------------------------ paths
    def _committed(self) -> list[tuple[int, str]]:
        if not os.path.isdir(self.directory):
            return []
        found = []
        for name in os.listdir(self.directory):
            m = _COMMITTED.match(name)
            if m and os.path.isfile(os.path.join(self.directory, name, "run.json")):
                found.append((int(m.group(1)), os.path.join(self.directory, name)))
        return sorted(found)

    def latest(self) -> str | None:
        """The newest committed checkpoint directory, or None."""
        found = self._committed()
        return found[-1][1] if found else None

    # ------------------------------------------------------------------- save
    def _model_and_optimizer(self):
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        if self.optimizer is None:
            return {"model": get_model_state_dict(self.model)}
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optimizer": optim_sd}

    def save(self, step: int, *, extra: dict[str, Any] | None = None) -> str:
        """Commits the state after ``step`` completed logical steps (and ``extra``, JSON-able: curves,
        the data loader's own position...). Returns the checkpoint's directory."""
        import torch.distributed.checkpoint as dcp

        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"Checkpointer.save: step must be an int >= 0 (completed steps), got {step!r}")
        try:
            json.dumps(extra)
        except (TypeError, ValueError) as e:
            raise ValueError(f"Checkpointer.save: extra must be JSON-able ({e})") from e
        dist = _dist()
        rank = dist.get_rank() if dist else 0
        world = dist.get_world_size() if dist else 1
        final = os.path.join(self.directory, f"step_{step:09d}")
        tmp = os.path.join(self.directory, f".partial_step_{step:09d}")
        if rank == 0:
            os.makedirs(self.directory, exist_ok=True)
            for name in os.listdir(self.directory):  # saves that were killed: never committed, never read
                if name.startswith(".partial_step_"):
                    shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
            os.makedirs(tmp)
        if dist:
            dist.barrier()
        with _quiet_single_process():
            dcp.save(self._model_and_optimizer(), checkpoint_id=os.path.join(tmp, "dcp"), no_dist=dist is None)
        if self.backend is not None:  # every rank's noise stream
            atomic_write_json(os.path.join(tmp, f"noise_rank{rank}.json"), self.backend.state_dict())
        if dist:
            dist.barrier()
        if rank == 0:
            run = {"format": _FORMAT, "step": step, "world_size": world, "extra": extra,
                   "accountant": self.accountant.state_dict() if self.accountant is not None else None,
                   "sampler": self.sampler.state_dict() if self.sampler is not None else None}
            atomic_write_json(os.path.join(tmp, "run.json"), run)  # written last: marks the files complete
            _fsync_dir(tmp)
            if os.path.exists(final):  # the same step saved again (a resumed run): replace it
                shutil.rmtree(final)
            os.replace(tmp, final)
            _fsync_dir(self.directory)
            for _, old in self._committed()[:-self.keep]:
                shutil.rmtree(old, ignore_errors=True)
        if dist:
            dist.barrier()
        return final

    # ---------------------------------------------------------------- restore
    def restore(self, path: str | os.PathLike | None = None) -> dict[str, Any] | None:
        """Restores the newest committed checkpoint (or ``path``): model, optimizer, accountant, noise
        stream, and the sampler set to continue after the checkpoint's step. Returns ``{"step": t,
        "extra": ...}``, or None when there is no checkpoint (a fresh run)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        path = os.fspath(path) if path is not None else self.latest()
        if path is None:
            return None
        try:
            with open(os.path.join(path, "run.json")) as f:
                run = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{path} is not a checkpoint written by dpcompile.Checkpointer ({e})") from e
        if run.get("format") != _FORMAT:
            raise ValueError(f"{path}: checkpoint format {run.get('format')!r}, this dpcompile reads {_FORMAT}")
        state = self._model_and_optimizer()
        if self.optimizer is not None and not os.path.exists(os.path.join(path, "dcp")):
            raise ValueError(f"{path}: no model/optimizer state")
        try:
            with _quiet_single_process():
                dcp.load(state, checkpoint_id=os.path.join(path, "dcp"), no_dist=_dist() is None)
        except Exception as e:  # noqa: BLE001 - DCP raises several kinds; say which checkpoint and why
            if "optimizer" in state and "optimizer" in str(e):
                raise ValueError(f"{path}: the checkpoint has no optimizer state matching this optimizer ({e})") from e
            raise
        if self.optimizer is None:
            set_model_state_dict(self.model, state["model"])
        else:
            set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optimizer"])
        step = int(run["step"])
        if self.accountant is not None:
            if run["accountant"] is None:
                raise ValueError(f"{path}: saved without an accountant; its privacy spent is unknown")
            self.accountant.load_state_dict(run["accountant"])
        if self.sampler is not None:
            if run["sampler"] is None:
                raise ValueError(f"{path}: saved without a sampler; its sampling seed is unknown")
            self.sampler.load_state_dict(run["sampler"], start_step=step)
        if self.backend is not None:
            self._restore_noise(path, run)
        return {"step": step, "extra": run.get("extra")}

    def _restore_noise(self, path: str, run: dict[str, Any]) -> None:
        dist = _dist()
        rank = dist.get_rank() if dist else 0
        mine = os.path.join(path, f"noise_rank{rank}.json")
        if not os.path.exists(mine):
            mine = os.path.join(path, "noise_rank0.json")  # more ranks than saved: the shared seed and step
        if not os.path.exists(mine):
            raise ValueError(f"{path}: saved without the noise stream (no backend given to the Checkpointer)")
        with open(mine) as f:
            self.backend.load_state_dict(json.load(f))


@contextlib.contextmanager
def _quiet_single_process():
    # DCP warns that it assumes one process when there is no process group: that is what we ask for
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
