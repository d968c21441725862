"""Reach: the address a coordinator announces, and a start-up check that it can be reached there.

A coordinator listening on ``0.0.0.0`` only knows its local addresses; behind a router or in a cloud VM
the address volunteers must dial is another one (a public IP or a DNS name). ``--announce-addr`` (or
``runtime.announce_addr``) names it: :func:`announce_multiaddr` builds the multiaddr p2pd announces and
the join line prints, and :func:`reachability_problem` tells the organiser, at start-up, when that
address cannot be reached and what to open.

What the check can and cannot see: a fresh libp2p node on this machine dials the announced multiaddr
and asks for the run info (asyncloco/transport/discovery.py). A failure means a firewall on this host, a
wrong address, or a router that does not forward the port (or does not loop back — then outside peers
may still get through; the message says so). Success from here does not prove that the outside world
gets through a cloud security group; the message for an address that is not one of this machine's
interfaces reminds the organiser to forward the port.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from typing import Optional

__all__ = ["validate_announce_addr", "announce_multiaddr", "local_addresses", "reachability_problem", "free_port"]

logger = logging.getLogger(__name__)

_MAX_NAME = 253


def validate_announce_addr(address: str) -> str:
    """An IPv4/IPv6 address or a DNS name (no scheme, no port); raises ``ValueError`` saying what to pass."""
    address = address.strip()
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        labels = address.rstrip(".").split(".")
        valid = 0 < len(address) <= _MAX_NAME and all(
            0 < len(label) <= 63 and label.replace("-", "").isalnum() and not label.startswith("-") for label in labels
        )
        if not valid or address.replace(".", "").isdigit():
            raise ValueError(
                f"--announce-addr {address!r} is neither an IP address nor a DNS name; pass the public address "
                "volunteers dial, e.g. 203.0.113.7 or coordinator.example.org (no scheme, no port: the port is --port)"
            ) from None
        return address.rstrip(".")
    if ip.is_unspecified:
        raise ValueError(f"--announce-addr {address} is the wildcard address; announce the address volunteers dial")
    return str(ip)


def announce_multiaddr(address: str, port: int) -> str:
    """``/ip4/<ip>/tcp/<port>``, ``/ip6/...`` or ``/dns/<name>/tcp/<port>`` (p2pd resolves DNS names)."""
    if not 0 < port < 65536:
        raise ValueError(f"an announced address needs an explicit port, got {port}")
    address = validate_announce_addr(address)
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return f"/dns/{address}/tcp/{port}"
    return f"/ip{ip.version}/{ip}/tcp/{port}"


def local_addresses() -> set[str]:
    """IP addresses of this machine's interfaces that the kernel would use (best effort, no extra deps)."""
    found = {"127.0.0.1", "::1"}
    try:
        for info in socket.getaddrinfo(socket.gethostname(), None):
            found.add(str(info[4][0]))
    except OSError:
        pass
    for family, probe in ((socket.AF_INET, "192.0.2.1"), (socket.AF_INET6, "2001:db8::1")):
        try:  # a UDP "connect" sends nothing; it asks the kernel which source address it would use
            with socket.socket(family, socket.SOCK_DGRAM) as sock:
                sock.connect((probe, 9))
                found.add(str(sock.getsockname()[0]))
        except OSError:
            pass
    return found


def free_port(host: str) -> int:
    """A TCP port free on ``host`` now (announced addresses need the port before p2pd binds it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


async def reachability_problem(
    address: str, port: int, peer_id: str, listen_host: str, timeout: float = 10.0
) -> Optional[str]:
    """None when a fresh libp2p node on this machine reaches the coordinator ``peer_id`` at the announced
    ``address:port`` and gets its run info back; else what is wrong and what to open.

    A full libp2p dial, not a bare TCP connect: a middlebox that accepts any TCP connection, or another
    service on that port, must not pass for the coordinator."""
    from hivemind.p2p import P2P

    from asyncloco.transport.discovery import ask_run_info

    if listen_host in ("127.0.0.1", "::1", "localhost") and address not in ("127.0.0.1", "::1", "localhost"):
        return (
            f"the coordinator listens on {listen_host} only, so nobody can reach {address}:{port}; "
            "start it with --host 0.0.0.0 (or this machine's address)"
        )
    maddr = f"{announce_multiaddr(address, port)}/p2p/{peer_id}"
    try:
        resolved = sorted({str(info[4][0]) for info in socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)})
    except OSError as error:
        return f"{address} does not resolve ({error}); check the DNS name given to --announce-addr"
    problem: Optional[str] = None
    prober = None
    try:
        prober = await asyncio.wait_for(P2P.create(initial_peers=[maddr], dht_mode="client"), timeout=timeout)
        await ask_run_info(prober, peer_id, timeout=timeout)
    except Exception as error:  # P2PDaemonError (could not dial), TransportError, asyncio.TimeoutError
        problem = str(error).strip().splitlines()[-1][:200] or type(error).__name__
    finally:
        if prober is not None:
            await prober.shutdown()
    if problem is None:
        return None
    if any(ip in local_addresses() for ip in resolved):
        fix = (
            f"open TCP port {port} in this machine's firewall (e.g. `ufw allow {port}/tcp`, or the cloud "
            "provider's security group)"
        )
    else:
        fix = (
            f"{address} ({', '.join(resolved)}) is not an address of this machine, so the router or cloud NAT in "
            f"front of it must forward TCP port {port} here (port forwarding / security group); if the router "
            "cannot loop back (no hairpin NAT), peers outside may still get through: check from another network"
        )
    return f"the coordinator is not reachable at {maddr} from this machine ({problem}); {fix}"
