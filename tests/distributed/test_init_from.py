"""``run.init_from`` takes a Hugging Face directory or a converted Megatron checkpoint (the root
Megatron-LM and Bridge keep, or its iteration directory): under EP2 each gives the RL trainer
exactly the weights of the Hugging Face model. The checkpoint's common state is Megatron-LM's
(``checkpoint_version``, ``iteration``, ``content_metadata``, and here also the ``args`` namespace
Megatron-LM saves): none of it is the model's, and a strict ``load_state_dict`` of it failed
before issue 35."""

from __future__ import annotations

import argparse

import torch

from megatron_gspo.hf import rank_pieces
from megatron_gspo import parallel
from megatron_gspo.config import config_from_dict
from megatron_gspo.hf.convert import hf_to_mcore
from megatron_gspo.hf.mapping import hf_param_shapes
from megatron_gspo.hf.hf_config import model_config_from_hf
from megatron_gspo.train.rl_trainer import RLTrainer
from tests.distributed.layouts import assemble
from bench.spawn import run_on_ranks
from bench.hf_tiny import build_hf_model, load_safetensors_dir, save_hf_model


def _worker(rank, world, cfg_dict, source):
    cfg = config_from_dict(cfg_dict)
    pg = parallel.initialize(cfg.parallel, seed=1)
    trainer = RLTrainer(cfg, pg, init_hf_dir=source)
    pieces = [(p, t.clone()) for p, t in rank_pieces.local_hf_pieces(trainer.gpt, cfg.model, pg)]
    parallel.destroy_model_parallel()
    return {"weights": pieces}


def test_init_from_hf_and_from_converted_megatron_checkpoint(tmp_path):
    hf_dir = save_hf_model(build_hf_model("gqa2_untied", seed=4), tmp_path / "hf")
    hf_to_mcore(hf_dir, tmp_path / "mcore", progress=False)
    model = model_config_from_hf(str(hf_dir))
    fields = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "head_dim",
              "num_experts", "moe_router_topk", "moe_ffn_hidden_size", "norm_topk_prob",
              "vocab_size", "rope_theta", "rms_norm_eps", "tie_word_embeddings")
    cfg = {"model": {f: getattr(model, f) for f in fields}, "parallel": {"expert": 2}}
    expected = {k: v.double() for k, v in load_safetensors_dir(hf_dir).items()}
    shapes = hf_param_shapes(config_from_dict(cfg).model)
    common_file = tmp_path / "mcore" / "iter_0000000" / "common.pt"
    common = torch.load(common_file, weights_only=True)
    assert common["iteration"] == 0 and common["checkpoint_version"] == 3.0
    common["args"] = argparse.Namespace(tensor_model_parallel_size=1, finetune=False)
    torch.save(common, common_file)
    for source in (hf_dir, tmp_path / "mcore", tmp_path / "mcore" / "iter_0000000"):
        results = run_on_ranks(2, _worker, (cfg, str(source)), timeout_s=300)
        got = assemble(results, "weights", shapes)
        for name in shapes:
            assert torch.equal(got[name], expected[name]), (source, name)
