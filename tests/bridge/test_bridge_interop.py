"""Checkpoints move between this project and Megatron-Bridge 0.6.2 / Megatron-LM, both ways, with
the real tools (the ``bridge`` tier: ``.venv-bridge/bin/python -m pytest -m bridge tests/bridge``; the
environment: launch/envs/bridge.sh; Bridge on the CPU: tests/bridge/bridge_shim.py).

* Bridge -> project: Bridge's ``AutoBridge.import_ckpt`` writes a Megatron checkpoint of a tiny
  Qwen3-MoE (two: GQA 2 with untied embeddings, GQA 4 tied with ``norm_topk_prob`` false and RoPE
  theta 1e6); ``megatron-gspo convert mcore-to-hf`` of its root (no --hf-config: Bridge records the
  model's directory) is bit-identical to the original safetensors; for the first model, ``run.init_from`` of the root
  gives the RL trainer exactly the model's weights under layouts 1, TP2, EP2, PP2 and TP2xEP2, and
  one GSPO step (``train_rollout``) from there agrees across the layouts.
* project -> Bridge: the project's checkpoints (``convert hf-to-mcore``, and ``save_model`` after
  that GSPO step under each layout) are exported by Bridge's own ``AutoBridge.export_ckpt``
  (``load_megatron_model``: the newest ``iter_*``, ``run_config.yaml``, the default strictness),
  bit-identical to the original model (both models: ``run_config.yaml`` carries the tie, the
  router's pre-softmax and RoPE theta; Bridge's export of a tied model adds an ``lm_head.weight``
  equal to the embedding) and to the trained weights, and the project's own ``mcore-to-hf`` of
  them agrees bit for bit.
* project -> Megatron-LM: the tracker file, iteration directory, format and common state of the
  converted checkpoint, read with Megatron-LM's own functions (``megatron/training/checkpointing.py``
  as megatron-core 0.19.2 ships it).

Every process launch is a fork of the harness's fork server (bench.spawn): one for Bridge's import,
one per layout (load, step, save), one for Bridge's exports. Measured (2-core machine, beside other
work): see tests/tiers.py BRIDGE.
"""

from __future__ import annotations

import types

import pytest
import torch

from bench.hf_tiny import build_hf_model, load_safetensors_dir, save_hf_model
from bench.spawn import run_on_ranks
from megatron_gspo.config import config_from_dict
from megatron_gspo.hf.convert import hf_to_mcore, mcore_to_hf
from megatron_gspo.hf.hf_config import model_config_from_hf
from megatron_gspo.hf.mapping import hf_param_shapes
from megatron_gspo.hf import megatron_layout
from tests.bridge import bridge_worker
from tests.distributed.layouts import LAYOUTS, assemble, max_rel_diff, tiny_config
from tests.distributed.test_rl_trainer_layouts import GSPO, RUN, STEP, rollout_batch

pytestmark = [pytest.mark.bridge, pytest.mark.slow]

ORDER = ("1", "TP2", "EP2", "PP2", "TP2xEP2")
MODELS = ("gqa2_untied", "gqa4_tied")  # bench/hf_tiny.py CASES
TOLERANCE = 1e-5  # one GSPO step under another layout (tests/distributed/test_rl_trainer_layouts.py)
FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "head_dim",
          "num_experts", "moe_router_topk", "moe_ffn_hidden_size", "norm_topk_prob", "vocab_size",
          "rope_theta", "rms_norm_eps", "tie_word_embeddings", "max_position_embeddings")


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    """Per model: the HF directory, Bridge's import of it (one launch for both) and the
    project's conversion of it."""
    root = tmp_path_factory.mktemp("bridge")
    out = {}
    for case in MODELS:
        hf_dir = save_hf_model(build_hf_model(case, seed=4), root / case / "hf")
        hf_to_mcore(hf_dir, root / case / "project", progress=False, sync_files=False)
        out[case] = types.SimpleNamespace(
            root=root / case, hf_dir=hf_dir, bridge=root / case / "bridge",
            project=root / case / "project", model=model_config_from_hf(str(hf_dir)),
            original=load_safetensors_dir(hf_dir))
    run_on_ranks(1, bridge_worker.bridge_import, ({str(m.hf_dir): str(m.bridge) for m in out.values()},),
                 timeout_s=300)
    return out


@pytest.fixture(scope="session")
def work(models):
    """The model the layouts train (GQA 2, untied)."""
    return models[MODELS[0]]


@pytest.fixture(scope="session")
def trained(work):
    """layout -> {before, weights (after one GSPO step), root (its save_model)}, each layout
    started from Bridge's checkpoint root with run.init_from."""
    batch = rollout_batch()
    out = {}
    for layout in ORDER:
        world, parallel = LAYOUTS[layout]
        cfg = tiny_config(parallel, model={f: getattr(work.model, f) for f in FIELDS}, gspo=GSPO,
                          run={**RUN, "init_from": str(work.bridge)})
        save_root = work.root / f"trained_{layout}"
        results = run_on_ranks(world, bridge_worker.train_from,
                               (cfg, batch, STEP, str(save_root), str(work.hf_dir)), timeout_s=300)
        shapes = hf_param_shapes(config_from_dict(cfg).model)
        out[layout] = {"before": assemble(results, "before", shapes),
                       "weights": assemble(results, "weights", shapes), "root": save_root}
    return out


