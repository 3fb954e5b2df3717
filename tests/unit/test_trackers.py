"""run.loggers: W&B (offline) and MLflow (file store) get each step once, equal to metrics.jsonl.

The acceptance check: ``run.loggers: [jsonl, tensorboard, wandb, mlflow]``, offline, a run that
checkpoints at step 3, logs steps 4 and 5 and dies, then resumes from step 3 with other values:
one W&B run and one MLflow run whose histories equal metrics.jsonl step for step, no step twice,
the configuration logged once, W&B's step axes defined. The W&B offline files are read back with
wandb's own reader (``wandb leet inspect --json``), MLflow with ``MlflowClient``. No network:
W&B offline, MLflow's file store, everything under tmp_path.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch.distributed as dist

from launch import preflight
from megatron_gspo.config import ConfigError, config_from_dict, dump_config, load_config
from pipeline.step import loop
from pipeline.observe import trackers
from pipeline.observe.metrics import MetricsLogger, read_metrics
from pipeline.observe.trackers import MLflowTracker, Tracker, scalars
from pipeline.servers.cluster import free_port
from tests.reliability.test_preflight import assert_one_message, no_ranks, run  # noqa: F401

CONFIGS = Path(__file__).resolve().parents[2] / "launch" / "configs"
ALL = "run.loggers=[jsonl,tensorboard,wandb,mlflow]"


@pytest.fixture(autouse=True)
def offline(tmp_path, monkeypatch):
    """W&B offline and quiet, its own files under tmp_path; MLflow's defaults (a file store in
    the run directory); no tracker setting from the environment."""
    for name in ("WANDB_DIR", "WANDB_PROJECT", "WANDB_ENTITY", "WANDB_RUN_ID", "WANDB_RESUME",
                 "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_ALLOW_FILE_STORE"):
        monkeypatch.setenv(name, "")  # then deleted: undone after the test, also if code sets it
        monkeypatch.delenv(name)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb_home"))


def _cfg(run_dir: Path, *overrides: str):
    return config_from_dict({}, [f"run.output_dir={run_dir}", *overrides])


def wandb_segments(run_dir: Path) -> list[list[dict]]:
    """The records of each W&B offline run directory under run_dir/wandb (one per process that
    opened the run), in start order, as wandb's own reader prints them."""
    segments = []
    for path in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(path)],
                             capture_output=True, text=True, timeout=120, check=True).stdout
        segments.append([json.loads(line) for line in out.splitlines() if line.strip()])
    return sorted(segments, key=lambda records: next(r["run"]["start_time"] for r in records
                                                     if r["type"] == "run"))


def wandb_history(segments: list[list[dict]]) -> list[dict]:
    return [r["history"]["item"] for records in segments for r in records if r["type"] == "history"]


def expected(run_dir: Path) -> dict[int, dict[str, float]]:
    """metrics.jsonl as the trackers must hold it: step -> its numbers."""
    return {r["step"]: scalars(r) for r in read_metrics(run_dir)}


def mlflow_history(run_dir: Path, run_id: str) -> dict[int, dict[str, float]]:
    from mlflow import MlflowClient

    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"  # MLflow 3 opens a file store only when asked
    client = MlflowClient((run_dir / "mlruns").resolve().as_uri())
    out: dict[int, dict[str, float]] = {}
    for key in client.get_run(run_id).data.metrics:
        points = client.get_metric_history(run_id, key)
        steps = [p.step for p in points]
        assert len(steps) == len(set(steps)), f"{key}: a step twice in MLflow: {steps}"
        for p in points:
            out.setdefault(p.step, {})[key] = p.value
    return out


def assert_wandb_matches(run_dir: Path, segments: list[list[dict]]) -> None:
    history = wandb_history(segments)
    steps = [row["_step"] for row in history]
    assert steps == sorted(set(steps)), f"W&B history steps {steps}: out of order or twice"
    got = {row["_step"]: {k: v for k, v in row.items()
                          if not k.startswith("_") and not k.endswith("/step")} for row in history}
    assert got == expected(run_dir)
    for row in history:  # each family's own step axis holds the run's step
        for key in row:
            if "/" in key:
                assert row[f"{key.split('/')[0]}/step"] == row["_step"]


