"""A process's CPU priority (its nice value), set at start-up by a service that asks for one.

Where the cluster's processes and its clients share a few cores, a woken process waits behind
the busy ones: on the 2-core dev box the gateway's added TTFT at 64 streams was mostly its event
loop waiting for the CPU, and a raised priority cut it (benchmarks/serve.py --gateway-nice).
"""

from __future__ import annotations

import os

NICE_RANGE = (-20, 19)


def set_nice(nice: int, who: str) -> None:
    """Set this process's nice value (threads started afterwards inherit it; Linux keeps one per
    thread). ValueError with what to do when it is out of range or not permitted."""
    lo, hi = NICE_RANGE
    if isinstance(nice, bool) or not isinstance(nice, int) or not lo <= nice <= hi:
        raise ValueError(f"{who}: --nice must be an integer in [{lo}, {hi}], got {nice!r}")
    if nice == os.getpriority(os.PRIO_PROCESS, 0):
        return
    try:
        os.setpriority(os.PRIO_PROCESS, 0, nice)
    except PermissionError:
        raise ValueError(f"{who}: not permitted to set nice {nice} (below the current "
                         f"{os.getpriority(os.PRIO_PROCESS, 0)} needs root or CAP_SYS_NICE, e.g. compose's "
                         "cap_add: [SYS_NICE]); leave --nice at 0 otherwise") from None
