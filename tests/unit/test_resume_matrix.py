"""The resume matrix: a checkpoint written under each ``rollout.async`` mode, resumed under each
mode (``pipeline.sources.base.RESUMES``). Each of the 9 cells either resumes exactly - every prompt
the sampler drew is trained once or still held by the source's final state, none twice, none lost
(and the saved one_step batch is trained bit for bit) - or is refused before any rank starts
(``launch.preflight.check_rollout_resume`` reads ``run_state.json``) and by the source's
``restore`` alike, in one line naming both modes.

The real loop (``pipeline.step.loop.run``) and the real sources, with the stand-in trainer, pusher
and client of tests/reliability/loop_fakes.py on a world of one. Run A (4 steps, saves at step
2) dies when it trains step 3 (the kill after a checkpoint); run B resumes from step 2's state.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from launch.preflight import check_rollout_resume
from megatron_gspo.config import ConfigError, config_from_dict
from megatron_gspo.train.checkpoint.run_state import read_run_state, write_run_state
from pipeline.scoring.data import PromptSampler
from pipeline.scoring.tasks import PAD_ID, decode
from pipeline.sources.base import BUFFER_KEY, STREAM_KEY, RESUMES, saved_mode
from pipeline.sources.choice import make_source
from pipeline.step import loop
from tests.reliability.loop_fakes import Crash, init_world_of_one, loop_context

MODES = ("off", "one_step", "full")
STEPS, SAVED_AT, GROUP = 4, 2, 4


@pytest.fixture(scope="module", autouse=True)
def world_of_one():
    made = init_world_of_one()
    yield
    if made:
        dist.destroy_process_group()


class Trainer:
    """Records each step's prompts (one per group) and batch; saves the run state as
    ``run_state.json`` holds it; dies when asked to train ``crash_at``."""

    def __init__(self, crash_at=None):
        self.crash_at = crash_at
        self.prompts: dict[int, list[str]] = {}
        self.batches: dict[int, dict] = {}
        self.states: dict[int, dict] = {}

    def train_rollout(self, batch, step):
        self.batches[step] = {k: v.clone() for k, v in batch.items()}
        if step == self.crash_at:
            raise Crash(f"killed at step {step}")
        self.prompts[step] = [_prompt_of(row) for row in batch["tokens"][::GROUP].tolist()]
        return {"clip_frac": 0.0}

    def hf_buckets(self):
        return []

    def save(self, run_dir, step, run_state):
        self.states[step] = _as_a_checkpoint_holds(step, run_state)


def _as_a_checkpoint_holds(step: int, run_state: dict) -> dict:
    """``run_state`` written and read back as a checkpoint's (run_state.json and its tensors in
    run_state.safetensors: megatron_gspo.train.checkpoint.run_state), without the step."""
    with tempfile.TemporaryDirectory() as tmp:
        write_run_state(Path(tmp), step, run_state)
        back = read_run_state(Path(tmp), {"files": {p.name: {} for p in Path(tmp).iterdir()}},
                              tensors=True)
    back.pop("step")
    return back


def _prompt_of(row: list[int]) -> str:
    text = decode([t for t in row if t != PAD_ID])
    return text[:text.index("=") + 1]


def _context(tmp_path, mode: str):
    ctx = loop_context(tmp_path, steps=STEPS, save_interval=SAVED_AT)
    ctx.cfg = config_from_dict({
        "gspo": {"group_size": GROUP}, "rollout": {"async": mode, "max_staleness": 1},
        "run": {"num_steps": STEPS, "global_batch_size": 8, "micro_batch_size": 4,
                "seq_length": 16, "eval_interval": 0, "save_interval": SAVED_AT}})
    return ctx


def _saved_run(tmp_path, mode: str) -> tuple[dict, Trainer]:
    """Run A under ``mode``: the run state of step 2's checkpoint, and A's trainer."""
    ctx = _context(tmp_path / f"a_{mode}", mode)
    trainer = Trainer(crash_at=SAVED_AT + 1)
    try:
        with pytest.raises(Crash):
            loop.run(ctx, trainer, start_step=0)
    finally:
        ctx.logger.close()
    return trainer.states[SAVED_AT], trainer


def _held(state: dict) -> list[str]:
    """Prompts a final run state holds untrained (the stream's groups; a one_step batch)."""
    held = []
    stream = state.get(STREAM_KEY) or {}
    for kind in ("complete", "partial", "pending"):
        held += [decode(item["prompt"]["prompt_ids"]) for item in stream.get(kind, [])]
    assert state.get(BUFFER_KEY) is None  # the last step starts no next rollout
    return held


@pytest.mark.parametrize("resumed", MODES)
@pytest.mark.parametrize("saved", MODES)
def test_each_cell_resumes_exactly_or_is_refused_before_the_ranks_start(tmp_path, saved, resumed):
    state, first = _saved_run(tmp_path, saved)
    assert saved_mode(state) == (None if saved == "off" else saved)
    ctx = _context(tmp_path / "b", resumed)
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    write_run_state(checkpoint, SAVED_AT, state)

    if resumed not in RESUMES[saved_mode(state)]:
        for refuse in (lambda: check_rollout_resume(ctx.cfg, checkpoint),
                       lambda: make_source(ctx, SAVED_AT).restore(state)):
            with pytest.raises(ConfigError) as refused:
                refuse()
            line = str(refused.value)
            assert "\n" not in line
            assert f"rollout.async: {resumed}:" in line
            assert f"written by a rollout.async: {saved} run" in line
        assert (saved, resumed) in {("one_step", "full"), ("full", "off"), ("full", "one_step")}
        ctx.logger.close()
        return

    check_rollout_resume(ctx.cfg, checkpoint)  # the launcher lets it start
    ctx.sampler.load_state_dict(state["sampler"])
    drawn_before = state["sampler"]["index"]
    source = make_source(ctx, SAVED_AT)
    source.restore(state)
    second = Trainer()
    try:
        assert loop.run(ctx, second, start_step=SAVED_AT, source=source)["status"] == "finished"
    finally:
        ctx.logger.close()

    trained = [p for step in range(1, SAVED_AT + 1) for p in first.prompts[step]]
    trained += [p for step in range(SAVED_AT + 1, STEPS + 1) for p in second.prompts[step]]
    final = second.states[STEPS]
    order = PromptSampler(ctx.sampler.dataset, seed=0).next_batch(final["sampler"]["index"])
    drawn = [decode(p.prompt_ids) for p in order]
    assert len(set(drawn)) == len(drawn)  # the prompts tell the samples apart
    assert len(set(trained)) == len(trained), "a prompt trained twice"
    assert sorted(trained + _held(final)) == sorted(drawn), "a prompt lost"
    assert final["sampler"]["index"] >= drawn_before
    if saved == "one_step":  # the saved batch of step 3 is trained bit for bit
        for key, value in first.batches[SAVED_AT + 1].items():
            assert torch.equal(second.batches[SAVED_AT + 1][key], value), key


def test_the_matrix_has_three_refusals_and_they_name_what_to_resume_with():
    refused = {(saved, resumed) for saved in (None, "one_step", "full") for resumed in MODES
               if resumed not in RESUMES[saved]}
    assert refused == {("one_step", "full"), ("full", "off"), ("full", "one_step")}
