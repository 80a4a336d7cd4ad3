"""The address a rank's process group will offer its peers, found before it connects, and the one line
that refuses a multi-host job whose address no other host can reach.

gloo picks the address the way torch's ProcessGroupGloo does: the interfaces named by
GLOO_SOCKET_IFNAME when set, else the first address this host's name resolves to that a socket can
bind, else loopback (torch warns and carries on). On many machines the host name resolves to
127.0.1.1 or 127.0.0.1 (Debian's /etc/hosts), so a rank on another host is told to connect to its
own loopback: it is refused at once and gloo reports "timed out connecting". NCCL chooses its own
interface, leaving out loopback unless NCCL_SOCKET_IFNAME names it.

A job spans hosts when this host runs fewer ranks than the world and the launch's master is not a
loopback address (a loopback master can only be reached from its own host). The driver
(megazero.launch) reads the environment and hands it in; this module only looks at sockets.
"""
from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct

_SIOCGIFADDR = 0x8915


def interface_address(name: str) -> str | None:
    """The IPv4 address of network interface `name`, None when it has none or does not exist."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def interfaces() -> dict[str, str]:
    """This host's interfaces that have an IPv4 address, loopback left out: {name: address}."""
    found = {}
    for _, name in socket.if_nameindex():
        address = interface_address(name)
        if address is not None and not is_loopback(address):
            found[name] = address
    return found


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        return False


def gloo_address(ifname: str | None) -> tuple[str, str]:
    """(address, why that one) gloo will offer this rank's peers."""
    if ifname:
        name = ifname.split(",")[0]
        address = interface_address(name)
        if address is None:
            return "", f"GLOO_SOCKET_IFNAME={ifname} names no interface with an address"
        return address, f"GLOO_SOCKET_IFNAME={ifname}"
    host = socket.gethostname()
    try:
        candidates = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return "127.0.0.1", f"the host name {host} does not resolve, so gloo falls back to loopback"
    for family, kind, proto, _, sockaddr in candidates:
        try:
            with socket.socket(family, kind, proto) as s:
                s.bind((sockaddr[0], 0))
        except OSError:
            continue
        return sockaddr[0], f"the host name {host} resolves to it"
    return "127.0.0.1", f"no address of the host name {host} can be bound, so gloo falls back to loopback"


def spans_hosts(world: int, local_world: int, master_addr: str | None) -> bool:
    """Whether ranks of this job run on other hosts (see the module docstring)."""
    if world <= local_world or not master_addr:
        return False
    try:
        resolved = {info[4][0] for info in socket.getaddrinfo(master_addr, None, type=socket.SOCK_STREAM)}
    except socket.gaierror:
        return True
    return not all(is_loopback(a) for a in resolved)


def address_error(backend: str, env_ifname: dict[str, str | None], spanning: bool) -> tuple[str | None, str]:
    """(the line refusing this rank's process-group address, or None; the address peers will reach)."""
    host = socket.gethostname()
    if backend == "nccl":
        ifname = env_ifname.get("NCCL_SOCKET_IFNAME")
        name = (ifname or "").lstrip("^=").split(",")[0]
        address = interface_address(name) if name else None
        if spanning and address is not None and is_loopback(address) and not (ifname or "").startswith("^"):
            return (f"this job spans hosts but NCCL_SOCKET_IFNAME={ifname} on host {host} is a loopback interface "
                    f"({address}), which the other hosts cannot reach; {_fix('NCCL_SOCKET_IFNAME')}"), address
        return None, address or ""
    ifname = env_ifname.get("GLOO_SOCKET_IFNAME")
    address, why = gloo_address(ifname)
    if not address:
        return f"{why} on host {host}; {_fix('GLOO_SOCKET_IFNAME')}", ""
    if spanning and is_loopback(address):
        return (f"this job spans hosts but host {host}'s process-group address is {address}, a loopback address "
                f"({why}), which the other hosts cannot reach; {_fix('GLOO_SOCKET_IFNAME')}"), address
    return None, address


def _fix(variable: str) -> str:
    found = interfaces()
    listed = ", ".join(f"{name} {address}" for name, address in found.items()) or "none found"
    return (f"set {variable} to this host's network interface (here: {listed}), or make the host name "
            f"resolve to that address")
