"""Issue 11, item 11 (and the config half of item 12): every input error before anything starts.

``config``, ``launch slurm``, ``sft`` and ``train`` run the same check (``launch.preflight``)
before they start a rank, a server or a job: the data files exist and fit ``run.seq_length``
(measured on the actual prompts), the reward function imports, every batch split (the
data-parallel one too, where the world is known), ``run.init_from`` exists, an external router
answers within seconds. Each bad input exits 2 with ONE message, printed once, naming the field
(or file) - and no rank is ever started (``ensure_ranks`` raises here if it is reached).
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from launch import cli, local
from pipeline.servers import free_port

CONFIG = "launch/configs/tiny_cpu.yaml"
COMMANDS = {
    "config": ["config"],
    "train": ["train"],
    "sft": ["sft"],
    "launch slurm": ["launch", "slurm", "--nodes", "2", "--rollout-nodes", "1", "--dry-run"],
}


@pytest.fixture()
def no_ranks(monkeypatch):
    def started(*args, **kwargs):
        raise AssertionError("ranks were started: the input error was not found before")

    monkeypatch.setattr(local, "ensure_ranks", started)


@pytest.fixture()
def files(tmp_path) -> dict[str, Path]:
    ok = tmp_path / "prompts.jsonl"
    ok.write_text("".join(json.dumps({"prompt": f"{i}+1=", "label": str(i + 1)}) + "\n"
                          for i in range(8)))
    long = tmp_path / "long.jsonl"  # line 3: 14 bytes; + max_new_tokens 6 > seq_length 16 + 1
    long.write_text(json.dumps({"prompt": "1+1=", "label": "2"}) + "\n"
                    + json.dumps({"prompt": "2+2=", "label": "4"}) + "\n"
                    + json.dumps({"prompt": "12345+67890123=", "label": "67902468"}) + "\n")
    return {"ok": ok, "long": long, "dir": tmp_path}


def run(command: str, capfd, *overrides: str) -> tuple[int, str, str, float]:
    argv = [*COMMANDS[command], "--config", CONFIG]
    for item in overrides:
        argv += ["--set", item]
    t0 = time.monotonic()
    code = cli.main(argv)
    elapsed = time.monotonic() - t0
    out, err = capfd.readouterr()
    return code, out, err, elapsed


def assert_one_message(code: int, out: str, err: str, command: str, *fragments: str) -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, (code, out[-2000:], err[-3000:])
    assert len(lines) == 1, f"expected one message, got {len(lines)} lines:\n{err[-3000:]}"
    assert lines[0].startswith(f"megatron-gspo {command}: "), lines[0]
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    assert "starting" not in out and "Traceback" not in err


def file_run(path: Path) -> tuple[str, ...]:
    return ("data.task=null", f"data.train_path={path}", "reward.kind=exact_match",
            "data.num_eval_prompts=null")


# (case id, overrides, fragments of the message, the commands that check it)
ALL = tuple(COMMANDS)
RL = ("config", "train", "launch slurm")  # what only GSPO reads (rollout, reward)
CASES = [
    ("missing train file", lambda f: file_run(f["dir"] / "nope.jsonl"),
     ["nope.jsonl", "not found"], ALL),
    ("missing eval file", lambda f: (*file_run(f["ok"]), f"data.eval_path={f['dir'] / 'held.jsonl'}"),
     ["held.jsonl", "not found"], ALL),
    ("reward module missing", lambda f: ("reward.kind=function", "reward.function=no_such_module_7q:score"),
     ["reward.function", "no_such_module_7q"], RL),
    ("reward file missing", lambda f: ("reward.kind=function", f"reward.function={f['dir'] / 'r.py'}:score"),
     ["reward.function", "r.py", "not found"], RL),
    ("gbs % group_size", lambda f: ("run.global_batch_size=36", "run.micro_batch_size=4"),
     ["run.global_batch_size: 36", "gspo.group_size 8"], ALL),
    ("gbs % updates_per_rollout", lambda f: ("run.global_batch_size=32", "run.micro_batch_size=8",
                                            "gspo.updates_per_rollout=3"),
     ["run.global_batch_size: 32", "gspo.updates_per_rollout = 3"], ALL),
    ("mini-batch < DP x micro-batch", lambda f: ("run.micro_batch_size=128",),
     ["data-parallel size 2", "run.micro_batch_size 128"], ALL),
    ("prompt + max_new_tokens > seq_length (file)", lambda f: file_run(f["long"]),
     ["long.jsonl:3", "15 tokens", "rollout.max_new_tokens 6", "run.seq_length 16"], RL),
    ("prompt + max_new_tokens > seq_length (task)", lambda f: ("data.digits=8",),
     ["data.digits 8", "18 tokens", "rollout.max_new_tokens 6", "run.seq_length 16"], RL),
    ("prompt + label > seq_length (sft)", lambda f: ("data.digits=8",),
     ["data.digits 8", "run.seq_length 16"], ("sft",)),
    ("run.init_from missing", lambda f: (f"run.init_from={f['dir'] / 'no_policy'}",),
     ["run.init_from", "no_policy", "does not exist"], ALL),
    ("run.init_from empty", lambda f: ("run.init_from=",), ["run.init_from", "empty"], ALL),
    ("run.output_dir empty", lambda f: ("run.output_dir=",), ["run.output_dir", "empty"], ALL),
    ("optim.lr inf", lambda f: ("optim.lr=.inf",), ["optim.lr", "finite", "inf"], ALL),
    ("optim.lr nan", lambda f: ("optim.lr=.nan",), ["optim.lr", "finite", "nan"], ALL),
    ("a float that had no bound: inf", lambda f: ("rollout.request_timeout_s=.inf",),
     ["rollout.request_timeout_s", "finite"], ALL),
    ("--set with broken YAML", lambda f: ("optim.lr=[1",), ["--set 'optim.lr=[1'", "YAML"], ALL),
]


@pytest.mark.parametrize(("case", "command"),
                         [(c[0], command) for c in CASES for command in c[3]])
def test_bad_input_exits_2_with_one_message_before_anything_starts(case, command, files, capfd,
                                                                    no_ranks, tmp_path):
    _, overrides, fragments, _ = next(c for c in CASES if c[0] == case)
    overrides = (f"run.output_dir={tmp_path / 'run'}", *overrides(files))
    code, out, err, _ = run(command, capfd, *overrides)
    assert_one_message(code, out, err, command, *fragments)
    assert not (tmp_path / "run").exists()  # nothing was started, nothing written


def test_unreachable_external_router_is_named_within_seconds(capfd, no_ranks, tmp_path):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    settings = (f"run.output_dir={tmp_path / 'run'}", "rollout.mode=external",
                f"rollout.router_url={url}")
    code, out, err, elapsed = run("train", capfd, *settings)
    assert_one_message(code, out, err, "train", "rollout.router_url", url, "not reachable")
    assert elapsed < 20, elapsed
    # config validates files for launch slurm too, whose job starts the router: a note only
    code, out, err, _ = run("config", capfd, *settings)
    assert code == 0 and err == "", err
    assert re.search(rf"^# note: rollout.router_url: {re.escape(url)} is not reachable", out, re.M)


def test_good_input_passes_the_check(capfd, tmp_path, files):
    """The check itself rejects nothing valid: the tiny config, and a file run that fits."""
    code, out, err, _ = run("config", capfd, f"run.output_dir={tmp_path / 'a'}")
    assert code == 0, err
    code, out, err, _ = run("config", capfd, f"run.output_dir={tmp_path / 'b'}", *file_run(files["ok"]))
    assert code == 0, err
    assert "# layout: world 2" in out
