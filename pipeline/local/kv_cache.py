"""The running batch's KV cache: transformers' ``DynamicCache`` built from per-layer tensors, with
layers that grow in place.

Shape legend: B rows, H_kv KV heads, T cached positions, d head dim.
"""

from __future__ import annotations

import functools

import torch


def kv_layers(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (keys, values) ``[B, H_kv, T, d]`` of a ``DynamicCache``."""
    return [(layer.keys, layer.values) for layer in cache.layers]


def cache_from(kv):
    """A ``DynamicCache`` over the per-layer (keys, values) ``kv``, every layer a
    :func:`growing_layer_class` one (decode steps write into spare capacity)."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    cache = DynamicCache(ddp_cache_data=kv)
    for layer in cache.layers:  # decode steps write into spare capacity
        if type(layer) is DynamicLayer:
            layer.__class__ = growing_layer_class()
    return cache


@functools.lru_cache(maxsize=None)
def growing_layer_class():
    """A transformers ``DynamicLayer`` whose keys / values are views of buffers with spare
    capacity along the sequence: a decode step writes its new column in place instead of
    ``torch.cat``-copying the layer's whole cache (O(cache) per step, O(length^2) per request);
    capacity doubles when full. ``keys`` / ``values`` stay what ``DynamicLayer`` exposes
    (``[B, H_kv, T, d]``, now views); whatever replaces them (a batch reindex) is noticed by
    identity and copied into a new buffer on the next update. ~10% of a decode step here."""
    from transformers.cache_utils import DynamicLayer

    class GrowingLayer(DynamicLayer):
        _buffers_kv = None  # (key buffer, value buffer, the keys view handed out last)

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized or self.keys is None or self.keys.numel() == 0:
                return super().update(key_states, value_states, *args, **kwargs)
            n, add = self.keys.shape[-2], key_states.shape[-2]
            bufs = self._buffers_kv
            if bufs is None or bufs[2] is not self.keys or n + add > bufs[0].shape[-2]:
                cap = max(2 * (n + add), n + add + 64)
                kbuf = self.keys.new_empty(self.keys.shape[:-2] + (cap, self.keys.shape[-1]))
                vbuf = self.values.new_empty(self.values.shape[:-2] + (cap, self.values.shape[-1]))
                kbuf[..., :n, :] = self.keys
                vbuf[..., :n, :] = self.values
            else:
                kbuf, vbuf = bufs[0], bufs[1]
            kbuf[..., n:n + add, :] = key_states
            vbuf[..., n:n + add, :] = value_states
            self.keys, self.values = kbuf[..., :n + add, :], vbuf[..., :n + add, :]
            self._buffers_kv = (kbuf, vbuf, self.keys)
            return self.keys, self.values

    return GrowingLayer
