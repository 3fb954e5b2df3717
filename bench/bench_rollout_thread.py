"""What rank 0's rollout costs rank 0's training step (issue 37, item 6).

Under ``rollout.async: one_step`` and ``full`` rank 0's rollout runs while its training step runs
(on GPUs: rank 0's main thread launches the kernels every pipeline and expert peer waits on).
It used to run on a thread of the training process: its client turns every ``/generate`` answer
into a ``RolloutResult`` in Python (the JSON of ``output_token_logprobs``, ``[logprob, token id,
null]`` per token, the checks and the sample's lists) under the training thread's interpreter
lock. Now it runs in a producer process of its own (``pipeline.sources.remote.RemoteSource``).
This bench times the same training step with, beside it, in one process, the arms interleaved
(each in each place in turn):

* ``idle``: nothing;
* ``thread`` / ``process``: only the parsing of one 30B-sized batch of answers, on a thread
  (``parse_generate_text``: the client before issue 37) or handed to the parse process
  (``pipeline.generation.parse_pool``, as ``read_generate_answer`` does);
* ``producer thread`` / ``producer process``: rank 0's whole ``one_step`` rollout through the
  batch source the step uses (``next(n)``: batch n taken, n+1's rollout started; the step;
  ``before_weights_change()``: n+1's rollout waited for): HTTP to a server process that answers
  every request with one of the 30B-sized answers, the parsing, the rewards, the batch; on a
  thread of the training process (``OneStepSource``, before) or in the producer process
  (``RemoteSource``, now). ``batch taken`` is ``next``'s time on rank 0 (the batch through the
  pipe, for the process).

The step: ``RLTrainer.train_rollout`` (recompute of log pi_old + 2 GSPO updates) of a Qwen3-MoE
of hidden 128, 4 layers, 16 experts top-2 on real Megatron-Core (gloo, world 1), a packed batch
of 64 sequences of 60-290 tokens, one torch thread (``bench/bench_kernels.py``'s step). The
answers: ``--samples`` x ``--tokens`` (default 512 x 4096: the 30B recipe's 256 samples of up to
8,192 tokens, ~2M tokens per step) in SGLang 0.5.23's ``/generate`` format, rendered as SGLang
renders them (``pipeline.local.bodies.render_json``).

``--pin`` (default): the step's thread on core 0 and everything beside it (the rollout thread,
the producer and parse processes, the answer server) on the other cores, as on a GPU node's host
where the training thread has a core of its own; without it the arms also share this machine's
2 cores (``--no-pin``). Each step is timed twice: its wall time, and its time on a core of its
own (the wall less the time its thread waited for a CPU: ``/proc/thread-self/schedstat``; what
the machine's other work takes, which a GPU node's host does not; waiting for the interpreter lock
stays in). Also reported: each parse alone (wall, and CPU of the training
process), and memory: tracemalloc of the training process over one batch (peak / kept), the
producer's peak RSS.

Run (about 12 minutes on the 2-core machine)::

    nice -n 19 .venv/bin/python bench/bench_rollout_thread.py --repeats 6

The ratios are against the idle step of the same run; the absolute seconds are this CPU's.
Numbers: docs/performance.md, "The rollout thread and rank 0's training step".
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import multiprocessing
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
import tracemalloc
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from aiohttp import web  # noqa: E402

from bench.bench_packing import make_batch  # noqa: E402
from bench.spawn import run_on_ranks  # noqa: E402
from megatron_gspo import parallel  # noqa: E402
from megatron_gspo.config import config_from_dict  # noqa: E402
from megatron_gspo.train.rl_trainer import RLTrainer  # noqa: E402
from pipeline.context import LoopContext  # noqa: E402
from pipeline.generation.client import answer_result, parse_generate_text  # noqa: E402
from pipeline.engines.factory import ClientSpec, build_client  # noqa: E402
from pipeline.generation.parse_pool import ParsePool, shared_pool  # noqa: E402
from pipeline.local.bodies import render_json  # noqa: E402
from pipeline.observe.metrics import MetricsLogger  # noqa: E402
from pipeline.scoring.data import PromptSampler, TaskPromptDataset  # noqa: E402
from pipeline.scoring.rewards import build_reward  # noqa: E402
from pipeline.scoring.tasks import AdditionTask  # noqa: E402
from pipeline.signals import StopFlag  # noqa: E402
from pipeline.sources.choice import make_source  # noqa: E402

MODEL = dict(num_layers=4, hidden_size=128, num_attention_heads=4, num_query_groups=2,
             head_dim=32, num_experts=16, moe_router_topk=2, moe_ffn_hidden_size=128,
             vocab_size=256, max_position_embeddings=4096)
VOCAB = 151936  # Qwen3's: token ids of up to 6 digits in the JSON
PROMPT_TOKENS = 300
URL = "http://10.0.0.1:30000"


def make_bodies(samples: int, tokens: int, seed: int) -> list[bytes]:
    """``samples`` answers of ``tokens`` output tokens each, as SGLang 0.5.23 renders them."""
    rng = np.random.default_rng(seed)
    bodies = []
    for i in range(samples):
        ids = rng.integers(0, VOCAB, tokens).tolist()
        # float32 log-probs (what SGLang's sampler returns), mostly near 0, a long tail
        lps = (-rng.exponential(0.4, tokens)).astype(np.float32).astype(np.float64).tolist()
        meta = {"id": f"b{i}", "finish_reason": {"type": "length", "length": tokens},
                "prompt_tokens": PROMPT_TOKENS, "weight_version": "7", "num_retractions": 0,
                "input_token_logprobs": [[None, 11, None]],
                "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, ids)],
                "output_token_logprobs_length": tokens, "completion_tokens": tokens,
                "reasoning_tokens": 0, "cached_tokens": 0,
                "weight_versions": [{"version": "7", "start": 0, "end": tokens}],
                "cached_tokens_details": None, "dp_rank": 0, "e2e_latency": 61.5,
                "response_sent_to_client_ts": 1.7e9}
        text = "".join(chr(97 + t % 26) * 4 for t in ids[:tokens])  # ~4 characters a token
        bodies.append(render_json({"text": text, "output_ids": ids, "meta_info": meta}))
    return bodies


def parse_in_thread(bodies: list[bytes]) -> list:
    """What the client does with each answer on its thread (``resp.text()`` decodes UTF-8)."""
    prompt = list(range(PROMPT_TOKENS))
    return [parse_generate_text(b.decode("utf-8"), f"b{i}", prompt, URL)
            for i, b in enumerate(bodies)]


def parse_in_process(pool: ParsePool, bodies: list[bytes]) -> list:
    """What the client does with each answer now: the bytes to the parse process, the sample's
    lists built from its compact answer (``read_generate_answer``, without the event loop)."""
    prompt = list(range(PROMPT_TOKENS))
    futures = [pool.submit(b, f"b{i}", PROMPT_TOKENS) for i, b in enumerate(bodies)]
    return [answer_result(f.result(), f"b{i}", prompt, URL) for i, f in enumerate(futures)]


def serve_answers(samples: int, tokens: int, seed: int, ready, cores) -> None:
    """A process answering every ``/generate`` with one of ``samples`` pre-rendered 30B-sized
    answers, in turn (what the producer arms' clients read; serving them costs this process,
    not the training process), on ``cores`` (None: any); ``ready`` gets its URL."""
    if cores:
        os.sched_setaffinity(0, cores)
    bodies = make_bodies(samples, tokens, seed)
    count = iter(range(10**9))

    async def generate(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=bodies[next(count) % len(bodies)],
                            content_type="application/json")

    async def other(request: web.Request) -> web.Response:
        return web.json_response({})

    async def main() -> None:
        app = web.Application(client_max_size=1 << 26)
        app.router.add_post("/generate", generate)
        app.router.add_post("/abort_request", other)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        ready.put(f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}")
        await asyncio.Event().wait()
    asyncio.run(main())


def producer_config(samples: int, tokens: int) -> dict:
    """The producer's run: ``samples`` samples of up to ``tokens`` output tokens per step."""
    return {"gspo": {"group_size": 8},
            "rollout": {"async": "one_step", "max_new_tokens": tokens, "max_concurrency": 64},
            "run": {"global_batch_size": samples, "micro_batch_size": 8, "num_steps": 10**6,
                    "seq_length": tokens + 64, "eval_interval": 0}}


