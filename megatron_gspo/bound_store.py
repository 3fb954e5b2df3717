"""TCPStores that listen on the job's address only.

torch's ``TCPStore(host, port, is_master=True)`` listens on every interface (``::`` / ``0.0.0.0``)
whatever ``host`` it is given; ``host`` is only where its own client connects. A store is the
rendezvous of every process group of the run, so anyone who can reach the port can join or poison
it. Here the listening socket is bound to ``host``'s address (127.0.0.1 for a local run, the
node's job address, ``MASTER_ADDR``, under Slurm) and handed to the store (``master_listen_fd``).

Used by ``parallel.init_distributed`` (rank 0's store when no torchrun agent hosts one) and by
``launch.torchrun_agent`` (torchrun's rendezvous store and the store it shares with the ranks).
The rollout side binds its weight-update stores the same way (``pipeline.weights.transport``).
"""

from __future__ import annotations

import datetime
import ipaddress
import socket
from typing import Optional

from megatron_gspo.config import ConfigError

LOCALHOST_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost"}


def resolve(host: str) -> str:
    """The address ``host`` names (its first IPv4 address when it has one); "localhost" is
    127.0.0.1. Raises ``OSError`` naming the host when it does not resolve."""
    if host in LOCALHOST_NAMES:
        return "127.0.0.1"
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror as err:
        raise OSError(f"cannot resolve the store address {host!r}: {err}") from err
    v4 = [info[4][0] for info in infos if info[0] == socket.AF_INET]
    return v4[0] if v4 else infos[0][4][0]


def is_loopback(address: str) -> bool:
    """127.0.0.0/8 (127.0.1.1 included) or ::1."""
    try:
        return ipaddress.ip_address(address.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


def check_reachable(host: str, *, nodes: int, name: str = "MASTER_ADDR") -> str:
    """The address a master store for ``host`` listens on (:func:`resolve`, on this node); with
    ``nodes`` > 1 a loopback one is refused (a ``ConfigError`` naming ``name`` and the fix): the
    processes of the other nodes resolve the same name elsewhere (DNS: the node's routable
    address) and would wait for a store nobody can reach until their timeout. The usual cause is
    an image whose /etc/hosts maps the hostname to 127.0.1.1."""
    address = resolve(host)
    if nodes > 1 and is_loopback(address):
        named = (f"{host!r} resolves to {address} on this node, a loopback address"
                 if host != address else f"{host} is a loopback address")
        raise ConfigError(
            f"{name}: {named}, but the run spans {nodes} nodes: rank 0's rendezvous store would "
            "listen there and the ranks of the other nodes could not connect. Usually /etc/hosts "
            f"maps this node's hostname ({socket.gethostname()}) to 127.0.1.1 (many container "
            "images do): map it to the node's routable address (the first of `hostname -I`, on "
            "the interface the nodes reach each other on) in the image or node, or, where you "
            f"set {name} yourself, set it to that address (launch slurm sets it to the training "
            "component's first node by name)")
    return address


def listen_socket(host: str, port: int, *, backlog: int = 128) -> socket.socket:
    """A listening TCP socket on ``host``'s address (:func:`resolve`) and ``port`` (0: any free
    one). ``OSError`` names the address when it cannot be bound (port in use, not this host's)."""
    address = resolve(host)
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((address, port))
        sock.listen(backlog)
    except OSError as err:
        sock.close()
        raise OSError(err.errno, f"cannot listen on {address}:{port} (the store address "
                                 f"{host!r}): {err.strerror}") from err
    return sock


def tcp_store(host: str, port: int, *, is_master: bool, world_size: Optional[int] = None,
              timeout: datetime.timedelta = datetime.timedelta(seconds=300),
              wait_for_workers: bool = True, multi_tenant: bool = False):
    """``torch.distributed.TCPStore(host, port, ...)``; the master listens on ``host``'s address
    only. ``port`` 0 on the master: a free port (``store.port`` says which)."""
    import torch.distributed as dist

    if not is_master:
        return dist.TCPStore(host, port, world_size, False, timeout,
                             wait_for_workers=wait_for_workers, multi_tenant=multi_tenant)
    sock = listen_socket(host, port, backlog=max(world_size or 0, 128))
    address, bound_port = sock.getsockname()[:2]
    try:
        store = dist.TCPStore(address, bound_port, world_size, True, timeout,
                              wait_for_workers=wait_for_workers, multi_tenant=multi_tenant,
                              master_listen_fd=sock.fileno())
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store owns the listening socket now
    return store
