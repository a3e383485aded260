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

from shardkit.errors import ConfigError

__all__ = ["COLLECTIVE_IFNAME_VARS", "collective_env", "interface_of", "is_loopback", "local_addresses",
           "node_address", "resolve", "route_source"]

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
    return str(socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0])


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


def _listing() -> str:
    found = local_addresses()
    return ", ".join(f"{addr} ({name})" for addr, name in sorted(found.items())) or "none"


def node_address(endpoint_host: str, local_addr: str | None, *, endpoint_key: str, local_key: str,
                 fix: str) -> str:
    """The address this host binds to and advertises in a job whose endpoint (the rendezvous store,
    the head node) is ``endpoint_host``, checked before anything starts.

    ``local_addr`` None: the address of the interface that routes to the endpoint (`route_source`),
    never the host name's resolution; 127.0.0.1 for a loopback endpoint. Given: it must be an address
    of this host (a name is resolved once), on the interface that routes to the endpoint.

    Example:
        >>> node_address("10.77.0.1", None, endpoint_key="engine.rdzv_endpoint",
        ...              local_key="engine.local_addr", fix="--set engine.local_addr=ADDR")
        '10.77.0.2'

    Args:
        endpoint_key, local_key: the config keys the two came from, for the messages.
        fix: how the user sets ``local_key`` (``--set engine.local_addr=ADDR``); ``ADDR`` is replaced
            by the address that would work.

    Raises:
        ConfigError: the endpoint's name does not resolve, no interface routes to it, ``local_addr``
            does not resolve or is not an address of this host, or is not on the interface that
            reaches the endpoint (a loopback address for a remote endpoint, another network's).
    """
    if is_loopback(endpoint_host):
        chosen = local_addr or "127.0.0.1"
        _check_own(chosen, local_key, fix.replace("ADDR", "127.0.0.1"))
        return chosen
    try:
        source = route_source(endpoint_host)
    except socket.gaierror as e:
        raise ConfigError(
            f"{endpoint_key}: the host {endpoint_host!r} does not resolve ({e.strerror or e}). Fix: set "
            f"{endpoint_key} to node 0's address (an IP address avoids name lookups), HOST:PORT") from e
    except OSError as e:
        raise ConfigError(
            f"{endpoint_key}: no interface of this host routes to {endpoint_host} ({e.strerror or e}); this "
            f"host's addresses: {_listing()}. Fix: set {endpoint_key} to node 0's address on a network "
            "this host is on (check it with `ip route get ADDRESS`), or join this host to that network"
        ) from e
    if local_addr is None:
        return source
    chosen = _check_own(local_addr, local_key, fix.replace("ADDR", source))
    if ":" in chosen:  # IPv6: the interface lookup is IPv4 only (module docstring); taken as given
        return chosen
    mine, route = interface_of(chosen), interface_of(source)
    if is_loopback(chosen) or (mine != route and chosen != source):
        where = "a loopback address" if is_loopback(chosen) else f"on interface {mine}"
        raise ConfigError(
            f"{local_key} = {local_addr!r} ({chosen}, {where}) cannot reach {endpoint_key} "
            f"{endpoint_host}: this host reaches it from {source} through interface {route}, so the other "
            f"nodes would be told to connect to an address they may not reach. Fix: "
            f"{fix.replace('ADDR', source)}, or leave {local_key} out (the address routing to the endpoint "
            "is the default)")
    return chosen


def _check_own(local_addr: str, local_key: str, fix: str) -> str:
    """``local_addr`` resolved; `ConfigError` unless it is an address of this host."""
    try:
        addr = resolve(local_addr)
    except OSError as e:
        raise ConfigError(f"{local_key} = {local_addr!r} does not resolve ({e}). Fix: {fix}") from e
    if ":" in addr or is_loopback(addr) or addr in local_addresses():
        return addr
    raise ConfigError(
        f"{local_key} = {local_addr!r}" + (f" ({addr})" if addr != local_addr else "")
        + f" is not an address of this host (its addresses: {_listing()}): the other nodes would connect "
        f"to another machine, and the collectives cannot bind to it. Fix: {fix}, or leave {local_key} "
        "out (the address routing to the endpoint is the default)")
