"""Graph dumps: readable files per compile, rank, stage and pass, and TORCH_TRACE artifacts."""
from __future__ import annotations

import contextlib
import contextvars
import functools
import json
import os
import re
from collections.abc import MutableMapping
from typing import Any, Callable, Iterator

import torch.fx as fx

_dump_dir_override: contextvars.ContextVar[str | None] = contextvars.ContextVar("dpcompile_dump_dir", default=None)


@contextlib.contextmanager
def dump_graphs(directory: str | os.PathLike) -> Iterator[None]:
    """Within this block, every dp_fsdp compile writes its graphs under ``directory``."""
    tok = _dump_dir_override.set(os.fspath(directory))
    try:
        yield
    finally:
        _dump_dir_override.reset(tok)


def resolve_dump_dir(option: str | None) -> str | None:
    return option or _dump_dir_override.get() or os.environ.get("DPCOMPILE_DUMP_DIR") or None


def graph_text(gm: fx.GraphModule) -> str:
    try:
        return gm.print_readable(print_output=False, include_stride=False, include_device=False, colored=False)
    except TypeError:
        return gm.print_readable(print_output=False)


def graph_snapshot(gm: fx.GraphModule) -> Callable[[], str]:
    """A function that prints ``gm`` as it is now (``graph_text``), later. Printing a GPT-2-sized graph takes
    seconds and most compiles never read their texts; copying its nodes takes a fifth of that. The copy shares
    each node's meta values (fake tensors, which no pass changes in place); later rewrites of ``gm`` (the
    passes, Inductor's own) do not reach it. Child graph modules (higher-order ops' bodies) are small: printed
    now."""
    graph = fx.Graph()
    graph._codegen = gm.graph._codegen  # how the signature and the return are printed (pytree specs)
    out, old = graph.graph_copy(gm.graph, {}, return_output_node=True)
    graph.output(out, type_expr=old.type).meta.update(old.meta)
    name = gm._get_name()
    children = [(n, graph_text_of(m, n)) for n, m in gm.named_children() if isinstance(m, fx.GraphModule)]

    def text() -> str:
        code = graph.python_code(root_module="self", verbose=True, include_stride=False, include_device=False,
                                 colored=False).src.lstrip("\n")
        body = fx.graph_module._addindent(f"class {name}(torch.nn.Module):\n" + code, 4)
        return body + fx.graph_module._addindent("\n".join([""] + [t for _, t in children]), 4)

    return text


def graph_text_of(gm: fx.GraphModule, name: str) -> str:
    """A child graph module's text as print_readable prints it (under its attribute name)."""
    return fx.graph_module._print_readable(gm, name, print_output=False)


class GraphTexts(MutableMapping):
    """stage -> readable graph (``CompiledStep.graphs``): a stage set from ``graph_snapshot`` is printed when
    first read."""

    def __init__(self, items: Any = ()):
        self._texts: dict[str, "str | Callable[[], str]"] = {}
        self.update(items)

    def __getitem__(self, stage: str) -> str:
        text = self._texts[stage]
        if callable(text):
            text = self._texts[stage] = text()
        return text

    def __setitem__(self, stage: str, text: "str | Callable[[], str]") -> None:
        self._texts[stage] = text

    def __delitem__(self, stage: str) -> None:
        del self._texts[stage]

    def __iter__(self) -> Iterator[str]:
        return iter(self._texts)

    def __len__(self) -> int:
        return len(self._texts)

    def __repr__(self) -> str:
        return f"GraphTexts({sorted(self._texts)})"

    def __reduce__(self):  # pickled (the compile cache's record) as the printed texts
        return (GraphTexts, (dict(self.items()),))


class GraphDumper:
    """Writes ``<dir>/<compile id>/rank<r>/<NN>_<stage>.py`` and trace artifacts."""

    def __init__(self, directory: str | None, compile_id: str, rank: int):
        self.directory = directory
        self.prefix = f"dpcompile_{compile_id}_rank{rank}"
        self.folder = _unused_folder(directory, _safe(compile_id), rank) if directory else None
        self.count = 0
        self.files: list[str] = []

    def dump(self, stage: str, body: "str | Callable[[], str]") -> None:
        """``body``: the text, or a function making it, called only if a folder or TORCH_TRACE takes it."""
        name = f"{self.count:02d}_{_safe(stage)}"
        self.count += 1
        if callable(body):
            body = functools.cache(body)
        _trace_artifact(f"{self.prefix}_{name}", body)
        if self.folder:
            body = body() if callable(body) else body
            os.makedirs(self.folder, exist_ok=True)
            path = os.path.join(self.folder, name + ".py")
            with open(path, "w") as f:
                f.write(body)
            self.files.append(path)

    def dump_summary(self, summary: dict[str, Any]) -> None:
        text = format_summary(summary)
        _trace_artifact(f"{self.prefix}_summary", text)
        if self.folder:
            os.makedirs(self.folder, exist_ok=True)
            with open(os.path.join(self.folder, "summary.txt"), "w") as f:
                f.write(text)
            with open(os.path.join(self.folder, "summary.json"), "w") as f:
                json.dump(summary, f, indent=2, default=str)


def _unused_folder(directory: str, compile_id: str, rank: int) -> str:
    """``<dir>/<compile id>/rank<r>``, or ``<compile id>.<n>`` when that already holds an earlier compile's
    files (compile ids start over after torch._dynamo.reset() and in every new process): never overwrite."""
    name, n = compile_id, 0
    while os.path.exists(os.path.join(directory, name, f"rank{rank}")):
        n += 1
        name = f"{compile_id}.{n}"
    return os.path.join(directory, name, f"rank{rank}")


def format_summary(s: dict[str, Any]) -> str:
    lines = ["dpcompile summary", "=" * 17]
    for key in ("compile_id", "rank", "batch_size", "loss", "schedule", "noise", "collectives", "rewrite", "counters", "graph_ops"):
        if key in s:
            lines.append(f"{key}: {json.dumps(s[key], default=str)}")
    lines.append("")
    lines.append("parameters:")
    for name, e in s.get("params", {}).items():
        lines.append(f"  {name} {e.get('shape')}")
        for k in ("decomposition", "norm", "why", "schedule"):
            if k in e:
                lines.append(f"    {k}: {e[k]}")
    for key in ("frozen", "notes"):
        if s.get(key):
            lines.append(f"{key}: {json.dumps(s[key], default=str)}")
    return "\n".join(lines) + "\n"


def _trace_artifact(name: str, payload: "str | Callable[[], str]") -> None:
    try:
        from torch._logging import trace_structured

        trace_structured(
            "artifact",
            metadata_fn=lambda: {"name": name, "encoding": "string"},
            payload_fn=payload if callable(payload) else (lambda: payload),  # called only when tracing
        )
    except Exception:  # tracing is best-effort; never break a compile over it
        pass


def _safe(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", s)