def test_wandb_and_mlflow_equal_metrics_jsonl_across_a_crash_and_resume(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    cfg = _cfg(run_dir, ALL)
    configs: list[bool] = []  # MLflow: whether each open logged the configuration
    real_open = MLflowTracker.open

    def spied_open(self, run_id, config):
        configs.append(config is not None)
        return real_open(self, run_id, config)

    monkeypatch.setattr(MLflowTracker, "open", spied_open)

    first = MetricsLogger.from_config(cfg, run_dir)
    first.resume_at(0)
    for step in range(1, 6):  # the checkpoint of step 3 is written; 4 and 5 are not
        first.log(step, {"train/loss": 1.0 / step, "rollout/servers_alive": 2,
                         **({"eval/reward_mean": 0.1 * step} if step % 2 else {})})
        if step == 3:
            first.commit(3)
    state = json.loads((run_dir / "trackers.json").read_text())
    assert state["wandb"]["sent_step"] == state["mlflow"]["sent_step"] == 3
    first.close()  # the process dies: steps 4 and 5 were never sent

    second = MetricsLogger.from_config(cfg, run_dir)
    second.resume_at(3)  # from the checkpoint of step 3: steps 4 and 5 again, other values
    for step in range(4, 7):
        second.log(step, {"train/loss": 100.0 + step, "rollout/servers_alive": 1,
                          **({"eval/reward_mean": 9.0} if step == 6 else {})})
    second.commit(6)
    second.close()

    assert sorted(expected(run_dir)) == [1, 2, 3, 4, 5, 6]
    assert expected(run_dir)[4]["train/loss"] == 104.0
    after = json.loads((run_dir / "trackers.json").read_text())
    assert {k: v["run_id"] for k, v in after.items()} == {k: v["run_id"] for k, v in state.items()}
    assert after["wandb"]["sent_step"] == after["mlflow"]["sent_step"] == 6

    # W&B: one run id over both processes' offline directories, its history = metrics.jsonl
    segments = wandb_segments(run_dir)
    assert len(segments) == 2
    runs = [next(r["run"] for r in records if r["type"] == "run") for records in segments]
    assert {r["run_id"] for r in runs} == {state["wandb"]["run_id"]}
    assert_wandb_matches(run_dir, segments)
    # the configuration once, by the first process; the resumed one resumes
    assert runs[0]["config"]["update"]["run"]["loggers"] == ["jsonl", "tensorboard", "wandb", "mlflow"]
    assert "run" not in runs[1]["config"]["update"] and runs[1].get("resume") is True
    for records in segments:  # every family has its own step axis, in each process
        defined = {(m.get("name") or m.get("glob_name"), m.get("step_metric"))
                   for m in (r["metric"] for r in records if r["type"] == "metric")}
        assert {("train/step", None), ("train/*", "train/step"), ("rollout/*", "rollout/step"),
                ("eval/*", "eval/step")} <= defined

    # MLflow: one run in the experiment, its metric histories = metrics.jsonl
    from mlflow import MlflowClient

    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"  # MLflow 3 opens a file store only when asked
    client = MlflowClient((run_dir / "mlruns").resolve().as_uri())
    experiment = client.get_experiment_by_name("megatron-gspo")
    assert [r.info.run_id for r in client.search_runs([experiment.experiment_id])] == \
        [state["mlflow"]["run_id"]]
    assert mlflow_history(run_dir, state["mlflow"]["run_id"]) == expected(run_dir)
    run = client.get_run(state["mlflow"]["run_id"])
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    assert run.data.params["run.output_dir"] == str(run_dir) and configs == [True, False]
    assert [a.path for a in client.list_artifacts(run.info.run_id)] == ["config.yaml"]


def test_the_gspo_loop_with_wandb_and_mlflow_resumed_after_a_crash(tmp_path):
    """The real loop (pipeline.step.loop.run) with a stand-in trainer that dies at step 6 after the
    checkpoint of step 3, then resumes from it: each tracker holds steps 1..8 once, as
    metrics.jsonl does."""
    from tests.reliability.loop_fakes import Crash, FakeTrainer, init_world_of_one, loop_context

    made = init_world_of_one()
    try:
        def context():
            ctx = loop_context(tmp_path, steps=8, save_interval=3)
            ctx.logger = MetricsLogger.from_config(_cfg(tmp_path, ALL), tmp_path)
            return ctx

        ctx = context()
        with pytest.raises(Crash):
            loop.run(ctx, FakeTrainer(crash_at=6), start_step=0)
        ctx.logger.close()
        sent = json.loads((tmp_path / "trackers.json").read_text())
        assert sent["wandb"]["sent_step"] == sent["mlflow"]["sent_step"] == 3
        ctx = context()
        assert loop.run(ctx, FakeTrainer(mark=100.0), start_step=3)["status"] == "finished"
        ctx.logger.close()
    finally:
        if made:
            dist.destroy_process_group()
    assert sorted(expected(tmp_path)) == list(range(1, 9))
    assert expected(tmp_path)[4]["train/clip_frac"] == 104.0
    assert_wandb_matches(tmp_path, wandb_segments(tmp_path))
    state = json.loads((tmp_path / "trackers.json").read_text())
    assert state["mlflow"]["run_id"] == sent["mlflow"]["run_id"]
    assert mlflow_history(tmp_path, state["mlflow"]["run_id"]) == expected(tmp_path)


class FakeTracker(Tracker):
    """Records what it is sent; ``fail_at``: raise once when sent that step."""

    name = "fake"

    def __init__(self, fail_at=None):
        self.fail_at, self.sent, self.opened, self.closed = fail_at, [], [], None

    def open(self, run_id, config):
        self.opened.append((run_id, config))
        return run_id or "run-1"

    def log(self, step, metrics):
        if step == self.fail_at:
            self.fail_at = None
            raise ConnectionError("tracker unreachable")
        self.sent.append((step, metrics))

    def close(self, finished):
        self.closed = finished


def test_a_failed_send_is_reported_and_sent_again_at_the_next_commit(tmp_path, capsys):
    fake = FakeTracker(fail_at=2)
    logger = MetricsLogger(tmp_path, tensorboard=False, trackers=[fake], config={"a": 1})
    logger.resume_at(0)
    for step in (1, 2, 3):
        logger.log(step, {"train/x": float(step)})
    logger.commit(3)
    assert [s for s, _ in fake.sent] == [1] and "sending step 2 failed" in capsys.readouterr().err
    logger.log(4, {"train/x": 4.0})
    logger.commit(4)
    assert [s for s, _ in fake.sent] == [1, 2, 3, 4]
    logger.log(5, {"train/x": 5.0})
    logger.close()  # step 5 never committed: not sent, and the run counts as failed
    assert [s for s, _ in fake.sent] == [1, 2, 3, 4] and fake.closed is False
    assert fake.opened == [(None, {"a": 1})]


def test_a_tracker_added_on_resume_gets_the_history_and_sent_steps_are_never_resent(tmp_path,
                                                                                     capsys):
    logger = MetricsLogger(tmp_path, tensorboard=False)  # jsonl only
    for step in (1, 2, 3):
        logger.log(step, {"train/x": float(step), "time_s": 0.0})
    logger.close()
    late = FakeTracker()
    logger = MetricsLogger(tmp_path, tensorboard=False, trackers=[late])
    logger.resume_at(3)  # first the history metrics.jsonl holds
    assert [s for s, _ in late.sent] == [1, 2, 3] and late.opened == [(None, None)]
    for step in (4, 5):
        logger.log(step, {"train/x": float(step)})
    logger.commit(5)
    logger.close()
    # resumed from the older checkpoint of step 3 (the one of 5 was damaged): 4, 5 not again
    again = FakeTracker()
    logger = MetricsLogger(tmp_path, tensorboard=False, trackers=[again])
    logger.resume_at(3)
    assert "already holds steps 4..5" in capsys.readouterr().err
    for step in (4, 5, 6):
        logger.log(step, {"train/x": 10.0 + step})
    logger.commit(6)
    logger.close()
    assert again.opened == [("run-1", None)] and [s for s, _ in again.sent] == [6]
    assert again.closed is True


def test_a_fresh_start_moves_the_tracker_ids_aside(tmp_path):
    for _ in range(2):
        fake = FakeTracker()
        logger = MetricsLogger(tmp_path, tensorboard=False, trackers=[fake], config={})
        logger.resume_at(0)
        logger.log(1, {"x": 1.0})
        logger.commit(1)
        logger.close()
        assert fake.opened == [(None, {})]  # a new run each time
    assert json.loads((tmp_path / "trackers.json.1").read_text())["fake"]["sent_step"] == 1
    assert (tmp_path / "metrics.jsonl.1").exists()


def test_the_ids_of_trackers_a_resumed_run_does_not_list_are_kept(tmp_path):
    class Other(FakeTracker):
        name = "other"

    for tracker, start in ((FakeTracker(), 0), (Other(), 1), (FakeTracker(), 2)):
        logger = MetricsLogger(tmp_path, tensorboard=False, trackers=[tracker])
        logger.resume_at(start)
        logger.log(start + 1, {"x": 1.0})
        logger.commit(start + 1)
        logger.close()
    assert tracker.opened == [("run-1", None)]  # fake's run again, after a run with other only
    assert [s for s, _ in tracker.sent] == [2, 3]  # step 2, logged while it was not listed, too
    state = json.loads((tmp_path / "trackers.json").read_text())
    assert state == {"fake": {"run_id": "run-1", "sent_step": 3},
                     "other": {"run_id": "run-1", "sent_step": 2}}


def test_sft_without_checkpoints_sends_every_step_at_its_end(tmp_path):
    from pipeline.step.sft_loop import run_sft
    from tests.reliability.test_metrics_resume import FakeSFT

    cfg = config_from_dict({"data": {"task": "addition", "digits": 2, "num_eval_prompts": 2}},
                           [f"run.output_dir={tmp_path}", "run.num_steps=4", "run.save_interval=0",
                            "run.global_batch_size=8", "run.micro_batch_size=4",
                            "run.seq_length=16", "run.loggers=[jsonl,mlflow]"])
    logger = MetricsLogger.from_config(cfg, tmp_path)
    run_sft(FakeSFT(), cfg, logger=logger)
    logger.close()
    assert not (tmp_path / "tb").exists()  # tensorboard is not in run.loggers
    run_id = json.loads((tmp_path / "trackers.json").read_text())["mlflow"]["run_id"]
    assert sorted(expected(tmp_path)) == [0, 1, 2, 3, 4]
    assert mlflow_history(tmp_path, run_id) == expected(tmp_path)


def test_a_missing_package_names_the_extra(tmp_path, monkeypatch):
    real = trackers.importlib.util.find_spec
    monkeypatch.setattr(trackers.importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real(name, *a))
    cfg = _cfg(tmp_path, ALL)
    message = "run.loggers: 'wandb' needs the wandb package: pip install 'megatron-gspo[wandb]'"
    with pytest.raises(ConfigError, match=rf"^{message}$".replace("[", r"\[").replace("]", r"\]")):
        MetricsLogger.from_config(cfg, tmp_path)
    from launch import preflight

    with pytest.raises(ConfigError, match="needs the wandb package"):  # before any rank starts
        preflight.check(cfg, program="sft", world_size=None)
    MetricsLogger.from_config(cfg, tmp_path, enabled=False)  # other ranks build no tracker
    trackers.check_installed(["jsonl", "mlflow"])


@pytest.mark.parametrize("override,message", [
    ("run.loggers=[jsonl,tensorboard,wandbb]",
     "run.loggers[2]: unknown logger 'wandbb' (choose from jsonl, tensorboard, wandb, mlflow)"),
    ("run.loggers=[tensorboard,wandb]", "run.loggers: must include jsonl"),
    ("run.loggers=[jsonl,wandb,wandb]", "run.loggers[2]: 'wandb' is listed twice"),
    ("run.loggers=jsonl", "run.loggers: expected a list"),
    ("run.wandb.project=demo", "run.wandb: set, but run.loggers does not list wandb"),
    ("run.mlflow.tracking_uri=file:/tmp/x", "run.mlflow: set, but run.loggers does not list mlflow"),
    ("run.wandb.mode=cloud", "run.wandb.mode: 'cloud' is not one of ['online', 'offline']"),
])
def test_config_errors_name_the_field(override, message):
    with pytest.raises(ConfigError) as err:
        config_from_dict({}, [override])
    assert str(err.value).startswith(message)


def test_the_demo_config_takes_every_logger_from_the_command_line():
    overrides = [ALL, "run.wandb.mode=offline", "run.wandb.project=demo",
                 "run.mlflow.experiment=demo"]
    cfg = load_config(CONFIGS / "tiny_cpu.yaml", overrides)
    assert cfg.run.loggers == ["jsonl", "tensorboard", "wandb", "mlflow"]
    assert (cfg.run.wandb.mode, cfg.run.wandb.project, cfg.run.mlflow.experiment) == \
        ("offline", "demo", "demo")
    assert config_from_dict(cfg.to_dict()) == cfg and "  loggers:\n  - jsonl\n" in dump_config(cfg)
    assert load_config(CONFIGS / "tiny_cpu.yaml").run.loggers == ["jsonl", "tensorboard"]


def test_tracker_settings_come_from_the_fields_then_the_environment(tmp_path, monkeypatch):
    run = _cfg(tmp_path, ALL).run
    wandb, mlflow = trackers.build_trackers(run, tmp_path)
    assert (wandb.project, wandb.mode, wandb.dir) == ("megatron-gspo", None, tmp_path)
    assert (mlflow.tracking_uri, mlflow.experiment) == ((tmp_path / "mlruns").as_uri(),
                                                        "megatron-gspo")
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.setenv("WANDB_PROJECT", "p")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    wandb, mlflow = trackers.build_trackers(run, tmp_path)
    assert (wandb.project, wandb.mode, mlflow.tracking_uri) == ("p", "offline",
                                                                "http://127.0.0.1:5000")
    run = _cfg(tmp_path, ALL, "run.wandb.mode=online", "run.wandb.dir=/w",
               "run.mlflow.tracking_uri=sqlite:///m.db").run
    wandb, mlflow = trackers.build_trackers(run, tmp_path)
    assert (wandb.mode, wandb.dir, mlflow.tracking_uri) == ("online", Path("/w"), "sqlite:///m.db")


def test_records_become_floats_for_the_trackers():
    """metrics.jsonl writes non-finite values as strings; the trackers get them as floats."""
    out = scalars({"step": 3, "time_s": 1, "a/b": 0.5, "c": "nan", "i": "-inf", "d": "text"})
    assert set(out) == {"time_s", "a/b", "c", "i"} and out["time_s"] == 1.0
    assert out["i"] == float("-inf") and out["c"] != out["c"]  # nan


# ---- issue 38, item 4: what would fail after the ranks started is found before (exit 2), and a
# tracker that fails mid-run never stops training (no_ranks: a fixture of test_preflight)


@pytest.fixture()
def no_wandb_key(tmp_path, monkeypatch):
    """No W&B API key anywhere: no WANDB_API_KEY, an empty netrc."""
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_IDENTITY_TOKEN_FILE", raising=False)
    monkeypatch.delenv("WANDB_BASE_URL", raising=False)
    netrc = tmp_path / "netrc"
    netrc.write_text("")
    monkeypatch.setenv("NETRC", str(netrc))
    return netrc


def test_a_package_that_does_not_import_names_the_extra(tmp_path, monkeypatch):
    """Installed but broken (a partial install, a missing dependency): find_spec finds it, the
    import fails; that used to be a ModuleNotFoundError in rank 0 after the start."""
    broken = tmp_path / "site" / "wandb"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("import wandb_core_missing_dependency_7q\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    for name in [m for m in sys.modules if m == "wandb" or m.startswith("wandb.")]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(ConfigError, match=r"^run\.loggers: 'wandb' needs the wandb package, which "
                                          r"does not import here \(ModuleNotFoundError: No module "
                                          r"named 'wandb_core_missing_dependency_7q'\): pip install "
                                          r"'megatron-gspo\[wandb\]'$"):
        preflight.check_trackers(_cfg(tmp_path / "run", "run.loggers=[jsonl,wandb]"))


@pytest.mark.parametrize("command", ["train", "sft"])
def test_tracker_input_errors_exit_2_with_one_line_before_the_ranks_start(
        command, tmp_path, monkeypatch, capfd, no_ranks, no_wandb_key):
    run_dir = tmp_path / "run"
    port = free_port()  # nothing listens there
    cases = [
        (("run.loggers=[jsonl,wandb]", "run.wandb.dir=/sys/mgspo-no-such/wandb"),
         ["run.wandb.dir: /sys/mgspo-no-such/wandb is not writable", "choose a writable "
          "run.wandb.dir"]),
        (("run.loggers=[jsonl,wandb]", "run.wandb.mode=online"),
         ["run.wandb.mode: online uploads while the run goes and needs a W&B API key",
          "WANDB_API_KEY", "run.wandb.mode: offline"]),
        (("run.loggers=[jsonl,mlflow]", f"run.mlflow.tracking_uri=http://127.0.0.1:{port}"),
         [f"run.mlflow.tracking_uri: http://127.0.0.1:{port} does not answer within 5 s",
          "Connection refused"]),
        (("run.loggers=[jsonl,mlflow]", "run.mlflow.tracking_uri=file:/sys/mgspo-no-such/mlruns"),
         ["run.mlflow.tracking_uri: /sys/mgspo-no-such/mlruns is not writable"]),
        (("run.loggers=[jsonl,mlflow]", "run.mlflow.tracking_uri=sqlite:////sys/mgspo-no/m.db"),
         ["run.mlflow.tracking_uri: /sys/mgspo-no (sqlite:////sys/mgspo-no/m.db) is not "
          "writable"]),
    ]
    for overrides, fragments in cases:
        code, out, err, _ = run(command, capfd, f"run.output_dir={run_dir}", *overrides)
        assert_one_message(code, out, err, command, *fragments)
        assert not run_dir.exists()
    # the same settings from the environment name the field and where the value came from
    monkeypatch.setenv("WANDB_MODE", "online")
    code, out, err, _ = run(command, capfd, f"run.output_dir={run_dir}",
                            "run.loggers=[jsonl,wandb]")
    assert_one_message(code, out, err, command,
                       "run.wandb.mode: online (from WANDB_MODE, run.wandb.mode unset) uploads")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{port}")
    code, out, err, _ = run(command, capfd, f"run.output_dir={run_dir}",
                            "run.loggers=[jsonl,mlflow]")
    assert_one_message(code, out, err, command, f"run.mlflow.tracking_uri: http://127.0.0.1:{port} "
                       "(from MLFLOW_TRACKING_URI, run.mlflow.tracking_uri unset) does not answer")


def test_what_would_work_passes_the_tracker_checks(tmp_path, monkeypatch, no_wandb_key):
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class NotFound(BaseHTTPRequestHandler):  # any answer: a server is there
        def do_GET(self):
            self.send_error(404)

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}"
        preflight.check_trackers(_cfg(tmp_path / "run", ALL, f"run.mlflow.tracking_uri={url}",
                                      f"run.wandb.dir={tmp_path / 'w'}"))
    finally:
        httpd.shutdown()
        httpd.server_close()
    no_wandb_key.write_text("machine api.wandb.ai\n  login user\n  password k" + "0" * 39 + "\n")
    preflight.check_trackers(_cfg(tmp_path / "run", ALL, "run.wandb.mode=online"))
    no_wandb_key.write_text("")
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    preflight.check_trackers(_cfg(tmp_path / "run", ALL, "run.wandb.mode=online"))
    assert not (tmp_path / "w").exists() and not (tmp_path / "run").exists()  # probes only


