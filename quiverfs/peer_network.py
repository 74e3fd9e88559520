"""Which peer addresses cluster members may have: ``--peer-network CIDR[,CIDR...]``.

The cluster secret is the trust boundary; this narrows it to the operator's network.
With networks given, the coordinator refuses a heartbeat whose peer address lies
outside them, and mountd never dials such a member. A peer address must then be an IP
address: a host name is refused, since what it resolves to can change after the check.
Without networks, any well-formed ``HOST:PORT`` is allowed.
"""
from __future__ import annotations

import dataclasses
import ipaddress
import re
from typing import ClassVar

from quiverfs.errors import ExitCode, QuietError

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Networks = tuple[Network, ...]

_HOST = re.compile(r"[A-Za-z0-9._:%-]+")  # a host name, an IPv4 or an IPv6 address
_PORT = re.compile(r"[0-9]{1,5}")


@dataclasses.dataclass(frozen=True)
class PeerNetworks:
    """``--peer-network``: networks in CIDR notation, comma-separated
    (``10.0.0.0/8,fd00::/8``); a network with host bits set is refused as a typo."""

    option: str
    toml_types: ClassVar[tuple[type, ...]] = (str,)

    def __call__(self, value: str) -> Networks:
        networks = []
        for part in value.split(","):
            try:
                networks.append(ipaddress.ip_network(part.strip()))
            except ValueError as exc:
                raise QuietError(f"invalid {self.option} {value!r}: {exc}: give networks "
                                 "like 10.0.0.0/8, comma-separated", ExitCode.USAGE) from None
        return tuple(networks)


def describe(networks: Networks) -> str:
    """The networks as the option spells them."""
    return ",".join(str(n) for n in networks)


def split_peer(peer: str) -> tuple[str, int]:
    """HOST and PORT of a peer address ``HOST:PORT`` (an IPv6 host with or without
    brackets); ValueError if it is not one."""
    host, sep, port = peer.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    well_formed = bool(sep and _HOST.fullmatch(host) and _PORT.fullmatch(port))
    if not well_formed or not 0 < int(port) < 65536:
        raise ValueError(f"peer address {peer!r} is not HOST:PORT")
    return host, int(port)


def peer_refusal(peer: str, networks: Networks) -> str | None:
    """Why a member whose peer server is at ``peer`` may not be dialled, or None."""
    try:
        host, _ = split_peer(peer)
    except ValueError as exc:
        return str(exc)
    why = host_refusal(host, networks)
    return None if why is None else f"peer address {peer!r}: {why}"


def host_refusal(host: str, networks: Networks) -> str | None:
    """Why a peer server on ``host`` is not allowed by ``networks``, or None."""
    if not networks:
        return None
    try:
        ip = ipaddress.ip_address(host.removeprefix("[").removesuffix("]"))
    except ValueError:
        return f"{host} is not an IP address, as --peer-network requires"
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped  # ::ffff:10.0.0.2 is 10.0.0.2
    if not any(ip in net for net in networks):
        return f"{host} is outside --peer-network {describe(networks)}"
    return None
