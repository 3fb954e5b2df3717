"""Training checkpoints: model and optimizer (Megatron dist_checkpointing, torch_dist), RNG states,
and the run's own state (the step and the data position), saved atomically and verified on
resume.

Layout of ``<run_dir>/checkpoints``::

    step_000012/            one checkpoint (a torch_dist directory written by every rank)
        model_optim/        dist_checkpointing: model + optimizer, layout-independent
        rank_00003.pt       this rank's RNG states (plain tensors and numbers: weights_only)
        scheduler.json      the LR schedule's state (Megatron's OptimizerParamScheduler), rank 0
        run_state.json      the step and what the caller saves of rank 0's data: the sampler's
                            position (RL: also the next step's batch or the stream's groups)
        run_state.safetensors  the tensors of that run state (the next batch, its routing
                            replay tensor), run_state.json holding placeholders (``run_state``)
        manifest.json       size and sha256 of every other file, the stack that wrote it
                            (megatron-core, torch, Python), the parallel layout, the model
                            config and the optimizer (plain / distributed) it was written
                            under; written last (rank 0)
    latest                  text file: the name of the newest complete checkpoint

A checkpoint is written into ``step_N.tmp``; once every rank has written its part, the ranks
checksum the files (each rank those it wrote itself, still in its page cache:
``manifest._my_share``), rank 0 writes ``manifest.json`` and renames the directory, then replaces
``latest`` atomically. A rank killed mid-save leaves a ``.tmp`` directory
that resume ignores (and the next save removes). Model and optimizer shards use Megatron's
``sharded_state_dict``, so a checkpoint written under one parallel layout loads under another.

**Resume** (:func:`latest_checkpoint`) takes the newest checkpoint whose every file matches its
manifest (:func:`verify_checkpoint`: sizes, then sha256); a newer one that does not is reported
with the file that is wrong, and the next older one is used. A directory without a manifest is
a partial save and never used. When no checkpoint is intact, :class:`CheckpointError` lists what
is wrong with each. Loading (:func:`load_checkpoint`) under the layout that wrote the checkpoint
needs this rank's RNG file: without it the resumed run would not draw the same random numbers (an
error, never skipped silently).

**Resume under another parallel layout.** The manifest records the layout (tensor, pipeline,
expert, expert_tensor, context, data, world size; ``records.layout_of``) and the model config. A
checkpoint resumes under another layout: dist_checkpointing stores global tensors, so the model
and the Adam moments reshard, the step count and the LR schedule are layout-free. Megatron's own
optimizer state dict is not: its nesting follows the layout (one sub-optimizer per expert-parallel
group, ``chained_<i>.`` key prefixes, per-sub-optimizer param groups), so loading it under another
layout fails with a ``KeyError``; :func:`load_checkpoint` then builds this layout's optimizer
state dict, maps every tensor to the key the checkpoint stored it under, and takes the step count
and the param groups' settings from the checkpoint (``load._load_resharded``). Per-rank RNG states
do not map to another world: they start fresh (the seeded initialisation of this run), said in
one line. Nothing the training computes draws from them: dropout is 0, every sampling order comes
from a generator seeded by (run.seed, step or epoch), the data position is in ``run_state.json``.
The distributed optimizer's state is the exception: Megatron's ``dp_reshardable`` format
(``state.DISTRIBUTED_OPTIMIZER_SHARDING`` says why that one) follows its buffers, so such a
checkpoint resumes only under the layout that wrote it, and neither optimizer's checkpoint loads
into the other (``records.optimizer_refusal``: the kind refused before the ranks start, the
layout when they load). Under the layout that wrote it a checkpoint loads exactly as before
(Megatron's state dict, RNG restored, a missing RNG file an error). A changed MODEL cannot resume (``records.model_changes``:
any field that changes the parameters' shapes or meaning; the launcher refuses it before the
ranks start, launch/preflight.py).

**What the manifest protects against, and what not.** The manifest catches damage: a truncated
or partly written file, a flipped byte, a missing or extra file, a partial save. It is no
signature: whoever can write the checkpoint can rewrite a file *and* its manifest entry, and
such a checkpoint passes verification. Loading therefore never runs code from it: Megatron's
reader unpickles ``model_optim/.metadata`` and the ``.distcp`` byte items without restriction,
so :func:`load_checkpoint` first vets them (:func:`megatron_gspo.dcp_metadata.check_torch_dist`:
``.metadata`` with an unpickler that resolves only the classes torch's checkpoint metadata is
made of, byte items and ``common.pt`` with torch's ``weights_only`` loader; tensors and the
RNG files are read ``weights_only`` anyway) and refuses a pickle that names anything else with
a :class:`CheckpointError` naming the file, before Megatron reads it. Tampered *values*
(weights, optimizer state, ``run_state.json``) are not detected; resume only from checkpoints
whose directory you trust as you trust your code.

**Disk.** Before writing, rank 0 compares the free space of the checkpoint filesystem with the
bytes this save writes (the main replicas of every rank's shards); too little, or a write that
fails with ENOSPC, is a :class:`CheckpointDiskFull` naming the path, the space needed and the
space free, raised on every rank alike. ``keep`` (``run.keep_checkpoints``) deletes all but the
newest ``keep`` checkpoints after each save, never one in ``protect`` (the one this run resumed
from).

The package: ``manifest`` (manifests, verification, the newest intact checkpoint),
``run_state`` (``run_state.json`` and its tensors), ``state``
(the sharded model / optimizer state, the RNG states), ``records`` (the layout and model records,
the resume refusal), ``save`` (the writer, disk-full handling, rotation) and ``load`` (the
resharded load); the cross-rank collectives are ``megatron_gspo.collectives``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from megatron_gspo.train.checkpoint.load import load_checkpoint
from megatron_gspo.train.checkpoint.manifest import (MANIFEST, MANIFEST_FORMAT, CheckpointError,
                                                     checkpoint_root, latest_checkpoint,
                                                     verify_checkpoint, writer_rank)
from megatron_gspo.train.checkpoint.records import (model_changes, model_record,
                                                    optimizer_refusal, resume_candidate,
                                                    resume_refusal)
from megatron_gspo.train.checkpoint.save import CheckpointDiskFull, save_checkpoint
from megatron_gspo.train.train_step import gather_params

__all__ = ["MANIFEST", "MANIFEST_FORMAT", "CheckpointDiskFull", "CheckpointError",
           "CheckpointedTrainer", "checkpoint_root", "latest_checkpoint", "load_checkpoint",
           "model_changes", "model_record", "optimizer_refusal", "resume_candidate",
           "resume_refusal",
           "save_checkpoint", "verify_checkpoint", "writer_rank"]


class CheckpointedTrainer:
    """``save`` / ``load`` for a trainer with a ``TrainState`` (``self.state``) and a config
    (``self.cfg``): model, optimizer, LR schedule, RNG and the caller's run state. Shared by the RL
    and SFT trainers; ``resumed_from`` remembers the checkpoint a run resumed from, which
    ``run.keep_checkpoints`` rotation must never delete."""

    resumed_from: Optional[Path] = None

    def current_policy(self):
        """Collective: this rank's policy chunk with every parameter as the last optimizer step
        left it. Every reader of the weights outside a forward pass takes the model from here
        (the weight sync's ``hf_buckets``, :meth:`save`, the HF export): with
        ``parallel.overlap_param_gather`` the parameter shards of other data-parallel ranks
        are otherwise one step behind until the next forward
        (``megatron_gspo.train.train_step.gather_params``)."""
        gather_params(self.state)
        return self.gpt

    def save(self, run_dir: str | Path, step: int, run_state: dict) -> Path:
        """Collective: checkpoint after ``step``."""
        self.current_policy()
        return save_checkpoint(run_dir, step, self.state.model, self.state.optimizer, run_state,
                               scheduler=self.state.scheduler, keep=self.cfg.run.keep_checkpoints,
                               protect=[self.resumed_from] if self.resumed_from else [],
                               model_config=self.cfg.model)

    def load(self, path: str | Path) -> dict:
        """Collective: restore a checkpoint written by :meth:`save`; returns its run state."""
        run_state = load_checkpoint(path, self.state.model, self.state.optimizer,
                                    scheduler=self.state.scheduler, model_config=self.cfg.model)
        self.resumed_from = Path(path)
        return run_state
