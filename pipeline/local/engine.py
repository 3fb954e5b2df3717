"""The local rollout server's engine: transformers' Qwen3-MoE on the CPU with batched decoding.

One thread owns the model. Each turn of its loop:

1. runs the queued control operations (weight updates, reads) - so weights change only *between*
   decoding steps, never under a forward pass;
2. applies aborts (a queued request answers "Abort in waiting queue", a running one returns its
   partial output with the ``Aborted`` finish reason);
3. admits waiting requests: one left-padded prefill for all of them, whose KV cache is merged into
   the running batch's cache (shorter side padded on the left, the attention mask marking padding);
4. decodes ONE token for every running request in a single batched forward pass (explicit
   ``position_ids`` per row, so padding never shifts RoPE), samples, and drops finished rows.

Sampling (SGLang semantics, ``sglang.srt.layers.sampler.Sampler.forward`` in 0.5.23;
:func:`pipeline.local.sampling.sample`):

* temperature < 1e-6 means greedy (``top_k = 1`` at temperature 1);
* the returned ``output_token_logprobs`` are log-probs of the **temperature-scaled** distribution
  ``log_softmax(logits / T)`` over the full vocabulary, *before* top-k / top-p / min-p truncation
  (SGLang's default; greedy requests get ``log_softmax(logits)``). ``input_token_logprobs`` are
  raw (``T = 1``) log-probs, as in SGLang's logits processor;
* the token is drawn from the truncated distribution by inverse-CDF sampling with one uniform per
  step from a per-request ``torch.Generator``: seeded by ``sampling_seed`` when given, else from
  the server's ``--random-seed`` stream. A request's random numbers therefore do not depend on
  what else is in the batch (its tokens do only through fp32 rounding of the logits).

Routed experts (``--enable-return-routed-experts``, SGLang's ``return_routed_experts``): a forward
hook on every MoE layer's router records its top-k indices (the experts the layer then runs) for
each input token of the prefill and of every decode step; a request gets those of positions
``[routed_experts_start_len, seqlen - 1)`` (``docs/sglang_protocol.md``).

Prefix cache (SGLang's radix cache, ``srt/mem_cache/radix_cache.py``; on unless
``--disable-radix-cache``): :class:`~pipeline.local.prefix_cache.PrefixCache`, a radix tree of token ids holding the KV (and,
with ``--enable-return-routed-experts``, the captured routes) of finished requests, bounded in
tokens (``--radix-cache-max-tokens``), least recently used leaves evicted first. The rules, as
0.5.23 applies them:

* a request that finishes by stop or length leaves ``prompt + output`` minus the last token (its
  KV was never computed: ``Req.owned_kv_len``) in the tree (``release_kv_cache(checkpoint=True)``);
  a request with ``max_new_tokens`` 0 leaves its whole prompt; an aborted one leaves nothing
  (where SGLang differs: see :meth:`LocalEngine._store`);
* a new request reuses the longest cached prefix of its ``input_ids``, at most
  ``len(input_ids) - 1`` tokens and, when it asks for input log-probs (``logprob_start_len >=
  0``), at most ``logprob_start_len`` (``Req._compute_max_prefix_len``): the positions whose
  log-probs it wants are computed, never read from the cache. ``meta_info.cached_tokens`` is the
  number reused (``pre_len - already_computed``, counted once: a retracted request keeps it);
* the routes of cached positions are the ones recorded when their KV was computed (SGLang keeps
  the captured top-k per KV slot, ``state_capturer/base.py`` ``get_topk``);
* ``flush_cache`` (accepted only when idle) empties it, so does every weight update that flushes
  (``flush_cache: true``, the default; ``flush_cache: false`` keeps the KV of the old weights, as in
  SGLang); a retracted request (pause mode ``retract``) is recomputed without a lookup.

Cache hits are prefilled in the same batch as cold requests: the cached KV is the past of the
forward (each row's prefix left-padded to the longest), the uncached rest its input (left-padded
to the longest), the attention mask marking both paddings, positions explicit.

Shape legend: B running rows, T cached positions, V vocabulary, H_kv KV heads, d head dim.
"""

from __future__ import annotations

import concurrent.futures
import inspect
import json
import logging
import os
import random
import threading
import time
from collections import deque
from pathlib import Path
from typing import Callable, Optional

import torch

from pipeline.local.kv_cache import cache_from, kv_layers
from pipeline.local.model_files import check_model_dir, load_config
from pipeline.local.prefix_cache import PrefixCache, default_radix_cache_tokens
from pipeline.local.protocol import (finish_abort_queued, finish_abort_running, finish_length,
                                     finish_stop)
