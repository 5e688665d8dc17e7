"""Spawned gloo ranks for the multi-rank tests (their bodies: dist_worker.py)."""
import json
import multiprocessing
import multiprocessing.forkserver
import os
import tempfile
import time

import pytest
import torch.multiprocessing as mp

import dist_worker
import tiers


# How the ranks start. "forkserver": each rank is forked from a server process (one per pytest process) that has
# imported dist_worker, so torch, dpcompile and the test models, once (CI time: a spawned rank spent about 7 s of
# CPU importing them, some 17 spawns of 2-4 ranks each). "spawn" (DPCOMPILE_TEST_RANKS_START=spawn): a fresh
# interpreter per rank, as torchrun starts them: each with its own string hash seed and address layout, so a set
# iterated in another order on one rank shows up as ranks that disagree. benchmarks/gpu_tests.sh runs the suite
# that way; the NCCL tests and the compile cache's restarts (a restart is a new process) always spawn. The server
# also does the once-per-process work of a rank's first compile (rank_preload.py).
START_METHOD = os.environ.get("DPCOMPILE_TEST_RANKS_START", "forkserver")
if START_METHOD not in ("forkserver", "spawn"):
    raise ValueError(f"DPCOMPILE_TEST_RANKS_START={START_METHOD!r}: use forkserver or spawn")
_TESTS = os.path.dirname(os.path.abspath(__file__))
# the environment the test session started with (collection): the fork server keeps the one it starts with, and a
# test's monkeypatched variables must not reach the ranks of every later test
_SESSION_ENV = dict(os.environ)


def _start_fork_server():
    """The fork server (started unless it runs) with the session's environment; it imports rank_preload (the test
    bodies and what a rank's first compile would repeat) from tests/ (multiprocessing passes it no sys.path:
    PYTHONPATH)."""
    multiprocessing.set_forkserver_preload(["rank_preload"])
    now = dict(os.environ)
    try:
        os.environ.clear()
        os.environ.update(_SESSION_ENV)
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_TESTS, _SESSION_ENV.get("PYTHONPATH")) if p)
        multiprocessing.forkserver.ensure_running()
    finally:
        os.environ.clear()
        os.environ.update(now)


def spawn(fn, *args, world=2, timeout=420, start_method=None):
    """Runs fn(rank, world, init_file, *args) on `world` new processes (START_METHOD unless start_method says);
    fails if they do not finish."""
    method = start_method or START_METHOD
    if method == "forkserver":
        _start_fork_server()
    init = tempfile.mktemp(prefix="dpcompile_init_")
    ctx = mp.start_processes(fn, args=(world, init, *args), nprocs=world, join=False, start_method=method)
    deadline = time.time() + timeout
    while not ctx.join(timeout=5):
        if time.time() > deadline:
            for p in ctx.processes:
                p.kill()
            raise AssertionError("ranks did not finish: a collective mismatch or deadlock")


def read(tmp, world=2, prefix="rank"):
    """Each rank's JSON report, <prefix><rank>.json in tmp."""
    return [json.load(open(os.path.join(tmp, f"{prefix}{r}.json"))) for r in range(world)]


# pytest-xdist workers above which each job spawns its own ranks: on a machine with that many cores the jobs run
# in parallel (benchmarks/gpu_tests.sh, 14 workers: the shared groups made the run longer); on CI's 2 cores
# spawning is what costs
SPREAD_WORKERS = 4


class SharedRanks:
    """Small multi-rank tests that share their ranks: spawning them is the slow part of such a test. ``jobs``:
    {job: (group, dist_worker function name, keyword arguments)}. Under pytest-xdist (--dist loadgroup) each
    group is one xdist group and one spawned process group, which runs every job of the group
    (dist_worker.jobs) when its first test asks; with more than SPREAD_WORKERS workers each job is a group of
    its own; a plain run runs all of them in one."""

    def __init__(self, name: str, jobs: dict, world: int = 2, timeout: int = 2400, extended_jobs=()):
        self.name, self.jobs, self.world, self.timeout = name, jobs, world, timeout
        # jobs of the extended tier (tests/tiers.py): in their group, run only when that tier runs
        self.extended_jobs = frozenset(extended_jobs)
        assert self.extended_jobs <= set(jobs), self.extended_jobs - set(jobs)
        self._dirs: dict = {}

    def mark(self, job: str):
        """The xdist_group mark of a test that reads ``job``."""
        return pytest.mark.xdist_group(f"{self.name}{self._group(job)}")

    def marks(self, job: str) -> list:
        """Every mark of a test that reads ``job``: its xdist group, and the extended tier's for its jobs."""
        return [self.mark(job)] + ([tiers.extended] if job in self.extended_jobs else [])

    def _group(self, job: str) -> str:
        if not os.environ.get("PYTEST_XDIST_WORKER"):
            return "all"
        if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > SPREAD_WORKERS:
            return job
        return str(self.jobs[job][0])

    def out_dir(self, job: str, tmp_path_factory) -> str:
        """The job's output folder, its group run first if it has not run; a job that raised fails the test."""
        group = self._group(job)
        if group not in self._dirs:
            specs = {j: spec[1:] for j, spec in self.jobs.items()
                     if self._group(j) == group and (j not in self.extended_jobs or tiers.extended_tier())}
            out = tmp_path_factory.mktemp(f"{self.name}{group}")
            try:
                spawn(dist_worker.jobs, str(out), specs, world=self.world, timeout=self.timeout)
            except AssertionError as e:  # the group's other tests fail with it, without spawning it again
                self._dirs[group] = e
                raise
            self._dirs[group] = out
        if isinstance(self._dirs[group], AssertionError):
            raise AssertionError(f"{job}: the ranks of its group failed: {self._dirs[group]}")
        out = self._dirs[group] / job
        errors = [e.read_text() for e in sorted(out.glob("error*.txt"))]
        assert not errors, f"{job}:\n" + "\n".join(errors)
        return str(out)
