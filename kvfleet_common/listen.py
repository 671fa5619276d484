"""A service that cannot listen where it was told says so in one line: the address, what it is
for, why (a plain socket's own bind says: grpc reports only that the bind failed) and the flag
that moves it."""

from __future__ import annotations

import errno
import socket
from collections.abc import Iterable

# errno -> why, and what to do (the port's flag filled in).
_WHY = {
    errno.EADDRINUSE: (
        "the port is in use (another kvfleet service, or a second `kvfleet up`?)",
        "free it or choose another with {flag}",
    ),
    errno.EADDRNOTAVAIL: ("the host is not an address of this machine", "listen on one of its addresses (--host)"),
    errno.EACCES: ("permission denied", "a port below 1024 needs root: choose another with {flag}"),
    errno.EINVAL: ("not a port number (0..65535)", "choose another with {flag}"),
}


class _Unresolved(OSError):
    """A host name that does not resolve (no bind was tried)."""


class CannotListen(OSError):
    """A listening socket could not be bound; str() is the line a service exits with."""

    def __init__(self, what: str, host: str, port: int, flag: str, cause: OSError | None) -> None:
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        why, todo = _WHY.get(cause.errno or 0, ("", "")) if cause is not None else ("", "")
        if cause is None:
            why = "the bind failed"
        elif isinstance(cause, _Unresolved) or not why:
            why = cause.strerror or str(cause)
        todo = (todo or "choose another address or port ({flag})").format(flag=flag)
        super().__init__(f"cannot listen on {address} ({what}): {why}; {todo}")
        self.address = address
        self.flag = flag


def bind_error(host: str, port: int) -> OSError | None:
    """What a plain bind of host:port raises now (SO_REUSEADDR, as grpc and aiohttp bind), or None."""
    if not 0 <= port <= 65535:  # getaddrinfo takes 70000 as 4464
        return OSError(errno.EINVAL, "not a port number")
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return _Unresolved(errno.EADDRNOTAVAIL, f"the host {host!r} does not resolve ({exc.strerror})")
    for family, kind, proto, _, addr in infos:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(addr)
            except OSError as exc:
                return exc
    return None


def cannot_listen(what: str, host: str, port: int, flag: str, exc: OSError | None = None) -> CannotListen:
    """The error for a bind that failed: ``exc`` where the server raised an OSError, else found
    by binding the address again."""
    return CannotListen(what, host, port, flag, exc if exc is not None else bind_error(host, port))


def check_free(what: str, host: str, port: int, flag: str) -> None:
    """Raise CannotListen now if host:port cannot be bound (before starting what would)."""
    exc = bind_error(host, port)
    if exc is not None:
        raise CannotListen(what, host, port, flag, exc)


def check_ports(host: str, ports: Iterable[tuple[str, int, str]]) -> None:
    """check_free for each (what, port, flag) whose port is set (0: any free port, or off)."""
    for what, port, flag in ports:
        if port:
            check_free(what, host, port, flag)
