"""Scheduler failover: address lists, the term that fences a deposed scheduler, and their timings.

A cluster may run a hot standby beside its scheduler (`zeroserve scheduler --standby-of ADDR`,
services/scheduler/standby.py). Clients, workers and the detokenizer then know several scheduler
addresses (`tcp://a:7000,tcp://b:7000`) and talk to one at a time, moving to the next when the
current one is gone (its connection dropped), silent, or answers that it is a standby.

**The term rule** (Raft's terms, without votes: two schedulers have no quorum). Every scheduler
has a term; a standby that takes over takes its old active's term + 1. The scheduler stamps its
term in what it sends (Welcome, Step, Pong, Outputs, DetokNew, DetokTokens) and every peer keeps
the highest term it has seen (`Fence`): a message of a lower term is dropped, so a deposed
scheduler (one that was paused or cut off, not dead) can neither drive a worker nor deliver a
token once a peer has met its successor. Peers say their term in Hello, Heartbeat and Ping; a
scheduler with a standby peer that hears of a higher term steps down (services/scheduler/standby.py);
a lone scheduler never does (it takes a backend peer's higher term). Term 0 in a
message means "no term" (an older peer, or the in-process engine): it is never fenced.
"""

from __future__ import annotations

from zeroserve.common.errors import InvalidRequest

# a standby pings its active this often and takes over when no answer came for the lease
# (`--standby-lease`, 1 s): a live active answers within a loop turn (<= 0.2 s idle), but on a
# loaded 2-core host its loop was seen to stall 0.54 s, and a 0.5 s lease then deposed a live
# scheduler. A dead one is noticed sooner anyway: its connection drops (standby.py)
FOLLOW_PING_S = 0.1
# a scheduler that hears of a higher term exits with this code; its supervisor (`up`, compose,
# Swarm) starts it again as the standby of the one now active
EXIT_DEPOSED = 4

# peers with several addresses: a standby's answer means "the active is elsewhere, or I take over
# within my lease": ask it again this often for up to STANDBY_WAIT_S, then try the next address
STANDBY_RETRY_S = 0.1
STANDBY_WAIT_S = 2.0
# a scheduler that accepted no connection or answered nothing this long is passed over
NO_ANSWER_S = 1.0
STANDBY_DETAIL = "standby: this scheduler is not active"


def split_addresses(addrs: str | list[str] | tuple[str, ...], flag: str = "address") -> list[str]:
    """`tcp://a:1,tcp://b:2` (or a list of them) -> ["tcp://a:1", "tcp://b:2"]: the schedulers a
    peer may talk to, in the order it tries them. Empty entries are refused, duplicates dropped."""
    parts = addrs.split(",") if isinstance(addrs, str) else list(addrs)
    out: list[str] = []
    for p in parts:
        p = p.strip() if isinstance(p, str) else p
        if not p:
            raise InvalidRequest(f"{flag} {addrs!r}: an empty scheduler address in the list")
        if p not in out:
            out.append(p)
    if not out:
        raise InvalidRequest(f"{flag}: no scheduler address")
    return out


class Fence:
    """A peer's memory of the highest scheduler term it has seen; `admit(term)` says whether a
    message of that term may act (False: it comes from a deposed scheduler and is dropped)."""

    __slots__ = ("term", "dropped")

    def __init__(self) -> None:
        self.term = 0
        self.dropped = 0  # messages fenced off, for logs and tests

    def admit(self, term: int) -> bool:
        if term and term < self.term:
            self.dropped += 1
            return False
        if term > self.term:
            self.term = term
        return True

    def stale(self, term: int) -> bool:
        """Whether a scheduler of `term` is behind what we know (without counting a drop)."""
        return bool(term) and term < self.term


def outranks(term: int, sid: str, other_term: int, other_sid: str) -> bool:
    """Between two active schedulers, the one that stays: the higher term; at equal terms (both
    took over at once, each unable to see the other) the larger instance id."""
    return (term, sid) > (other_term, other_sid)
