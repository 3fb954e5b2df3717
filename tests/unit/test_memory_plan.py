"""The memory planner (megatron_gspo/plan.py, ``megatron-gspo plan``).

* its parameter arithmetic equals an independent count: the parameters of the real Megatron
  policy on every rank (tiny model; TP2 x EP2, uneven PP2, tied embeddings under PP2);
* its per-token activation bytes for Megatron's local spec equal the storages autograd saves in
  one layer's forward (saved-tensor hooks), float32 and bfloat16;
* its verdicts: the published working layouts of gpu_path_review fit on their hardware, the
  project's previous 30B layout without recompute does not fit on 80 GB, and the shipped recipes
  fit on 80 GB H100s (tests/slurm/test_recipes.py runs them through config / plan / launch);
* the command prints one itemised block per stage and ends with the ``fits:`` line;
* on both shipped recipes it reports, against arithmetic done here by hand, the weight sync's
  gather buffers, the rollout servers' update-group buffers, the host copies of the CPU offload
  and the routing-replay tensor; it refuses sizes that are not positive / finite, naming the flag.

The comparison with measured peak RSS growth of tiny CPU runs is bench/bench_memory_plan.py
(numbers in docs/performance.md).
"""

from __future__ import annotations

import copy

import pytest
import torch

from megatron_gspo.config import ConfigError, config_from_dict
from megatron_gspo.plan import (GIB, PlanDoesNotFit, check_fits, plan_memory, stage_params,
                                update_group_count)
from bench.spawn import run_on_ranks

TINY = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, head_dim=32,
            num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, vocab_size=250,
            make_vocab_size_divisible_by=8)

# Qwen3-30B-A3B and Qwen3-235B-A22B (their config.json)
QWEN3_30B = dict(num_layers=48, hidden_size=2048, num_attention_heads=32, num_query_groups=4,
                 head_dim=128, num_experts=128, moe_router_topk=8, moe_ffn_hidden_size=768,
                 vocab_size=151936, make_vocab_size_divisible_by=128, rope_theta=1e6,
                 max_position_embeddings=40960, params_dtype="bfloat16")
QWEN3_235B = dict(QWEN3_30B, num_layers=94, hidden_size=4096, num_attention_heads=64,
                  moe_ffn_hidden_size=1536)
FULL_RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform",
                      recompute_num_layers=1)


# ---- parameters: the planner against the real model -------------------------------------------

def _count_worker(rank, world, cfg_dicts):
    from megatron_gspo import parallel
    from megatron_gspo.model import gpt as policy

    out = {}
    for name, cfg_dict in cfg_dicts.items():
        cfg = config_from_dict(cfg_dict)
        pg = parallel.initialize(cfg.parallel)
        gpt = policy.build_model(cfg.model, cfg.parallel, pg)
        expert = sum(p.numel() for n, p in gpt.named_parameters() if ".experts." in n)
        dense = sum(p.numel() for n, p in gpt.named_parameters() if ".experts." not in n)
        from megatron_gspo.hf.gather import HFGather, sender_ranks

        sources = {}
        for mode in ("rank", "stage", "node"):  # rollout.weight_sync.senders
            gather = HFGather(cfg.model, senders=sender_ranks(mode, pg.pp.rank()))
            gather.local_pieces(gpt, pg)  # the weight sync's plan (collective)
            sources[mode] = sorted({b.source for b in gather.plan.buckets})
        out[name] = {"pp_rank": pg.pp.rank(), "dense": dense, "expert": expert,
                     "sources": sources}
        parallel.destroy_model_parallel()
    return out