def producer_source(cfg_dict: dict, url: str, run_dir: str, *, in_process: bool):
    """Rank 0's ``rollout.async: one_step`` source over ``url``: on a thread of this process (the
    client before issue 37 item 6) or in the producer process (``RemoteSource``, now)."""
    cfg = config_from_dict(cfg_dict)
    spec = ClientSpec(router_url=None, server_urls=(url,), max_concurrency=64)
    dataset = TaskPromptDataset(AdditionTask(digits=3, seed=0))
    ctx = LoopContext(cfg=cfg, run_dir=run_dir, sampler=PromptSampler(dataset, seed=0),
                      reward_fn=build_reward(cfg.reward, cfg.data), client=build_client(spec),
                      decode=dataset.encoder.decode, stop_token_ids=[dataset.encoder.eos_id],
                      logger=MetricsLogger(run_dir, enabled=False), stop=StopFlag(),
                      engine=None if in_process else spec)
    return make_source(ctx, 0)


ARMS = ("idle", "thread", "process", "producer thread", "producer process")
"""idle: no rollout; thread / process: only the parsing of one batch, on a thread, itself or
handed to the parse process; producer thread / process: rank 0's whole one_step rollout (HTTP,
parsing, rewards, the batch) over the answer server, on a thread of the training process (the
client before issue 37 item 6, with its parse process) or in the producer process (now)."""


