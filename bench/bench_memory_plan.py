"""The memory planner against measurements on CPU: peak RSS growth of tiny RL updates, and the
bytes autograd saves per token and layer.

    .venv/bin/python bench/bench_memory_plan.py            # every case, a table (markdown)
    .venv/bin/python bench/bench_memory_plan.py --case B   # one case

Each case runs in a fresh process (world size 1, gloo, float32, Megatron's local spec): after the
imports and Megatron's initialisation the resident set size is read (the baseline), then the
policy, its DDP wrapper and Adam are built and ``RLTrainer.train_rollout`` runs one rollout batch
(the old-log-prob recompute and the optimizer steps), and the process's peak RSS (``ru_maxrss``)
is read; with glibc's mmap threshold fixed (see ``FIXED_MMAP_THRESHOLD``) and with its defaults. ``megatron_gspo.plan.plan_memory(..., spec="local", device="cpu")`` predicts that growth
for the same configuration; the acceptance bar is 25% (docs/performance.md, "Memory plan").

The second measurement, ``saved_bytes_per_token``, counts the distinct storages autograd saves in
one layer's forward (saved-tensor hooks) and compares them with the planner's per-token formula
for the local spec (exact up to the RoPE tables, which are per sequence, not per token).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BASE_MODEL = dict(num_layers=4, hidden_size=256, num_attention_heads=4, num_query_groups=2,
                  head_dim=64, num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=256,
                  vocab_size=8192, make_vocab_size_divisible_by=8, max_position_embeddings=4096)

# name -> (what it stresses, config sections). gspo.group_size 2 and updates_per_rollout 1: one
# optimizer step over run.global_batch_size rows.
CASES = {
    "A": ("weights and Adam dominate (large vocabulary, short rows)",
          {"model": dict(BASE_MODEL, hidden_size=512, moe_ffn_hidden_size=512, vocab_size=32000,
                         head_dim=64, num_attention_heads=8, num_query_groups=4),
           "run": dict(seq_length=128, micro_batch_size=2, global_batch_size=4)}),
    "B": ("activations dominate (long rows, no recompute)",
          {"model": dict(BASE_MODEL),
           "run": dict(seq_length=2048, micro_batch_size=4, global_batch_size=8)}),
    "C": ("B with full recompute (uniform, 1 layer)",
          {"model": dict(BASE_MODEL, recompute_granularity="full", recompute_method="uniform",
                         recompute_num_layers=1),
           "run": dict(seq_length=2048, micro_batch_size=4, global_batch_size=8)}),
    "D": ("B with selective recompute of the MoE layers",
          {"model": dict(BASE_MODEL, recompute_granularity="selective", recompute_modules=["moe"]),
           "run": dict(seq_length=2048, micro_batch_size=4, global_batch_size=8)}),
}


def case_config(name: str) -> dict:
    _, sections = CASES[name]
    cfg = {k: dict(v) for k, v in sections.items()}
    cfg["gspo"] = {"group_size": 2, "updates_per_rollout": 1}
    cfg["rollout"] = {"max_new_tokens": cfg["run"]["seq_length"] // 2}
    cfg["optim"] = {"lr": 1e-5}
    return cfg


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def _child(name: str) -> dict:
    """Runs in the fresh process: baseline RSS, one rollout batch, peak RSS."""
    os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1",
                      MASTER_PORT=str(20000 + os.getpid() % 20000))
    import torch

    torch.set_num_threads(2)
    from megatron_gspo import parallel
    from megatron_gspo.config import config_from_dict
    from megatron_gspo.train.batching import rl_batch
    from megatron_gspo.train.rl_trainer import RLTrainer

    cfg = config_from_dict(case_config(name))
    parallel.init_distributed(cfg.parallel)
    pg = parallel.initialize(cfg.parallel, seed=1)
    # the rollout batch (host tensors, built before the baseline: the planner does not count it)
    gen = torch.Generator().manual_seed(0)
    rows, seq, new = cfg.run.global_batch_size, cfg.run.seq_length, cfg.rollout.max_new_tokens
    prompts = [torch.randint(1, cfg.model.vocab_size, (seq - new,), generator=gen).tolist()
               for _ in range(rows)]
    outputs = [torch.randint(1, cfg.model.vocab_size, (new + 1,), generator=gen).tolist()
               for _ in range(rows)]
    logprobs = [[-1.0] * len(o) for o in outputs]
    advantages = torch.tensor([1.0, -1.0] * (rows // 2))
    batch = rl_batch(prompts, outputs, logprobs, advantages, seq, 0)
    baseline = _rss_bytes()
    trainer = RLTrainer(cfg, pg)
    trainer.train_rollout(batch, step=1)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    parallel.destroy()
    return {"baseline": baseline, "peak": peak, "growth": peak - baseline}


FIXED_MMAP_THRESHOLD = {"MALLOC_MMAP_THRESHOLD_": str(128 << 10)}
"""glibc's malloc raises its mmap threshold (up to 32 MiB) each time a large block is freed, and
then serves blocks below it from the heap, where freed memory stays resident: RSS then counts
memory no tensor holds. A fixed threshold (128 KiB, glibc's initial value) turns that off, so
the RSS follows the live tensors, as a GPU allocator's allocated bytes do. Both are reported."""


def _run_child(name: str, env: dict) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", name], capture_output=True,
                          text=True, timeout=1800, cwd=ROOT, env={**os.environ, **env})
    if proc.returncode != 0:
        raise RuntimeError(f"case {name} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure(name: str, *, default_malloc: bool = True) -> dict:
    """Measured RSS growth (fresh processes: fixed mmap threshold, and glibc's default) and the
    planner's prediction for case ``name``; ``error`` is against the fixed-threshold run."""
    from megatron_gspo.config import config_from_dict
    from megatron_gspo.plan import plan_memory

    fixed = _run_child(name, FIXED_MMAP_THRESHOLD)["growth"]
    default = _run_child(name, {})["growth"] if default_malloc else None
    plan = plan_memory(config_from_dict(case_config(name)), 1, 1e6, spec="local", device="cpu")
    stage = plan.stages[0]
    return {"case": name, "what": CASES[name][0], "measured": fixed, "measured_default": default,
            "predicted": stage.total, "items": {i.name: i.bytes for i in stage.items},
            "error": stage.total / fixed - 1.0}


# ----------------------------------------------------------------------------------------------
# Saved tensors per token of one layer


def saved_bytes_per_token(model_section: dict, *, rows: int = 2, seq: int = 64) -> dict:
    """Distinct storages autograd saves in the forward of a 1-layer policy, per token, in this
    process (needs torch.distributed initialised with world size 1), split into the decoder
    layer and the rest; and the planner's per-token layer bytes for the same model."""
    import torch

    from megatron_gspo import parallel
    from megatron_gspo.config import config_from_dict
    from megatron_gspo.model import gpt as policy
    from megatron_gspo.plan import _shape, attention_bytes, moe_bytes

    cfg = config_from_dict({"model": dict(model_section, num_layers=1)})
    pg = parallel.initialize(cfg.parallel, seed=1)
    gpt = policy.build_model(cfg.model, cfg.parallel, pg)
    policy.init_weights(gpt, cfg.model, pg, seed=1)
    params = {p.untyped_storage().data_ptr() for p in gpt.parameters()}
    inside = [0]

    def enter(*_):
        inside[0] += 1

    def leave(*_):
        inside[0] -= 1

    layer = gpt.decoder.layers[0]
    layer.register_forward_pre_hook(enter)
    layer.register_forward_hook(leave)
    seen: dict[int, tuple[int, bool]] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and ptr not in seen:
            seen[ptr] = (t.untyped_storage().nbytes(), inside[0] > 0)
        return t

    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.model.vocab_size, (rows, seq), generator=gen)
    position_ids = torch.arange(seq).expand(rows, seq).contiguous()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        gpt(tokens, position_ids, None)
    parallel.destroy_model_parallel()
    T = rows * seq
    layer_bytes = sum(n for n, in_layer in seen.values() if in_layer)
    s = _shape(cfg, 1.0)
    per_token = sum(attention_bytes(s, "local").values()) + sum(moe_bytes(s, "local").values())
    rope = 4 * seq * s.d * s.B  # per sequence (one table for the batch), not per token
    return {"measured": layer_bytes / T, "predicted": per_token + rope / T}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", choices=sorted(CASES), action="append")
    parser.add_argument("--fixed-only", action="store_true",
                        help="skip the runs with glibc's default malloc settings")
    parser.add_argument("--child", choices=sorted(CASES), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args.child)))
        return 0
    rows = [measure(name, default_malloc=not args.fixed_only) for name in (args.case or sorted(CASES))]
    gib = float(1 << 30)
    print("| case | what | RSS growth, fixed mmap threshold | RSS growth, glibc default | "
          "predicted | error | largest predicted items |")
    print("|---|---|---|---|---|---|---|")
    worst = 0.0
    for r in rows:
        top = sorted(r["items"].items(), key=lambda kv: -kv[1])[:3]
        items = ", ".join(f"{k} {v / gib:.2f}" for k, v in top if v > 0)
        default = "-" if r["measured_default"] is None else f"{r['measured_default'] / gib:.3f} GiB"
        print(f"| {r['case']} | {r['what']} | {r['measured'] / gib:.3f} GiB | {default} | "
              f"{r['predicted'] / gib:.3f} GiB | {r['error']:+.1%} | {items} |")
        worst = max(worst, abs(r["error"]))
    print(f"\nlargest |error|: {worst:.1%} (bar: 25%)")
    return 0 if worst <= 0.25 else 1


if __name__ == "__main__":
    sys.exit(main())
