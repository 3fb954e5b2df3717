"""The in-process half of the fault harness (``bench/faults``): loaded by ``site/sitecustomize.py``
in every Python process of a run that carries ``MGSPO_FAULT`` in its environment; standard
library only (it runs before anything else of the process).

* In the launcher (the first process with ``MGSPO_FAULT`` and no ``MGSPO_FAULT_LAUNCHER_PID``):
  records its own pid in the environment, so that every process below it (torchrun, the ranks)
  knows where ``sigterm`` goes.
* In a training rank (``RANK`` set): an import hook (a ``MetaPathFinder`` that wraps the found
  loader's ``exec_module``) patches the phase's function the moment its module is imported. The
  N-th entry into the phase on the fault's rank (the step it is called for, or the final export)
  starts a thread that waits ``MGSPO_FAULT_DELAY_S`` seconds, appends a JSON record to
  ``MGSPO_FAULT_LOG`` (``inside``: whether the phase was still running) and fires the fault; a
  rank that exits before the delay is over fires it as it exits (``at_exit``: true).

Nothing here runs where ``MGSPO_FAULT`` is unset (``sitecustomize`` checks it first).
"""

from __future__ import annotations

import atexit
import functools
import importlib.abc
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

FAULT_ENV = "MGSPO_FAULT"
"""``ACTION@PHASE[:STEP]``, e.g. ``sigterm@sync:2``; without ``:STEP`` the phase's first entry."""
DELAY_ENV = "MGSPO_FAULT_DELAY_S"
RANK_ENV = "MGSPO_FAULT_RANK"
"""The training rank whose phase entry fires the fault (default 0); ``kill-rank`` kills it."""
LOG_ENV = "MGSPO_FAULT_LOG"
LAUNCHER_ENV = "MGSPO_FAULT_LAUNCHER_PID"

ACTIONS = ("sigterm", "kill-server", "kill-router", "kill-rank")


def _arg(index: int, name: str):
    def get(args: tuple, kwargs: dict):
        return kwargs[name] if name in kwargs else args[index]
    return get


def _final_export(args: tuple, kwargs: dict):
    out = kwargs.get("out", args[3] if len(args) > 3 else None)
    return "final" if out is not None and Path(out).name == "hf" else None


PHASES = {
    # phase: (module, attribute patched there, the step of a call from its arguments)
    "rollout": ("pipeline.step.loop", "HeldBackRoutes.next_batch", _arg(2, "step")),  # rank 0
    "update": ("megatron_gspo.train.rl_trainer", "RLTrainer.train_rollout", _arg(2, "step")),
    "sync": ("pipeline.step.loop", "sync_weights", _arg(2, "version")),
    "eval": ("pipeline.step.loop", "evaluate", _arg(1, "step")),  # rank 0
    "save": ("megatron_gspo.train.checkpoint", "CheckpointedTrainer.save", _arg(2, "step")),
    "export": ("launch.rl_session", "export_hf_dir", _final_export),  # hf/, not init_hf/
}


def parse(spec: str) -> tuple[str, str, str | None]:
    """``"sigterm@sync:2"`` -> ``("sigterm", "sync", "2")``; ValueError naming what is wrong."""
    action, _, where = spec.partition("@")
    phase, _, step = where.partition(":")
    if action not in ACTIONS or phase not in PHASES:
        raise ValueError(f"{FAULT_ENV}={spec!r}: want ACTION@PHASE[:STEP], ACTION one of "
                         f"{', '.join(ACTIONS)}, PHASE one of {', '.join(PHASES)}")
    return action, phase, (step or None)


