"""``gspo.kl_coef > 0``: the RL trainer's frozen reference policy and the KL it reports.

Two gloo ranks (expert parallelism 2) run ``RLTrainer.train_rollout`` itself for two rollout
batches, starting from a Hugging Face model (``run.init_from``). Checked against transformers'
Qwen3-MoE in float64 as the oracle:

* step 1: the policy IS the reference, so ``kl_mean`` is exactly 0;
* step 2: ``kl_mean`` equals the k3 KL between the policy after step 1 and the initial HF model,
  computed here from transformers' log-probs at the rollout temperature
  (``mean_i (1/n_i) sum_t exp(x) - x - 1``, ``x = log pi_ref - log pi``);
* the loss carries the term: ``loss - policy_loss = kl_coef * kl_mean``;
* the reference never moves: after both updates it still holds the HF weights, bit for bit.
"""

from __future__ import annotations

import math
import shutil

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from megatron_gspo import parallel
from megatron_gspo.config import config_from_dict
from megatron_gspo.hf.hf_config import model_config_from_hf
from megatron_gspo.hf.mapping import hf_param_shapes
from megatron_gspo.hf import rank_pieces
from megatron_gspo.train.batching import rl_batch
from megatron_gspo.train.rl_trainer import RLTrainer
from pipeline.scoring.tasks import PAD_ID
from tests.distributed.layouts import assemble
from bench.spawn import run_on_ranks
from bench.hf_tiny import build_hf_model, load_safetensors_dir, save_hf_model

KL_COEF, TEMPERATURE, SEQ = 0.5, 0.7, 16
# the oracle in float64: transformers' eager expert loop (its grouped GEMM has no float64 kernel)
F64 = dict(dtype=torch.float64, experts_implementation="eager", attn_implementation="eager")


def _rollout_batch(seed: int, rows: int, vocab: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    prompts, outputs = [], []
    for _ in range(rows):
        prompt_len = int(torch.randint(2, 6, (1,), generator=gen))
        out_len = int(torch.randint(3, SEQ + 1 - prompt_len, (1,), generator=gen))
        prompts.append(torch.randint(1, vocab, (prompt_len,), generator=gen).tolist())
        outputs.append(torch.randint(1, vocab, (out_len,), generator=gen).tolist())
    advantages = torch.randn(rows, generator=gen)
    return rl_batch(prompts, outputs, [[0.0] * len(o) for o in outputs], advantages, SEQ, PAD_ID)


def _worker(rank, world, cfg_dict, batches):
    cfg = config_from_dict(cfg_dict)
    pg = parallel.initialize(cfg.parallel, seed=1)
    trainer = RLTrainer(cfg, pg, init_hf_dir=cfg.run.init_from)

    def pieces(model):
        return [(p, t.clone()) for p, t in rank_pieces.local_hf_pieces(model, cfg.model, pg)]

    first = trainer.train_rollout(batches[0], 1)
    after_first = pieces(trainer.gpt)
    second = trainer.train_rollout(batches[1], 2)
    reference = pieces(trainer.reference.model[0])
    parallel.destroy_model_parallel()
    return {"first": first, "second": second, "after_first": after_first, "reference": reference}


def _hf_log_probs(model, batch) -> torch.Tensor:
    with torch.no_grad():
        logits = model(batch["tokens"]).logits.double() / TEMPERATURE
    return torch.log_softmax(logits, -1).gather(-1, batch["labels"][..., None])[..., 0]


def test_kl_to_the_frozen_reference_matches_transformers_in_float64(tmp_path):
    hf_model = build_hf_model("gqa2_untied", seed=4)
    hf_dir = save_hf_model(hf_model, tmp_path / "hf")
    model = model_config_from_hf(str(hf_dir))
    fields = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "head_dim",
              "num_experts", "moe_router_topk", "moe_ffn_hidden_size", "norm_topk_prob",
              "vocab_size", "rope_theta", "rms_norm_eps", "tie_word_embeddings")
    cfg = {"model": {f: getattr(model, f) for f in fields}, "parallel": {"expert": 2},
           "gspo": {"kl_coef": KL_COEF, "group_size": 4, "mismatch_correction": False},
           "rollout": {"temperature": TEMPERATURE},
           "optim": {"optimizer": "adam", "lr": 1e-2, "clip_grad": 1.0},
           "run": {"init_from": str(hf_dir), "global_batch_size": 8, "micro_batch_size": 2,
                   "seq_length": SEQ, "num_steps": 2}}
    batches = [_rollout_batch(seed, 8, model.vocab_size) for seed in (1, 2)]
    results = run_on_ranks(2, _worker, (cfg, batches), timeout_s=600)
    shapes = hf_param_shapes(config_from_dict(cfg).model)
    first, second = results[0]["first"], results[0]["second"]
    for r in results:  # every rank reports the same values (wall-clock timings aside)
        assert r["second"]["kl_mean"] == second["kl_mean"] and r["second"]["loss"] == second["loss"]

    # step 1: policy == reference
    assert first["kl_mean"] == 0.0
    # the reference is frozen at the initial (HF) weights
    initial = {k: v.double() for k, v in load_safetensors_dir(hf_dir).items()}
    reference = assemble(results, "reference", shapes)
    for name in shapes:
        assert torch.equal(reference[name], initial[name]), name

    # step 2: the KL between the policy after step 1 and the reference, from transformers in f64
    after_first = assemble(results, "after_first", shapes)
    moved_dir = tmp_path / "after_first"
    moved_dir.mkdir()
    shutil.copy(hf_dir / "config.json", moved_dir / "config.json")
    save_file({k: v.float().contiguous() for k, v in after_first.items()},
              str(moved_dir / "model.safetensors"), metadata={"format": "pt"})
    moved = AutoModelForCausalLM.from_pretrained(moved_dir, **F64).eval()
    batch = batches[1]
    ref_lp = _hf_log_probs(AutoModelForCausalLM.from_pretrained(hf_dir, **F64).eval(),
                           batch)
    lp = _hf_log_probs(moved, batch)
    mask = batch["response_mask"]
    x = torch.where(mask, ref_lp - lp, 0.0)
    k3 = torch.exp(x) - x - 1.0
    expected = float((k3.sum(-1) / mask.sum(-1)).mean())
    assert expected > 1e-4, "the first update did not move the policy measurably"
    # Megatron computes in float32 (measured: 1e-6 relative)
    assert math.isclose(second["kl_mean"], expected, rel_tol=1e-5), (second["kl_mean"], expected)
    # and the loss contains exactly that term (D = N: both are per-sequence means)
    assert math.isclose(second["loss"] - second["policy_loss"], KL_COEF * second["kl_mean"],
                        rel_tol=1e-5, abs_tol=1e-9)
