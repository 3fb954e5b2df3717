"""The whole run, :class:`Config` (one field per YAML section), and its plain form: the
mapping that ``to_dict`` returns and ``megatron-gspo config`` prints, keys in the fields' order."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from megatron_gspo.config.checks import require
from megatron_gspo.config.data import DataConfig, RewardConfig, ToolsConfig
from megatron_gspo.config.gspo import GSPOConfig
from megatron_gspo.config.model import ModelConfig, ParallelConfig
from megatron_gspo.config.rollout import ParityConfig, RolloutConfig
from megatron_gspo.config.run import OptimConfig, RunSettings
from megatron_gspo.config.validate import (validate_batches, validate_data_reward,
                                           validate_model_parallel,
                                           validate_parallel_optim,
                                           validate_quantization, validate_routing_replay,
                                           validate_schedule, validate_staleness,
                                           validate_weight_sync)


@dataclass(kw_only=True, slots=True)
class Config:
    """The whole run: one field per YAML section."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    gspo: GSPOConfig = field(default_factory=GSPOConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    run: RunSettings = field(default_factory=RunSettings)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    parity: ParityConfig = field(default_factory=ParityConfig)
    tools: ToolsConfig = field(default_factory=ToolsConfig)

    def __post_init__(self) -> None:
        validate_model_parallel(self.model, self.parallel)
        validate_parallel_optim(self.parallel, self.optim)
        validate_data_reward(self.data, self.reward)
        validate_batches(self.run, self.gspo)
        validate_schedule(self.optim, self.run)
        validate_weight_sync(self.rollout, self.model)
        validate_quantization(self.rollout, self.gspo)
        validate_routing_replay(self.gspo, self.model)
        validate_staleness(self.rollout, self.run, self.gspo, self.model)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: _to_plain(getattr(self, f.name)) for f in dataclasses.fields(self)}


def yaml_key(cls: type, name: str) -> str:
    """The YAML key of field ``name`` (``YAML_KEYS`` maps the keys that are not field names)."""
    for key, field_name in getattr(cls, "YAML_KEYS", {}).items():
        if field_name == name:
            return key
    return name


def _to_plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {yaml_key(type(value), f.name): _to_plain(getattr(value, f.name))
                for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [_to_plain(v) for v in value]
    return value


def validate_data_parallel(cfg: Config, data_parallel_size: int) -> None:
    """The check that needs the world: a mini-batch (run.global_batch_size /
    gspo.updates_per_rollout rows) must split into data-parallel size x run.micro_batch_size rows.
    SFT, whose step is the whole global batch, applies the same rule, so that a file accepted for
    one program is accepted for the other (as in :func:`validate_batches`). Called by both
    trainers and by ``megatron-gspo config --world-size``; the message names the fields."""
    dp, mbs, k = data_parallel_size, cfg.run.micro_batch_size, cfg.gspo.updates_per_rollout
    gbs = cfg.run.global_batch_size
    require((gbs // k) % (dp * mbs) == 0,
            f"run.global_batch_size: a mini-batch of {gbs} / gspo.updates_per_rollout {k} = "
            f"{gbs // k} sequences does not split into data-parallel size {dp} x "
            f"run.micro_batch_size {mbs}")