@pytest.fixture(scope="session")
def bridge_exports(models, work, trained):
    """Bridge's export_ckpt of the project's converted checkpoints and of each trained one
    (one launch): label -> the exported tensors."""
    exports = {case: (m.hf_dir, m.project) for case, m in models.items()}
    exports.update({layout: (work.hf_dir, t["root"]) for layout, t in trained.items()})
    out_root = work.root.parent / "bridge_exports"
    run_on_ranks(1, bridge_worker.bridge_export,
                 ([(str(hf), str(root), str(out_root / label)) for label, (hf, root) in exports.items()],),
                 timeout_s=600)
    return {label: load_safetensors_dir(out_root / label) for label in exports}


def _assert_bit_identical(got: dict, want: dict, what: str) -> None:
    assert sorted(got) == sorted(want), f"{what}: tensor names differ: {sorted(set(got) ^ set(want))}"
    differ = [n for n in want if got[n].dtype != want[n].dtype or not torch.equal(got[n], want[n])]
    assert not differ, f"{what}: not bit-identical: {differ[:5]}"


@pytest.mark.parametrize("case", MODELS)
def test_bridge_checkpoint_converts_back_bit_exact(case, models):
    m = models[case]
    assert (m.bridge / megatron_layout.TRACKER).read_text().strip() == "0"
    out = mcore_to_hf(m.bridge, m.root / "bridge_to_hf", progress=False, sync_files=False)
    _assert_bit_identical(load_safetensors_dir(out.out_dir), m.original,
                          f"{case}: Bridge import_ckpt -> project mcore-to-hf")


@pytest.mark.parametrize("layout", ORDER)
def test_init_from_bridge_checkpoint_then_one_gspo_step(layout, work, trained):
    got = trained[layout]
    for name, tensor in work.original.items():  # the trainer starts from exactly the HF weights
        assert torch.equal(got["before"][name], tensor.double()), (layout, name)
    moved = [n for n in work.original if not torch.equal(got["weights"][n], got["before"][n])]
    assert moved, f"{layout}: the GSPO step changed no weight"
    for name, tensor in got["weights"].items():
        assert torch.isfinite(tensor).all(), (layout, name)
        err = max_rel_diff(tensor, trained["1"]["weights"][name])
        assert err <= TOLERANCE, f"{layout}: {name} after the step differs from layout 1 by {err:.2e}"


@pytest.mark.parametrize("layout", ORDER)
def test_trained_checkpoint_converts_back_bit_exact(layout, work, trained):
    root = trained[layout]["root"]
    assert megatron_layout.resolve(root) == root / "iter_0000000"
    out = mcore_to_hf(root, work.root / f"trained_{layout}_hf", progress=False, sync_files=False)
    want = {n: t.float() for n, t in trained[layout]["weights"].items()}
    _assert_bit_identical(load_safetensors_dir(out.out_dir), want, f"save_model under {layout} -> mcore-to-hf")


@pytest.mark.parametrize("label", MODELS + ORDER)
def test_bridge_exports_the_projects_checkpoint_bit_exact(label, models, trained, bridge_exports):
    want = models[label].original if label in models else {
        n: t.float() for n, t in trained[label]["weights"].items()}
    got = dict(bridge_exports[label])
    if "lm_head.weight" not in want and "lm_head.weight" in got:  # tied: Bridge writes lm_head too
        assert torch.equal(got.pop("lm_head.weight"), want["model.embed_tokens.weight"])
    _assert_bit_identical(got, want, f"Bridge export_ckpt of {label}")


def test_megatron_lm_finds_and_reads_the_converted_checkpoint(models, trained):
    """Megatron-LM's ``_load_base_checkpoint`` (megatron/training/checkpointing.py): the tracker
    file (``checkpoint_exists``; without it "will not load any checkpoints and will start from
    random"), ``read_metadata``, ``get_checkpoint_name(..., return_base_dir=True)``,
    ``_get_checkpoint_format`` and ``load_common_state_dict``, whose ``checkpoint_version`` must be
    >= 2.0 (else ``fix_query_key_value_ordering`` reorders QKV) and ``iteration`` present (else it
    exits without ``--finetune``)."""
    from megatron.core import dist_checkpointing
    from megatron.training import checkpointing as mlm

    for root in (*(m.project for m in models.values()), *(t["root"] for t in trained.values())):
        assert mlm.checkpoint_exists(str(root))
        iteration, release = mlm.read_metadata(mlm.get_checkpoint_tracker_filename(str(root)))
        assert (iteration, release) == (0, False)
        name = mlm.get_checkpoint_name(str(root), iteration, release, return_base_dir=True)
        assert name == str(root / "iter_0000000")
        assert mlm._get_checkpoint_format(name, types.SimpleNamespace()) == "torch_dist"
        common = dist_checkpointing.load_common_state_dict(name)
        assert common["checkpoint_version"] >= 2.0 and common["iteration"] == 0
        assert dist_checkpointing.load_content_metadata(preloaded_state_dict=common) == {
            "singleton_local_shards": False}
