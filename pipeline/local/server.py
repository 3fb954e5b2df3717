"""The local rollout server's HTTP side: SGLang's native API over :class:`LocalEngine`.

Its own program: ``python -m pipeline.local --model-path DIR [--host H] [--port P] ...``
(:mod:`pipeline.local.__main__`; ``megatron-gspo serve``, ``launch/serve.py``, is the same server).
This module assembles the app (:class:`LocalRolloutServer`: the routes of
:mod:`pipeline.local.routes` over one :class:`~pipeline.local.state.ServerState`) and runs it
(:func:`serve`). By default it enforces what SGLang 0.5.23
enforces (each rule checked against the wheel by ``tests/rollout/test_server_conformance.py``):

* only SGLang's paths (``@app`` routes of its http_server.py); anything else is a 404 (``/get_load``
  too; ``/metrics`` only with ``--enable-metrics``);
* control bodies are ``io_struct``'s request classes: every field accepted with SGLang's default
  (``protocol.CONTROL_REQUESTS``), unknown fields ignored, a missing or mistyped one a 400;
* weight-update sessions: ``update_weights_from_tensor`` / ``_distributed`` only between
  ``begin_weight_update`` and ``end_weight_update`` (SGLang's messages); disk updates need none;
* ``/flush_cache`` is refused (400 ``Flush cache failed.``) unless ``is_fully_idle(ignore_waiting=
  paused)``: nothing running, and nothing waiting unless the engine is paused (``in_place`` keeps
  running requests with their KV, so it is refused; after ``retract`` or ``abort`` it works);
  ``?timeout=`` waits as SchedulerFlushWrapper does;
* every update flushes after a successful load (``flush_cache`` defaults to true); a refused flush
  makes the update answer failure with SGLang's "Weights were updated, but the cache was not
  flushed ..." (the weights and the engine's version did change; ``/model_info``'s version not);
* an update to an unpaused server takes SGLang's model-update writer lock: it waits for every
  in-flight generate (each holds the reader lock) and holds new ones back; paused, it runs at once;
* a prefix cache as SGLang's radix cache (``prefix_cache.PrefixCache``; ``--disable-radix-cache`` turns
  it off, ``--radix-cache-max-tokens`` bounds it): ``meta_info.cached_tokens`` is the number of
  prompt tokens it served, ``cached_tokens_details`` ``{"device": n, "host": 0}`` (None without a
  hit); a request with ``n > 1`` first sends its prompt alone with ``max_new_tokens`` 0, as
  SGLang's TokenizerManager does, so its samples find it cached; an accepted flush (and so every
  weight update with ``flush_cache: true``) and ``release_memory_occupation`` empty it;
* ``/health`` and ``/health_generate`` are a one-token generation that waits while generation
  is paused: 200 once the engine produces anything after the check began, 503 after
  ``SGLANG_HEALTH_CHECK_TIMEOUT`` (20 s); ``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false``
  makes ``/health`` answer at once; ``/ready`` is 503 while paused (:mod:`pipeline.local.routes.
  health`);
* pause modes: ``abort`` aborts until no generate is left, ``in_place`` holds requests with their
  KV, ``retract`` sends running requests back to the waiting queue, recomputed (prompt + output so
  far re-prefilled) on the weights of the time after ``continue_generation``;
* ``meta_info.weight_versions`` / ``weight_version`` exactly as 0.5.23 builds them
  (``request.compute_weight_version_spans`` / ``add_weight_versions_to_meta_info``);
  ``update_weight_version`` aborts every request unless ``abort_all_requests: false``;
* data-parallel layout (``--dp-size``, ``--attn-dp-size``, ``--enable-dp-attention``, resolved as
  ``handle_deprecated_dp_attention`` does and reported in ``/server_info``): with replicas
  (``dp_size > 1``) tensor / distributed updates and update groups are SGLang's failed assert (a
  plain 500 ``Internal Server Error``), disk updates work, and answers are merged over the DP
  ranks as SGLang merges them (``" | "``). The server itself always computes as ONE replica,
  whatever layout it reports.

Extensions, used only by a request that negotiates them with the header
``X-Megatron-Gspo-Extensions: checksums,delta,timings`` (any subset; ``/server_info`` lists those
offered in ``megatron_gspo_extensions``, none with ``--no-extensions``): per-bucket ``checksums``
(per TP rank; per shard file for disk updates) and the server's ``timings`` (``receive_s``,
``load_s``) in weight-update answers, and ``"delta": true`` bf16 deltas. Without the header the
answer is SGLang's body and ``delta`` is an ignored unknown field.

Other deviations (all documented in docs/rollout.md):

* ``update_weights_from_tensor`` takes SGLang's pickled payloads (shared-memory handles) only with
  ``--allow-pickled-tensors`` on 127.0.0.1, else base64 safetensors (:mod:`pipeline.weights.transport`);
* ``init_weights_update_group`` / ``update_weights_from_distributed`` run over gloo (CPU), with
  SGLang's own group code when the ``sglang`` package is importable; ``--tp-size N`` joins N group
  ranks (:mod:`pipeline.local.tp_ranks`); ``/server_info`` also has ``weight_sync_impl`` and
  ``allow_pickled_tensors``;
* weight updates land in place: ``update_weights_from_distributed`` receives into two reused
  buffers laid out by SGLang's ``FlattenedTensorBucket`` (no fresh allocation per bucket), the
  trainer's shared-memory buckets stay mapped (``tp_ranks.MappedStorages``), disk shards are
  ``readinto`` the parameters; each weight is checksummed right after it is written;
* ``/weights_checker {"action": "checksum"}`` returns :func:`weights_checksum` (sha256 over the HF
  names, dtypes, shapes and bytes), not SGLang's per-engine digest;
* ``keep_pause``, ``is_async``, ``token_step``, ``manifest``, ``recapture_cuda_graph``,
  ``torch_empty_cache`` of the update bodies are accepted and have no effect (0.5.23 reads
  ``keep_pause`` and ``is_async`` nowhere; a disk update never changes the pause state).

Limits (a request must not be able to take the server down: ``n: 1000000`` once OOM-killed it):

* ``--max-n``: ``sampling_params.n`` above it is a 400 ``{"error": {"message": ...}}`` (SGLang's
  ValueError shape; SGLang itself has no such limit);
* ``--max-queued-requests`` (SGLang's flag): a request whose samples do not fit in the waiting
  queue is a 503 ``{"detail": "The request queue is full."}``, SGLang's answer when its
  ``--max-queued-requests`` is reached (before anything is queued; a streamed request gets the
  same 503 instead of SGLang's aborted stream);
* ``--max-request-mb`` / ``--max-weight-update-mb`` (the weight-carrying
  ``update_weights_from_tensor`` / ``_distributed``): a larger body is a 413 in SGLang's
  HTTPException shape, from its Content-Length before it is read, or as soon as a chunked body
  passes the limit (:class:`~pipeline.local.bodies.BodyLimit`; SGLang reads any size);
* ``--max-json-depth``: deeper JSON is a 400 (the HTTPException shape, FastAPI's "There was an
  error parsing the body", SGLang's answer when its parser gives up), checked on the bytes
  before parsing (:func:`~pipeline.local.bodies.json_depth_exceeds`), never a 500;
* every body is parsed as SGLang parses it (orjson: :func:`~pipeline.local.bodies.parse_json`), so
  invalid UTF-8, a lone surrogate, ``NaN`` / ``Infinity`` are SGLang's 400, never a 500 further
  on; every answer is rendered as SGLang renders it (orjson: a NaN or -inf is ``null``);
* ``--model-path``: its safetensors headers and every weight's shape are checked against
  config.json before transformers loads it (:mod:`pipeline.local.model_files`): one line naming
  the file, the tensor and the shapes, exit status 2;
* ``update_weights_from_disk`` loads only from the served model's directory and the
  ``--weight-roots`` directories (paths resolved, symlinks followed), each shard named by the
  index a plain file of the directory; every header is checked against its file first, so a
  malformed index or a truncated shard is a ``{"success": false}`` answer that changes nothing;
* ``init_weights_update_group`` joins a group at ``rank_offset >= 1`` only: rank 0 hosts the
  group's TCP store, and that is the trainer's (a server never opens a store).
"""