def _vm_hwm_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _sched() -> tuple[float, float]:
    """(seconds on a CPU, seconds runnable but waiting for one) of the calling thread so far
    (Linux's ``/proc/thread-self/schedstat``)."""
    on_cpu, waiting, _ = Path("/proc/thread-self/schedstat").read_text().split()
    return int(on_cpu) / 1e9, int(waiting) / 1e9


def timed_step(trainer, batch, step: int) -> tuple[float, float]:
    """The step's wall seconds, and its seconds on a core of its own: the wall less the time
    its thread was runnable but waited for a CPU (what other processes on this loaded 2-core
    machine take; a GPU node's host gives rank 0's training thread a core). Waiting for the
    interpreter lock is not a wait for a CPU (the thread sleeps on the lock): it stays in."""
    _, wait0 = _sched()
    t0 = time.perf_counter()
    trainer.train_rollout(batch, step)
    wall = time.perf_counter() - t0
    return wall, wall - (_sched()[1] - wait0)


class Cores:
    """``--pin``: the training step's thread on the first core, everything else (the rollout
    thread, the producer and parse processes, the answer server) on the others, as on a GPU
    node's host, where rank 0's training thread has a core of its own: what remains of the arms'
    difference is the interpreter lock, not two processes sharing this machine's 2 cores.
    Linux's affinity is per thread and inherited by the threads and processes a thread starts."""

    def __init__(self, pin: bool):
        cores = sorted(os.sched_getaffinity(0))
        self.active = pin and len(cores) >= 2
        self.train, self.rollout = {cores[0]}, set(cores[1:])

    def rollout_side(self) -> None:
        if self.active:
            os.sched_setaffinity(0, self.rollout)

    def training(self) -> None:
        if self.active:
            os.sched_setaffinity(0, self.train)


