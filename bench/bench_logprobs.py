"""Peak memory and time: chunked vocab-parallel log-probs (+entropy) vs the naive full log_softmax.

Run (about 3 minutes on the 2-core CPU machine):

    .venv/bin/python bench/bench_logprobs.py
    .venv/bin/python bench/bench_logprobs.py --vocab 151936 --tokens 2048 8192 --naive-max-tokens 2048

Both variants compute, for bf16 logits ``[T, V]`` (one rank, tp=1, the worst case), the log-prob of
the target token and the entropy, then back-propagate a random weighting of both (forward +
backward), producing ``logits.grad`` in bf16:

* naive: ``lp = torch.log_softmax(logits.float() / temp, -1)``; ``lp.gather(-1, target)``;
  ``entropy = -(lp.exp() * lp).sum(-1)`` (what most RL trainers do).
* chunked: ``megatron_gspo.loss.logprobs.vocab_parallel_log_probs(..., chunk_size=C, with_entropy=True)``.

How memory is measured, and why. ``tracemalloc`` does not see torch's allocations, so every
(variant, tokens) runs in a FRESH Python subprocess that allocates its inputs, records its resident
set size (RSS), resets the kernel's high-water mark (writing ``5`` to ``/proc/self/clear_refs``),
runs forward + backward once, and reads ``VmHWM`` from ``/proc/self/status``. "Extra peak" =
``VmHWM - RSS before the step``: everything the step allocated at its peak, including the
``logits.grad`` it must return (bf16, same size as the logits; equal for both variants). torch's CPU
allocator hands buffers of this size straight back to the OS (mmap/munmap), so RSS tracks live
tensors; the kernel's HWM is exact (no sampling). Time is the median wall time of ``--repeats``
further forward + backward runs in the same process.

The naive variant at 8k tokens x 151936 needs ~35 GB (several float32 copies of the logits): more
than this 24 GB machine has. It runs up to ``--naive-max-tokens``; both variants are linear in T
(the chunked one's workspace is constant in T), so the ratio at the largest common T is reported.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def _hwm_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM")


def _reset_hwm() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _step(variant: str, logits, target, grad_lp, grad_ent, temperature: float, chunk_size: int) -> None:
    if variant == "naive":
        log_softmax = torch.log_softmax(logits.float() / temperature, dim=-1)
        log_probs = log_softmax.gather(-1, target.unsqueeze(-1)).squeeze(-1)
        entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    else:
        from megatron_gspo.loss.logprobs import vocab_parallel_log_probs

        log_probs, entropy = vocab_parallel_log_probs(logits, target, chunk_size=chunk_size,
                                                      temperature=temperature, with_entropy=True)
    ((log_probs * grad_lp).sum() + (entropy * grad_ent).sum()).backward()


def worker(args) -> dict:
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(args.tokens, args.vocab, generator=gen).mul_(3).to(torch.bfloat16).requires_grad_()
    target = torch.randint(0, args.vocab, (args.tokens,), generator=gen)
    grad_lp = torch.randn(args.tokens, generator=gen)
    grad_ent = torch.randn(args.tokens, generator=gen)
    baseline = _rss_bytes()
    _reset_hwm()
    start = time.perf_counter()
    _step(args.variant, logits, target, grad_lp, grad_ent, args.temperature, args.chunk_size)
    first_s = time.perf_counter() - start
    extra_peak = _hwm_bytes() - baseline
    times = []
    for _ in range(args.repeats):
        logits.grad = None
        start = time.perf_counter()
        _step(args.variant, logits, target, grad_lp, grad_ent, args.temperature, args.chunk_size)
        times.append(time.perf_counter() - start)
    return {"extra_peak_bytes": extra_peak, "first_s": first_s,
            "median_s": statistics.median(times) if times else first_s,
            "logits_bytes": logits.numel() * logits.element_size()}


def run_variant(variant: str, tokens: int, chunk_size: int, args) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--variant", variant, "--tokens", str(tokens),
           "--vocab", str(args.vocab), "--chunk-size", str(chunk_size), "--repeats", str(args.repeats),
           "--threads", str(args.threads), "--temperature", str(args.temperature)]
    env = dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{variant} T={tokens} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--naive-max-tokens", type=int, default=2048)
    parser.add_argument("--chunk-sizes", type=int, nargs="+", default=[512, 1024])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--temperature", type=float, default=0.9)
    # worker mode (one measurement in a fresh process)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", default="naive", help=argparse.SUPPRESS)
    parser.add_argument("--chunk-size", type=int, default=1024, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.tokens = args.tokens[0]
        print(json.dumps(worker(args)))
        return

    gib = 2 ** 30
    rows = []
    for tokens in args.tokens:
        naive = run_variant("naive", tokens, 0, args) if tokens <= args.naive_max_tokens else None
        if naive:
            rows.append((tokens, "naive log_softmax", naive, None))
        for chunk_size in args.chunk_sizes:
            rows.append((tokens, f"chunked, chunk {chunk_size}", run_variant("chunked", tokens, chunk_size, args),
                         naive))
        print(f"done T={tokens}", file=sys.stderr, flush=True)

    print(f"\nbf16 logits, vocab {args.vocab}, tp=1, forward+backward of log-prob + entropy, "
          f"{args.threads} threads, {platform.processor() or platform.machine()}, "
          f"{datetime.date.today().isoformat()}\n")
    print("| tokens | variant | logits (GiB) | extra peak (GiB) | extra peak / naive | time (s) | time / naive |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for tokens, name, r, naive in rows:
        mem_ratio = f"{r['extra_peak_bytes'] / naive['extra_peak_bytes']:.3f}" if naive else "-"
        time_ratio = f"{r['median_s'] / naive['median_s']:.2f}" if naive else "-"
        print(f"| {tokens} | {name} | {r['logits_bytes'] / gib:.2f} | {r['extra_peak_bytes'] / gib:.2f} | "
              f"{mem_ratio} | {r['median_s']:.2f} | {time_ratio} |")
    print("\nextra peak includes logits.grad (bf16, = logits size) which both variants must return.")
    print("reproduce: .venv/bin/python bench/bench_logprobs.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
