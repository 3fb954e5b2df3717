"""External experiment trackers: Weights & Biases and MLflow, fed by ``pipeline.observe.metrics``.

``run.loggers`` lists them (with jsonl and tensorboard, which ``MetricsLogger`` writes itself);
``run.wandb`` and ``run.mlflow`` hold their settings; docs/metrics.md names every metric. Only
global rank 0 has trackers. The packages are optional (``pip install 'megatron-gspo[wandb]'``,
``[mlflow]``) and imported when a tracker opens; a missing one is a ``ConfigError`` naming
``run.loggers`` when the tracker is built. ``launch.preflight.check_trackers`` finds, before any
rank starts, what would make a tracker fail to open (exit 2, one line naming the field): the
package (and the extra to install), a tracker directory that cannot be written, W&B online
without an API key, an MLflow tracking server that does not answer.

Each step once, across restarts. W&B and MLflow cannot delete a logged point, and a run resumed
from the checkpoint of step N re-runs the steps after N that the interrupted run may have logged
already. So a step reaches the trackers only once no resumed run can redo it:
:meth:`TrackerSet.commit` (N), which the loops call right after each checkpoint of step N is
written (``MetricsLogger.commit``), and at the end of a run, sends every step <= N logged so far;
a step logged after the last checkpoint of a run that then dies is never sent by that run. The
price is a lag: W&B and MLflow show a step at the next checkpoint (``run.save_interval`` steps at
most; with save_interval 0, an RL run shows up at its end). metrics.jsonl and TensorBoard get
every step at once.

``<run_dir>/trackers.json`` holds, per tracker, its run id and ``sent_step``, the last step sent
(written after every commit). A resumed run (``open(N)``, N > 0) reopens the same W&B run
(``wandb.init(id=..., resume="allow")``) and MLflow run, first sends what metrics.jsonl holds up to
step N that ``sent_step`` says was not sent (a tracker added to run.loggers on resume gets the
whole history), and never sends a step <= ``sent_step`` again: if the newest checkpoint was
damaged and the run resumed from an older one, the tracker keeps the first values of the re-run
steps (metrics.jsonl has the new ones) and a note says so. A fresh start (N = 0) moves an earlier
trackers.json aside, as ``MetricsLogger`` does metrics.jsonl, and starts new tracker runs. The
resolved configuration is logged once, when a tracker run is created (W&B ``config``, MLflow
params and a ``config.yaml`` artifact). A process killed between sending a step and writing
trackers.json (milliseconds) would send that step again on resume.

Step axes: every ``<prefix>/...`` family (train, rollout, eval, sync, parity) gets its own W&B
step metric ``<prefix>/step`` (``define_metric``, as slime does), all counting the run's step (the
``step`` of metrics.jsonl), and W&B's own step is the run's step too; MLflow records the step with
each point.

A tracker never stops training. One that fails to send (a network error) is reported on stderr
the first time and tries again at each later commit; one that still fails to open (the checks
passed, then its server went away) is left out of the run; either way metrics.jsonl keeps every
step, and :meth:`TrackerSet.close` says at the end of the run what each failing tracker missed.
Only an input error when opening (a resumed run's MLflow run missing from the store) stops it.
MLflow's HTTP retries are bounded (:data:`HTTP_LIMITS`), so a dead tracking server costs seconds
per checkpoint, not minutes.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, ClassVar, Optional

from megatron_gspo.config import ConfigError, MLflowConfig, RunSettings, WandbConfig
from megatron_gspo.errors import InputError

STATE_FILE = "trackers.json"
HTTP_LIMITS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": "30"}
"""MLflow's client retries a request 7 times with exponential backoff (minutes) by default: a
tracking server that goes away would stall training at every checkpoint's send. Set where the
environment does not set them."""
PACKAGES = {"wandb": "wandb", "mlflow": "mlflow"}
"""logger name -> the module it imports (the mlflow extra installs mlflow-skinny: module mlflow)."""


def check_installed(loggers: list[str]) -> None:
    """A ConfigError naming run.loggers and the extra to install for the first listed tracker
    whose package is missing or does not import (a broken or partial install fails the same way
    when the tracker opens, after the ranks started)."""
    for name in loggers:
        module = PACKAGES.get(name)
        if module is None:
            continue
        fix = f"pip install 'megatron-gspo[{name}]'"
        if importlib.util.find_spec(module) is None:
            raise ConfigError(f"run.loggers: {name!r} needs the {module} package: {fix}")
        try:
            importlib.import_module(module)
        except Exception as err:  # noqa: BLE001 - any failure to import is the same input error
            raise ConfigError(f"run.loggers: {name!r} needs the {module} package, which does not "
                              f"import here ({type(err).__name__}: {err}): {fix}") from None


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The numbers of a metrics.jsonl record as floats, "step" left out; the non-finite values
    the file writes as strings ("nan", "inf", "-inf") become floats again."""
    out = {}
    for key, value in record.items():
        if key == "step":
            continue
        if isinstance(value, str) and value in ("nan", "inf", "-inf"):
            value = float(value)
        if isinstance(value, (int, float)):
            out[key] = float(value)
    return out


