"""Where a step's batch comes from: the :class:`BatchSource` seam, and the resume matrix.

``rollout.async`` picks one source for the whole run (``pipeline.sources.choice.make_source``,
called once where the session is built); the step (``pipeline.step.loop.run``) only talks to
this protocol:

=========  ============================  ===========================  ======================
mode       ``next(step)``                ``before_weights_change()``  ``weights_changed(v)``
=========  ============================  ===========================  ======================
off        rollout now                   {}                           -
one_step   take n (made during n-1),     wait for n+1's rollout       -
           start n+1's rollout
full       take the stream's P oldest    {}                           admit more groups
           complete groups
=========  ============================  ===========================  ======================

**The resume matrix.** A checkpoint's run state holds the sampler's position and, depending on
the mode that wrote it, that mode's own state: ``one_step`` the next step's finished batch
(:data:`BUFFER_KEY`; none when the run saved without one), ``full`` the stream's groups
(:data:`STREAM_KEY`). :func:`resume_refusal` decides each (saved mode x resumed mode) cell, for
the launcher before the ranks start (``launch.preflight.check_resume``) and for each source's
``restore`` alike:

==================  ======  ============================  ======
saved \\ resumed     off     one_step                      full
==================  ======  ============================  ======
sampler only        yes     yes                           yes
one_step batch      yes*    yes                           no
full stream         no      no                            yes
==================  ======  ============================  ======

``*`` the first step trains the saved batch (its prompts are drawn already). ``one_step`` ->
``full`` is refused: the stream would never train the saved batch (its prompts are past the
sampler), and a batch one version stale may break ``rollout.max_staleness: 0``. ``full`` ->
another mode is refused: its complete, partial and queued groups would be lost. Every refusal is
one line naming both modes and what to resume with.

This module imports no torch: the launcher reads it before any rank starts.
"""

from __future__ import annotations

from typing import Optional, Protocol

from megatron_gspo.config import ConfigError

BUFFER_KEY = "rollout_buffer"
"""rank 0's run-state key of the finished batch of the next step (``rollout.async: one_step``)."""

STREAM_KEY = "rollout_stream"
"""rank 0's run-state key of the stream (``rollout.async: full``)."""


class BatchSource(Protocol):
    """Rank 0's batches, one per step. Every rank holds one (so that every rank can name its
    methods in ``on_main``), but only rank 0 calls them; constructing one touches nothing."""

    mode: str
    """The ``rollout.async`` value it serves."""

    def restore(self, saved: dict) -> None:
        """Rank 0, before :meth:`start`: a checkpoint's run state (``{}``: a fresh start);
        consumes its own part exactly, or raises :class:`ResumeRefused`."""

    def start(self) -> None:
        """Rank 0, after the first weight sync: begin generating, where the mode does."""

    def next(self, step: int) -> tuple[dict, dict]:
        """Rank 0: step ``step``'s (batch, rollout metrics)."""

    def before_weights_change(self) -> dict:
        """Rank 0, after the update, before the weight sync: what must end before the servers'
        weights change; returns its ``train/`` metrics ({} for most modes)."""

    def weights_changed(self, version: int) -> None:
        """Rank 0: the servers now hold the weights after step ``version``."""

    def state(self) -> dict:
        """Rank 0: the run state a checkpoint of the last finished step holds (the sampler's
        position and the mode's own part). Cheap to take: a batch stays tensors here, and the
        checkpoint writes them as they are (``run_state.safetensors``)."""

    def busy_s(self) -> float:
        """Rank 0: seconds the servers spent on this source's rollouts so far (monotone)."""

    def close(self) -> None:
        """Stop what runs (any rank; a no-op where nothing started)."""


class ResumeRefused(ConfigError):
    """A checkpoint's run state that the mode resumed with cannot consume exactly."""


def saved_mode(run_state: dict) -> Optional[str]:
    """The mode whose own state ``run_state`` holds: ``"full"``, ``"one_step"`` or None (the
    sampler's position alone: written by ``off``, or by ``one_step`` without a finished batch)."""
    if run_state.get(STREAM_KEY) is not None:
        return "full"
    if run_state.get(BUFFER_KEY) is not None:
        return "one_step"
    return None


RESUMES: dict[Optional[str], tuple[str, ...]] = {
    None: ("off", "one_step", "full"),
    "one_step": ("off", "one_step"),
    "full": ("full",),
}
"""The resume matrix: saved mode (:func:`saved_mode`) -> the modes that consume it exactly."""


def resume_refusal(run_state: dict, mode: str) -> Optional[str]:
    """One line refusing to resume ``run_state`` under ``rollout.async: mode`` (naming both
    modes), or None when ``mode`` consumes it exactly (:data:`RESUMES`)."""
    saved = saved_mode(run_state)
    if mode in RESUMES[saved]:
        return None
    if saved == "full":
        state = run_state[STREAM_KEY]
        return (f"rollout.async: {mode}: the checkpoint was written by a rollout.async: full run "
                f"and holds {len(state['complete'])} complete groups, "
                f"{len(state.get('partial', []))} groups stopped in flight and "
                f"{len(state['pending'])} prompts queued, which another mode would not train; "
                "resume it with rollout.async: full")
    buffer = run_state[BUFFER_KEY]
    return (f"rollout.async: {mode}: the checkpoint was written by a rollout.async: one_step run "
            f"and holds the finished batch of step {buffer['step']}, which the stream would not "
            "train; resume it with rollout.async: one_step or off (off trains it, and its next "
            "checkpoint resumes with full)")


def check_resume(run_state: dict, mode: str) -> None:
    """:class:`ResumeRefused` with :func:`resume_refusal`'s line, if any."""
    refusal = resume_refusal(run_state, mode)
    if refusal is not None:
        raise ResumeRefused(refusal)
