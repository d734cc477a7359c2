"""Addresses and listening sockets: parse `host:port`, and bind with errors that name both.

Every port plait listens on is bound here, by Python, and only then handed to c10d's TCPStore
(`master_listen_fd`). Binding ourselves gives a real errno ("port 29500 on 127.0.0.1 is already
in use", pytorch#72816), and a socket bound before the workers start cannot be taken by another
process in between: there is no free-port race.
"""

from __future__ import annotations

import errno
import re
import socket

from plait.run.config import LaunchError

ALL_INTERFACES = ""
_BACKLOG = 2048  # every worker of a large node may connect at once


class PortInUse(LaunchError):
    pass


def parse_endpoint(text: str, *, default_port: int, flag: str) -> tuple[str, int]:
    """`host:port`, `host`, `[v6addr]:port` → (host, port)."""
    text = text.strip()
    m = re.fullmatch(r"\[([0-9a-fA-F:.%\w]+)\](?::(\w*))?|([^:\[\]]+)(?::(\w*))?", text)
    if not text or not m:
        raise LaunchError(f"{flag} {text!r}: expected HOST:PORT, e.g. node0.cluster:29400 or [::1]:29400")
    host = m.group(1) or m.group(3)
    port_text = m.group(2) if m.group(1) else m.group(4)
    if port_text is None:
        return host, default_port
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise LaunchError(f"{flag} {text!r}: port {port_text!r} is not a number from 0 to 65535")
    return host, int(port_text)


def format_endpoint(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def listen(host: str, port: int, *, what: str) -> socket.socket:
    """A listening TCP socket on host:port (host "" = every interface, IPv4 and IPv6; port 0 = any)."""
    try:
        if host == ALL_INTERFACES:
            return _listen_all_interfaces(port)
        family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(addr)
            sock.listen(_BACKLOG)
        except BaseException:
            sock.close()
            raise
        return sock
    except socket.gaierror as e:
        raise LaunchError(f"{what}: cannot resolve host {host!r} ({e.strerror})") from None
    except OSError as e:
        where = format_endpoint(host or "0.0.0.0", port)
        if e.errno == errno.EADDRINUSE:
            raise PortInUse(
                f"{what}: port {port} on {host or 'this machine'} is already in use ({where}); "
                f"pick another port or stop the process holding it"
            ) from None
        if e.errno == errno.EADDRNOTAVAIL:
            raise LaunchError(f"{what}: {host} is not an address of this machine") from None
        raise LaunchError(f"{what}: cannot listen on {where}: {e.strerror}") from None


def _listen_all_interfaces(port: int) -> socket.socket:
    """Dual-stack `[::]:port` where IPv6 exists, else `0.0.0.0:port`."""
    if socket.has_ipv6:
        sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            sock.bind(("::", port))
            sock.listen(_BACKLOG)
            return sock
        except OSError as e:
            sock.close()
            if e.errno == errno.EADDRINUSE:
                raise
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("0.0.0.0", port))
        sock.listen(_BACKLOG)
    except BaseException:
        sock.close()
        raise
    return sock


def is_local_address(host: str) -> bool:
    """Whether `host` names this machine: it does if we can bind a socket to it."""
    try:
        infos = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return False
    for family, _, _, _, addr in infos:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind(addr)
                return True
            except OSError:
                continue
    return False


def route_address(host: str, port: int) -> str:
    """The address of this machine that reaches host:port — what other nodes can reach us at."""
    try:
        infos = socket.getaddrinfo(host, port or 1, type=socket.SOCK_DGRAM)
    except socket.gaierror:
        infos = []
    for family, _, _, _, addr in infos:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            try:
                s.connect(addr)  # UDP: picks a route, sends nothing
                return s.getsockname()[0]
            except OSError:
                continue
    return socket.getfqdn()
