"""Which address a host's peer server binds to and advertises (internal).

The default is the address other hosts already reach this one by: the local address of the
route to the job's coordination service (a connected UDP socket's own address; connecting a
UDP socket sends nothing). A job whose coordinator is on loopback runs on one host, so
loopback is then right; any other job gets a routable address, IPv4 or IPv6.
"""

from __future__ import annotations

import ipaddress
import socket
from typing import NamedTuple

from fastckpt.errors import ConfigError

__all__ = ["PeerAddress", "peer_address", "route_source_address", "split_host_port"]

_WILDCARDS = frozenset({"0.0.0.0", "::", ""})


def split_host_port(address: str) -> tuple[str, int]:
    """``"host:port"`` or ``"[v6]:port"`` -> ``(host, port)``.

    Raises:
        ConfigError: not of that form.
    """
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"not a host:port address: {address!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ConfigError(f"an IPv6 address needs brackets, as in [::1]:1234: {address!r}")
    return host, int(port)


def route_source_address(host: str, port: int) -> str:
    """This host's own address on the route to ``host`` (a name or an IPv4/IPv6 literal).

    Raises:
        ConfigError: ``host`` does not resolve, or no route leads to any of its addresses.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except socket.gaierror as e:
        raise ConfigError(f"cannot resolve the coordinator host {host!r}: {e}") from e
    errors = []
    for family, _, _, _, sockaddr in infos:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            try:
                s.connect(sockaddr)
            except OSError as e:
                errors.append(f"{sockaddr[0]}: {e}")
                continue
            return str(s.getsockname()[0])
    raise ConfigError(f"no route to the coordinator {host!r} ({'; '.join(errors) or 'no address'})")


class PeerAddress(NamedTuple):
    """Where a peer server listens, and what peers are told to connect to."""

    bind: str
    advertise: str


def peer_address(host: str | None, *, service_address: str | None, process_count: int) -> PeerAddress:
    """Where this host's peer server listens and what it advertises.

    * ``host`` set to an address or name: bind and advertise it (an explicit choice wins).
    * ``host`` a wildcard (``"0.0.0.0"``, ``"::"``): bind every interface, advertise the
      default address below.
    * ``host`` None: in a multi-process job, the address of the route to the coordination
      service (``service_address``, ``host:port``); alone, loopback.

    Raises:
        ConfigError: a multi-process job without a coordination service address and no
            ``host`` (there is nothing to infer a reachable address from), or no route.
    """
    if host is not None and host not in _WILDCARDS:
        return PeerAddress(host, host)
    if process_count <= 1 and service_address is None:
        default = "127.0.0.1"
    elif service_address is None:
        raise ConfigError("RamOptions.host is needed: this multi-process job has no coordination service "
                          "address to find a reachable peer address from")
    else:
        default = route_source_address(*split_host_port(service_address))
    if host is None:
        return PeerAddress(default, default)
    bind = "::" if _is_v6(default) else "0.0.0.0"
    return PeerAddress(bind, default)


def _is_v6(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.split("%", 1)[0]).version == 6
    except ValueError:
        return False