def _step_worker(rank, world, cfg_dict, batch, bodies, repeats, producer_cfg, url, run_dir,
                 pin):
    torch.set_num_threads(1)
    cores = Cores(pin)
    cores.rollout_side()  # what starts from here runs beside the step
    cfg = config_from_dict(cfg_dict)
    pg = parallel.initialize(cfg.parallel, seed=cfg.run.seed)
    trainer = RLTrainer(cfg, pg)
    pool = ParsePool()
    parsers = {"thread": lambda: parse_in_thread(bodies),
               "process": lambda: parse_in_process(pool, bodies)}
    sources = {"producer thread": producer_source(producer_cfg, url, run_dir, in_process=True),
               "producer process": producer_source(producer_cfg, url, run_dir, in_process=False)}
    taken = {name: 0 for name in sources}  # the step each source made last
    steps = iter(range(10**6))
    trainer.train_rollout(batch, next(steps))  # warm-up: allocator, kernels, the parse process
    for name, source in sources.items():  # warm-up: the producer started, its first batch made
        source.restore({})
        source.next(1)
        source.before_weights_change()
        taken[name] = 1
    alone = {}
    for name, parse in parsers.items():  # each parse alone, nothing else running
        parse()
        runs = []
        for _ in range(2):
            t0, c0 = time.perf_counter(), time.process_time()
            parse()
            runs.append((time.perf_counter() - t0, time.process_time() - c0))
        alone[name] = min(runs)
    times: dict[str, list[float]] = {arm: [] for arm in ARMS}
    own_core: dict[str, list[float]] = {arm: [] for arm in ARMS}
    busy_s: dict[str, list[float]] = {arm: [] for arm in ARMS[1:]}
    take_s: dict[str, list[float]] = {arm: [] for arm in sources}
    for r in range(repeats):
        order = ARMS[r % len(ARMS):] + ARMS[:r % len(ARMS)]  # each arm in each place in turn
        for arm in order:
            gc.collect()
            if arm in sources:  # the batch made last time; the next rollout starts now
                t0 = time.perf_counter()
                sources[arm].next(taken[arm] + 1)
                take_s[arm].append(time.perf_counter() - t0)
                taken[arm] += 1
                cores.training()
                t0 = time.perf_counter()
                wall, own = timed_step(trainer, batch, next(steps))
                times[arm].append(wall)
                own_core[arm].append(own)
                cores.rollout_side()
                sources[arm].before_weights_change()  # the rollout that ran beside the step
                busy_s[arm].append(time.perf_counter() - t0)
                continue
            done = threading.Event()
            box: dict = {}

            def rollout_thread():
                if arm != "idle":
                    t0 = time.perf_counter()
                    box["results"] = parsers[arm]()
                    box["seconds"] = time.perf_counter() - t0
                done.wait()

            thread = threading.Thread(target=rollout_thread, daemon=True)
            thread.start()
            cores.training()
            wall, own = timed_step(trainer, batch, next(steps))
            times[arm].append(wall)
            own_core[arm].append(own)
            cores.rollout_side()
            done.set()
            thread.join()
            if arm != "idle":
                busy_s[arm].append(box["seconds"])
    memory = {name: _memory(parse) for name, parse in parsers.items()}
    for name, source in sources.items():
        memory[name] = _memory(lambda s=source, n=name: _one_rollout(s, n, taken))
    memory["producer process"]["producer_hwm_mb"] = _vm_hwm_mb(sources["producer process"].pid)
    for source in sources.values():
        source.close()
    pool.close()
    shared_pool().close()  # the thread arm's client's (a process left would block this one's exit)
    parallel.destroy_model_parallel()
    return {"times": times, "own_core": own_core, "busy_s": busy_s, "take_s": take_s, "alone": alone,
            "memory": memory, "rss_hwm_mb": _vm_hwm_mb(os.getpid())}


def _one_rollout(source, name: str, taken: dict) -> list:
    """One whole rollout of ``source`` as rank 0 sees it: the batch taken, the next made."""
    batch, _ = source.next(taken[name] + 1)
    taken[name] += 1
    source.before_weights_change()
    return [batch]


def _memory(parse) -> dict:
    """tracemalloc over one batch: the peak while parsing and what the results keep."""
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    results = parse()
    kept, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    tokens = sum(len(r.output_ids) if hasattr(r, "output_ids") else int(r["response_mask"].sum())
                 for r in results)
    return {"peak_mb": (peak - base) / 1e6, "kept_mb": (kept - base) / 1e6, "tokens": tokens}


LABELS = {"idle": "idle", "thread": "parsing on a thread", "process": "parsing in the parse process",
          "producer thread": "one_step producer on a thread (before)",
          "producer process": "one_step producer in its process (now)"}


