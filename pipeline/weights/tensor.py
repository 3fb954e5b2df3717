"""The ``tensor`` transport: ``/update_weights_from_tensor`` with CUDA-IPC / shared-memory handles.

For servers on the trainer's node: per bucket, one ``MultiprocessingSerializer`` entry per
server TP rank (``transport.serialize_tensors``): handles to the source's own buffer, no bytes
over HTTP. A CPU buffer is moved to shared memory first (``transport.share_cpu_tensor``). The
server reads that memory until it answers, so :meth:`TensorTransport.send` returns only once
every server has answered. Inside a weight-update session (:class:`SessionTransport`).
"""

from __future__ import annotations

import torch

from pipeline.generation import client as rollout
from pipeline.weights import transport as wt
from pipeline.weights.interface import SessionTransport


class TensorTransport(SessionTransport):
    """The bucket's tensors as handles, one request per server."""

    def send(self, bucket, version: str, wire, wire_flat: torch.Tensor, extra: dict,
             entry: dict) -> list:
        p = self.pusher
        if wire_flat.device.type == "cpu":
            wt.share_cpu_tensor(wire_flat)
        layout, _ = wt.flat_layout([n for n, _ in wire], [t.dtype for _, t in wire],
                                   [t.shape for _, t in wire])
        views = wt.unflatten(wire_flat, layout)
        answers = [p.pool.submit(self._post, u, views, i, extra)
                   for i, u in enumerate(p.server_urls)]
        return [a.result() for a in answers]  # the server reads our shared memory until it answers

    def _post(self, url: str, views, server_index: int, extra: dict):
        # One MultiprocessingSerializer entry per TP rank of this server, each serialized on its
        # own (as SGLang's Engine does), so each rank opens its own handles.
        p = self.pusher
        payloads = [wt.serialize_tensors(views) for _ in range(p.tp[server_index])]
        body = {"serialized_named_tensors": payloads, "load_format": None, "flush_cache": False,
                "abort_all_requests": False, **extra}
        return rollout.control(url, "/update_weights_from_tensor", body, timeout_s=p.timeout_s,
                               headers=p.headers(server_index))
