"""The local rollout server's prefix cache: SGLang 0.5.23's radix cache of finished requests' KV.

:class:`PrefixCache` holds copies of the KV (and, with ``--enable-return-routed-experts``, the
captured routes) of finished requests in a radix tree of token ids, bounded in tokens
(``--radix-cache-max-tokens``, default :func:`default_radix_cache_tokens`). When the engine stores
and looks up (SGLang's rules) is described in :mod:`pipeline.local.engine`.

Shape legend: H_kv KV heads, d head dim.
"""

from __future__ import annotations

import heapq
import threading
from typing import Callable, Optional

import torch


class _Node:
    """A radix-tree node: ``tokens`` (one edge of the tree) and, per layer, the KV they computed
    (``[H_kv, len(tokens), d]`` on the model's device) and their routes (int32 ``[len(tokens),
    num_layers, top_k]`` on the host, or None)."""

    __slots__ = ("tokens", "kv", "routes", "children", "parent", "last_access")

    def __init__(self, tokens: tuple, kv: list, routes: Optional[torch.Tensor], parent):
        self.tokens = tokens
        self.kv = kv
        self.routes = routes
        self.children: dict[int, "_Node"] = {}  # first token of the child's edge -> child
        self.parent = parent
        self.last_access = 0


class PrefixCache:
    """SGLang 0.5.23's ``RadixCache`` (srt/mem_cache/radix_cache.py) with page size 1 and its
    default ``lru`` eviction, holding copies of KV and routes instead of KV-pool indices.

    ``match`` finds the longest cached prefix (splitting the node where it ends, as
    ``_match_prefix_helper`` does) and touches every node on the way; ``insert`` adds what is not
    cached yet (the cached part keeps the values it has, as ``_insert_helper`` does) and then
    evicts least recently used leaves until at most ``max_tokens`` tokens are held (SGLang's pool
    evicts when it needs room; here the bound is the tree's own). Thread-safe."""

    def __init__(self, max_tokens: int):
        if max_tokens < 1:
            raise ValueError(f"--radix-cache-max-tokens {max_tokens}: must be >= 1")
        self.max_tokens = int(max_tokens)
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        """Empty the tree (SGLang's ``tree_cache.reset()`` in ``Scheduler.flush_cache``)."""
        with self._lock:
            self._root = _Node((), [], None, None)
            self._size = 0
            self._clock = 0

    @property
    def num_tokens(self) -> int:
        """Tokens held (SGLang's ``total_size``)."""
        return self._size

    # --- lock held
    def _split(self, node: _Node, at: int) -> _Node:
        """Cut ``node``'s edge after ``at`` tokens: a new parent holds the head (copies, so an
        evicted half frees its memory)."""
        head = _Node(node.tokens[:at], [(k[:, :at].clone(), v[:, :at].clone()) for k, v in node.kv],
                     None if node.routes is None else node.routes[:at].clone(), node.parent)
        head.last_access = node.last_access
        node.parent.children[node.tokens[0]] = head
        node.tokens = node.tokens[at:]
        node.kv = [(k[:, at:].clone(), v[:, at:].clone()) for k, v in node.kv]
        node.routes = None if node.routes is None else node.routes[at:].clone()
        node.parent = head
        head.children[node.tokens[0]] = node
        return head

    def _walk(self, key: tuple) -> tuple[list[_Node], int]:
        """The nodes of the longest cached prefix of ``key`` (the last one ending exactly where
        the match does) and its length; every node on the path is touched."""
        self._clock += 1
        node, matched, path = self._root, 0, []
        while matched < len(key):
            child = node.children.get(key[matched])
            if child is None:
                break
            edge = child.tokens
            n = 1
            limit = min(len(edge), len(key) - matched)
            while n < limit and edge[n] == key[matched + n]:
                n += 1
            if n < len(edge):
                child = self._split(child, n)
            child.last_access = self._clock
            path.append(child)
            matched += n
            node = child
            if n < len(edge):
                break
        return path, matched

    def _evict(self) -> None:
        if self._size <= self.max_tokens:
            return
        heap, stack = [], [self._root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node is not self._root:
                heap.append((node.last_access, id(node), node))
        heapq.heapify(heap)
        while self._size > self.max_tokens and heap:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            del parent.children[node.tokens[0]]
            self._size -= len(node.tokens)
            if parent is not self._root and not parent.children:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))

    # --- public
    def match(self, tokens: list[int], limit: int):
        """(matched length m <= limit, per-layer KV ``[(K, V)]`` of ``[H_kv, m, d]``, routes
        ``[m, num_layers, top_k]`` or None); (0, None, None) without a match."""
        if limit <= 0:
            return 0, None, None
        with self._lock:
            path, m = self._walk(tuple(tokens[:limit]))
            if m == 0:
                return 0, None, None
            kv = [(torch.cat([n.kv[layer][0] for n in path], dim=1),
                   torch.cat([n.kv[layer][1] for n in path], dim=1))
                  for layer in range(len(path[0].kv))]
            routes = (None if any(n.routes is None for n in path)
                      else torch.cat([n.routes for n in path]))
            return m, kv, routes

    def insert(self, tokens: list[int], take: Callable[[int, int], list],
               routes: Optional[torch.Tensor]) -> int:
        """Cache ``tokens`` (their first ``max_tokens``): ``take(start, end)`` gives the per-layer
        KV ``[(K, V)]`` of ``[H_kv, end - start, d]`` of positions ``start .. end - 1`` (only the
        part not cached yet is taken), ``routes`` those of every position (or None). Returns how
        many tokens were added."""
        key = tuple(tokens[:self.max_tokens])
        if not key:
            return 0
        with self._lock:
            path, m = self._walk(key)
            added = len(key) - m
            if added:
                parent = path[-1] if path else self._root
                leaf = _Node(key[m:], take(m, len(key)),
                             None if routes is None else routes[m:len(key)].clone(), parent)
                leaf.last_access = self._clock
                parent.children[key[m]] = leaf
                self._size += added
            self._evict()
            return added


def default_radix_cache_tokens(config, dtype: torch.dtype, context_length: int,
                               max_running_requests: int) -> int:
    """``--radix-cache-max-tokens`` when not given: as many tokens as 1 GiB of KV holds (every
    layer's keys and values, ``num_key_value_heads x head_dim`` each, in ``--dtype``), at least
    one full context and at most ``context_length x max_running_requests``."""
    heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None)
                   or config.hidden_size // config.num_attention_heads)
    per_token = 2 * int(config.num_hidden_layers) * heads * head_dim * dtype.itemsize
    return int(min(context_length * max_running_requests,
                   max(context_length, (1 << 30) // max(per_token, 1))))
