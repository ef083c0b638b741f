"""A worker sets its thread count before torch loads, and `up` its workers' OpenMP wait policy
(services/worker/threads.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import json, sys
sys.path.insert(0, {root!r})
from zeroserve.services.worker.threads import configure
configure({threads})
import torch
print(json.dumps({{"policy": __import__("os").environ.get("OMP_WAIT_POLICY"), "threads": torch.get_num_threads()}}))
"""


def _probe(threads, **env) -> dict:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "MKL_"))}
    out = subprocess.run([sys.executable, "-c", PROBE.format(root=str(ROOT), threads=threads)],
                         env={**base, **env}, capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_libgomp_default_policy_and_threads_as_asked():
    assert _probe(1) == {"policy": None, "threads": 1}


def test_passive_only_when_teams_oversubscribe_the_cpus(monkeypatch):
    from zeroserve.services.worker.threads import wait_policy_for

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert wait_policy_for(2, cpus=2) is None
    assert wait_policy_for(4, cpus=2) == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # the user's choice is left alone
    assert wait_policy_for(4, cpus=2) is None


def test_up_gives_oversubscribed_workers_passive_waits(monkeypatch):
    """`up --workers 2 --threads 2` on 2 CPUs: each worker waits passively; one fitting worker
    keeps the default."""
    from zeroserve.services import launcher
    from zeroserve.services.cli import build_parser

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setattr(launcher, "usable_cpus", lambda: 2)

    def worker_envs(argv):
        args = build_parser().parse_args(["up", *argv])
        return [c.env for c in launcher.plan_children(args, "m") if c.role == "worker"]

    assert worker_envs(["--workers", "2", "--threads", "2"]) == [{"OMP_WAIT_POLICY": "PASSIVE"}] * 2
    assert worker_envs(["--workers", "1"]) == [{}]
    assert worker_envs(["--workers", "2"]) == [{}, {}]  # one thread each


def test_the_users_environment_wins():
    got = _probe(None, OMP_WAIT_POLICY="ACTIVE", OMP_NUM_THREADS="1")
    assert got == {"policy": "ACTIVE", "threads": 1}


def test_usable_cpus_follows_the_affinity_mask():
    from zeroserve.services.worker.threads import usable_cpus

    assert 1 <= usable_cpus() <= (os.cpu_count() or 1)
    if hasattr(os, "sched_getaffinity"):
        assert usable_cpus() == len(os.sched_getaffinity(0))
