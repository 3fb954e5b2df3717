"""The GPU path in one run: Transformer Engine spec, bf16, distributed optimizer, gradient clipping.

Run on a machine with one CUDA GPU (megatron-core and transformer-engine installed)::

    python bench/gpu_check.py

It builds a small Qwen3-style MoE with the TE spec in bf16, wraps it in Megatron DDP with the
distributed optimizer, takes optimizer steps on a fixed batch with gradient clipping, and prints
what it used and the loss of each step. Exit status 0 means every step ran and the loss fell.
This is the script recorded in closing notes when a session is lent a GPU; it is also what
``tests/gpu/test_gpu_step.py`` runs.
"""

from __future__ import annotations

import os
import sys
import time

import torch


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device", file=sys.stderr)
        return 2
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    from megatron_gspo.model import gpt as policy
    from megatron_gspo import parallel
    from megatron_gspo.config import config_from_dict
    from megatron_gspo.train.sft import nll_loss_fn
    from megatron_gspo.train.train_step import build_train_state, train_step

    cfg = config_from_dict({
        "model": {"num_layers": 4, "hidden_size": 512, "num_attention_heads": 8,
                  "num_query_groups": 4, "head_dim": 128, "num_experts": 16, "moe_router_topk": 4,
                  "moe_ffn_hidden_size": 256, "vocab_size": 32000, "params_dtype": "bfloat16",
                  "make_vocab_size_divisible_by": 128},
        "optim": {"lr": 1e-3, "clip_grad": 1.0, "use_distributed_optimizer": True},
    })
    parallel.init_distributed()
    pg = parallel.initialize(cfg.parallel, seed=1)
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    print(f"transformer engine spec: {policy.transformer_engine_available()}")
    gpt = policy.build_model(cfg.model, cfg.parallel, pg)
    policy.init_weights(gpt, cfg.model, pg, seed=1)
    state = build_train_state(gpt, cfg, pg)
    print(f"model: {type(gpt.decoder.layers[0].mlp.experts).__name__} experts, params dtype "
          f"{next(gpt.parameters()).dtype}, optimizer {type(state.optimizer).__name__}")
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 32000, (8, 257), generator=gen)
    batch = {"tokens": tokens[:, :-1].cuda(), "labels": tokens[:, 1:].cuda(),
             "position_ids": torch.arange(256).expand(8, 256).contiguous().cuda(),
             "loss_mask": torch.ones(8, 256, dtype=torch.bool).cuda()}
    mbs = [{k: v[i * 4:(i + 1) * 4] for k, v in batch.items()} for i in range(2)]
    losses = []
    for step in range(1, 6):
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = train_step(state, mbs, nll_loss_fn(cfg.model, pg), num_units_global=8 * 256)
        torch.cuda.synchronize()
        loss = sum(float(m["loss_sum"]) for m in out["per_microbatch"]) / (8 * 256)
        losses.append(loss)
        print(f"step {step} loss {loss:.4f} grad_norm {out['grad_norm']:.3f} "
              f"update_ok {out['update_successful']} {1e3 * (time.perf_counter() - start):.1f} ms")
    print(f"peak memory {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
    parallel.destroy()
    ok = all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    print("gpu_check:", "OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
