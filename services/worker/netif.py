"""Which network interface a tensor-parallel shard's collectives (gloo, NCCL) use.

Left alone, gloo binds to the address the host's *name* resolves to, and NCCL picks an interface
by its own heuristics. On a host whose name resolves to loopback (Debian's `127.0.1.1` default,
many containers) gloo then tells its peers on other hosts to dial 127.x, and the group never
forms (`Gloo connectFullMesh failed ... remote=[127.0.0.1]`). The address that does work is the
one the shard advertises (`--advertise-host`: the rendezvous address the other shards already
dial), or, without one, the source address of the route to the rendezvous. So the worker finds
the interface carrying that address and sets GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME before the
process group is made, unless the user set them; `--collective-ifname` overrides the choice.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Callable, Mapping, MutableMapping
from typing import NamedTuple

from zeroserve.common.errors import InvalidRequest

IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


class Choice(NamedTuple):
    ifname: str | None  # None: nothing found, the libraries choose
    address: str | None
    why: str


def host_of(addr: str) -> str:
    """The host of tcp://HOST:PORT (brackets of an IPv6 literal removed)."""
    host = addr.split("//", 1)[-1].rsplit(":", 1)[0]
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def resolve(host: str) -> str | None:
    """An IP literal as is; a name to its first address (IPv4 first); None if it does not resolve."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return None
    infos.sort(key=lambda i: i[0] != socket.AF_INET)
    return infos[0][4][0] if infos else None


def source_address(remote_ip: str) -> str | None:
    """The local address the kernel's route to `remote_ip` uses (a UDP connect sends nothing)."""
    family = socket.AF_INET6 if ":" in remote_ip else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((remote_ip, 9))
            return s.getsockname()[0]
    except OSError:
        return None


def interfaces() -> dict[str, list[str]]:
    """Interface name -> its IP addresses."""
    import psutil

    return {name: [a.address.split("%", 1)[0] for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6)]
            for name, addrs in psutil.net_if_addrs().items()}


def _carrying(ip: str, table: Mapping[str, list[str]]) -> str | None:
    for name, addrs in table.items():
        if ip in addrs:
            return name
    if ipaddress.ip_address(ip).is_loopback:  # 127.0.1.1 lives on lo without being listed
        return next((n for n, addrs in table.items() if "127.0.0.1" in addrs or "::1" in addrs), None)
    return None


def pick_interface(advertise_host: str | None, rendezvous_addr: str | None, *,
                   table: Mapping[str, list[str]] | None = None,
                   route: Callable[[str], str | None] = source_address) -> Choice:
    """The interface carrying the advertised address, else the one the route to the rendezvous
    leaves by; `why` says which and, when neither worked, why not."""
    table = interfaces() if table is None else table
    notes = []
    if advertise_host:
        ip = resolve(advertise_host)
        name = _carrying(ip, table) if ip else None
        if name:
            return Choice(name, ip, f"it carries the advertised address {advertise_host} ({ip})")
        notes.append(f"no interface carries the advertised address {advertise_host}"
                     + (f" ({ip})" if ip else " (it does not resolve)"))
    if rendezvous_addr:
        host = host_of(rendezvous_addr)
        ip = resolve(host)
        src = route(ip) if ip else None
        name = _carrying(src, table) if src else None
        if name:
            return Choice(name, src, "; ".join([*notes, f"the route to the rendezvous {host} leaves by it ({src})"]))
        notes.append(f"no route to the rendezvous {host}" if src is None else f"no interface carries {src}")
    return Choice(None, None, "; ".join(notes) or "no advertised address and no rendezvous address")


def bind_collectives(choice: Choice, override: str | None = None,
                     env: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Set the libraries' interface variables the user did not set; returns what was set.
    `override` (--collective-ifname) wins over the choice and over the environment."""
    if override is not None:
        if override not in interfaces():
            raise InvalidRequest(f"--collective-ifname {override!r}: no such interface here "
                                 f"(have {', '.join(sorted(interfaces()))})")
        name = override
    elif choice.ifname is None:
        return {}
    else:
        name = choice.ifname
    out = {}
    for var in IFNAME_VARS:
        if override is not None or not env.get(var):
            env[var] = out[var] = name
    return out
