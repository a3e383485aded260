"""This host's own network address, and what torch's and TensorFlow's collectives need to bind to it.

On many Debian hosts (127.0.1.1) and in containers the host name resolves to loopback. A process
that advertises "its" address from the host name (gloo does, when ``GLOO_SOCKET_IFNAME`` is unset)
then tells its peers on other machines to connect to 127.0.0.1, and the job fails in
``connectFullMesh``. So across machines shardkit never uses the host name's resolution: it takes the
address of the interface that routes to the job's endpoint (the kernel's choice of source address,
found by "connecting" a UDP socket, which sends nothing), or the address the user named, and hands the
collectives its interface by name (``GLOO_SOCKET_IFNAME``, ``NCCL_SOCKET_IFNAME``), unless the user
set those already.

IPv4 only for the interface lookup (``SIOCGIFADDR``); an IPv6 address is used as given, and the
interface variables are then left to the user.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import socket
import struct
from collections.abc import Mapping

__all__ = ["COLLECTIVE_IFNAME_VARS", "collective_env", "interface_of", "is_loopback", "local_addresses",
           "resolve", "route_source"]

#: The variables that pin gloo's and NCCL's sockets to one interface (set only where the user did not).
COLLECTIVE_IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
_SIOCGIFADDR = 0x8915


def resolve(host: str) -> str:
    """``host`` as an IPv4/IPv6 address string (a name is resolved once; an address is returned as is).

    Raises:
        OSError: the name does not resolve.
    """
    with contextlib.suppress(ValueError):
        return str(ipaddress.ip_address(host.strip("[]")))
    return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and a name that resolves to one of them."""
    try:
        return ipaddress.ip_address(resolve(host)).is_loopback
    except (OSError, ValueError):
        return False


def route_source(host: str, port: int = 9) -> str:
    """The address of this host that the kernel would send from to reach ``host`` (no packet is sent).

    Raises:
        OSError: no interface routes to ``host`` (``ENETUNREACH``), or the name does not resolve.
    """
    addr = resolve(host)
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((addr, port))
        return str(s.getsockname()[0])


def local_addresses() -> dict[str, str]:
    """``{IPv4 address: interface name}`` for every interface of this host that has an address."""
    out: dict[str, str] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on it
                continue
            out[socket.inet_ntoa(packed[20:24])] = name
    return out


def interface_of(addr: str) -> str | None:
    """The name of this host's interface that holds ``addr``; None when no interface does."""
    return local_addresses().get(addr)


def collective_env(addr: str, environ: Mapping[str, str]) -> dict[str, str]:
    """What the collectives of a process on this host need to bind to ``addr``: the interface variables
    (`COLLECTIVE_IFNAME_VARS`) that ``environ`` (the user's environment and the job's ``env:``) does not
    set already. Empty for a loopback address or one no interface holds (IPv6)."""
    if is_loopback(addr):
        return {}
    name = interface_of(addr)
    if name is None:
        return {}
    return {var: name for var in COLLECTIVE_IFNAME_VARS if not environ.get(var)}