class Unreachable(FakeTracker):
    """``fail_open``: opening fails; else every send fails (a tracking server gone mid-run)."""

    def __init__(self, fail_open=False):
        super().__init__()
        self.fail_open = fail_open

    def open(self, run_id, config):
        if self.fail_open:
            raise ConnectionRefusedError("tracking server gone")
        return super().open(run_id, config)

    def log(self, step, metrics):
        raise ConnectionRefusedError("tracking server gone")


class Healthy(FakeTracker):
    name = "other"


def test_a_tracker_failing_mid_run_warns_once_and_training_goes_on(tmp_path, capsys):
    sending, healthy = Unreachable(), Healthy()
    logger = MetricsLogger(tmp_path, tensorboard=False, trackers=[sending, healthy])
    logger.resume_at(0)
    for step in range(1, 5):
        logger.log(step, {"train/x": float(step)})
        logger.commit(step)
    err = capsys.readouterr().err
    assert err.count("metrics: fake: sending step 1 failed (ConnectionRefusedError: tracking "
                     "server gone)") == 1 and err.count("metrics:") == 1, err  # once
    assert "training goes on and metrics.jsonl keeps every step" in err
    logger.close()
    summary = capsys.readouterr().err
    assert "metrics: fake failed 4 time(s) during the run (first: sending step 1 failed" in summary
    assert "steps 1..4 were not sent to it (a resumed run sends them)" in summary
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4]
    assert [s for s, _ in healthy.sent] == [1, 2, 3, 4] and healthy.closed is True


