"""A worker sets its OpenMP wait policy and thread count before torch loads (services/worker/threads.py)."""

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
from services.worker.threads import configure
configure({threads})
import torch
print(json.dumps({{"policy": __import__("os").environ["OMP_WAIT_POLICY"], "threads": torch.get_num_threads()}}))
"""


def _probe(threads, **env) -> dict:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "MKL_"))}
    out = subprocess.run([sys.executable, "-c", PROBE.format(root=str(ROOT), threads=threads)],
                         env={**base, **env}, capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_passive_by_default_and_threads_as_asked():
    assert _probe(1) == {"policy": "PASSIVE", "threads": 1}


def test_the_users_environment_wins():
    got = _probe(None, OMP_WAIT_POLICY="ACTIVE", OMP_NUM_THREADS="1")
    assert got == {"policy": "ACTIVE", "threads": 1}


def test_usable_cpus_follows_the_affinity_mask():
    from services.worker.threads import usable_cpus

    assert 1 <= usable_cpus() <= (os.cpu_count() or 1)
    if hasattr(os, "sched_getaffinity"):
        assert usable_cpus() == len(os.sched_getaffinity(0))
