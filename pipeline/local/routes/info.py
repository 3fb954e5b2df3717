"""Information routes: ``/model_info``, ``/server_info`` (and their ``get_`` spellings),
``/v1/loads``, ``/v1/models`` and, only with ``--enable-metrics``, ``/metrics``; as SGLang 0.5.23
answers them (the health routes: :mod:`pipeline.local.routes.health`). :func:`register` adds them
to the app."""

from __future__ import annotations

import sys
import time

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse

from pipeline.local import protocol as proto
from pipeline.local.state import ServerState


def register(app: FastAPI, *, enable_metrics: bool) -> None:
    """This module's routes (``/metrics`` only with ``--enable-metrics``, as SGLang mounts it)."""
    app.get("/model_info")(model_info)
    app.get("/get_model_info")(model_info)
    app.get("/server_info")(server_info)
    app.get("/get_server_info")(server_info)
    app.get("/v1/loads")(loads)
    if enable_metrics:
        app.get("/metrics")(metrics)
    app.get("/v1/models")(models)


def model_info(request: Request):
    state: ServerState = request.app.state.server
    eng = state.engine
    return {  # model_path / served_model_name / load_format: moved by a disk update
        "model_path": state.reported_model_path,
        "served_model_name": state.reported_model_path,
        "tokenizer_path": str(eng.model_path), "is_generation": True,
        "preferred_sampling_params": None, "weight_version": state.reported_weight_version,
        "load_format": state.reported_load_format, "reasoning_parser": None,
        "tool_call_parser": None,
        "disaggregation_mode": "null", "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": getattr(eng.config, "model_type", None),
        "architectures": getattr(eng.config, "architectures", None),
    }


def server_info(request: Request):
    state: ServerState = request.app.state.server
    eng, a = state.engine, state.args
    running, waiting = eng.counts()
    return {
        "model_path": str(eng.model_path), "tokenizer_path": str(eng.model_path),
        "host": a.host, "port": a.port, "tp_size": state.tp_size,
        # as 0.5.23 resolves and reports them (ServerArgs.resolved_dict): replicas,
        # attention-DP groups, and the deprecated flag true whenever attention DP runs
        "dp_size": state.dp_size, "attn_dp_size": state.attn_dp_size,
        "enable_dp_attention": state.attn_dp_size > 1, "ep_size": 1,
        "pp_size": 1, "random_seed": a.random_seed,
        "skip_tokenizer_init": eng.tokenizer is None, "device": eng.device.type,
        "dtype": a.dtype, "quantization": getattr(a, "quantization", None),
        "load_format": "auto", "context_length": eng.context_length,
        "max_running_requests": eng.max_running_requests,
        "max_prefill_tokens": eng.max_prefill_tokens,
        "enable_memory_saver": False, "weight_version": str(a.weight_version),
        "disable_radix_cache": eng.prefix_cache is None,
        "radix_cache_max_tokens": (eng.prefix_cache.max_tokens
                                   if eng.prefix_cache is not None else None),
        "enable_metrics": state.enable_metrics,
        "max_total_num_tokens": eng.context_length * eng.max_running_requests,
        "max_req_input_len": eng.context_length - 1,
        "internal_states": [{"num_running_reqs": running, "num_waiting_reqs": waiting,
                             "num_finished_reqs": eng.num_finished,
                             "last_gen_throughput": 0.0}],
        "version": proto.PROTOCOL_VERSION, "implementation": proto.IMPLEMENTATION,
        "megatron_gspo_extensions": list(state.extensions),
        "startup_time": state.startup_time, "frontend": "python",
        "launch_command": " ".join(sys.argv), "kv_events": None,
        "weight_sync_impl": state.impl.origin,
        "allow_pickled_tensors": state.args_allow_pickle,
    }


def load_snapshot(state: ServerState) -> dict:
    """The one DP rank's entry of ``/v1/loads``."""
    eng = state.engine
    running, waiting = eng.counts()
    total = eng.context_length * eng.max_running_requests
    used = eng.num_used_tokens()
    return {"dp_rank": 0, "num_running_reqs": running, "num_waiting_reqs": waiting,
            "num_used_tokens": used, "max_total_num_tokens": total,
            "token_usage": used / total if total else 0.0}


async def loads(request: Request):
    return {"timestamp": time.time(), "version": proto.PROTOCOL_VERSION, "accelerator": "cpu",
            "num_accelerators": 0, "loads": [load_snapshot(request.app.state.server)]}


async def metrics(request: Request):
    running, waiting = request.app.state.server.engine.counts()
    return PlainTextResponse(f"sglang:num_running_reqs {running}\n"
                             f"sglang:num_queue_reqs {waiting}\n")


async def models(request: Request):
    eng = request.app.state.server.engine
    return {"object": "list", "data": [{"id": str(eng.model_path), "object": "model",
                                        "owned_by": "sglang", "root": str(eng.model_path)}]}