def test_a_tracker_that_cannot_open_is_left_out_and_the_run_goes_on(tmp_path, capsys):
    gone, other = Unreachable(fail_open=True), Healthy()
    logger = MetricsLogger(tmp_path, tensorboard=False, trackers=[gone, other])
    logger.resume_at(0)
    logger.log(1, {"train/x": 1.0})
    logger.commit(1)
    logger.close()
    err = capsys.readouterr().err
    assert "metrics: fake: opening failed (ConnectionRefusedError: tracking server gone); it is " \
           "left out of this run; training goes on" in err
    assert "metrics: fake failed 1 time(s) during the run" in err and "got nothing" in err
    assert [s for s, _ in other.sent] == [1] and other.closed is True
    assert "fake" not in json.loads((tmp_path / "trackers.json").read_text())
    assert [r["step"] for r in read_metrics(tmp_path)] == [1]


def test_a_real_mlflow_server_gone_mid_run_does_not_stop_training(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # fail fast (this run: 2)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    port = free_port()
    cfg = _cfg(tmp_path, "run.loggers=[jsonl,mlflow]",
               f"run.mlflow.tracking_uri=http://127.0.0.1:{port}")
    logger = MetricsLogger.from_config(cfg, tmp_path)
    logger.resume_at(0)
    for step in (1, 2):
        logger.log(step, {"train/x": float(step)})
        logger.commit(step)
    logger.close()
    err = capsys.readouterr().err
    assert err.count("metrics: mlflow: opening failed") == 1, err
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