def _flat(tree: dict, prefix: str = "") -> dict[str, str]:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = str(value)
    return out


class Tracker:
    """One external tracker: ``open`` a run (new or by id), ``log`` steps in order, ``close``."""

    name: ClassVar[str]

    def open(self, run_id: Optional[str], config: Optional[dict]) -> str:
        """Start a new run (``run_id`` None, then log ``config``) or reopen ``run_id``; returns
        the run's id."""
        raise NotImplementedError

    def log(self, step: int, metrics: dict[str, float]) -> None:
        raise NotImplementedError

    def close(self, finished: bool) -> None:
        """End the run: ``finished`` False marks it failed (steps were left unsent)."""
        raise NotImplementedError


class WandbTracker(Tracker):
    name = "wandb"

    def __init__(self, settings: WandbConfig, run_dir: Path):
        check_installed([self.name])
        self.run_dir = run_dir
        self.project = settings.project or os.environ.get("WANDB_PROJECT") or "megatron-gspo"
        self.entity = settings.entity
        # an explicit mode wins; else wandb reads WANDB_MODE itself; else offline
        self.mode = settings.mode or (None if os.environ.get("WANDB_MODE") else "offline")
        self.dir = Path(settings.dir or os.environ.get("WANDB_DIR") or run_dir)
        self._run: Any = None
        self._axes: set[str] = set()

    def open(self, run_id: Optional[str], config: Optional[dict]) -> str:
        import wandb

        self.dir.mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(project=self.project, entity=self.entity, name=self.run_dir.name,
                               dir=str(self.dir), mode=self.mode, id=run_id,
                               resume="allow" if run_id else None, config=config)
        return self._run.id

    def log(self, step: int, metrics: dict[str, float]) -> None:
        row = dict(metrics)
        for axis in sorted({key.split("/", 1)[0] for key in metrics if "/" in key}):
            if axis not in self._axes:
                self._run.define_metric(f"{axis}/step")
                self._run.define_metric(f"{axis}/*", step_metric=f"{axis}/step")
                self._axes.add(axis)
            row[f"{axis}/step"] = step
        self._run.log(row, step=step)

    def close(self, finished: bool) -> None:
        self._run.finish(exit_code=0 if finished else 1)