@pytest.mark.parametrize("world, layouts", [
    (4, {"tp2ep2": ({"tensor": 2, "sequence_parallel": True, "expert": 2, "expert_tensor": 1}, {}),
         "tp2etp2": ({"tensor": 2, "sequence_parallel": True, "expert": 2}, {}),
         "tp2pp2": ({"tensor": 2, "sequence_parallel": True, "pipeline": 2}, {})}),
    (2, {"pp2_uneven": ({"pipeline": 2, "num_layers_in_first_pipeline_stage": 2}, {"num_layers": 3}),
         "pp2_tied": ({"pipeline": 2}, {"tie_word_embeddings": True}),
         "ep2_tied": ({"expert": 2}, {"tie_word_embeddings": True})}),
])
def test_parameter_counts_match_the_real_policy_on_every_rank(world, layouts):
    cfgs = {name: {"model": {**TINY, **model}, "parallel": par}
            for name, (par, model) in layouts.items()}
    results = run_on_ranks(world, _count_worker, (cfgs,), timeout_s=300)
    for name, cfg_dict in cfgs.items():
        cfg = config_from_dict(cfg_dict)
        for rank_result in (r[name] for r in results):
            dense, expert = stage_params(cfg, rank_result["pp_rank"])
            assert (dense, expert) == (rank_result["dense"], rank_result["expert"]), (name, rank_result)
            # the rollout servers join one update group per sending rank of the weight sync
            for mode, sources in rank_result["sources"].items():
                moded = config_from_dict({**cfg_dict,
                                          "rollout": {"weight_sync": {"senders": mode}}})
                assert update_group_count(moded, world) == len(sources), (name, mode, sources)
            # one host: a sender per pipeline stage, the stage's lowest rank
            assert rank_result["sources"]["node"] == rank_result["sources"]["stage"]
            assert len(rank_result["sources"]["stage"]) == cfg.parallel.pipeline


# ---- activations: the local spec's per-token bytes against autograd's saved tensors -----------

def _saved_worker(rank, world, model_sections, rows, seq):
    from megatron_gspo import parallel
    from megatron_gspo.model import gpt as policy

    out = {}
    for name, model in model_sections.items():
        cfg = config_from_dict({"model": {**model, "num_layers": 1}})
        pg = parallel.initialize(cfg.parallel, seed=1)
        gpt = policy.build_model(cfg.model, cfg.parallel, pg)
        params = {p.untyped_storage().data_ptr() for p in gpt.parameters()}
        depth = [0]
        layer = gpt.decoder.layers[0]
        layer.register_forward_pre_hook(lambda *_: depth.__setitem__(0, depth[0] + 1))
        layer.register_forward_hook(lambda *_: depth.__setitem__(0, depth[0] - 1))
        seen = {}

        def pack(t):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in params and ptr not in seen and depth[0] > 0:
                seen[ptr] = t.untyped_storage().nbytes()
            return t

        tokens = torch.randint(0, cfg.model.vocab_size, (rows, seq))
        positions = torch.arange(seq).expand(rows, seq).contiguous()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            gpt(tokens, positions, None)
        out[name] = sum(seen.values())
        parallel.destroy_model_parallel()
    return out


def test_local_spec_activation_bytes_equal_the_tensors_autograd_saves():
    from megatron_gspo.plan import _shape, attention_bytes, moe_bytes

    rows, seq = 2, 48
    models = {"fp32": dict(TINY), "bf16": dict(TINY, params_dtype="bfloat16"),
              "wide": dict(TINY, hidden_size=96, moe_ffn_hidden_size=40, moe_router_topk=3,
                           num_experts=8, num_attention_heads=8, num_query_groups=4, head_dim=16)}
    (measured,) = run_on_ranks(1, _saved_worker, (models, rows, seq), timeout_s=300)
    for name, model in models.items():
        cfg = config_from_dict({"model": model})
        s = _shape(cfg, 1.0)
        per_token = sum(attention_bytes(s, "local").values()) + sum(moe_bytes(s, "local").values())
        rope = 4 * seq * s.d * s.B  # the cos / sin tables: per sequence, not per token
        predicted = per_token * rows * seq + rope
        assert abs(predicted / measured[name] - 1) < 0.02, (name, predicted, measured[name])


# ---- verdicts ---------------------------------------------------------------------------------

