"""Issue 21, item 4: rank 0's rendezvous store listens on MASTER_ADDR as this node resolves it
(``megatron_gspo.bound_store``: not on every interface). On images whose /etc/hosts maps the
hostname to 127.0.1.1 (or MASTER_ADDR is any loopback address) while the ranks span several nodes,
the other nodes could never connect and would wait out their timeout: rank 0 refuses at once,
naming MASTER_ADDR, the address and the fix. A single-node run on loopback, and a routable
address on many nodes, pass. CPU only: the hostname's resolution is replaced by the hosts-file
answer of such an image."""

from __future__ import annotations

import socket

import pytest

from launch import cli
from megatron_gspo import bound_store, parallel
from megatron_gspo.config import ConfigError
from megatron_gspo.parallel import nodes_in_world
from pipeline.servers.cluster import free_port

REAL_GETADDRINFO = socket.getaddrinfo


def hosts_file(mapping: dict[str, str]):
    """``socket.getaddrinfo`` as an /etc/hosts with ``mapping`` (name -> IPv4) answers it."""

    def getaddrinfo(host, port, *args, **kwargs):
        if host in mapping:
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (mapping[host], port or 0))]
        return REAL_GETADDRINFO(host, port, *args, **kwargs)

    return getaddrinfo


def srun_rank0(monkeypatch, *, nodes: int, tasks: int, master: str) -> None:
    """The environment srun gives training rank 0 of the job's training step."""
    for name in ("WORLD_SIZE", "RANK", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE",
                 "TORCHELASTIC_USE_AGENT_STORE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_LOCALID", "0")
    monkeypatch.setenv("SLURM_NTASKS", str(tasks))
    monkeypatch.setenv("SLURM_STEP_NUM_NODES", str(nodes))
    monkeypatch.setenv("SLURM_NNODES", str(nodes))
    monkeypatch.setenv("MASTER_ADDR", master)
    monkeypatch.setenv("MASTER_PORT", str(free_port()))


def test_nodes_in_world_reads_the_launchers_variables():
    assert nodes_in_world({}) == 1
    assert nodes_in_world({"SLURM_PROCID": "3", "SLURM_STEP_NUM_NODES": "8", "SLURM_NNODES": "12"}) == 8
    assert nodes_in_world({"SLURM_PROCID": "3", "SLURM_NNODES": "2"}) == 2
    assert nodes_in_world({"SLURM_NNODES": "2"}) == 1  # not a rank srun started
    assert nodes_in_world({"GROUP_WORLD_SIZE": "4", "SLURM_PROCID": "0", "SLURM_NNODES": "1"}) == 4


def test_loopback_master_address_on_several_nodes_is_refused(monkeypatch):
    monkeypatch.setattr(bound_store.socket, "getaddrinfo",
                        hosts_file({"gpu-101": "127.0.1.1", "gpu-102": "10.1.0.102"}))
    with pytest.raises(ConfigError) as err:
        bound_store.check_reachable("gpu-101", nodes=8)
    message = str(err.value)
    for fragment in ("MASTER_ADDR: 'gpu-101' resolves to 127.0.1.1 on this node, a loopback",
                     "loopback", "spans 8 nodes", "/etc/hosts", "hostname -I"):
        assert fragment in message, (fragment, message)
    for loopback in ("127.0.0.1", "localhost", "::1"):
        with pytest.raises(ConfigError, match="a loopback address, but the run spans 2 nodes"):
            bound_store.check_reachable(loopback, nodes=2)
    # what can work is not refused: one node on loopback, a routable address on many
    assert bound_store.check_reachable("gpu-101", nodes=1) == "127.0.1.1"
    assert bound_store.check_reachable("localhost", nodes=1) == "127.0.0.1"
    assert bound_store.check_reachable("gpu-102", nodes=8) == "10.1.0.102"


def test_train_rank0_refuses_before_any_store_listens(monkeypatch, capfd, tmp_path):
    """``megatron-gspo train`` as srun starts rank 0 of a 2-node training step whose MASTER_ADDR
    (its own hostname) the image resolves to 127.0.1.1: exit 2 with one message naming it, and
    no store was started (it would have listened where the other node's rank cannot connect)."""
    monkeypatch.setattr(bound_store.socket, "getaddrinfo", hosts_file({"trainer-001": "127.0.1.1"}))
    srun_rank0(monkeypatch, nodes=2, tasks=2, master="trainer-001")

    def tcp_store(*args, **kwargs):
        raise AssertionError(f"a store was started on {args[:2]}: the loopback MASTER_ADDR was "
                             "not refused")

    monkeypatch.setattr(parallel, "tcp_store", tcp_store)  # where the trainer starts its store
    code = cli.main(["train", "--config", "launch/configs/tiny_cpu.yaml",
                     "--set", f"run.output_dir={tmp_path / 'run'}"])
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err[-3000:]
    assert len(lines) == 1 and lines[0].startswith("megatron-gspo train: "), err[-3000:]
    assert "MASTER_ADDR: 'trainer-001' resolves to 127.0.1.1" in lines[0]
    assert "spans 2 nodes" in lines[0]
