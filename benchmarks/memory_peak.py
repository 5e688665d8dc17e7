"""What is alive at the peak of a CUDA memory snapshot (anchors.py --memory-snapshots).

    python benchmarks/memory_peak.py SNAPSHOT.pickle [SNAPSHOT2.pickle ...] [--top 25]

Replays the allocator's trace of the recorded step (alloc / free events of device 0), finds the event at
which the allocated bytes peak, and prints the blocks alive there, the largest first, each with the line
that allocated it: for Inductor's generated code, the line of the compiled module (``buf12 =
empty_strided_cuda(...)``, read from the file while it still exists, i.e. on the machine that ran the
step), otherwise the innermost frame outside torch. Blocks allocated before the recording started
(parameters, optimizer state) have no trace; they are summed as "before the step".
"""
from __future__ import annotations

import argparse
import collections
import linecache
import os
import pickle
import sys

GIB = 2**30


def generated_files(frames: list[dict]) -> set[str]:
    return {f["filename"] for f in frames if "torchinductor" in f.get("filename", "")}


def site(frames: list[dict]) -> tuple[str, str]:
    """(where, source line) of the frame that asked for the block: a generated module of Inductor's, else
    the innermost frame outside torch's own package."""
    frames = [f for f in frames if f.get("filename", "").endswith(".py")]  # the C++ frames come first
    for f in frames:
        name = f["filename"]
        if "torchinductor" in name or f"{os.sep}torch{os.sep}" not in name:
            line = linecache.getline(name, f.get("line", 0)).strip()
            return f"{os.path.basename(name)}:{f.get('line')} {f.get('name')}", line
    f = frames[0] if frames else {}
    return f"{os.path.basename(f.get('filename', '?'))}:{f.get('line')} {f.get('name')}", ""


def replay(trace: list[dict]):
    """Yields (index, event, live bytes after it) over the alloc / free events."""
    live = 0
    for i, e in enumerate(trace):
        if e["action"] == "alloc":
            live += e["size"]
        elif e["action"] == "free_requested":
            live -= e["size"]
        else:
            continue
        yield i, e, live


def analyse(path: str, top: int, copy_to: str | None = None) -> None:
    with open(path, "rb") as f:
        snap = pickle.load(f)
    trace = snap["device_traces"][0]
    at_end = sum(b["size"] for s in snap["segments"] if s.get("device", 0) == 0
                 for b in s["blocks"] if b["state"] == "active_allocated")
    events = list(replay(trace))
    if not events:
        print(f"{path}: no allocations recorded")
        return
    net = events[-1][2]
    before = at_end - net  # alive when the recording started
    peak_i, peak_e, peak_live = max(events, key=lambda t: t[2])
    alive: dict[int, dict] = {}
    for i, e, _ in events:
        if i > peak_i:
            break
        if e["action"] == "alloc":
            alive[e["addr"]] = e
        else:
            alive.pop(e["addr"], None)
    print(f"== {os.path.basename(path)}")
    print(f"peak {(before + peak_live) / GIB:.3f} GiB = {before / GIB:.3f} GiB before the step "
          f"+ {peak_live / GIB:.3f} GiB allocated by it ({len(alive)} blocks); at the end of the step "
          f"{at_end / GIB:.3f} GiB")
    where, line = site(peak_e.get("frames", []))
    print(f"peak reached at event {peak_i} of {len(trace)}: {where}  {line}")
    by_site: dict[tuple[str, str], list[int]] = collections.defaultdict(list)
    for e in alive.values():
        by_site[site(e.get("frames", []))].append(e["size"])
    rows = sorted(by_site.items(), key=lambda kv: -sum(kv[1]))
    print(f"{'MiB':>9} {'blocks':>6}  allocated at")
    for (where, line), sizes in rows[:top]:
        print(f"{sum(sizes) / 2**20:9.1f} {len(sizes):6d}  {where}  {line[:110]}")
    rest = rows[top:]
    if rest:
        print(f"{sum(sum(s) for _, s in rest) / 2**20:9.1f} {sum(len(s) for _, s in rest):6d}  "
              f"({len(rest)} more sites)")
    files = collections.Counter()
    for (where, _), sizes in rows:
        files[where.split(":")[0]] += sum(sizes)
    print("by module: " + ", ".join(f"{n} {b / 2**20:.0f} MiB" for n, b in files.most_common(6)))
    if copy_to:  # the generated modules that allocated what is alive at the peak: to read them elsewhere
        import shutil

        os.makedirs(copy_to, exist_ok=True)
        for src in set().union(*(generated_files(e.get("frames", [])) for e in alive.values())):
            if os.path.exists(src):
                shutil.copy(src, copy_to)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("snapshots", nargs="+")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--copy-sources", default=None, metavar="DIR",
                    help="copy the Inductor-generated modules that allocated the blocks alive at the peak to DIR")
    args = ap.parse_args(argv)
    for p in args.snapshots:
        analyse(p, args.top, args.copy_sources)
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