class MLflowTracker(Tracker):
    name = "mlflow"

    def __init__(self, settings: MLflowConfig, run_dir: Path):
        check_installed([self.name])
        self.run_dir = run_dir
        self.tracking_uri = (settings.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
                             or (run_dir / "mlruns").resolve().as_uri())
        self.experiment = (settings.experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME")
                           or "megatron-gspo")
        self._client: Any = None
        self._run_id = ""

    def open(self, run_id: Optional[str], config: Optional[dict]) -> str:
        if "://" not in self.tracking_uri or self.tracking_uri.startswith("file:"):
            # MLflow 3 refuses its file store (in maintenance) unless asked for; it is the one
            # store that needs no server or database, hence the offline default
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        for name, value in HTTP_LIMITS.items():  # the environment's own values win
            os.environ.setdefault(name, value)
        from mlflow import MlflowClient
        from mlflow.entities import Param
        from mlflow.exceptions import MlflowException

        client = self._client = MlflowClient(self.tracking_uri)
        if run_id is None:
            experiment = client.get_experiment_by_name(self.experiment)
            experiment_id = (experiment.experiment_id if experiment is not None
                             else client.create_experiment(self.experiment))
            run_id = client.create_run(experiment_id, run_name=self.run_dir.name).info.run_id
        else:
            try:
                client.get_run(run_id)
            except MlflowException:
                raise ConfigError(
                    f"run.mlflow: run {run_id} (from {self.run_dir / STATE_FILE}) is not in the "
                    f"tracking store {self.tracking_uri}; set run.mlflow.tracking_uri to the store "
                    "the run started in, or delete its entry from that file to start a new "
                    "MLflow run") from None
            client.update_run(run_id, status="RUNNING")
        self._run_id = run_id
        if config is not None:
            params = [Param(k, v) for k, v in _flat(config).items()]
            for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
                client.log_batch(run_id, params=params[i:i + 100])
            client.log_dict(run_id, config, "config.yaml")
        return run_id

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        points = [Metric(key, value, now, step) for key, value in metrics.items()]
        for i in range(0, len(points), 1000):  # MLflow's limit per batch
            self._client.log_batch(self._run_id, metrics=points[i:i + 1000])

    def close(self, finished: bool) -> None:
        self._client.set_terminated(self._run_id, status="FINISHED" if finished else "FAILED")


def build_trackers(run: RunSettings, run_dir: str | Path) -> list[Tracker]:
    """The trackers ``run.loggers`` lists, with their settings (nothing is opened yet)."""
    run_dir = Path(run_dir)
    trackers: list[Tracker] = []
    if "wandb" in run.loggers:
        trackers.append(WandbTracker(run.wandb, run_dir))
    if "mlflow" in run.loggers:
        trackers.append(MLflowTracker(run.mlflow, run_dir))
    return trackers


def move_aside(path: Path) -> None:
    """Rename ``path`` to ``<path>.<k>`` with the first free k = 1, 2, ..."""
    k = 1
    while path.with_name(f"{path.name}.{k}").exists():
        k += 1
    os.replace(path, path.with_name(f"{path.name}.{k}"))


