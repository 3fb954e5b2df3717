"""Spawned training ranks of tests/rollout/test_client_conformance.py (importable for spawn).

``push_recorded`` builds the real Megatron policy, pushes it twice with ``WeightPusher`` (one
transport, one pause mode, the pusher's defaults otherwise) while, optionally, requests are
generating on the servers, and records every HTTP call the pusher makes (``pipeline.generation.client.
http_json`` wrapped on every rank): method, URL, path, body (bulk payloads replaced by their
size), headers, timeout, answer status. The test checks the record against SGLang's rules read
from the wheel.
"""

from __future__ import annotations

import threading
import time
import urllib.parse

import torch
import torch.distributed as dist

from megatron_gspo import parallel
from megatron_gspo.config import ParallelConfig
from megatron_gspo.hf.gather import HFGather
from megatron_gspo.hf.hf_config import model_config_from_hf
from megatron_gspo.hf import rank_pieces
from megatron_gspo.model import gpt as policy
from pipeline.generation import client as rollout
from pipeline.weights.push import WeightPusher, WeightPushError
from tests.rollout.sync_worker import _control_group, _server_weights_match



class Recorder:
    """Wraps ``pipeline.generation.client.http_json``: every call the process makes, in order."""

    def __init__(self):
        self.calls: list[dict] = []
        self._lock = threading.Lock()
        self._real = rollout.http_json

    def __enter__(self):
        def recorded(method, url, body=None, *, timeout_s=30.0, headers=None):
            extra = {} if headers is None else {"headers": headers}
            status, answer = self._real(method, url, body, timeout_s=timeout_s, **extra)
            parts = urllib.parse.urlsplit(url)
            shown = None
            if isinstance(body, dict):
                shown = {k: (f"<{len(v)} entries>" if k == "serialized_named_tensors" else v)
                         for k, v in body.items()}
            with self._lock:
                self.calls.append({
                    "t": time.monotonic(), "method": method,
                    "server": f"{parts.scheme}://{parts.netloc}", "path": parts.path,
                    "body": shown, "headers": dict(headers or {}), "timeout_s": timeout_s,
                    "status": status,
                    "answer_keys": sorted(answer) if isinstance(answer, dict) else None,
                    "answer": answer if isinstance(answer, dict) and len(str(answer)) < 2000
                    else None})
            return status, answer

        rollout.http_json = recorded
        return self

    def __exit__(self, *exc):
        rollout.http_json = self._real


def _generate_in_background(urls, n: int, max_new_tokens: int, out: list
                            ) -> tuple[list[threading.Thread], threading.Barrier]:
    """``n`` long streamed requests per server (ignore_eos); each final chunk is appended to
    ``out`` as (url, status, answer). The returned barrier (one party per request + the caller)
    is passed once every request has streamed its first output tokens: a push after it meets
    them mid-decode, with output (so a version change records an event on them)."""
    import json
    import urllib.request

    started = threading.Barrier(len(urls) * n + 1, timeout=120)

    def one(url, i):
        body = json.dumps({
            "rid": f"bg-{i}-{url[-5:]}", "input_ids": [5, 6, 7, 8 + i], "stream": True,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 1.0,
                                "ignore_eos": True, "sampling_seed": i},
            "return_logprob": True, "logprob_start_len": -1}).encode()
        req = urllib.request.Request(url + "/generate", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
        last, waiting = None, True
        with urllib.request.urlopen(req, timeout=300) as resp:
            status = resp.status
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                last = json.loads(line[5:])
                if waiting and last.get("output_ids"):
                    waiting = False
                    started.wait()
        if waiting:  # finished without streaming output: release the caller anyway
            started.abort()
        out.append((url, status, last))

    threads = [threading.Thread(target=one, args=(u, i), daemon=True)
               for u in urls for i in range(n)]
    for th in threads:
        th.start()
    return threads, started


def push_recorded(rank: int, world_size: int, hf_dir: str, server_urls: list[str],
                  transport: str, pause_mode: str, shared_dir: str, bucket_bytes: int,
                  timeout_s: float, background: int, max_new_tokens: int):
    par = ParallelConfig(expert=world_size)
    pg = parallel.initialize(par)
    model_cfg = model_config_from_hf(hf_dir)
    gpt = policy.build_model(model_cfg, par, pg).eval()
    gather = HFGather(model_cfg, bucket_bytes=bucket_bytes)
    report = {"pushes": [], "generated": [], "error": None}
    with Recorder() as rec:
        pusher = WeightPusher(server_urls, transport=transport, shared_dir=shared_dir,
                              pause_mode=pause_mode, timeout_s=timeout_s, group=_control_group())
        threads = []
        for k in range(2):
            policy.init_weights(gpt, model_cfg, pg, seed=900 + k)
            if rank == 0 and k == 1 and background:
                threads, started = _generate_in_background(server_urls, background,
                                                           max_new_tokens, report["generated"])
                started.wait()  # every request has output tokens: the push meets them decoding
            try:
                stats = pusher.push(gather.buckets(gpt, pg), f"v{k + 1}")
            except WeightPushError as err:
                report["error"] = str(err)
                break
            pieces = list(rank_pieces.local_hf_pieces(gpt, model_cfg, pg))
            mismatched = {u: _server_weights_match(u, pieces) for u in server_urls}
            report["pushes"].append({"stats": stats, "mismatched": mismatched})
        for th in threads:
            th.join(300)
        pusher.close()
    report["calls"] = rec.calls
    parallel.destroy_model_parallel()
    return report
