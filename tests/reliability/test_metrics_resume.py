"""Issue 11, item 7: on resume, metrics.jsonl and TensorBoard keep each step exactly once.

The probe: a run checkpointed at step 3, went on to log steps 4 and 5, and was killed; the resumed
run logged 4 and 5 again, so metrics.jsonl read ``[.., 4, 5, 4, 5, ..]`` and TensorBoard showed
both runs' points. Here the real GSPO loop (``pipeline.step.loop.run``) and the real SFT loop
(``pipeline.step.sft_loop.run_sft``) with the real ``MetricsLogger``, the trainer replaced by a stand-in
that dies at step 6; TensorBoard is read back with TensorBoard's own ``EventAccumulator``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.distributed as dist

from megatron_gspo.config import config_from_dict
from pipeline.step import loop
from pipeline.observe.metrics import MetricsLogger
from pipeline.step.sft_loop import run_sft
from tests.reliability.loop_fakes import Crash, FakeTrainer, init_world_of_one, loop_context


@pytest.fixture(scope="module", autouse=True)
def world_of_one():
    made = init_world_of_one()
    yield
    if made:
        dist.destroy_process_group()


def _steps(run_dir: Path) -> list[int]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["step"] for line in lines]


def _tensorboard(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tb"))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_gspo_resume_logs_each_step_once(tmp_path):
    # the first run: checkpoints at 3, logs 4 and 5, dies while training step 6
    first = FakeTrainer(crash_at=6, mark=0.0)
    with pytest.raises(Crash):
        loop.run(loop_context(tmp_path, steps=8, save_interval=3, tensorboard=True), first,
                 start_step=0)
    assert first.saved == [3] and _steps(tmp_path) == [1, 2, 3, 4, 5]
    with open(tmp_path / "metrics.jsonl", "a") as f:  # the killed writer's torn last line
        f.write('{"step": 6, "time_s"')
    # the resumed run (a new process: a new logger) from the checkpoint of step 3
    second = FakeTrainer(mark=100.0)
    ctx = loop_context(tmp_path, steps=8, save_interval=3, tensorboard=True)
    result = loop.run(ctx, second, start_step=3)
    ctx.logger.close()
    assert result["status"] == "finished" and second.trained == [4, 5, 6, 7, 8]
    assert _steps(tmp_path) == [1, 2, 3, 4, 5, 6, 7, 8]  # was [1, 2, 3, 4, 5, 4, 5, 6, 7, 8]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["train/clip_frac"] for r in records] == [1, 2, 3, 104, 105, 106, 107, 108]
    # TensorBoard: each step once, the resumed run's values from step 4 on
    assert _tensorboard(tmp_path, "train/clip_frac") == [
        (1, 1.0), (2, 2.0), (3, 3.0), (4, 104.0), (5, 105.0), (6, 106.0), (7, 107.0), (8, 108.0)]


class FakeSFT:
    def __init__(self, crash_at=None, mark=0.0):
        self.step, self.crash_at, self.mark = 0, crash_at, mark

    def train_batch(self, pairs):
        self.step += 1
        if self.step == self.crash_at:
            raise Crash(f"killed at step {self.step}")
        return {"loss": self.mark + self.step, "grad_norm": 1.0, "lr": 1e-3}

    def eval_loss(self, pairs):
        return 0.5

    def save(self, run_dir, step, run_state):
        self.position = run_state


def test_sft_resume_logs_each_step_once(tmp_path):
    cfg = config_from_dict({"data": {"task": "addition", "digits": 2, "num_eval_prompts": 2},
                            "run": {"num_steps": 6, "save_interval": 3, "global_batch_size": 8,
                                    "micro_batch_size": 4, "seq_length": 16,
                                    "output_dir": str(tmp_path)}})
    first = FakeSFT(crash_at=6)
    logger = MetricsLogger(tmp_path, tensorboard=True)
    with pytest.raises(Crash):
        run_sft(first, cfg, logger=logger)
    logger.close()
    assert _steps(tmp_path) == [0, 1, 2, 3, 4, 5]
    second = FakeSFT(mark=100.0)
    second.step = 3
    logger = MetricsLogger(tmp_path, tensorboard=True)
    run_sft(second, cfg, logger=logger, start_step=3, run_state=first.position)
    logger.close()
    assert _steps(tmp_path) == [0, 1, 2, 3, 4, 5, 6]
    assert [s for s, _ in _tensorboard(tmp_path, "train/loss")] == [1, 2, 3, 4, 5, 6]
    assert [v for _, v in _tensorboard(tmp_path, "train/loss")][3:] == [104.0, 105.0, 106.0]


def test_fresh_start_moves_an_earlier_metrics_file_aside(tmp_path):
    logger = MetricsLogger(tmp_path, tensorboard=False)
    logger.log(1, {"x": 1.0})
    logger.close()
    logger = MetricsLogger(tmp_path, tensorboard=False)
    logger.resume_at(0)
    logger.log(1, {"x": 2.0})
    logger.close()
    assert _steps(tmp_path) == [1]
    assert json.loads((tmp_path / "metrics.jsonl.1").read_text())["x"] == 1.0
