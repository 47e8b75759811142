"""The job's network interface (unbroken/control/store/netif.py): the route to the coordinator picks it, a user's own
``GLOO_SOCKET_IFNAME`` wins, and a job on loopback is left to gloo. The same on real separate hosts (network
namespaces) is in tests/test_netns.py."""

from __future__ import annotations

import socket

import pytest

from unbroken.control.store.netif import (
    GLOO_INTERFACE_ENV,
    interface_with,
    job_interface,
    local_address_towards,
    split_address,
    use_job_interface,
)


def test_addresses_split_and_malformed_ones_are_named() -> None:
    assert split_address("10.0.0.1:29400") == ("10.0.0.1", 29400)
    assert split_address("[::1]:80") == ("::1", 80)
    for bad in ("10.0.0.1", ":29400", "host:port", ""):
        with pytest.raises(ValueError, match="expected HOST:PORT"):
            split_address(bad)


def test_loopback_is_the_route_to_loopback_and_lo_holds_it() -> None:
    assert local_address_towards("127.0.0.1", 9) == "127.0.0.1"
    assert interface_with("127.0.0.1") == "lo"
    assert interface_with("203.0.113.77") is None  # a documentation address (TEST-NET-3) this machine does not hold
    assert job_interface("127.0.0.1:9,10.0.0.1:9") is None  # the first coordinator decides; loopback: gloo's choice


def test_a_job_on_loopback_leaves_gloo_alone_and_a_users_choice_wins() -> None:
    env: dict[str, str] = {}
    assert use_job_interface("127.0.0.1:29400", env) is None and env == {}
    env = {GLOO_INTERFACE_ENV: "eth7"}
    assert use_job_interface("127.0.0.1:29400", env) == "eth7" and env == {GLOO_INTERFACE_ENV: "eth7"}


def test_a_coordinator_on_this_hosts_own_address_is_reached_over_its_interface() -> None:
    """The host's address on a non-loopback interface (where it has one): the job's interface is that one."""
    candidates = [name for _, name in socket.if_nameindex() if name != "lo"]
    found = [(name, addr) for name in candidates if (addr := _ipv4(name)) is not None]
    if not found:
        pytest.skip("this machine has no IPv4 address outside loopback")
    name, address = found[0]
    assert interface_with(address) == name
    env: dict[str, str] = {}
    # The route to one's own address goes over lo, but from that address: the interface holding it is the job's.
    assert use_job_interface(f"{address}:29400", env) == name and env == {GLOO_INTERFACE_ENV: name}


def _ipv4(name: str) -> str | None:
    from unbroken.control.store.netif import _ipv4_of

    return _ipv4_of(name)