class TrackerSet:
    """The trackers of one run, the steps logged but not yet sent, and ``trackers.json``."""

    def __init__(self, trackers: list[Tracker], run_dir: str | Path, *,
                 config: Optional[dict] = None, stream=None):
        self.trackers = trackers
        self.path = Path(run_dir) / STATE_FILE
        self.config = config
        self.stream = stream
        """Where notes and send failures are printed; None: stderr."""
        self.sent: dict[str, int] = {}
        """tracker name -> the last step it was sent (-1: none yet)."""
        self._state: dict[str, dict] = {}
        """trackers.json: per tracker name its run_id and sent_step (entries of trackers this run
        does not have are kept, for a later run that lists them again)."""
        self._pending: dict[int, dict[str, float]] = {}
        self.failures: dict[str, list[str]] = {}
        """tracker name -> what failed (``"opening failed (...)"``, ``"sending step N failed
        (...)"``), in order; the first is printed at once, the summary at :meth:`close`."""
        self.dropped: set[str] = set()
        """Trackers that failed to open: left out of the rest of the run."""

    def open(self, resume_step: Optional[int], records: list[dict]) -> None:
        """``resume_step`` 0: a fresh start (new tracker runs); N > 0: the run continues after
        step N (``records``: what metrics.jsonl holds, every step <= N, sent where not yet);
        None: reopen the runs trackers.json names, if any, without sending anything."""
        if resume_step == 0 and self.path.exists():
            move_aside(self.path)
        self._state = json.loads(self.path.read_text()) if self.path.exists() else {}
        for tracker in list(self.trackers):
            entry = self._state.setdefault(tracker.name, {})
            run_id = entry.get("run_id")
            try:
                entry["run_id"] = tracker.open(run_id, None if run_id else self.config)
            except InputError:
                raise  # a setting to fix (e.g. a resumed run's MLflow run not in this store)
            except Exception as err:  # noqa: BLE001 - the run goes on; metrics.jsonl has it all
                self._failed(tracker.name, f"opening failed ({type(err).__name__}: {err})",
                             "it is left out of this run")
                self.trackers.remove(tracker)
                self.dropped.add(tracker.name)
                if not entry:
                    del self._state[tracker.name]
                continue
            self.sent[tracker.name] = int(entry.get("sent_step", -1))
            if resume_step and self.sent[tracker.name] > resume_step:
                self._note(f"{tracker.name} already holds steps {resume_step + 1}.."
                           f"{self.sent[tracker.name]} of an earlier run (resumed from an older "
                           "checkpoint); it keeps those values, metrics.jsonl has the new ones")
        for record in records:
            self.add(int(record["step"]), record)
        self._save()
        if resume_step:
            self.commit(resume_step)

    def add(self, step: int, record: dict) -> None:
        """A logged record (merged into an earlier one of the same step), sent at its commit."""
        self._pending.setdefault(step, {}).update(scalars(record))

    def commit(self, step: int) -> None:
        """No resumed run can redo the steps <= ``step``: send them, in order, to every tracker
        that has not had them, then record that in trackers.json."""
        due = sorted(s for s in self._pending if s <= step)
        for tracker in self.trackers:
            for s in [s for s in due if s > self.sent[tracker.name]]:
                try:
                    tracker.log(s, self._pending[s])
                except Exception as err:  # noqa: BLE001 - reported; retried at the next commit
                    self._failed(tracker.name, f"sending step {s} failed ({type(err).__name__}: "
                                 f"{err})", "it is sent again at the next checkpoint")
                    break
                self.sent[tracker.name] = s
        for s in due:
            if all(self.sent[t.name] >= s for t in self.trackers):
                del self._pending[s]
        self._save()

    def _save(self) -> None:
        for name, step in self.sent.items():
            self._state[name]["sent_step"] = step
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self._state, indent=1) + "\n")
        os.replace(tmp, self.path)

    def close(self) -> None:
        """End every tracker's run; steps still unsent to it (the run did not end at a
        checkpoint, or it failed to send them) are left to metrics.jsonl and mark its run failed.
        A tracker that failed during the run is summed up here, at the end of the run."""
        for tracker in self.trackers:
            unsent = any(s > self.sent[tracker.name] for s in self._pending)
            try:
                tracker.close(finished=not unsent)  # another tracker's failure is not its own
            except Exception as err:  # noqa: BLE001 - closing must not hide the run's own error
                self._failed(tracker.name, f"closing failed ({type(err).__name__}: {err})", "")
        for name, what in self.failures.items():
            if name in self.dropped:
                outcome = "it got nothing from this run"
            elif name in self.sent:
                unsent = sorted(s for s in self._pending if s > self.sent[name])
                outcome = (f"steps {unsent[0]}..{unsent[-1]} were not sent to it (a resumed run "
                           "sends them)" if unsent else "every step was sent in the end")
            else:
                outcome = ""
            self._note(f"{name} failed {len(what)} time(s) during the run (first: {what[0]}); "
                       f"{outcome + '; ' if outcome else ''}metrics.jsonl holds every step")

    def _failed(self, name: str, what: str, then: str) -> None:
        """Record a tracker's failure; print the first one of each tracker at once (once)."""
        seen = self.failures.setdefault(name, [])
        seen.append(what)
        if len(seen) == 1:
            tail = (f"; {then}; training goes on and metrics.jsonl keeps every step (further "
                    "failures of it are summed up at the end of the run)" if then else "")
            self._note(f"{name}: {what}{tail}")

    def _note(self, text: str) -> None:
        print(f"metrics: {text}", file=self.stream or sys.stderr, flush=True)
