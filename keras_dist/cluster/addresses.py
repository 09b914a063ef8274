"""Network addresses of a job: one rule for `host:port`, and free ports.

A host is kept bare inside keras_dist (`::1`, `node0`); `join_address` puts an
IPv6 host in brackets for a `host:port` string and `split_address` takes them
off again, so that every caller (the runtime, the launcher, the cluster
environments, the rendezvous) reads and writes addresses the same way.
"""

from __future__ import annotations

import re
import socket

#: Where a one-node launch puts its coordinator.
LOCAL_COORDINATOR_HOST = "127.0.0.1"


def is_port(raw: str) -> bool:
    """Whether `raw` is a port number from 1 to 65535, written in ASCII digits."""
    # Not str.isdigit: it accepts digits such as "²" that int() rejects.
    return re.fullmatch(r"[0-9]+", raw) is not None and 0 < int(raw) < 65536


def split_address(address: str, *, name: str | None = None) -> tuple[str, int]:
    """`"host:port"` (or `"[::1]:port"`) as `(host, port)`, validated; the host
    without brackets.

    Args:
        address: the `host:port` string.
        name: the argument it came from, for the error message (a job
            address when None).

    Raises:
        ValueError: naming the address (and `name`) when it is not
            `host:port` with a port from 1 to 65535.

    Example:

    >>> split_address("[::1]:1234")
    ('::1', 1234)
    """
    host, separator, port = str(address).rpartition(":")
    if not (separator and host and is_port(port)):
        what = f"`{name}`" if name else "A job address"
        received = f"{name}={address!r}" if name else repr(address)
        raise ValueError(
            f"{what} looks like 'host:port' with a port from 1 to 65535. "
            f"Received: {received}"
        )
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


def join_address(host: str, port: int) -> str:
    """`host:port`, with an IPv6 host in brackets (`[::1]:1234`).

    Example:

    >>> join_address("::1", 1234)
    '[::1]:1234'
    """
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


def find_free_port(host: str = LOCAL_COORDINATOR_HOST) -> int:
    """A TCP port nobody listens on now, chosen by the OS (binding port 0).

    Args:
        host: the interface to bind (`""`: every IPv4 one, `"::"`: every
            IPv6 one).

    Returns:
        The port number. Another program could take it before the job does;
        asking the OS keeps that window small and never collides with a
        fixed port that another job also picked.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])