PUBLISHED = {
    # name: (GPUs, GiB per GPU, config); gpu_path_review.md's table of working layouts
    "slime Qwen3-30B-A3B, 8 x H100": (8, 80, {
        "model": {**QWEN3_30B, **FULL_RECOMPUTE, "moe_router_dtype": "fp32"},
        "parallel": {"tensor": 4, "sequence_parallel": True, "expert": 8, "expert_tensor": 1},
        "optim": {"use_distributed_optimizer": True, "optimizer_cpu_offload": True,
                  "use_precision_aware_optimizer": True},
        "run": {"max_tokens_per_micro_batch": 20480, "micro_batch_size": 1,
                "global_batch_size": 32, "seq_length": 16384},
        "gspo": {"group_size": 4}, "rollout": {"max_new_tokens": 8192}}),
    # verl offloads the optimizer between phases; the closest Megatron mechanism here is the
    # optimizer's CPU offload (weights and gradients stay on the GPU: the planner counts them)
    "verl GSPO Qwen3-30B-A3B, 8 x H100": (8, 80, {
        "model": {**QWEN3_30B, **FULL_RECOMPUTE},
        "parallel": {"tensor": 2, "sequence_parallel": True, "expert": 8, "expert_tensor": 1},
        "optim": {"use_distributed_optimizer": True, "optimizer_cpu_offload": True},
        "run": {"max_tokens_per_micro_batch": 30720, "micro_batch_size": 1,
                "global_batch_size": 256, "seq_length": 10240},
        "gspo": {"group_size": 16, "updates_per_rollout": 8}, "rollout": {"max_new_tokens": 8192}}),
    # examples/rl/model_configs/qwen3_30b_a3b_moe.sh does not name its GPU; without recompute
    # or a distributed optimizer it needs more than 80 GB (asserted below), so an H200
    "Megatron-LM RL Qwen3-30B-A3B, 8 x H200": (8, 141, {
        "model": dict(QWEN3_30B),
        "parallel": {"tensor": 4, "sequence_parallel": True, "expert": 2},
        "run": {"micro_batch_size": 1, "global_batch_size": 256, "seq_length": 8192},
        "gspo": {"group_size": 16}, "rollout": {"max_new_tokens": 8192}}),
    "slime Qwen3-235B-A22B, 64 x H100": (64, 80, {
        "model": {**QWEN3_235B, **FULL_RECOMPUTE},
        "parallel": {"tensor": 4, "sequence_parallel": True, "pipeline": 4,
                     "num_layers_in_last_pipeline_stage": 22, "context": 2, "expert": 16,
                     "expert_tensor": 1},
        "optim": {"use_distributed_optimizer": True, "optimizer_cpu_offload": True,
                  "use_precision_aware_optimizer": True},
        "run": {"max_tokens_per_micro_batch": 16384, "micro_batch_size": 1,
                "global_batch_size": 64, "seq_length": 16384},
        "gspo": {"group_size": 8}, "rollout": {"max_new_tokens": 8192}}),
    "verl Qwen3-235B-A22B, 64 x H100": (64, 80, {
        "model": {**QWEN3_235B, **FULL_RECOMPUTE},
        "parallel": {"tensor": 4, "sequence_parallel": True, "pipeline": 8,
                     "num_layers_in_first_pipeline_stage": 11,
                     "num_layers_in_last_pipeline_stage": 11, "expert": 4, "expert_tensor": 1},
        "optim": {"use_distributed_optimizer": True, "optimizer_cpu_offload": True},
        "run": {"max_tokens_per_micro_batch": 12288, "micro_batch_size": 1,
                "global_batch_size": 128, "seq_length": 12288},
        "gspo": {"group_size": 16}, "rollout": {"max_new_tokens": 4096}}),
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_published_working_layouts_fit_on_their_hardware(name):
    world, gib, cfg_dict = PUBLISHED[name]
    plan = plan_memory(config_from_dict(cfg_dict), world, gib)
    assert plan.fits, plan.format()
    assert plan.peak[0] > 0.15 * gib * GIB  # a real load, not an empty plan


def test_megatron_lm_example_needs_more_than_an_h100():
    world, _, cfg_dict = PUBLISHED["Megatron-LM RL Qwen3-30B-A3B, 8 x H200"]
    assert not plan_memory(config_from_dict(cfg_dict), world, 80).fits


# the project's 30B YAML before this work: TP1 / PP2 / EP8, 10,240 padded tokens per
# micro-batch, no recompute, no offload (gpu_path_review: ~120 / ~91 GB on 16 GPUs)
OLD_30B = {"model": dict(QWEN3_30B),
           "parallel": {"pipeline": 2, "expert": 8, "expert_tensor": 1},
           "optim": {"use_distributed_optimizer": True},
           "run": {"micro_batch_size": 1, "global_batch_size": 256, "seq_length": 10240},
           "gspo": {"group_size": 16, "updates_per_rollout": 4},
           "rollout": {"max_new_tokens": 8192}}


@pytest.mark.parametrize("world", [16, 64])
def test_previous_30b_layout_without_recompute_does_not_fit_on_80_gb(world):
    plan = plan_memory(config_from_dict(OLD_30B), world, 80)
    assert not plan.fits
    peak, stage = plan.peak
    assert stage == 0 and 85 * GIB < peak < 130 * GIB  # the review's ~103-120 GB by hand
    # ... and full recompute brings it under 80 GB
    fixed = copy.deepcopy(OLD_30B)
    fixed["model"].update(FULL_RECOMPUTE)
    assert plan_memory(config_from_dict(fixed), world, 80).fits


def test_memory_options_each_lower_the_plan():
    def peak(changes: dict) -> float:
        cfg = copy.deepcopy(OLD_30B)
        for section, values in changes.items():
            cfg[section].update(values)
        return plan_memory(config_from_dict(cfg), 16, 80).peak[0]

    base = peak({})
    assert peak({"model": FULL_RECOMPUTE}) < base
    assert peak({"model": {"recompute_granularity": "selective", "recompute_modules": ["moe"]}}) < base
    assert peak({"optim": {"optimizer_cpu_offload": True}}) < base
    assert peak({"optim": {"use_distributed_optimizer": False}}) > base
    assert peak({"run": {"max_tokens_per_micro_batch": 4096}}) < base
    assert peak({"gspo": {"kl_coef": 0.01}}) > base  # the reference policy's weights


def test_in_flight_micro_batches_follow_1f1b():
    cfg = copy.deepcopy(OLD_30B)
    cfg["parallel"]["pipeline"] = 4
    plan = plan_memory(config_from_dict(cfg), 32, 80)
    held = [next(i for i in s.items if i.name.startswith("in-flight")).name for s in plan.stages]
    assert held == [f"in-flight micro-batches: {n}" for n in (4, 3, 2, 1)]


def test_check_fits_refuses_with_the_breakdown_unless_told_to_proceed():
    cfg = config_from_dict(OLD_30B)
    with pytest.raises(PlanDoesNotFit, match=r"(?s)stage 0: layers 0-23.*fits: no \(peak .* of "
                                              r"80 GiB, stage 0\).*--ignore-memory-plan"):
        check_fits(cfg, 16, 80)
    assert isinstance(PlanDoesNotFit("x"), ConfigError)  # the CLI reports it as exit status 2
    assert not check_fits(cfg, 16, 80, proceed=True).fits


def test_plan_command_prints_every_stage_and_ends_with_the_verdict(capsys, tmp_path):
    import yaml

    from launch.cli import main

    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(OLD_30B))
    assert main(["plan", "--config", str(path), "--world-size", "16", "--gpu-memory-gib", "80"]) == 1
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0].startswith("layout: world 16 = tensor 1 x context 1 x pipeline 2 x data 8")
    assert sum(line.startswith("stage ") for line in out) == 2
    for item in ("bf16 weights", "fp32 gradients", "optimizer states", "activations / micro-batch",
                 "in-flight micro-batches", "recompute working set", "logits + log-prob workspace",
                 "communication & runtime"):
        assert sum(item in line for line in out) == 2, item
    assert out[-1].startswith("fits: no (peak ") and out[-1].endswith("of 80 GiB, stage 0)")
    assert main(["plan", "--config", str(path), "--world-size", "16", "--gpu-memory-gib", "141"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("fits: yes")


def test_train_checks_the_plan_against_this_gpu():
    """``train``'s check (launch/plan.check_training_memory): the world of srun / torchrun, the
    GPU's memory; nothing on a machine without CUDA."""
    from launch.plan import check_training_memory

    cfg = config_from_dict(OLD_30B)
    assert check_training_memory(cfg, 16, proceed=False) is None  # this machine: no CUDA
    with pytest.raises(PlanDoesNotFit, match=r"fits: no \(peak .* of 80 GiB, stage 0\)"):
        check_training_memory(cfg, 1, proceed=False, env={"SLURM_NTASKS": "16"},
                              device_memory_gib=80)
    verdict = check_training_memory(cfg, 1, proceed=True, env={"WORLD_SIZE": "64"},
                                    device_memory_gib=80)
    assert verdict.startswith("fits: no")
    assert check_training_memory(cfg, 16, proceed=False, env={},
                                 device_memory_gib=141).startswith("fits: yes")


# ---- the recipes: weight-sync buffers, update groups, routing replay, host memory -------------

MIB = float(1 << 20)
RECIPES = {"launch/configs/qwen3_30b_a3b.yaml": 16, "launch/configs/qwen3_235b_a22b.yaml": 64}


def _plan_lines(capsys, argv) -> tuple[int, list[str]]:
    from launch.cli import main

    code = main(["plan", *argv])
    captured = capsys.readouterr()
    return code, (captured.out + captured.err).strip().splitlines()


def _gib(line: str, name: str) -> float:
    assert line.lstrip().startswith(name), (name, line)
    return float(line.lstrip()[len(name):].split()[0])


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_plan_on_the_recipes_reports_sync_buffers_update_groups_and_routing_replay(capsys, recipe):
    import yaml

    raw = yaml.safe_load(open(recipe))
    m, par, run, rollout = raw["model"], raw["parallel"], raw["run"], raw["rollout"]
    world = RECIPES[recipe]
    code, out = _plan_lines(capsys, ["--config", recipe, "--world-size", str(world),
                                     "--gpu-memory-gib", "80"])
    assert code == 0 and out[-1].startswith("fits: yes"), "\n".join(out)  # as test_recipes says
    stages = par.get("pipeline", 1)
    assert sum(line.startswith("stage ") for line in out) == stages

    # gather buffers: 2 x the largest bucket a rank sends; buckets of weight_sync.bucket_mb
    # unless one tensor is larger: the (unpadded) embedding / lm_head, bf16, on the end stages
    embedding = m["vocab_size"] * m["hidden_size"] * 2
    bucket = rollout.get("weight_sync", {}).get("bucket_mb", 512) * MIB
    assert embedding > bucket  # both recipes: the end stages hold a larger tensor than a bucket
    gathers = [_gib(line, "weight-sync gather buffers") for line in out
               if "weight-sync gather buffers" in line]
    expected = [2 * (embedding if s in (0, stages - 1) else bucket) / GIB for s in range(stages)]
    assert gathers == pytest.approx(expected, abs=0.006), (gathers, expected)
    assert f"a {embedding / MIB:.0f} MiB tensor" in next(l for l in out if "gather buffers" in l)

    # routing replay: int16 [global_batch, seq_length, layers, top-k] per step
    replay = 2 * run["global_batch_size"] * run["seq_length"] * m["num_layers"] * m["moe_router_topk"]
    (line,) = [l for l in out if l.startswith("routing replay")]
    assert (f"int16 [{run['global_batch_size']} x {run['seq_length']} x {m['num_layers']} x "
            f"{m['moe_router_topk']}]") in line
    assert f"= {replay / 1e9:.2f} GB" in line
    dp = int(line.rsplit("data-parallel ", 1)[1].split()[0])  # each rank receives its share only
    assert f"sends each training rank only its rows: {replay / dp / 1e9:.2f} GB" in line and dp > 1
    assert {"launch/configs/qwen3_30b_a3b.yaml": "2.01 GB",       # the issue: ~2.0 / 3.9 GB
            "launch/configs/qwen3_235b_a22b.yaml": "3.94 GB"}[recipe] in line

    # update groups on every SGLang GPU, 128 MiB each: weight_sync distributed (the recipes'
    # transport since issue 37) sends from one rank per node and stage (weight_sync.senders
    # auto): pipeline x nodes per stage (8 GPUs a node), not one per sending rank (pipeline x
    # expert: the 16 / 64)
    assert stages * par["expert"] == {"launch/configs/qwen3_30b_a3b.yaml": 16,
                                      "launch/configs/qwen3_235b_a22b.yaml": 64}[recipe]
    groups = stages * -(-(world // stages) // 8)
    assert groups == {"launch/configs/qwen3_30b_a3b.yaml": 2,
                      "launch/configs/qwen3_235b_a22b.yaml": 8}[recipe]
    (line,) = [l for l in out if l.startswith("rollout-server GPU")]
    assert rollout["weight_sync"]["transport"] == "distributed"
    assert line.startswith(f"rollout-server GPU (weight_sync distributed, {rollout['tp_size']} "
                           "GPU(s) per server)")
    assert f"{groups} update group(s) (one per node and pipeline stage" in line
    assert f"= {groups * 128 * MIB / GIB:.2f} GiB" in line
    left = 1 - rollout["mem_fraction_static"]
    assert f"{left:.2f} x 80 GiB = {left * 80:.1f} GiB" in line  # what they must fit in

    # host memory: only the 235B recipe offloads its optimizer; 16 bytes per offloaded parameter
    # with Adam: fp32 parameter copy 4 + m, v 8 (one item), fp32 gradient copy 4 (another)
    offload = raw.get("optim", {}).get("optimizer_cpu_offload", False)
    host = [i for i, l in enumerate(out) if l.startswith("host memory per rank")]
    assert bool(host) == offload
    if offload:
        cfg = config_from_dict(raw)
        dp = world // (par.get("tensor", 1) * stages * par.get("context", 1))
        edp = world // (stages * par["expert"] * par.get("expert_tensor", 1))
        params = max(d / dp + e / edp for d, e in (stage_params(cfg, s) for s in range(stages)))
        states = _gib(out[host[0] + 1], "offloaded optimizer states")
        grads = _gib(out[host[0] + 2], "host gradient copy")
        assert states == pytest.approx(12 * params / GIB, abs=0.006)
        assert grads == pytest.approx(4 * params / GIB, abs=0.006)
        assert float(out[host[0]].split(": ")[1].split()[0]) == pytest.approx(16 * params / GIB,
                                                                             abs=0.06)


def test_plan_reports_distributed_sync_groups_and_replay_on_in_host_memory(capsys, tmp_path):
    import yaml

    cfg = copy.deepcopy(OLD_30B)
    cfg["rollout"].update({"weight_sync": {"transport": "distributed"},
                           "mem_fraction_static": 0.8, "tp_size": 2})
    cfg["gspo"]["routing_replay"] = "rollout"  # no recompute here: replay is allowed
    path = tmp_path / "replay.yaml"
    path.write_text(yaml.safe_dump(cfg))
    code, out = _plan_lines(capsys, ["--config", str(path), "--world-size", "16",
                                     "--gpu-memory-gib", "141"])
    assert code == 0, "\n".join(out)
    (line,) = [l for l in out if l.startswith("rollout-server GPU")]
    # 16 ranks, one stage, 8 GPUs a node: one sender per node (weight_sync.senders auto)
    assert line.startswith("rollout-server GPU (weight_sync distributed, 2 GPU(s) per server): "
                           "2 update group(s) (one per node and pipeline stage")
    assert "= 0.25 GiB per GPU" in line and "0.20 x 141 GiB = 28.2 GiB" in line
    per_rank = plan_memory(config_from_dict(
        {**cfg, "rollout": {**cfg["rollout"],
                            "weight_sync": {"transport": "distributed", "senders": "rank"}}}),
        16, 141)
    (line,) = [l for l in per_rank.notes if l.startswith("rollout-server GPU")]
    assert "16 update group(s) (one per sending rank" in line and "= 2.00 GiB per GPU" in line
    replay = 2 * 256 * 10240 * 48 * 8
    (host,) = [i for i, l in enumerate(out) if l.startswith("host memory per rank")]
    assert _gib(out[host + 1], "routing-replay tensor") == pytest.approx(replay / GIB, abs=0.006)
    assert "(on: in the host memory above)" in next(l for l in out if l.startswith("routing replay"))
    plan = plan_memory(config_from_dict(cfg), 16, 141)
    assert plan.host_bytes == replay  # no offload: the replay tensor is all


@pytest.mark.parametrize("argv, flag", [
    (["--world-size", "0"], "--world-size"),
    (["--world-size", "-16"], "--world-size"),
    (["--gpu-memory-gib", "0"], "--gpu-memory-gib"),
    (["--gpu-memory-gib", "-80"], "--gpu-memory-gib"),
    (["--gpu-memory-gib", "nan"], "--gpu-memory-gib"),
    (["--gpu-memory-gib", "inf"], "--gpu-memory-gib"),
    (["--moe-imbalance", "0.5"], "--moe-imbalance"),
    (["--moe-imbalance", "nan"], "--moe-imbalance"),
    (["--moe-imbalance=-inf"], "--moe-imbalance"),
])
def test_plan_refuses_bad_sizes_naming_the_flag(capsys, argv, flag):
    code, out = _plan_lines(capsys, ["--config", "launch/configs/qwen3_30b_a3b.yaml", *argv])
    text = "\n".join(out)
    assert code == 2 and "configuration error" in text and f"{flag}: must be" in text, text
    assert not any(line.startswith("stage ") for line in out)


@pytest.mark.parametrize("world, gib, imbalance", [
    (True, 80, 1.0), (16.0, 80, 1.0), (0, 80, 1.0), (16, 0.0, 1.0), (16, float("nan"), 1.0),
    (16, "80", 1.0), (16, 80, 0.99), (16, 80, float("inf")), (16, None, 1.0)])
def test_plan_memory_refuses_bad_sizes(world, gib, imbalance):
    with pytest.raises(ConfigError, match=r"--(world-size|gpu-memory-gib|moe-imbalance): must be"):
        plan_memory(config_from_dict(OLD_30B), world, gib, moe_imbalance=imbalance)
