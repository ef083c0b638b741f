"""The interface a tensor-parallel shard binds its collectives to (services/worker/netif.py)."""

from __future__ import annotations

import pytest

from zeroserve.common.errors import InvalidRequest
from zeroserve.services.worker import netif

TABLE = {"lo": ["127.0.0.1", "::1"], "eth0": ["10.7.0.2", "fe80::1"], "eth1": ["192.168.5.9"]}


def _route(table_src: dict[str, str]):
    return lambda ip: table_src.get(ip)


def test_the_advertised_address_wins_even_when_the_hostname_says_loopback():
    c = netif.pick_interface("10.7.0.2", "tcp://10.7.0.3:29500", table=TABLE, route=_route({}))
    assert c.ifname == "eth0" and c.address == "10.7.0.2" and "advertised address 10.7.0.2" in c.why


def test_without_an_advertised_address_the_route_to_the_rendezvous_decides():
    c = netif.pick_interface(None, "tcp://192.168.5.1:29500", table=TABLE, route=_route({"192.168.5.1": "192.168.5.9"}))
    assert c.ifname == "eth1" and "route to the rendezvous 192.168.5.1" in c.why


def test_an_advertised_address_no_interface_carries_falls_back_to_the_route_and_says_so():
    # behind NAT / a port mapping the advertised address is not local
    c = netif.pick_interface("203.0.113.7", "tcp://10.7.0.9:1", table=TABLE, route=_route({"10.7.0.9": "10.7.0.2"}))
    assert c.ifname == "eth0" and "no interface carries the advertised address 203.0.113.7" in c.why


def test_nothing_found_leaves_the_choice_to_the_libraries():
    c = netif.pick_interface("no-such-host.invalid", None, table=TABLE, route=_route({}))
    assert c.ifname is None and "does not resolve" in c.why
    assert netif.bind_collectives(c, env={}) == {}


def test_loopback_rendezvous_is_lo_on_this_machine():
    c = netif.pick_interface(None, "tcp://127.0.0.1:29500")
    assert c.ifname is not None and "127.0.0.1" in netif.interfaces()[c.ifname]
    assert netif.pick_interface("127.0.1.1", None, table=TABLE).ifname == "lo"  # Debian's hostname address


def test_ipv6_rendezvous_literal():
    c = netif.pick_interface(None, "tcp://[fe80::2]:29500", table=TABLE, route=_route({"fe80::2": "fe80::1"}))
    assert c.ifname == "eth0"


def test_the_users_variables_are_kept_and_the_flag_overrides_everything():
    choice = netif.Choice("eth0", "10.7.0.2", "test")
    env = {"GLOO_SOCKET_IFNAME": "bond0"}
    assert netif.bind_collectives(choice, env=env) == {"NCCL_SOCKET_IFNAME": "eth0"}
    assert env == {"GLOO_SOCKET_IFNAME": "bond0", "NCCL_SOCKET_IFNAME": "eth0"}
    lo = next(n for n, a in netif.interfaces().items() if "127.0.0.1" in a)
    env = {"GLOO_SOCKET_IFNAME": "bond0"}
    assert netif.bind_collectives(choice, override=lo, env=env) == {"GLOO_SOCKET_IFNAME": lo, "NCCL_SOCKET_IFNAME": lo}
    with pytest.raises(InvalidRequest, match="--collective-ifname 'nope0': no such interface"):
        netif.bind_collectives(choice, override="nope0", env={})
