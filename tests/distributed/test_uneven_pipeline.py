"""Uneven pipeline stages end to end on CPU: a converted checkpoint and a Hugging Face directory
load into a 3-layer policy split 2 + 1 or 1 + 2 over PP2, give transformers' log-probs, and come
back out (the weight sync's gather, as export and every sync use it) bit-identical.

The training step under uneven stages is tests/distributed/test_memory_layouts.py.
"""

from __future__ import annotations

import pytest
import torch

from megatron_gspo import parallel
from megatron_gspo.config import ParallelConfig
from megatron_gspo.hf.convert import hf_to_mcore
from megatron_gspo.hf.export import export_hf_dir
from megatron_gspo.hf.hf_config import model_config_from_hf
from megatron_gspo.hf.mcore_checkpoint import load_model
from megatron_gspo.hf.safetensors_io import HFCheckpoint
from megatron_gspo.hf import rank_pieces
from megatron_gspo.model import gpt as policy
from tests.distributed import convert_worker
from bench.spawn import run_on_ranks
from bench.hf_tiny import build_hf_model, hf_log_probs, load_safetensors_dir, random_batch, save_hf_model

UNEVEN = {"first2": {"pipeline": 2, "num_layers_in_first_pipeline_stage": 2},
          "last2": {"pipeline": 2, "num_layers_in_last_pipeline_stage": 2}}


@pytest.fixture(scope="module")
def three_layers(tmp_path_factory):
    root = tmp_path_factory.mktemp("uneven")
    model = build_hf_model("gqa2_untied", seed=6, num_layers=3)
    hf_dir = save_hf_model(model, root / "hf")
    hf_to_mcore(hf_dir, root / "mcore", progress=False)
    batch = random_batch(259)
    return root, model, hf_dir, batch


@pytest.mark.parametrize("split", list(UNEVEN))
def test_converted_checkpoint_gives_transformers_log_probs(split, three_layers):
    root, model, hf_dir, batch = three_layers
    cases = {"c": {"hf_config": str(root / "mcore" / "iter_0000000" / "hf_config"),
                   "checkpoints": {"converted": str(root / "mcore")}}}
    reports = [r for r in run_on_ranks(2, convert_worker.run_checkpoints,
                                       (UNEVEN[split], cases, batch, {}), timeout_s=300)
               if r is not None]
    assert len(reports) == 1
    ours = reports[0]["c"]["converted"]["log_probs"].double()
    reference = hf_log_probs(model, batch)
    assert (ours - reference).abs().max().item() <= 1e-5
    assert reference.std() > 0.5


def _export_worker(rank, world, parallel_section, hf_dir, mcore_dir, out_root):
    par = ParallelConfig(**parallel_section)
    pg = parallel.initialize(par)
    model_cfg = model_config_from_hf(hf_dir)
    gpt = policy.build_model(model_cfg, par, pg)
    layers = len(gpt.decoder.layers)
    offset = rank_pieces.rank_layout(gpt, model_cfg, pg).layer_offset
    load_model(gpt, mcore_dir)
    export_hf_dir(gpt, model_cfg, pg, f"{out_root}/from_mcore")
    with torch.no_grad():
        for p in gpt.parameters():
            p.fill_(float("nan"))
    with HFCheckpoint(hf_dir) as ckpt:
        policy.load_hf_weights(gpt, model_cfg, pg, ckpt.read)
    export_hf_dir(gpt, model_cfg, pg, f"{out_root}/from_hf")
    parallel.destroy_model_parallel()
    return {"pp_rank": pg.pp.rank(), "layers": layers, "offset": offset}


@pytest.mark.parametrize("split, stages", [("first2", [(2, 0), (1, 2)]), ("last2", [(1, 0), (2, 1)])])
def test_uneven_stages_load_and_export_bit_identical(split, stages, three_layers, tmp_path):
    root, _, hf_dir, _ = three_layers
    results = run_on_ranks(2, _export_worker, (UNEVEN[split], str(hf_dir), str(root / "mcore"),
                                               str(tmp_path)), timeout_s=300)
    assert [(r["layers"], r["offset"]) for r in sorted(results, key=lambda r: r["pp_rank"])] == stages
    original = load_safetensors_dir(hf_dir)
    for source in ("from_mcore", "from_hf"):
        exported = load_safetensors_dir(tmp_path / source)
        assert sorted(exported) == sorted(original)
        differ = [n for n in original if not torch.equal(exported[n], original[n])]
        assert not differ, f"{split}, {source}: not bit-identical: {differ[:5]}"