def report(out: dict, args) -> None:
    """The table (markdown) and the ratio line."""
    idle = statistics.median(out["times"]["idle"])
    idle_own = statistics.median(out["own_core"]["idle"])
    print("| rank 0 beside the step | step on its own core (s, median) | vs idle | step wall "
          "(s, median) | vs idle | alone: wall / CPU of the training process (s) | its work "
          "during the step (s) | batch taken (s) | training process memory: peak / kept (MB) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for arm in ARMS:
        step = statistics.median(out["times"][arm])
        own = statistics.median(out["own_core"][arm])
        head = (f"| {LABELS[arm]} | {own:.2f} | {own / idle_own:.3f} | {step:.2f} | "
                f"{step / idle:.3f}")
        if arm == "idle":
            print(f"{head} | - | - | - | - |")
            continue
        alone = out["alone"].get(arm)
        alone_text = f"{alone[0]:.2f} / {alone[1]:.2f}" if alone else "-"
        take = out["take_s"].get(arm)
        take_text = f"{statistics.median(take):.3f}" if take else "-"
        mem = out["memory"][arm]
        extra = (f" (producer: {mem['producer_hwm_mb']:.0f} peak RSS)"
                 if "producer_hwm_mb" in mem else "")
        print(f"{head} | {alone_text} | {statistics.median(out['busy_s'][arm]):.2f} | "
              f"{take_text} | {mem['peak_mb']:.0f} / {mem['kept_mb']:.0f}{extra} |")
    for key in ("times", "own_core"):
        print(f"# {key}: " + "; ".join(f"{arm} {[round(x, 2) for x in out[key][arm]]}"
                                      for arm in ARMS))
    print(f"# training process peak RSS {out['rss_hwm_mb']:.0f} MB")
    print("rank 0's step on its own core vs idle: " + ", ".join(
        f"{arm} {statistics.median(out['own_core'][arm]) / idle_own:.3f}x" for arm in ARMS[1:])
        + f" ({args.samples} x {args.tokens} tokens per step; wall: " + ", ".join(
            f"{arm} {statistics.median(out['times'][arm]) / idle:.3f}x" for arm in ARMS[1:])
        + ")")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=6, help="steps per arm (default 6)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the raw numbers here")
    ap.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True,
                    help="the step on core 0, everything beside it on the others (default; "
                         "Cores)")
    args = ap.parse_args()

    rng = random.Random(args.seed)
    lengths = [rng.randint(60, 290) for _ in range(64)]
    batch = make_batch(lengths, 256, args.seed)
    cfg = {"model": MODEL,
           "gspo": {"group_size": 8, "updates_per_rollout": 2, "routing_metrics": False},
           "optim": {"lr": 1e-4},
           "run": {"global_batch_size": len(lengths), "micro_batch_size": 16,
                   "seq_length": max(lengths), "num_steps": 100,
                   "max_tokens_per_micro_batch": 4096}}
    t0 = time.perf_counter()
    bodies = make_bodies(args.samples, args.tokens, args.seed)
    size = sum(len(b) for b in bodies)
    print(f"# {args.samples} answers x {args.tokens} tokens: {size / 1e6:.1f} MB of JSON "
          f"({size / args.samples / 1e3:.0f} kB each), built in {time.perf_counter() - t0:.1f} s",
          flush=True)
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Queue()
    cores = Cores(args.pin)
    server = ctx.Process(target=serve_answers, daemon=True,
                         args=(args.samples, args.tokens, args.seed, ready,
                               cores.rollout if cores.active else None))
    server.start()
    url = ready.get(timeout=600)
    run_dir = tempfile.mkdtemp(prefix="bench_rollout_thread_")
    try:
        out = run_on_ranks(1, _step_worker, (cfg, batch, bodies, args.repeats,
                                             producer_config(args.samples, args.tokens), url,
                                             run_dir, args.pin), timeout_s=3600)[0]
    finally:
        server.kill()
        shutil.rmtree(run_dir, ignore_errors=True)
    report(out, args)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), **out}, indent=1))


if __name__ == "__main__":
    main()
