"""SFT honours ``run.init_from`` and ``run.save_interval``, and a resumed SFT run is exact.

One gloo rank runs the real SFT loop (``pipeline.step.sft_loop.run_sft`` with ``SFTTrainer``) with a
cosine LR schedule after a warmup:

* the trainer starts from a Hugging Face directory (``run.init_from``): its weights are the HF
  model's, bit for bit;
* a run interrupted after step 2 (checkpoints every 2 steps) and resumed from its checkpoint in a
  fresh trainer ends with exactly the weights, losses, LRs and held-out loss of the uninterrupted
  run, and ``train/lr`` in metrics.jsonl follows the schedule.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from megatron_gspo import parallel
from megatron_gspo.config import config_from_dict
from megatron_gspo.hf.hf_config import model_config_from_hf
from megatron_gspo.hf.mapping import hf_param_shapes
from megatron_gspo.hf import rank_pieces
from tests.distributed.layouts import assemble
from bench.spawn import run_on_ranks
from bench.hf_tiny import build_hf_model, load_safetensors_dir, save_hf_model

NUM_STEPS, LR, MIN_LR, WARMUP = 4, 3e-3, 3e-4, 1


class Interrupted(Exception):
    pass


class StopsAfter:
    """The trainer, killed (an exception) when asked for step ``steps + 1``."""

    def __init__(self, trainer, steps: int):
        self.trainer, self.left = trainer, steps

    def train_batch(self, pairs):
        if self.left == 0:
            raise Interrupted
        self.left -= 1
        return self.trainer.train_batch(pairs)

    def eval_loss(self, pairs):
        return self.trainer.eval_loss(pairs)

    def save(self, run_dir, step, run_state):
        return self.trainer.save(run_dir, step, run_state)


def _sft_worker(rank, world, cfg_dicts):
    from megatron_gspo.train.checkpoint import latest_checkpoint
    from megatron_gspo.train.sft import SFTTrainer
    from pipeline.observe.metrics import MetricsLogger
    from pipeline.step.sft_loop import run_sft
    from pipeline.scoring.tasks import PAD_ID

    cont, split = (config_from_dict(cfg_dicts[k]) for k in ("continuous", "interrupted"))
    pg = parallel.initialize(cont.parallel, seed=1)

    def pieces(trainer):
        return [(p, t.clone()) for p, t in rank_pieces.local_hf_pieces(trainer.gpt, cont.model, pg)]

    def logger(cfg):
        return MetricsLogger(cfg.run.output_dir, tensorboard=False)

    trainer = SFTTrainer(cont, pg, pad_id=PAD_ID)
    initial = pieces(trainer)
    continuous = run_sft(trainer, cont, logger=logger(cont))
    final_continuous = pieces(trainer)

    try:
        run_sft(StopsAfter(SFTTrainer(split, pg, pad_id=PAD_ID), 2), split, logger=logger(split))
        raise AssertionError("the run was not interrupted")
    except Interrupted:
        pass
    fresh = SFTTrainer(split, pg, pad_id=PAD_ID)
    latest = latest_checkpoint(split.run.output_dir)
    run_state = fresh.load(latest)
    resumed = run_sft(fresh, split, logger=logger(split), start_step=int(run_state["step"]),
                      run_state=run_state)
    out = {"initial": initial, "final_continuous": final_continuous, "final_resumed": pieces(fresh),
           "continuous": (continuous.losses, continuous.eval_losses),
           "resumed": (resumed.losses, resumed.eval_losses), "latest": latest.name}
    parallel.destroy_model_parallel()
    return out


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_sft_starts_from_init_from_and_resumes_exactly(tmp_path):
    hf_dir = save_hf_model(build_hf_model("gqa2_untied", seed=4), tmp_path / "hf")
    model = model_config_from_hf(str(hf_dir))
    fields = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "head_dim",
              "num_experts", "moe_router_topk", "moe_ffn_hidden_size", "norm_topk_prob",
              "vocab_size", "rope_theta", "rms_norm_eps", "tie_word_embeddings")
    base = {"model": {f: getattr(model, f) for f in fields},
            "optim": {"optimizer": "adam", "lr": LR, "min_lr": MIN_LR, "lr_decay_style": "cosine",
                      "warmup_steps": WARMUP},
            "data": {"task": "addition", "digits": 2, "num_eval_prompts": 4},
            "run": {"init_from": str(hf_dir), "num_steps": NUM_STEPS, "save_interval": 2,
                    "global_batch_size": 8, "micro_batch_size": 4, "seq_length": 16,
                    "eval_interval": 0}}
    cfgs = {name: {**base, "run": {**base["run"], "output_dir": str(tmp_path / name)}}
            for name in ("continuous", "interrupted")}
    result = run_on_ranks(1, _sft_worker, (cfgs,), timeout_s=600)[0]
    shapes = hf_param_shapes(config_from_dict(base).model)

    # run.init_from: the HF weights exactly
    initial = assemble([result], "initial", shapes)
    hf = load_safetensors_dir(hf_dir)
    for name in shapes:
        assert torch.equal(initial[name], hf[name].double()), name

    # resume: steps 3..4 of the interrupted run are those of the uninterrupted one
    losses, eval_losses = result["continuous"]
    resumed_losses, resumed_eval = result["resumed"]
    assert result["latest"] == "step_000002"
    assert resumed_losses == losses[2:] and resumed_eval == eval_losses[-1:]
    final, resumed = (assemble([result], key, shapes) for key in ("final_continuous", "final_resumed"))
    for name in shapes:
        assert torch.equal(final[name], resumed[name]), name
    assert max((final[n] - initial[n]).abs().max() for n in shapes) > 1e-4  # it trained

    # metrics.jsonl: train/lr every step, the schedule's value (optimizer step j = run step - 1)
    def lr(j):
        if j <= WARMUP:
            return LR * j / WARMUP
        return MIN_LR + 0.5 * (1 + math.cos(math.pi * (j - WARMUP) / (NUM_STEPS - WARMUP))) * (LR - MIN_LR)

    train = [r for r in _records(tmp_path / "continuous") if "train/loss" in r]
    assert [r["step"] for r in train] == list(range(1, NUM_STEPS + 1))
    assert all(abs(r["train/lr"] - lr(r["step"] - 1)) <= 1e-12 for r in train)
    split = [r for r in _records(tmp_path / "interrupted") if "train/loss" in r]
    assert [(r["step"], r["train/lr"]) for r in split] == [(r["step"], r["train/lr"]) for r in train]
    # checkpoints every save_interval steps and at the last
    names = sorted(p.name for p in (tmp_path / "continuous" / "checkpoints").iterdir())
    assert names == ["latest", "step_000002", "step_000004"]
