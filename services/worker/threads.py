"""CPU threads and OpenMP's wait policy for a worker process, set before torch is imported
(libgomp and MKL read their environment once, when they load).

Wait policy. libgomp's default (no OMP_WAIT_POLICY) spins a while before a waiting thread
sleeps; PASSIVE sleeps at once, ACTIVE never sleeps. A worker keeps the default unless its
team would share cores with other workers' teams (`wait_policy_for`): there, spinning threads
steal each other's cycles (a decode-sized linear went from 1.2 ms to 8.6 ms beside another busy
worker, and the same workload took 28.9 s spinning vs 21.0 s with PASSIVE). Beside the light
processes of a cluster (scheduler, detokenizer, gateway) the default wins: a thread that sleeps
at every torch op's fork and join pays a wake-up each time, and on a virtual machine waking an
idle vCPU is slow. Measured with `benchmarks/serve_peers.py --servers zeroserve` (SmolLM2 Q4_1,
2-core AMD EPYC VM, AVX2), two runs each, interleaved: PASSIVE 79.8 / 77.8 output tok/s at 16
concurrent, batch-1 TPOT 21.7 / 25.8 ms, batch-1 TTFT 255 / 269 ms; the default 86.6 / 87.1,
15.5 / 18.0 ms, 125 / 137 ms (a 256-token prefill in process: ~960 vs ~620 ms). A bounded spin
(GOMP_SPINCOUNT=20000, ~0.5 ms) measured between the two: 84.5 / 87.2 tok/s against 91.9 / 97.9.
"""

from __future__ import annotations

import os

# the policy for workers whose teams together ask for more threads than the host has CPUs
OVERSUBSCRIBED_WAIT_POLICY = "PASSIVE"


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask: a container's cpuset, `taskset`)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def wait_policy_for(total_threads: int, cpus: int) -> str | None:
    """The OMP_WAIT_POLICY for workers on one host of `cpus` CPUs whose teams add up to
    `total_threads`: PASSIVE when that is more than the CPUs (their threads would spin against
    each other), else None (libgomp's spin-then-sleep default). The user's own OMP_WAIT_POLICY wins."""
    if "OMP_WAIT_POLICY" in os.environ:
        return None
    return OVERSUBSCRIBED_WAIT_POLICY if total_threads > cpus else None


def configure(threads: int | None) -> dict[str, str | None]:
    """Set OMP_NUM_THREADS / MKL_NUM_THREADS (unless set) to ``threads`` or the usable CPUs;
    returns the thread count and the wait policy in effect (None: libgomp's default). Call
    before importing torch."""
    n = str(threads or os.environ.get("OMP_NUM_THREADS") or usable_cpus())  # the user's count sizes MKL too
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        if threads or var not in os.environ:
            os.environ[var] = n
    return {"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY"), "OMP_NUM_THREADS": os.environ["OMP_NUM_THREADS"]}
