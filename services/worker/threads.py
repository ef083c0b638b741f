"""CPU threads and OpenMP's wait policy for a worker process, set before torch is imported
(libgomp and MKL read their environment once, when they load).

A worker shares its cores: with the scheduler, the detokenizer and the gateway under `zeroserve
up`, with other workers in a compose stack. OpenMP threads that spin while they wait (the
default) then steal those cycles, and lose them back to every other spinning thread: on the
2-core dev box a decode-sized linear went from 1.2 ms to 8.6 ms with another busy process, and
the same worker workload took 28.9 s spinning vs 21.0 s with PASSIVE. On a host running only
the cluster no setting was clearly ahead (SmolLM2, 32 streams through `benchmarks/serve.py`,
output tok/s, HTTP/direct: PASSIVE 71.8/76.8 and 69.3/78.4; ACTIVE 73.8/78.5; libgomp's default
spin-then-sleep 89.8/90.2, 66.1/71.5, 84.9/67.9: +-15% run to run). So a worker waits passively
unless OMP_WAIT_POLICY says otherwise: little to lose alone, much when the cores are shared.
"""

from __future__ import annotations

import os

DEFAULT_WAIT_POLICY = "PASSIVE"


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask: a container's cpuset, `taskset`)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def configure(threads: int | None) -> dict[str, str]:
    """Set OMP_WAIT_POLICY (unless set) and OMP_NUM_THREADS / MKL_NUM_THREADS (unless set) to
    ``threads`` or the usable CPUs; returns what is in effect. Call before importing torch."""
    os.environ.setdefault("OMP_WAIT_POLICY", DEFAULT_WAIT_POLICY)
    n = str(threads or os.environ.get("OMP_NUM_THREADS") or usable_cpus())  # the user's count sizes MKL too
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        if threads or var not in os.environ:
            os.environ[var] = n
    return {k: os.environ[k] for k in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
