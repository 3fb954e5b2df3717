"""Layouts the weight sync can never reach, refused before anything starts.

``rollout.weight_sync.transport: tensor`` hands the servers handles to the sending ranks' own
buffers: CUDA-IPC handles on GPUs, shared-memory handles on CPU (``pipeline.weights.tensor``,
SGLang 0.5.23's ``MultiprocessingSerializer``, opened by each TP worker with ``torch.multiprocessing``
rebuild functions). Such a handle opens only on the node that made it: every training rank that
sends and every rollout server must be on one node. Where the placement is known the layout is
refused with one line naming the field (a ``ConfigError``, exit 2):

* ``launch slurm`` (:func:`check_job`): the servers run on ``--rollout-nodes`` of their own, or, with
  ``--rollout-nodes 0``, on every training node, listening on the network (``--host 0.0.0.0``,
  where the local server refuses pickled payloads): never on one node with every sender;
* ``train`` (``launch.preflight``; every rank started by srun or torchrun checks its own node,
  so together they check every node): a world on several nodes (:func:`check_world`:
  torchrun's / srun's node count), and in external mode a router worker whose address is not one
  of this node's (:func:`check_servers`).

The file alone does not say where the servers run (an external router's host may or may not be
the trainer's node), so ``megatron-gspo config`` only notes the rule for ``tensor``.
"""

from __future__ import annotations

import ipaddress
import socket
from typing import Iterable
from urllib.parse import urlsplit

from megatron_gspo.bound_store import LOCALHOST_NAMES, is_loopback
from megatron_gspo.config import Config, ConfigError
from megatron_gspo.parallel import nodes_in_world

FIELD = "rollout.weight_sync.transport"
WHY = ("tensor passes the servers CUDA-IPC / shared-memory handles of the sending ranks' buffers, "
       "which open only on the node that made them")
REMEDY = (f"use {FIELD}: distributed (a broadcast group per sending node, NCCL between nodes) or "
          "disk (a shared filesystem)")
CONFIG_NOTE = (f"{FIELD}: tensor works only with every training rank and every rollout server on "
               "one node (train refuses any other placement before it starts)")


def is_this_node(host: str) -> bool:
    """Whether ``host`` (a name or an address) is one of this node's addresses: loopback, or an
    address a socket can be bound to here (an interface's). A name that does not resolve is not."""
    if host in LOCALHOST_NAMES:
        return True
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return False
    for family, _, _, _, sockaddr in infos:
        address = sockaddr[0]
        if is_loopback(address) or ipaddress.ip_address(address.split("%", 1)[0]).is_unspecified:
            return True
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((address, 0))
                return True
            except OSError:
                continue
    return False


def nonlocal_servers(urls: Iterable[str]) -> list[str]:
    """The server URLs whose host is not this node (:func:`is_this_node`)."""
    return [url for url in urls if not is_this_node(urlsplit(url).hostname or "")]


def check_world(cfg: Config, env=None) -> None:
    """``tensor``: the training ranks must be on one node (torchrun's / srun's node count)."""
    if cfg.rollout.weight_sync.transport != "tensor":
        return
    nodes = nodes_in_world(env)
    if nodes > 1:
        raise ConfigError(f"{FIELD}: tensor with training ranks on {nodes} nodes: {WHY}, and the "
                          f"servers are on at most one of them; {REMEDY}")


def check_servers(cfg: Config, urls: Iterable[str]) -> None:
    """``tensor``: every rollout server (here: the external router's workers) must be on this node."""
    if cfg.rollout.weight_sync.transport != "tensor":
        return
    far = nonlocal_servers(urls)
    if far:
        raise ConfigError(f"{FIELD}: tensor with rollout server(s) {', '.join(far)} on another "
                          f"node than this training rank ({socket.gethostname()}): {WHY}; {REMEDY}")


def check_job(cfg: Config, *, colocated: bool, train_nodes: int, server: str) -> None:
    """``launch slurm``: no layout it renders puts the servers on one node with every sender
    (colocated SGLang servers on GPUs are refused on their own, by ``launch slurm``)."""
    if cfg.rollout.weight_sync.transport != "tensor":
        return
    if not colocated:
        where = "the job's rollout servers run on --rollout-nodes of their own"
    elif train_nodes > 1:
        where = (f"with --rollout-nodes 0 the servers are spread over the {train_nodes} training "
                 "nodes, and every sender sends to every server")
    elif server == "local":
        where = ("the job's local servers listen on the network (--host 0.0.0.0), and the local "
                 "server takes pickled handles only on 127.0.0.1 (--allow-pickled-tensors)")
    else:
        return
    raise ConfigError(f"{FIELD}: tensor cannot sync in a Slurm job: {WHY}, and {where}; {REMEDY}")
