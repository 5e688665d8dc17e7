"""Spawned gloo ranks for the multi-rank tests (their bodies: dist_worker.py)."""
import json
import os
import tempfile
import time

import pytest
import torch.multiprocessing as mp

import dist_worker
import tiers


def spawn(fn, *args, world=2, timeout=420):
    """Runs fn(rank, world, init_file, *args) on `world` spawned processes; fails if they do not finish."""
    init = tempfile.mktemp(prefix="dpcompile_init_")
    ctx = mp.start_processes(fn, args=(world, init, *args), nprocs=world, join=False, start_method="spawn")
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
