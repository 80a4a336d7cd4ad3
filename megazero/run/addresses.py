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
(megazero.run.launch) reads the environment and hands it in; this module only looks at sockets (and,
for the reachability probe, the launch's store that the driver hands in).

A peer host's address can be routable yet unreachable (a firewall dropping packets, a route to a
gateway nobody holds, the wrong interface offered): gloo then retries until its timeout. Before the
process group starts, each host connects to a listener on every other host's process-group address
and names the first one that does not answer within REACH_SECONDS.
"""

from __future__ import annotations

import fcntl
import ipaddress
import json
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
            return (
                f"this job spans hosts but NCCL_SOCKET_IFNAME={ifname} on host {host} is a loopback interface "
                f"({address}), which the other hosts cannot reach; {_fix('NCCL_SOCKET_IFNAME')}"
            ), address
        return None, address or ""
    ifname = env_ifname.get("GLOO_SOCKET_IFNAME")
    address, why = gloo_address(ifname)
    if not address:
        return f"{why} on host {host}; {_fix('GLOO_SOCKET_IFNAME')}", ""
    if spanning and is_loopback(address):
        return (
            f"this job spans hosts but host {host}'s process-group address is {address}, a loopback address "
            f"({why}), which the other hosts cannot reach; {_fix('GLOO_SOCKET_IFNAME')}"
        ), address
    return None, address


def _fix(variable: str) -> str:
    found = interfaces()
    listed = ", ".join(f"{name} {address}" for name, address in found.items()) or "none found"
    return (
        f"set {variable} to this host's network interface (here: {listed}), or make the host name "
        f"resolve to that address"
    )


REACH_SECONDS = 5.0  # a peer host that has not answered a connection by then is unreachable


def listen(address: str) -> socket.socket | None:
    """A socket listening on `address` (any port) for the other hosts' reachability probes; the kernel
    completes their connections, nothing accepts them."""
    try:
        s = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM)
        s.bind((address, 0))
        s.listen(128)
        return s
    except OSError:
        return None


def probe(address: str, port: int, seconds: float = REACH_SECONDS) -> str | None:
    """None when a connection to address:port is made within `seconds`, else why not."""
    try:
        with socket.create_connection((address, port), timeout=seconds):
            return None
    except socket.timeout:
        return f"no answer within {seconds:g} s: packets to it are dropped"
    except OSError as err:
        return (err.strerror or str(err)).lower()


def check_reach(
    store, rank: int, world: int, local_rank: int, address: str | None, ifname: str | None
) -> tuple[socket.socket | None, str | None]:
    """(this rank's listener, to close once every rank has probed; the line naming a peer host its
    host cannot reach, or None). Every rank listens on its process-group address and posts it in the
    launch's store; each host's local rank 0 connects to the first rank of every other address, so
    a peer whose packets are dropped is named in seconds, before gloo would wait out its timeout."""
    listener = listen(address) if address else None
    port = listener.getsockname()[1] if listener is not None else 0
    store.set(f"reach-address/{rank}", json.dumps([address, port, ifname]))
    if local_rank != 0:
        return listener, None
    seen = {address}
    for peer in range(world):
        peer_address, peer_port, peer_ifname = json.loads(store.get(f"reach-address/{peer}"))
        if peer_address in seen or not peer_port:
            continue
        seen.add(peer_address)
        why = probe(peer_address, peer_port)
        if why is not None:
            host = json.loads(store.get(f"process/{peer}"))["host"]
            return listener, unreachable_line(peer, host, peer_address, peer_port, why, peer_ifname)
    return listener, None


def unreachable_line(peer: int, host: str, address: str, port: int, why: str, ifname: str | None) -> str:
    """The line naming a peer host this rank cannot connect to (its process-group address)."""
    offered = f"GLOO_SOCKET_IFNAME={ifname} there" if ifname else "its host name's address"
    return (
        f"cannot reach rank {peer} (host {host}) at {address}:{port} ({why}); that is the "
        f"address its process group offers ({offered}): make it one the other hosts can reach (a route, "
        f"a firewall), or set GLOO_SOCKET_IFNAME on host {host} to the interface they share"
    )