class _Trigger:
    def __init__(self, action: str, phase: str, step: str | None, delay_s: float):
        self.action, self.phase, self.step, self.delay_s = action, phase, step, delay_s
        self.armed = True
        self.running = 0
        self._once = threading.Lock()

    def wrap(self, fn, step_of):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            fires = False
            if self.armed:
                step = step_of(args, kwargs)
                fires = step is not None and (self.step is None or str(step) == self.step)
            if fires:
                self.armed = False
                self.running += 1
                threading.Thread(target=self._fire, args=(str(step),), daemon=True).start()
                atexit.register(self._fire, str(step), at_exit=True)
            try:
                return fn(*args, **kwargs)
            finally:
                if fires:
                    self.running -= 1
        return wrapper

    def _fire(self, step: str, at_exit: bool = False) -> None:
        """After the delay (on a thread), or at once if the process exits before it ends (then
        ``at_exit`` is recorded): whichever comes first fires the fault."""
        if not at_exit:
            time.sleep(self.delay_s)
        if not self._once.acquire(blocking=False):
            return
        record = dict(action=self.action, phase=self.phase, step=step, delay_s=self.delay_s,
                      rank=int(os.environ.get("RANK", "0")), pid=os.getpid(),
                      inside=self.running > 0, at_exit=at_exit, time=time.time())
        try:
            target, sig = _target(self.action)
            record["target"] = target
        except Exception as err:  # noqa: BLE001 - said in the record, the run goes on
            target, record["error"] = None, f"{type(err).__name__}: {err}"
        log = os.environ.get(LOG_ENV)
        if log:  # first: the fault may end this process before anything else happens here
            with open(log, "a") as f:
                f.write(json.dumps(record) + "\n")
        if target is not None:
            os.kill(target, sig)


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        for task in Path(f"/proc/{todo.pop()}/task").glob("*"):
            try:
                kids = [int(c) for c in (task / "children").read_text().split()]
            except (OSError, ValueError):
                continue
            out += kids
            todo += kids
    return out


def _child_with(*needles: bytes) -> int:
    """The first process below this one whose command line holds one of ``needles``."""
    for pid in _descendants(os.getpid()):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if any(needle in cmdline for needle in needles):
            return pid
    raise LookupError(f"no process below rank {os.environ.get('RANK')} runs "
                      f"{' or '.join(n.decode() for n in needles)}")


def _target(action: str) -> tuple[int, int]:
    """The pid ``action`` goes to and the signal it sends."""
    if action == "sigterm":
        return int(os.environ[LAUNCHER_ENV]), signal.SIGTERM
    if action == "kill-server":
        return _child_with(b"pipeline.local"), signal.SIGKILL
    if action == "kill-router":
        return _child_with(b"sglang_router", b"sglang::router"), signal.SIGKILL  # its title
    return os.getpid(), signal.SIGKILL  # kill-rank


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for the phase's module it asks the finders after it and wraps the
    loader's ``exec_module`` so that the phase's function is patched once the module ran."""

    def __init__(self, module: str, attribute: str, trigger: _Trigger, step_of):
        self.module, self.attribute, self.trigger, self.step_of = module, attribute, trigger, step_of

    def find_spec(self, name, path=None, target=None):
        if name != self.module:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            self._patch(module)
        spec.loader.exec_module = exec_module
        return spec

    def _patch(self, module) -> None:
        *owner_path, name = self.attribute.split(".")
        owner = module
        for part in owner_path:
            owner = getattr(owner, part)
        setattr(owner, name, self.trigger.wrap(getattr(owner, name), self.step_of))
        sys.meta_path.remove(self)


def install() -> None:
    """Called by ``sitecustomize`` where ``MGSPO_FAULT`` is set."""
    if LAUNCHER_ENV not in os.environ:  # the first process of the run: the launcher
        os.environ[LAUNCHER_ENV] = str(os.getpid())
        return
    if "RANK" not in os.environ or os.environ.get("RANK") != os.environ.get(RANK_ENV, "0"):
        return
    action, phase, step = parse(os.environ[FAULT_ENV])
    module, attribute, step_of = PHASES[phase]
    trigger = _Trigger(action, phase, step, float(os.environ.get(DELAY_ENV, "0")))
    sys.meta_path.insert(0, _PatchOnImport(module, attribute, trigger, step_of))
