"""The vLLM worker extension the project ships (``--worker-extension-cls
pipeline.engines.vllm.worker_extension.WeightSyncExtension``, the repository root on the
server's ``PYTHONPATH``): weight updates into a running vLLM 0.32 server where its own
weight-transfer engines cannot run (on the CPU: ``nccl`` needs an accelerator, ``ipc`` is CUDA
IPC), and the step every in-place update of an MoE model needs on vLLM's CPU backend.

It runs inside vLLM's worker process (vLLM's own virtual environment: only ``torch`` and this
repository's :mod:`pipeline.weights.transport`, which needs nothing else), and is reached over
HTTP through ``/collective_rpc`` (``VLLM_SERVER_DEV_MODE=1``), whose arguments are strings: each
method takes one JSON string and returns a JSON-able dict per worker.

* :meth:`mgspo_join_group`: join the trainer's gloo update group (world ``1 + workers``, the
  trainer is rank 0; the same rendezvous and store keys as SGLang's update groups,
  :func:`pipeline.weights.transport.new_update_group`).
* :meth:`mgspo_receive_bucket`: receive one flattened bucket (one broadcast of its bytes, as
  SGLang's ``flattened_bucket``), keep its tensors, and answer the bucket checksum of what arrived
  (:func:`pipeline.weights.transport.bucket_checksum`, the trainer's own digest).
* :meth:`mgspo_load_received`: load every bucket received since the last load in one in-place
  reload (vLLM's ``reload_weights(weights_iterator=...)``: its layerwise reload needs every
  tensor of a layer), then :meth:`_repack_moe`.
* :meth:`mgspo_load_from_disk`: ``reload_weights(weights_path=...)`` of a safetensors directory,
  then :meth:`_repack_moe`.

**The MoE repack.** vLLM 0.32's unquantized MoE method copies updated expert weights into the
existing storage and skips the expert kernel's ``process_weights_after_loading`` on an update
(``UnquantizedFusedMoEMethod._setup_kernel``: ``is_weight_update``). On the CPU that skipped
step is the grouped-gemm prepack (``experts/cpu_moe.py``: ``cpu_prepack_moe_weight``), so the
kernel reads checkpoint-layout weights as prepacked ones and the served model is wrong by nats
(docs/vllm.md). :meth:`_repack_moe` runs it again for every MoE layer; elsewhere the step is a
no-op or the kernel's own. The prefix cache still holds KV of the old weights: the client resets
it (``/reset_prefix_cache``) after every update.
"""

from __future__ import annotations

import json
import time

import torch
from safetensors.torch import load_file

from pipeline.weights import transport as wt


class WeightSyncExtension:
    """Mixed into vLLM's worker class (``self`` is the worker: ``self.model_runner``, ``self.rank``)."""

    def _mgspo_state(self) -> dict:
        state = self.__dict__.get("_mgspo")
        if state is None:
            state = self.__dict__["_mgspo"] = {"groups": {}, "received": {}}
        return state

    def mgspo_describe(self, spec: str = "{}") -> dict:
        """This worker's rank (the server runs the extension when this answers)."""
        return {"rank": int(getattr(self, "rank", 0))}

    def mgspo_join_group(self, spec: str) -> dict:
        """``spec``: JSON ``{address, port, rank_offset, world_size, group_name, timeout_s}``;
        this worker joins at ``rank_offset + self.rank`` (blocks until the whole group joined)."""
        s = json.loads(spec)
        rank = int(s["rank_offset"]) + int(getattr(self, "rank", 0))
        group = wt.new_update_group(s["address"], int(s["port"]), rank, int(s["world_size"]),
                                    group_name=s["group_name"], backend="gloo",
                                    timeout_s=float(s.get("timeout_s", 300)))
        self._mgspo_state()["groups"][s["group_name"]] = group
        return {"rank": rank}

    def mgspo_destroy_group(self, spec: str) -> dict:
        s = json.loads(spec)
        group = self._mgspo_state()["groups"].pop(s["group_name"], None)
        if group is not None:
            wt.destroy_group(group)
        return {"destroyed": group is not None}

    def mgspo_receive_bucket(self, spec: str) -> dict:
        """``spec``: JSON ``{group_name, names, dtypes, shapes}``: one broadcast of the bucket's
        bytes from rank 0; its tensors are kept until :meth:`mgspo_load_received`. Answers the
        checksum of the tensors as received."""
        s = json.loads(spec)
        group = self._mgspo_state()["groups"].get(s["group_name"])
        if group is None:
            raise RuntimeError(f"no update group {s['group_name']!r} on this worker "
                               "(mgspo_join_group first)")
        layout, nbytes = wt.flat_layout(s["names"], [wt.parse_dtype(d) for d in s["dtypes"]],
                                        [tuple(x) for x in s["shapes"]])
        flat = torch.empty(nbytes, dtype=torch.uint8)
        wt.broadcast(group, flat, 0)
        named = [(n, t.clone()) for n, t in wt.unflatten(flat, layout)]
        self._mgspo_state()["received"].update(named)
        return {"checksum": wt.bucket_checksum(named)}

    def mgspo_load_received(self, spec: str = "{}") -> dict:
        """Load every tensor received since the last load (one in-place reload), repack the
        experts; answers the count and the seconds of each step."""
        received = self._mgspo_state()["received"]
        if not received:
            raise RuntimeError("mgspo_load_received: no bucket received since the last load")
        t0 = time.perf_counter()
        items = sorted(received.items())
        received.clear()
        self.model_runner.reload_weights(weights_iterator=iter(items))
        t1 = time.perf_counter()
        repacked = self._repack_moe()
        return {"tensors": len(items), "reload_s": t1 - t0, "repack_s": time.perf_counter() - t1,
                "repacked_layers": repacked}

    def mgspo_drop_received(self, spec: str = "{}") -> dict:
        """Forget the tensors received and not loaded (a push that failed half-way)."""
        received = self._mgspo_state()["received"]
        count = len(received)
        received.clear()
        return {"dropped": count}

    def mgspo_load_from_disk(self, spec: str) -> dict:
        """``spec``: JSON ``{path, checksum_shards}``: an in-place reload of that safetensors
        directory, then the expert repack; answers the checksum of the tensors of each shard
        named in ``checksum_shards`` as this worker reads them."""
        s = json.loads(spec)
        t0 = time.perf_counter()
        self.model_runner.reload_weights(weights_path=s["path"])
        t1 = time.perf_counter()
        repacked = self._repack_moe()
        t2 = time.perf_counter()
        sums = {shard: wt.bucket_checksum(load_file(f"{s['path']}/{shard}").items())
                for shard in s.get("checksum_shards") or []}
        return {"reload_s": t1 - t0, "repack_s": t2 - t1, "repacked_layers": repacked,
                "checksums": sums}

    def _repack_moe(self) -> int:
        """Run the expert kernel's ``process_weights_after_loading`` again on every MoE layer
        (module docstring); returns how many layers."""
        count = 0
        for module in self.model_runner.get_model().modules():
            kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
            if kernel is not None:
                kernel.fused_experts.process_weights_after_loading(module)
                count += 1
        return count
