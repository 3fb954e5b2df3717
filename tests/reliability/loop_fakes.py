"""Stand-ins for the GSPO loop's trainer, weight pusher and rollout client (no Megatron, no
servers), for reliability tests of the loop's own bookkeeping: metrics on resume, server events.

``loop_context(tmp_path, steps=..., ...)`` gives a :class:`pipeline.context.LoopContext` on a world
of one (``world_of_one`` below: gloo over a HashStore) with the synthetic addition task.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Optional

import torch.distributed as dist

from megatron_gspo.config import config_from_dict
from pipeline.context import LoopContext
from pipeline.signals import StopFlag
from pipeline.scoring.data import PromptSampler, TaskPromptDataset
from pipeline.observe.metrics import MetricsLogger
from pipeline.scoring.rewards import build_reward
from pipeline.generation.client import RolloutResult
from pipeline.scoring.tasks import AdditionTask, decode


def init_world_of_one() -> bool:
    """A gloo world of one if none is up; returns whether this call made it."""
    if dist.is_initialized():
        return False
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return True


class Crash(Exception):
    """The trainer process dying (the probe killed it) after the steps it was allowed."""


class FakeTrainer:
    """Records steps and saves; ``crash_at``: raise :class:`Crash` when asked to train that step;
    ``loss``: the per-step value it reports (``clip_frac``), to tell two runs' records apart."""

    def __init__(self, *, crash_at: Optional[int] = None, mark: float = 0.0):
        self.crash_at, self.mark = crash_at, mark
        self.saved: list[int] = []
        self.trained: list[int] = []

    def train_rollout(self, batch, step):
        if step == self.crash_at:
            raise Crash(f"killed at step {step}")
        self.trained.append(step)
        return {"clip_frac": self.mark + step}

    def hf_buckets(self):
        return []

    def save(self, run_dir, step, run_state):
        self.saved.append(step)


class FakePusher:
    def __init__(self):
        self.pushes: list[str] = []

    def push(self, buckets, version):
        self.pushes.append(version)
        return SimpleNamespace(metrics=dict)


class FakeClient:
    """Answers every prompt: the right sum for half of each group, a wrong one for the rest."""

    def generate_groups(self, prompts, group_size, sampling, *, seed=None, **_):
        groups = []
        for ids in prompts:
            a, b = decode(ids).rstrip("=").split("+")
            right = list(str(int(a) + int(b)).encode()) + [10]
            group = []
            for s in range(group_size):
                out = right if s < group_size // 2 else [ord("x"), 10]
                group.append(RolloutResult(rid=f"r{s}", prompt_ids=list(ids), output_ids=out,
                                           output_logprobs=[-0.5] * len(out), finish_reason="stop",
                                           matched_stop=10, prompt_tokens=len(ids),
                                           completion_tokens=len(out), weight_version="0",
                                           server_url="fake"))
            groups.append(group)
        return groups

    async def generate_groups_async(self, prompts, group_size, sampling, **kw):
        """What ``rollout.async: full``'s stream calls (one prompt at a time)."""
        return self.generate_groups(prompts, group_size, sampling, **kw)

    async def abort_all(self):
        """Every request is answered at once: nothing is ever in flight to abort."""


def loop_context(tmp_path, *, steps: int, save_interval: int = 0, tensorboard: bool = False,
                 client=None, pusher=None, **fields) -> LoopContext:
    cfg = config_from_dict({
        "gspo": {"group_size": 4},
        "run": {"num_steps": steps, "global_batch_size": 8, "micro_batch_size": 4,
                "seq_length": 16, "eval_interval": 0, "save_interval": save_interval},
    })
    dataset = TaskPromptDataset(AdditionTask(digits=2, seed=0))
    return LoopContext(
        cfg=cfg, run_dir=str(tmp_path), sampler=PromptSampler(dataset, seed=0),
        reward_fn=build_reward(cfg.reward, cfg.data), client=client or FakeClient(),
        decode=decode, stop_token_ids=[10],
        logger=MetricsLogger(tmp_path, enabled=True, tensorboard=tensorboard),
        stop=StopFlag(), weights=pusher or FakePusher(), **fields)