from pipeline.local.request import EngineRequest, QueueFull, compute_weight_version_spans
from pipeline.local.sampling import sample
from pipeline.local.weight_table import WeightTable

log = logging.getLogger("megatron_gspo.serve")


def _read_eos_ids(model_path: Path, config) -> set[int]:
    ids: set[int] = set()

    def add(v) -> None:
        if isinstance(v, int):
            ids.add(v)
        elif isinstance(v, (list, tuple)):
            ids.update(int(x) for x in v)

    add(getattr(config, "eos_token_id", None))
    gen = model_path / "generation_config.json"
    if gen.is_file():
        add(json.loads(gen.read_text()).get("eos_token_id"))
    return ids


def _has_tokenizer(model_path: Path) -> bool:
    return any((model_path / f).is_file() for f in ("tokenizer.json", "tokenizer.model",
                                                      "vocab.json", "tokenizer_config.json"))


class LocalEngine:
    """Owns the model and its thread; thread-safe ``submit`` / ``abort`` / ``call``."""

    _cache_from = staticmethod(cache_from)
    """Builds the running batch's cache (:func:`pipeline.local.kv_cache.cache_from`); the kernel
    benchmark (``bench/bench_kernels.py``) swaps it for a plain ``DynamicCache``."""

    def __init__(self, model_path: str, *, random_seed: Optional[int] = None,
                 max_running_requests: int = 64, max_prefill_tokens: int = 16384,
                 context_length: Optional[int] = None, weight_version: str = "default",
                 skip_tokenizer_init: bool = False, dtype: str = "float32",
                 max_queued_requests: Optional[int] = None,
                 capture_routed_experts: bool = False, device: str = "cpu",
                 radix_cache: bool = True, radix_cache_max_tokens: Optional[int] = None,
                 quantization: Optional[str] = None):
        from transformers import AutoModelForCausalLM

        self.device = torch.device(device)
        """Where the model, its KV cache and its forward passes live (``--device``); requests,
        sampling (each request's own CPU generator) and the answers stay on the host."""
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"--device {device}: torch {torch.__version__} sees no CUDA device")
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"--device {device}: must be cpu or cuda[:N]")

        self.model_path = Path(model_path).resolve()
        if not (self.model_path / "config.json").is_file():
            raise FileNotFoundError(f"{self.model_path}: no config.json (not a Hugging Face model dir)")
        self.dtype = getattr(torch, dtype)
        config = load_config(self.model_path)
        # damaged files, weights that do not fit config.json: one line naming them, not
        # transformers' error deep in its loader (or a weight it would initialise at random)
        check_model_dir(self.model_path, config)
        # PyTorch's fused SDPA (GQA without materialising repeated K/V heads): 1.6x the decode
        # throughput of transformers' eager attention on CPU (docs/performance.md, "Rollout
        # and training kernels"); the same function, to float rounding.
        kwargs = {"attn_implementation": "sdpa"}
        dtype_kw = "dtype" if "dtype" in inspect.signature(
            AutoModelForCausalLM.from_pretrained).parameters else "torch_dtype"
        try:
            self.model = AutoModelForCausalLM.from_pretrained(
                self.model_path, config=config, **{dtype_kw: self.dtype}, **kwargs)
        except TypeError:
            self.model = AutoModelForCausalLM.from_pretrained(
                self.model_path, config=config, torch_dtype=self.dtype, **kwargs)
        self.model.to(self.device).eval().requires_grad_(False)
        self.config = self.model.config
        self.vocab_size = int(self.config.vocab_size)
        self.context_length = int(context_length or getattr(self.config, "max_position_embeddings", 4096))
        self.eos_token_ids = _read_eos_ids(self.model_path, self.config)
        self.tokenizer = None
        if not skip_tokenizer_init and _has_tokenizer(self.model_path):
            from transformers import AutoTokenizer
            self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.weights = WeightTable(self.model, fp8=quantization == "fp8")
        if self.weights.fp8:  # computes with the FP8 blocks of its weights from the start
            self.weights.round_to_fp8()
        self.weight_version = weight_version
        self.max_running_requests = max_running_requests
        self.max_prefill_tokens = max_prefill_tokens
        self.max_queued_requests = max_queued_requests
        """Waiting (not yet running) requests at most; None: unbounded (SGLang's default)."""
        self._seed_rng = random.Random(random_seed if random_seed is not None
                                       else int.from_bytes(os.urandom(8), "little"))
        forward_params = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in forward_params else "past_key_values"
        self.capture_routed_experts = capture_routed_experts
        """``--enable-return-routed-experts``: record every MoE layer's top-k for the requests
        that ask (``return_routed_experts``); without it they get none (as in SGLang)."""
        self.num_layers = int(self.config.num_hidden_layers)
        self.top_k = int(getattr(self.config, "num_experts_per_tok", 0) or 0)
        self._routing: Optional[dict[int, torch.Tensor]] = None  # layer -> [B*S, top_k] int32
        if capture_routed_experts:
            self._install_routing_hooks()
        self.prefix_cache: Optional[PrefixCache] = None
        """The radix cache of finished requests' KV (None: ``--disable-radix-cache``)."""
        if radix_cache:
            self.prefix_cache = PrefixCache(
                radix_cache_max_tokens if radix_cache_max_tokens is not None
                else default_radix_cache_tokens(self.config, self.dtype, self.context_length,
                                                max_running_requests))

        self._cv = threading.Condition()
        self._waiting: deque[EngineRequest] = deque()
        self._running: list[EngineRequest] = []
        self._inflight: dict[str, EngineRequest] = {}
        self._ops: deque[tuple[Callable, concurrent.futures.Future]] = deque()
        self._abort_queued = False
        self._hold = False  # pause_generation(in_place / retract): keep requests, do not step
        self.paused = False
        """SGLang's scheduler ``_engine_paused`` (pause modes in_place / retract): a flush then
        ignores the waiting queue (``is_fully_idle(ignore_waiting=True)``)."""
        self._stopping = False
        self._error: Optional[BaseException] = None
        self.last_output_time = time.monotonic()
        """When the engine thread last produced something (``time.monotonic()``): a token or the
        end of any request, or the result of a call it ran (a weight load, a retract, ...).
        SGLang's TokenizerManager ``last_receive_tstamp``, bumped by every message from the
        scheduler; its health check answers 200 once it moves past the check's start."""
        self.num_finished = 0  # requests finished (any reason) since start
        # Batch state (engine thread only).
        self._cache = None  # transformers DynamicCache of the running rows: [B, H_kv, T, d]
        self._mask: Optional[torch.Tensor] = None  # [B, T] 1 = real token
        self._next_pos: Optional[torch.Tensor] = None  # [B] position of the next input token
        self._last: Optional[torch.Tensor] = None  # [B] sampled token not yet fed
        self._thread = threading.Thread(target=self._loop, name="rollout-engine", daemon=True)

    # ------------------------------------------------------------------ public, any thread
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self._error is None

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("text input needs a tokenizer; this server has none (started with "
                             "--skip-tokenizer-init or without tokenizer files): send input_ids")
        try:
            return list(self.tokenizer.encode(text, add_special_tokens=False))
        except (TypeError, ValueError) as err:  # the request's text, not the server: a 400
            raise ValueError(f"text: the tokenizer cannot encode it ({type(err).__name__}: "
                             f"{err})") from None

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> Optional[str]:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def submit(self, reqs: list[EngineRequest]) -> None:
        """Queue requests (all or none); ValueError for a duplicate rid or a too-long prompt,
        :class:`QueueFull` when the waiting queue has no room for all of them."""
        with self._cv:
            if self._error is not None:
                raise RuntimeError(f"the engine thread failed: {self._error!r}")
            if (self.max_queued_requests is not None
                    and len(self._waiting) + len(reqs) > self.max_queued_requests):
                raise QueueFull()
            seen = set()
            for r in reqs:
                if r.rid in self._inflight or r.rid in seen:
                    raise ValueError(f"Duplicate request ID detected: {r.rid}")
                seen.add(r.rid)
                if len(r.input_ids) >= self.context_length:
                    raise ValueError(
                        f"Input length ({len(r.input_ids)} tokens) exceeds the maximum allowed "
                        f"length ({self.context_length - 1} tokens). Use a shorter input.")
                bad = [t for t in r.input_ids if not 0 <= t < self.vocab_size]
                if bad:
                    raise ValueError(f"input_ids: token id {bad[0]} is outside the vocabulary "
                                     f"[0, {self.vocab_size})")
                if r.sampling.stop and self.tokenizer is None:
                    raise ValueError("stop strings need a tokenizer; use stop_token_ids")
            for r in reqs:
                r.max_new_tokens = min(r.sampling.max_new_tokens,
                                       self.context_length - len(r.input_ids))
                seed = (r.sampling.sampling_seed if r.sampling.sampling_seed is not None
                        else self._seed_rng.getrandbits(63))
                r.generator = torch.Generator().manual_seed(seed)
                self._inflight[r.rid] = r
                self._waiting.append(r)
            self._cv.notify_all()

    def abort(self, rid: Optional[str] = None, *, abort_all: bool = False) -> int:
        """Mark requests whose rid starts with ``rid`` (or all); returns how many."""
        with self._cv:
            hits = [r for r in self._inflight.values()
                    if abort_all or (rid is not None and r.rid.startswith(rid))]
            for r in hits:
                r._abort = True
            if hits:
                self._abort_queued = True
                self._cv.notify_all()
            return len(hits)

    def hold(self, on: bool) -> None:
        """Stop (or resume) stepping without dropping requests (pause mode in_place / retract)."""
        with self._cv:
            self._hold = on
            self.paused = on
            self._cv.notify_all()

    def retract(self) -> int:
        """Pause mode ``retract`` (engine thread, through :meth:`call`, after ``hold(True)``):
        every running request goes back to the waiting queue without its KV cache; admitted
        again it is re-prefilled with prompt + the tokens generated so far, on the weights of
        that time (SGLang's ``retract_all`` + ``_add_request_to_queue``). Returns how many."""
        reqs = [r for r in self._running if not r.finished]
        self._running, self._cache, self._mask = [], None, None
        self._next_pos = self._last = None
        with self._cv:
            for r in reqs:
                r.was_running = False
                r.num_retractions += 1
                self._waiting.append(r)
        return len(reqs)

    def apply_pending_aborts(self) -> None:
        """Engine thread: apply the aborts marked so far now (before a control operation that
        SGLang's scheduler receives after them)."""
        self._apply_aborts()

    def is_fully_idle(self, ignore_waiting: bool = False) -> bool:
        """SGLang's ``Scheduler.is_fully_idle``: nothing running and (unless ``ignore_waiting``)
        nothing waiting. A waiting request here never holds KV (a retracted one dropped it)."""
        running, waiting = self.counts()
        return running == 0 and (ignore_waiting or waiting == 0)

    def flush_cache(self) -> bool:
        """SGLang's ``Scheduler.flush_cache``: refused (False) unless
        ``is_fully_idle(ignore_waiting=paused)``; accepted, it empties the prefix cache
        (``tree_cache.reset()``). Any thread: a request is in flight (so a flush is refused)
        from admission until after its KV is stored."""
        if not self.is_fully_idle(ignore_waiting=self.paused):
            return False
        if self.prefix_cache is not None:
            self.prefix_cache.reset()
        return True

    def set_weight_version(self, new_version: Optional[str]) -> int:
        """SGLang's ``record_weight_version_change`` (engine thread, through :meth:`call`): a
        new version records (old version, output tokens) on every live request (running or
        waiting) that has output; returns how many."""
        if new_version is None or str(new_version) == self.weight_version:
            return 0
        old, self.weight_version = self.weight_version, str(new_version)
        with self._cv:
            live = list(self._inflight.values())
        recorded = 0
        for r in live:
            if r.output_ids and not r.finished:
                r.weight_version_events.append((old, len(r.output_ids)))
                recorded += 1
        return recorded

    def call(self, fn: Callable[[], object]) -> concurrent.futures.Future:
        """Run ``fn`` on the engine thread between two steps; returns a Future of its result."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cv:
            if not self._thread.is_alive():
                fut.set_exception(RuntimeError("the engine is not running"))
                return fut
            self._ops.append((fn, fut))
            self._cv.notify_all()
        return fut

    def counts(self) -> tuple[int, int]:
        with self._cv:
            running = sum(1 for r in self._inflight.values() if r.was_running)
            return running, len(self._inflight) - running

    def num_used_tokens(self) -> int:
        mask = self._mask
        return int(mask.shape[0] * mask.shape[1]) if mask is not None else 0

    # ------------------------------------------------------------------ engine thread
    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        try:
            while True:
                with self._cv:
                    while (not self._stopping and not self._ops and not self._abort_queued
                           and (self._hold or (not self._waiting and not self._running))):
                        self._cv.wait(0.5)
                    if self._stopping:
                        break
                    ops = list(self._ops)
                    self._ops.clear()
                    do_abort, self._abort_queued = self._abort_queued, False
                    admit = [] if self._hold else self._take_waiting()
                    hold = self._hold
                for fn, fut in ops:
                    if fut.set_running_or_notify_cancel():
                        try:
                            fut.set_result(fn())
                        except BaseException as err:  # noqa: BLE001 - reported to the caller
                            fut.set_exception(err)
                        self.last_output_time = time.monotonic()
                if do_abort:
                    self._apply_aborts()
                if admit:
                    self._prefill(admit)
                if self._running and not hold:
                    self._decode_step()
        except BaseException as err:  # noqa: BLE001 - kept for health checks and submitters
            log.exception("engine thread failed")
            self._error = err
        finally:
            with self._cv:
                pending = list(self._inflight.values())
                ops = list(self._ops)
                self._ops.clear()
            for r in pending:
                self._finish(r, finish_abort_running() if r.was_running else finish_abort_queued())
            for _, fut in ops:
                if not fut.done():
                    fut.set_exception(RuntimeError("the engine stopped"))

    def _take_waiting(self) -> list[EngineRequest]:
        room = self.max_running_requests - len(self._running)
        taken, tokens = [], 0
        while self._waiting and len(taken) < room:
            r = self._waiting[0]
            if r._abort:
                break  # handled by _apply_aborts first
            need = len(r.input_ids) + len(r.output_ids)  # a retracted one: prompt + output
            if taken and (len(taken) + 1) * max(tokens, need) > self.max_prefill_tokens:
                break
            taken.append(self._waiting.popleft())
            tokens = max(tokens, need)
        return taken

    def _apply_aborts(self) -> None:
        with self._cv:
            queued = [r for r in self._waiting if r._abort]
            self._waiting = deque(r for r in self._waiting if not r._abort)
        for r in queued:
            self._finish(r, finish_abort_queued())
        rows = [i for i, r in enumerate(self._running) if r._abort]
        for i in rows:
            self._finish(self._running[i], finish_abort_running())
        if rows:
            self._drop_rows(set(rows))

    def _finish(self, r: EngineRequest, reason: dict) -> None:
        if r.finish is not None:
            return
        r.finish = reason
        r.weight_version = self.weight_version
        r.weight_version_spans = compute_weight_version_spans(
            r.weight_version_events, self.weight_version, len(r.output_ids))
        r.e2e_latency = time.time() - r.created
        with self._cv:
            self._inflight.pop(r.rid, None)
            self.num_finished += 1
        self.last_output_time = time.monotonic()
        if r.on_event is not None:
            r.on_event("finish")

    # --- routed experts (``return_routed_experts``)
    def _install_routing_hooks(self) -> None:
        """A forward hook on every MoE layer's router (transformers 5's ``Qwen3MoeTopKRouter``,
        ``mlp.gate``: returns ``(logits, weights, indices)``; the experts module runs exactly
        ``indices``), recording them while :attr:`_routing` is a dict."""
        hooked = 0
        for index, layer in enumerate(self.model.model.layers):
            mlp = getattr(layer, "mlp", None)
            if getattr(mlp, "gate", None) is None or getattr(mlp, "experts", None) is None:
                continue  # a dense layer: SGLang's capture buffer keeps zeros there
            mlp.gate.register_forward_hook(self._routing_hook(index))
            hooked += 1
        if not hooked or self.top_k < 1:
            raise ValueError(f"--enable-return-routed-experts: {self.model_path} has no MoE "
                             "layer (no mlp.gate router) to record routed experts from")

    def _routing_hook(self, layer: int):
        def hook(module, args, output) -> None:
            if self._routing is None:
                return
            if not (isinstance(output, tuple) and len(output) == 3):
                raise RuntimeError(
                    f"layer {layer}: the MoE router returned {type(output).__name__}; routed "
                    "experts are read from transformers 5's Qwen3MoeTopKRouter output "
                    "(router_logits, routing_weights, selected_experts)")
            self._routing[layer] = output[2].detach().to("cpu", torch.int32)
        return hook

    def _routes(self, rows: int, width: int) -> torch.Tensor:
        """The recorded top-k of the last forward as int32 [rows, width, num_layers, top_k]
        (zeros for layers without a router, as SGLang's buffer)."""
        routes = torch.zeros(self.num_layers, rows * width, self.top_k, dtype=torch.int32)
        for layer, indices in self._routing.items():
            routes[layer] = indices.reshape(rows * width, self.top_k)
        return routes.view(self.num_layers, rows, width, self.top_k).permute(1, 2, 0, 3)

    def routed_experts(self, r: EngineRequest) -> torch.Tensor:
        """What SGLang returns for ``r`` (``BaseTopkCapturer.get_topk``): int32
        ``[seqlen - 1 - start, num_layers, top_k]`` for positions ``[start, seqlen - 1)`` of
        ``prompt + output``, ``start = min(routed_experts_start_len, seqlen - 1)``."""
        seqlen = len(r.input_ids) + len(r.output_ids)
        start = min(r.routed_experts_start_len, seqlen - 1)
        recorded = (torch.cat(r.routed) if r.routed
                    else torch.zeros(0, self.num_layers, self.top_k, dtype=torch.int32))
        return recorded[start:seqlen - 1].contiguous()

    # --- model calls
    def _forward(self, ids, mask, pos, cache, *, all_logits: bool):
        """One forward pass; ``cache`` (a DynamicCache, None for a prefill) grows in place."""
        from transformers import DynamicCache

        cache = DynamicCache() if cache is None else cache
        dev = self.device
        out = self.model(input_ids=ids.to(dev), attention_mask=mask.to(dev),
                         position_ids=pos.to(dev), use_cache=True,
                         logits_to_keep=0 if all_logits else 1, **{self._cache_kw: cache})
        new_cache = getattr(out, "cache", None) or getattr(out, "past_key_values")
        # the cache stays on the device; the logits come to the host (sampling, log-probs)
        return out.logits.float().to("cpu"), new_cache

    def _records_routes(self, r: EngineRequest) -> bool:
        """Whether the routes of ``r``'s tokens are kept: for the request itself, and with the
        prefix cache for every request (SGLang's capturer records every token it computes, so a
        cached prefix always has its routes)."""
        return self.capture_routed_experts and (r.return_routed_experts
                                                or self.prefix_cache is not None)

    def _lookup(self, r: EngineRequest):
        """(m, per-layer KV of the m cached positions, their routes): the longest prefix of a new
        request's ``input_ids`` in the prefix cache, at most ``len - 1`` and, with input
        log-probs, ``logprob_start_len`` tokens (SGLang's ``_compute_max_prefix_len``). A
        retracted request (it has output) is recomputed without a lookup."""
        if self.prefix_cache is None or r.output_ids:
            return 0, None, None
        limit = len(r.input_ids) - 1
        if r.return_logprob and r.logprob_start_len >= 0:
            limit = min(limit, r.logprob_start_len)
        m, kv, routes = self.prefix_cache.match(r.input_ids, limit)
        if m and self._records_routes(r) and routes is None:
            return 0, None, None  # (cannot happen: routes are recorded whenever they are kept)
        return m, kv, routes

    def _store(self, r: EngineRequest, cache, mask_row: torch.Tensor, row: int) -> None:
        """Engine thread, just before ``r`` finishes by stop or length (still in flight, so no
        flush runs meanwhile): put the KV ``r`` computed - row ``row`` of ``cache``, the columns
        ``mask_row`` marks, ``prompt + output`` minus its last token - and its routes in the
        prefix cache.

        Aborted requests are never stored (this server's rule). SGLang 0.5.23 differs there: a
        running request it aborts gets ``to_finish = FINISH_ABORT()``, runs one more decode step
        and is released with ``release_kv_cache(req, tree_cache, checkpoint=True)``
        (managers/scheduler.py ``abort_request``, "Abort method 3"; scheduler_components/
        batch_result_processor.py), so its KV does enter the tree there."""
        if self.prefix_cache is None:
            return
        cols = mask_row.nonzero()[:, 0]
        seq = r.input_ids + r.output_ids
        n = int(cols.numel())
        if not 0 < n <= len(seq):
            return
        layers = kv_layers(cache)
        cols_dev = cols.to(self.device)

        def take(begin: int, end: int) -> list:
            idx = cols_dev[begin:end]
            return [(k[row].index_select(1, idx), v[row].index_select(1, idx)) for k, v in layers]
        routes = None
        if self._records_routes(r) and r.routed:
            routes = torch.cat(r.routed)
            if routes.shape[0] < n:
                routes = None
        self.prefix_cache.insert(seq[:n], take, routes)

    def _prefill(self, reqs: list[EngineRequest]) -> None:
        for r in reqs:
            r.was_running = True
        # A retracted request (pause mode "retract") is recomputed: prompt + its output so far,
        # on the current weights; the next token is sampled from the last position's logits.
        seqs = [r.input_ids + r.output_ids for r in reqs]
        lengths = [len(x) for x in seqs]
        hits = [self._lookup(r) for r in reqs]
        for r, (m, _, _) in zip(reqs, hits):
            if not r.output_ids:  # counted at the first prefill only (SGLang's retracted_stain)
                r.cached_tokens = m
        cached = [m for m, _, _ in hits]
        todo = [n - m for n, m in zip(lengths, cached)]  # positions computed now, per row
        past, width = max(cached), max(todo)
        # Row i: [pad | cached_i (past) | pad | todo_i (input)], each part left-padded; without
        # any hit (past == 0) exactly the left-padded prefill of every sequence.
        ids = torch.zeros(len(reqs), width, dtype=torch.long)
        mask = torch.zeros(len(reqs), past + width, dtype=torch.long)
        pos = torch.zeros(len(reqs), width, dtype=torch.long)
        for i, x in enumerate(seqs):
            m, t = cached[i], todo[i]
            ids[i, width - t:] = torch.tensor(x[m:])
            mask[i, past - m:past] = 1
            mask[i, past + width - t:] = 1
            pos[i, width - t:] = torch.arange(m, lengths[i])
        cache = None
        if past:
            some = next(kv for m, kv, _ in hits if m)  # per layer ([H_kv, m, d], [H_kv, m, d])
            layers = []
            for layer in range(len(some)):
                ref = some[layer][0]
                k = ref.new_zeros(len(reqs), ref.shape[0], past, ref.shape[2])
                v = torch.zeros_like(k)
                for i, (m, kv, _) in enumerate(hits):
                    if m:
                        k[i, :, past - m:] = kv[layer][0]
                        v[i, :, past - m:] = kv[layer][1]
                layers.append((k, v))
            cache = self._cache_from(layers)
        want_input = any(r.return_logprob and r.logprob_start_len >= 0 and not r.output_ids
                         for r in reqs)
        capture = any(self._records_routes(r) for r in reqs)
        self._routing = {} if capture else None
        try:
            logits, cache = self._forward(ids, mask, pos, cache, all_logits=want_input)
            if capture:  # the computed positions of each row (its padding cut off)
                routes = self._routes(len(reqs), width)
                for i, r in enumerate(reqs):
                    if self._records_routes(r):  # a recomputed request: recorded anew
                        r.routed.clear()
                        if cached[i]:  # the cached positions: the routes recorded with their KV
                            r.routed.append(hits[i][2].clone())
                        r.routed.append(routes[i, width - todo[i]:].clone())
        finally:
            self._routing = None
        hits = None  # the cached KV now lives in ``cache``
        if want_input:  # logits column of position q in row i: q + (width - todo_i) - cached_i
            self._input_logprobs(reqs, logits, lengths,
                                 [width - t - m for t, m in zip(todo, cached)])
        last = logits[:, -1]
        keep = []
        for i, r in enumerate(reqs):
            if r._abort:
                self._finish(r, finish_abort_running())
            elif r.max_new_tokens <= 0:
                self._store(r, cache, mask[i], i)  # the whole prompt's KV was computed
                self._finish(r, finish_length(0))
            else:
                keep.append(i)
        if not keep:
            return
        tokens = self._sample_and_record(
            [reqs[i] for i in keep], last[keep],
            store=lambda j: self._store(reqs[keep[j]], cache, mask[keep[j]], keep[j]))
        still = [(i, t) for i, t in zip(keep, tokens) if not reqs[i].finished]
        if not still:
            return
        rows = torch.tensor([i for i, _ in still], device=self.device)
        new_kv = [(k[rows], v[rows]) for k, v in kv_layers(cache)]
        rows = rows.cpu()
        self._merge([reqs[i] for i, _ in still], new_kv, mask[rows],
                    torch.tensor([lengths[i] for i, _ in still]),
                    torch.tensor([t for _, t in still]))

    def _input_logprobs(self, reqs, logits, lengths, shifts) -> None:
        """``shifts[i]``: the logits column of row i's position q is ``q + shifts[i]`` (every
        position from ``logprob_start_len`` on was computed: the cache stops before it)."""
        logprobs = torch.log_softmax(logits, dim=-1)  # raw, T = 1 (SGLang's input logprobs)
        for i, r in enumerate(reqs):
            if not (r.return_logprob and r.logprob_start_len >= 0) or r.output_ids:
                continue  # (a recomputed request has its input logprobs already)
            off = shifts[i]
            start = min(r.logprob_start_len, lengths[i] - 1)
            vals: list[Optional[float]] = []
            tops: list[Optional[list[tuple[float, int]]]] = []
            for p in range(start, lengths[i]):
                # SGLang 0.5.23 answers [None] + the values of tokens start+1.. (scheduler_components/
                # logprob_result_processor.py): the token AT logprob_start_len has no value
                if p == start:
                    vals.append(None)
                    tops.append(None)
                    continue
                row = logprobs[i, off + p - 1]
                vals.append(float(row[r.input_ids[p]]))
                if r.top_logprobs_num > 0:
                    top = torch.topk(row, min(r.top_logprobs_num, row.numel()))
                    tops.append(list(zip(top.values.tolist(), top.indices.tolist())))
            r.input_logprobs = vals
            r.input_top = tops if r.top_logprobs_num > 0 else None

    def _merge(self, reqs, kv, mask, next_pos, last) -> None:
        if not self._running:
            self._running, self._cache, self._mask = list(reqs), self._cache_from(kv), mask
            self._next_pos, self._last = next_pos, last
            return
        width = max(self._mask.shape[1], mask.shape[1])

        def pad(t: torch.Tensor, dim: int) -> torch.Tensor:
            missing = width - t.shape[dim]
            if missing == 0:
                return t
            shape = list(t.shape)
            shape[dim] = missing
            return torch.cat([t.new_zeros(shape), t], dim=dim)

        self._cache = self._cache_from(
            [(torch.cat([pad(k0, 2), pad(k1, 2)]), torch.cat([pad(v0, 2), pad(v1, 2)]))
             for (k0, v0), (k1, v1) in zip(kv_layers(self._cache), kv)])
        self._mask = torch.cat([pad(self._mask, 1), pad(mask, 1)])
        self._next_pos = torch.cat([self._next_pos, next_pos])
        self._last = torch.cat([self._last, last])
        self._running.extend(reqs)

    def _drop_rows(self, rows: set[int]) -> None:
        keep = [i for i in range(len(self._running)) if i not in rows]
        if not keep:
            self._running, self._cache, self._mask = [], None, None
            self._next_pos = self._last = None
            return
        idx = torch.tensor(keep)
        idx_dev = idx.to(self.device)
        mask = self._mask[idx]
        # Drop leading columns that are padding in every remaining row.
        first = int((mask.sum(0) > 0).nonzero()[0])
        self._running = [self._running[i] for i in keep]
        self._mask = mask[:, first:]
        self._cache = self._cache_from([(k[idx_dev, :, first:], v[idx_dev, :, first:])
                                        for k, v in kv_layers(self._cache)])
        self._next_pos, self._last = self._next_pos[idx], self._last[idx]

    def _decode_step(self) -> None:
        batch = len(self._running)
        mask = torch.cat([self._mask, torch.ones(batch, 1, dtype=self._mask.dtype)], dim=1)
        capture = any(self._records_routes(r) for r in self._running)
        self._routing = {} if capture else None
        try:
            logits, self._cache = self._forward(self._last[:, None], mask, self._next_pos[:, None],
                                                self._cache, all_logits=False)
            if capture:  # the position of each row's fed token (its last sampled one)
                routes = self._routes(batch, 1)
                for i, r in enumerate(self._running):
                    if self._records_routes(r):
                        r.routed.append(routes[i].clone())
        finally:
            self._routing = None
        self._mask = mask
        self._next_pos = self._next_pos + 1
        tokens = self._sample_and_record(
            self._running, logits[:, -1],
            store=lambda i: self._store(self._running[i], self._cache, self._mask[i], i))
        self._last = torch.tensor(tokens)
        done = {i for i, r in enumerate(self._running) if r.finished}
        if done:
            self._drop_rows(done)

    # --- sampling
    def _sample_and_record(self, reqs: list[EngineRequest], logits: torch.Tensor, *,
                           store: Optional[Callable[[int], None]] = None) -> list[int]:
        """Sample one token per row of ``logits`` [B, V], append it, apply stop rules;
        ``store(i)`` runs just before row i finishes (its KV into the prefix cache)."""
        logits = logits[:, : self.vocab_size]
        chosen, logprobs = sample(reqs, logits)
        tokens = chosen.tolist()
        token_logprobs = logprobs.gather(1, chosen[:, None])[:, 0].tolist()
        for i, (r, tok) in enumerate(zip(reqs, tokens)):
            r.output_ids.append(tok)
            if r.return_logprob:
                r.output_logprobs.append(token_logprobs[i])
                if r.top_logprobs_num > 0:
                    top = torch.topk(logprobs[i], min(r.top_logprobs_num, logprobs.shape[1]))
                    r.output_top.append(list(zip(top.values.tolist(), top.indices.tolist())))
            reason = self._stop_reason(r, tok)
            if reason is not None:
                if store is not None:
                    store(i)
                self._finish(r, reason)
            elif r.on_event is not None:
                r.on_event("token")
        self.last_output_time = time.monotonic()
        return tokens

    def _stop_reason(self, r: EngineRequest, tok: int) -> Optional[dict]:
        s = r.sampling
        if s.stop:  # SGLang: stop strings first, then stop tokens / EOS, then the length cap
            tail = self.decode(r.output_ids[-64:], skip_special_tokens=False) or ""
            for stop in s.stop:
                if stop in tail:
                    return finish_stop(stop)
        if not s.ignore_eos and (tok in s.stop_token_ids or tok in self.eos_token_ids):
            return finish_stop(tok)
        if len(r.output_ids) >= r.max_new_tokens:
            return finish_length(r.max_new_tokens)
        return None