from __future__ import annotations

import logging
import time

import torch
from fastapi import FastAPI

from pipeline.local import fault_injection
from pipeline.local.bodies import BodyLimit
from pipeline.local.engine import LocalEngine
from pipeline.local.routes import control, generate, health, info, weights
from pipeline.local.state import ServerState

log = logging.getLogger("megatron_gspo.serve")


class LocalRolloutServer:
    """FastAPI app + engine. ``args``: the parsed flags (:func:`pipeline.local.args.add_arguments`)."""

    def __init__(self, args):
        self.state = ServerState(args)
        """What the routes share (``app.state.server``)."""
        self.app = FastAPI(title="megatron-gspo local rollout server")
        self.app.state.server = self.state
        generate.register(self.app)
        health.register(self.app)
        info.register(self.app, enable_metrics=self.state.enable_metrics)
        control.register(self.app)
        weights.register(self.app)
        if getattr(args, "fault_perturb_weights", 0.0):  # tests of the parity watchdog only
            fault_injection.install(self.app, self.engine, args.fault_perturb_weights,
                                    seed=args.random_seed or 0)
        if getattr(args, "fault_update_delay_s", 0.0):  # tests of a long sync pause only
            fault_injection.install_update_delay(self.app, self.engine, args.fault_update_delay_s)
        # added last: the outermost middleware (the fault injection's wraps the app's streams)
        self.app.state.max_json_depth = self.state.max_json_depth
        self.app.add_middleware(BodyLimit, max_bytes=self.state.max_request_bytes,
                                max_weight_bytes=self.state.max_weight_update_bytes)

    @property
    def engine(self) -> LocalEngine:
        return self.state.engine

    @property
    def tp_size(self) -> int:
        return self.state.tp_size

    @property
    def paused(self) -> bool:
        """Whether generation is paused (``pause_generation`` until ``continue_generation``)."""
        return self.state.paused

    def shutdown(self) -> None:
        """Stop the engine thread and the TP rank processes."""
        self.state.shutdown()


def serve(args) -> int:
    """Load the model, then serve until SIGINT / SIGTERM (uvicorn's handlers)."""
    import uvicorn

    torch.set_num_threads(max(1, args.cpu_threads))
    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.random_seed is not None:
        torch.manual_seed(args.random_seed)
    t0 = time.time()
    server = LocalRolloutServer(args)
    server.engine.start()
    log.info("loaded %s in %.1f s; serving on http://%s:%d", args.model_path, time.time() - t0,
             args.host, args.port)
    config = uvicorn.Config(server.app, host=args.host, port=args.port,
                            log_level=args.log_level.lower(), access_log=False,
                            timeout_graceful_shutdown=5)
    try:
        uvicorn.Server(config).run()
    finally:
        server.shutdown()
    return 0
