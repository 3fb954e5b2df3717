"""Typed run configuration: one dataclass per concern, loaded from YAML with ``--set`` overrides.

A YAML file has up to ten sections, each a dataclass of this package::

    model:    ModelConfig      the Qwen3-MoE architecture
    parallel: ParallelConfig   tensor / pipeline / expert / context parallel sizes
    gspo:     GSPOConfig       the loss and the RL step (see docs/gspo_math.md)
    rollout:  RolloutConfig    sampling and the rollout servers
    optim:    OptimConfig      optimizer and learning-rate schedule
    run:      RunSettings      seed, steps, batch sizes, output, logging
    data:     DataConfig       prompts: a synthetic task, or JSONL / Parquet files
    reward:   RewardConfig     how responses are scored (built-ins, a function, an HTTP service)
    parity:   ParityConfig     the parity watchdog: servers vs trainer after every weight sync
    tools:    ToolsConfig      multi-turn, tool-using rollouts

``load_config(path, overrides=["gspo.eps_high=5e-4"])`` returns a validated :class:`Config`.
Unknown keys are rejected with their full path, values are type-checked, and every invalid value
raises :class:`ConfigError` naming the field and the fix. Nothing is rewritten silently: derived
values (padded vocabulary, data-parallel size) are computed by functions, never stored back.

Every check that the file alone decides runs when it is loaded, in ``Config.__post_init__`` (one
section's fields in that section's ``__post_init__``, cross-section ones in the ``validate_*``
functions of :mod:`~megatron_gspo.config.validate` it calls), so ``megatron-gspo config``,
``launch slurm``, ``sft`` and ``train`` accept and reject the same files with the same message.
The one check that needs the world size (the data-parallel split of a batch) is
:func:`validate_data_parallel`, called where the world is known.

The modules: ``checks`` (:class:`ConfigError`), the sections by concern (``model``: model and
parallel; ``gspo``; ``rollout``: rollout, its weight sync, parity; ``run``: optim and run;
``data``: data, reward, tools), ``validate`` (the checks across sections), ``root``
(:class:`Config`), ``load`` (YAML, overrides, the typed build) with ``yaml_load`` (the safe YAML
reader). This module re-exports the public names; import them from here.
"""

from __future__ import annotations

from megatron_gspo.config.checks import ConfigError
from megatron_gspo.config.data import REWARD_KINDS, DataConfig, RewardConfig, ToolsConfig
from megatron_gspo.config.gspo import GSPOConfig
from megatron_gspo.config.load import apply_override, config_from_dict, dump_config, load_config
from megatron_gspo.config.model import (ModelConfig, ParallelConfig, padded_vocab_size,
                                        pipeline_stage_layers)
from megatron_gspo.config.rollout import (ParityConfig, RolloutConfig, RouterConfig,
                                         WeightSyncConfig)
from megatron_gspo.config.root import Config, validate_data_parallel
from megatron_gspo.config.run import MLflowConfig, OptimConfig, RunSettings, WandbConfig
from megatron_gspo.config.validate import (quantization_note, validate_model_parallel,
                                           validate_sft_context_parallel)

__all__ = [
    "REWARD_KINDS", "Config", "ConfigError", "DataConfig", "GSPOConfig", "MLflowConfig",
    "ModelConfig", "OptimConfig", "ParallelConfig", "ParityConfig", "RewardConfig",
    "RolloutConfig", "RouterConfig", "RunSettings", "ToolsConfig", "WandbConfig", "WeightSyncConfig",
    "apply_override", "config_from_dict", "dump_config", "load_config", "padded_vocab_size",
    "pipeline_stage_layers", "quantization_note", "validate_data_parallel",
    "validate_model_parallel",
    "validate_sft_context_parallel",
]
