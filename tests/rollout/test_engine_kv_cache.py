"""The local server's decode cache (``kv_cache.growing_layer_class``): keys and values written into
spare capacity are exactly what transformers' ``DynamicLayer`` concatenates, through capacity
growth and after the batch is reindexed (a finished row dropped)."""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

from pipeline.local.engine import LocalEngine
from pipeline.local.kv_cache import growing_layer_class


def _kv(batch, length, seed):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, 2, length, 4, generator=gen),
            torch.randn(batch, 2, length, 4, generator=gen))


def test_growing_layer_matches_dynamic_layer_through_growth_and_reindexing():
    k0, v0 = _kv(3, 5, 0)
    cache = LocalEngine._cache_from([(k0, v0)])
    layer = cache.layers[0]
    assert type(layer) is growing_layer_class()
    ref_k, ref_v = k0, v0
    for step in range(150):  # 5 + 150 columns: the first buffer (2 x 6 = 12 wide) grows 4 times
        if step == 60:  # a row finishes: the engine rebuilds the cache from the kept rows
            keep = torch.tensor([0, 2])
            cache = LocalEngine._cache_from([(layer.keys[keep], layer.values[keep])])
            layer = cache.layers[0]
            ref_k, ref_v = ref_k[keep], ref_v[keep]
        if step == 100:  # something replaces keys/values behind the buffer's back
            layer.batch_select_indices(torch.tensor([1, 0]))
            ref_k, ref_v = ref_k[[1, 0]], ref_v[[1, 0]]
        new_k, new_v = _kv(ref_k.shape[0], 1 + step % 2, 10 + step)
        k, v = layer.update(new_k, new_v)
        ref_k, ref_v = torch.cat([ref_k, new_k], dim=-2), torch.cat([ref_v, new_v], dim=-2)
        assert torch.equal(k, ref_k) and torch.equal(v, ref_v), step
        assert layer.get_seq_length() == ref_k.shape[-2]
    assert layer._buffers_kv[0].shape[-2] > ref_k.shape[-2]  # spare capacity, not a copy per step


def test_an_empty_cache_layer_initialises_as_transformers_does():
    layer = DynamicLayer()
    layer.__class__ = growing_layer_class()
    k, v = _kv(2, 3, 1)
    out_k, out_v = layer.update(k, v)
    assert torch.equal(out_k, k) and torch.equal(out_v, v)
    k2, v2 = _kv(2, 1, 2)
    out_k, out_v = layer.update(k2, v2)
    assert torch.equal(out_k, torch.cat([k, k2], dim=-2)) and torch.equal(out_v, torch.cat([v, v2], -2))
