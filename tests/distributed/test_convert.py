"""HF -> Megatron conversion judged by transformers, under parallel layouts, and back.

Run: ``.venv/bin/python -m pytest -q tests/distributed/test_convert.py``

For each tiny random Qwen3-MoE of ``bench/hf_tiny.CASES`` (built and saved by transformers), the
checkpoint converted with ``hf_to_mcore(tensor=2, expert=2)`` is loaded into the real Megatron
policy under layouts 1, TP2, EP2, PP2 and TP2xEP2 (gloo ranks, fp32):

* per-token log-probs equal transformers' own to 1e-5;
* the TP2xEP2 run saves the model again with Megatron's ``dist_checkpointing.save``; every other
  layout loads that checkpoint too and gets bit-identical logits to the converted one;
* that Megatron-saved checkpoint, exported with ``mcore_to_hf``, is bit-identical to the original
  safetensors and transformers loads it.

One spawn per layout covers every case and checkpoint (the spawns dominate the run time).
"""

from __future__ import annotations

import pytest
import torch

from megatron_gspo.hf.convert import hf_to_mcore, mcore_to_hf
from tests.distributed import convert_worker
from tests.distributed.layouts import LAYOUTS
from bench.spawn import run_on_ranks
from bench.hf_tiny import (CASES, build_hf_model, hf_log_probs, load_safetensors_dir, random_batch,
                           save_hf_model)

TOLERANCE = 1e-5
ORDER = ["TP2xEP2", "1", "TP2", "EP2", "PP2"]  # TP2xEP2 first: it saves what the others load


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("convert")
    batch = random_batch(min(c["vocab_size"] for c in CASES.values()))
    cases = {}
    for name in CASES:
        model = build_hf_model(name)
        hf_dir = save_hf_model(model, root / f"{name}_hf")
        mcore_dir = root / f"{name}_mcore"
        hf_to_mcore(hf_dir, mcore_dir, tensor=2, expert=2, progress=False)
        cases[name] = {"hf_dir": hf_dir, "mcore_dir": mcore_dir, "saved_dir": root / f"{name}_saved",
                       "reference": hf_log_probs(model, batch),
                       "ref_logits": model(batch["tokens"]).logits.detach()}
    return root, batch, cases


@pytest.fixture(scope="module")
def layout_results(converted):
    """layout -> case -> checkpoint label -> {log_probs, logits}."""
    _, batch, cases = converted
    results = {}
    for layout in ORDER:
        world, parallel_section = LAYOUTS[layout]
        checkpoints = {name: {"hf_config": str(c["mcore_dir"] / "iter_0000000" / "hf_config"),
                              "checkpoints": {"converted": str(c["mcore_dir"])}}
                       for name, c in cases.items()}
        save_dirs = {}
        if layout == "TP2xEP2":
            save_dirs = {name: str(c["saved_dir"]) for name, c in cases.items()}
        else:
            for name, c in cases.items():
                checkpoints[name]["checkpoints"]["saved_at_TP2xEP2"] = str(c["saved_dir"])
        per_rank = run_on_ranks(world, convert_worker.run_checkpoints,
                                (parallel_section, checkpoints, batch, save_dirs), timeout_s=300)
        reports = [r for r in per_rank if r is not None]
        assert len(reports) == 1
        results[layout] = reports[0]
    return results


@pytest.mark.parametrize("layout", ORDER)
@pytest.mark.parametrize("case", list(CASES))
def test_log_probs_match_transformers(layout, case, converted, layout_results):
    reference = converted[2][case]["reference"]
    ours = layout_results[layout][case]["converted"]["log_probs"].double()
    assert ours.shape == reference.shape
    err = (ours - reference).abs().max().item()
    assert err <= TOLERANCE, f"{case} under {layout}: max |log p - log p_hf| = {err:.2e}"
    assert reference.std() > 0.5  # the comparison is not between two near-uniform distributions


@pytest.mark.parametrize("layout", [l for l in ORDER if l != "TP2xEP2"])
@pytest.mark.parametrize("case", list(CASES))
def test_checkpoint_saved_at_other_layout_gives_identical_logits(layout, case, layout_results):
    runs = layout_results[layout][case]
    assert torch.equal(runs["saved_at_TP2xEP2"]["logits"], runs["converted"]["logits"])


@pytest.mark.parametrize("case", list(CASES))
def test_round_trip_through_megatron_is_bit_identical(case, converted, layout_results):
    from transformers import AutoModelForCausalLM

    root, batch, cases = converted
    c = cases[case]
    out = mcore_to_hf(c["saved_dir"], root / f"{case}_export", progress=False)
    original, exported = load_safetensors_dir(c["hf_dir"]), load_safetensors_dir(out.out_dir)
    assert sorted(exported) == sorted(original)
    differ = [n for n in original if exported[n].dtype != original[n].dtype
              or not torch.equal(exported[n], original[n])]
    assert not differ, f"{case}: not bit-identical after HF -> Megatron (TP2xEP2) -> HF: {differ[:5]}"
    model = AutoModelForCausalLM.from_pretrained(out.out_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(model(batch["tokens"]).logits, c["ref_logits"])
