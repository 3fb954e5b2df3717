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
from pipeline.servers.cluster import free_port

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
def _megatron_root_without_iteration(directory: Path) -> Path:
    """A Megatron-LM / Bridge root whose tracker file names an iteration that is not there."""
    root = directory / "megatron_root"
    root.mkdir(exist_ok=True)
    (root / "latest_checkpointed_iteration.txt").write_text("5")
    return root


ALL = tuple(COMMANDS)
RL = ("config", "train", "launch slurm")  # what only GSPO reads (rollout, reward)
RUNS = tuple(c for c in ALL if c != "config")  # config notes a missing input path (below)
CASES = [
    ("missing train file", lambda f: file_run(f["dir"] / "nope.jsonl"),
     ["nope.jsonl", "not found"], RUNS),
    ("missing eval file", lambda f: (*file_run(f["ok"]), f"data.eval_path={f['dir'] / 'held.jsonl'}"),
     ["held.jsonl", "not found"], RUNS),
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
     ["run.init_from", "no_policy", "does not exist"], RUNS),
    ("run.init_from empty", lambda f: ("run.init_from=",), ["run.init_from", "empty"], ALL),
    ("run.init_from a Megatron root whose tracker names nothing",
     lambda f: (f"run.init_from={_megatron_root_without_iteration(f['dir'])}",),
     ["run.init_from", "latest_checkpointed_iteration.txt names iter_0000005"], RUNS),
    ("run.output_dir empty", lambda f: ("run.output_dir=",), ["run.output_dir", "empty"], ALL),
    ("optim.lr inf", lambda f: ("optim.lr=.inf",), ["optim.lr", "finite", "inf"], ALL),
    ("optim.lr nan", lambda f: ("optim.lr=.nan",), ["optim.lr", "finite", "nan"], ALL),
    ("a float that had no bound: inf", lambda f: ("rollout.request_timeout_s=.inf",),
     ["rollout.request_timeout_s", "finite"], ALL),
    ("--set with broken YAML", lambda f: ("optim.lr=[1",), ["--set 'optim.lr=[1'", "YAML"], ALL),
    # issue 22, item 9: the packed budget below the longest sequence (prompt 6 + response 6 - 1)
    ("token budget < longest sequence (task)", lambda f: ("run.max_tokens_per_micro_batch=10",),
     ["run.max_tokens_per_micro_batch: 10", "data.digits 2, 6 tokens", "rollout.max_new_tokens 6",
      "11 positions", "at least 11"], RL),
    ("token budget < longest sequence (file)",  # "7+1=": 4 bytes + 6 - 1
     lambda f: (*file_run(f["ok"]), "run.max_tokens_per_micro_batch=8"),
     ["run.max_tokens_per_micro_batch: 8", "prompts.jsonl:", "rollout.max_new_tokens 6",
      "9 positions"], RL),
    # issue 22, item 11: a run directory that cannot be written (checked by the commands that
    # write it); root passes permission bits, not these
    ("run.output_dir under a file", lambda f: (f"run.output_dir={f['ok'] / 'run'}",),
     ["run.output_dir", "prompts.jsonl", "not a directory"], ("train", "sft", "launch slurm")),
    ("run.output_dir on sysfs", lambda f: ("run.output_dir=/sys/mgspo-no-such-run/run",),
     ["run.output_dir", "/sys/mgspo-no-such-run/run", "not writable"],
     ("train", "sft", "launch slurm")),
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


@pytest.mark.parametrize("field, value", [("data.train_path", "nope.jsonl"),
                                          ("data.eval_path", "held.jsonl"),
                                          ("run.init_from", "no_policy"),
                                          ("data.tokenizer_dir", "no_tokenizer")])
def test_config_notes_input_paths_missing_on_this_machine(field, value, files, capfd, tmp_path):
    """``config`` validates files meant for a cluster (the recipes' placeholder paths): a path
    that does not exist here is a note naming the field, exit 0; train / sft / launch slurm
    refuse it (the cases above)."""
    settings = [f"run.output_dir={tmp_path / 'run'}", *file_run(files["ok"])]
    missing = files["dir"] / value
    code, out, err, _ = run("config", capfd, *settings, f"{field}={missing}")
    assert code == 0 and err == "", err
    assert re.search(rf"^# note: {re.escape(field)}: {re.escape(str(missing))} does not exist on "
                     "this machine", out, re.M), out[-2000:]


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


@pytest.mark.parametrize("command", ["train", "sft"])
def test_gradient_accumulation_fusion_without_apex_is_named_before_ranks(command, capfd, no_ranks,
                                                                          tmp_path, monkeypatch):
    """Issue 21, item 4: with CUDA present, model.gradient_accumulation_fusion: true (both GPU
    recipes) needs apex's fused_weight_gradient_mlp_cuda, which megatron-core only asks for when
    every rank builds its output layer; found at preflight, with the remedy."""
    import sys

    import torch

    from launch import preflight

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, preflight.GRAD_ACCUM_FUSION_MODULE, None)  # import fails
    code, out, err, _ = run(command, capfd, f"run.output_dir={tmp_path / 'run'}",
                            "model.gradient_accumulation_fusion=true")
    assert_one_message(code, out, err, command, "model.gradient_accumulation_fusion",
                       "fused_weight_gradient_mlp_cuda", "--cpp_ext --cuda_ext",
                       "set model.gradient_accumulation_fusion: false")
    assert not (tmp_path / "run").exists()


def test_gradient_accumulation_fusion_check_passes_where_it_can_run(monkeypatch):
    """No refusal with the extension importable, with the field false, or without CUDA (the
    field is GPU-only and refused as such when the model is built)."""
    import sys
    import types

    import torch

    from launch import preflight
    from megatron_gspo.config import ConfigError, load_config

    on = load_config(CONFIG, ["model.gradient_accumulation_fusion=true"])
    off = load_config(CONFIG, ["model.gradient_accumulation_fusion=false"])
    name = preflight.GRAD_ACCUM_FUSION_MODULE
    monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    preflight.check_gradient_accumulation_fusion(on)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    preflight.check_gradient_accumulation_fusion(off)
    with pytest.raises(ConfigError, match="model.gradient_accumulation_fusion"):
        preflight.check_gradient_accumulation_fusion(on)
    monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    preflight.check_gradient_accumulation_fusion(on)


def test_the_token_budget_check_is_the_packers_own_condition():
    """Issue 22, item 9: preflight refuses run.max_tokens_per_micro_batch exactly when the packer
    (``train.batching.plan_micro_batches``) would refuse the longest sequence mid-run: prompt +
    max_new_tokens - 1 label positions, at most run.seq_length, padded for cp and tp."""
    from types import SimpleNamespace

    from launch import preflight
    from megatron_gspo.config import ConfigError
    from megatron_gspo.train.batching import plan_micro_batches

    checked = refused = 0
    for cp in (1, 2, 4):
        for tp in (1, 2):
            for prompt, new, seq_length in ((6, 6, 16), (9, 30, 24), (3, 5, 64), (20, 1, 20)):
                longest = min(prompt + new - 1, seq_length)
                for budget in range(1, 40):
                    cfg = SimpleNamespace(
                        run=SimpleNamespace(max_tokens_per_micro_batch=budget,
                                            seq_length=seq_length),
                        parallel=SimpleNamespace(context=cp, tensor=tp),
                        rollout=SimpleNamespace(max_new_tokens=new))
                    try:
                        plan_micro_batches([longest, 1], budget, 1, cp_size=cp, tp_size=tp)
                        packer_ok = True
                    except ValueError:
                        packer_ok = False
                    try:
                        preflight._check_token_budget(cfg, prompt, "test prompts")
                        preflight_ok = True
                    except ConfigError as err:
                        assert "run.max_tokens_per_micro_batch" in str(err)
                        assert "rollout.max_new_tokens" in str(err)
                        preflight_ok = False
                    assert preflight_ok == packer_ok, (cp, tp, prompt, new, seq_length, budget)
                    checked += 1
                    refused += not packer_ok
    assert refused and refused < checked  # both outcomes were exercised


def test_a_token_budget_that_fits_passes(capfd, tmp_path):
    code, out, err, _ = run("config", capfd, f"run.output_dir={tmp_path / 'a'}",
                            "run.max_tokens_per_micro_batch=11")
    assert code == 0, err


@pytest.fixture()
def read_only_dir(tmp_path):
    """A read-only tmpfs (what stops root too), where this machine lets us mount one."""
    import subprocess

    mount = tmp_path / "ro"
    mount.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here: {proc.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


@pytest.mark.parametrize("command", ["train", "sft", "launch slurm"])
@pytest.mark.parametrize("inside", [False, True])
def test_a_read_only_run_directory_is_refused_before_anything_starts(command, inside, capfd,
                                                                     no_ranks, read_only_dir):
    """Issue 22, item 11: a read-only mount (the directory itself, or the one it would be made
    in) used to give a traceback, exit 1; now exit 2, one line naming the directory."""
    run_dir = read_only_dir if inside else read_only_dir / "run"
    code, out, err, _ = run(command, capfd, f"run.output_dir={run_dir}")
    assert_one_message(code, out, err, command, f"run.output_dir: {run_dir} is not writable",
                       "Read-only file system")


def test_a_writable_run_directory_is_left_as_it_was(tmp_path):
    from launch import preflight

    existing = tmp_path / "existing"
    existing.mkdir()
    preflight.check_writable(existing)
    preflight.check_writable(tmp_path / "new" / "run")
    assert list(tmp_path.rglob("*")) == [existing]  # the probes left nothing, created nothing


def test_a_run_lock_that_is_a_directory_is_named(capfd, no_ranks, tmp_path):
    """Issue 22, lesser finding: ``run.lock`` a directory used to pass the check and give a
    traceback in the rank; the check (and the lock itself) name the path."""
    from launch.run_lock import RunDirLocked, RunLock

    run_dir = tmp_path / "run"
    (run_dir / "run.lock").mkdir(parents=True)
    code, out, err, _ = run("train", capfd, f"run.output_dir={run_dir}")
    assert_one_message(code, out, err, "train", f"{run_dir / 'run.lock'} is a directory")
    with pytest.raises(RunDirLocked, match=f"{run_dir / 'run.lock'} is a directory"):
        RunLock(run_dir).acquire(wait_for_stale_s=0)


def config_file_run(command: str, path: Path, capfd, *overrides: str):
    argv = [*COMMANDS[command], "--config", str(path)]
    for item in overrides:
        argv += ["--set", item]
    code = cli.main(argv)
    out, err = capfd.readouterr()
    return code, out, err


@pytest.mark.parametrize("command", ["config", "train"])
def test_config_file_errors_exit_2_with_one_message_naming_the_file(command, capfd, no_ranks,
                                                                    tmp_path):
    """Issue 22, items 2 and 3 and the lesser findings, through the command line: a duplicated
    key (exit 0 before), an alias bomb (a hang before), an empty file (all defaults before), a
    non-UTF-8 file (a traceback before)."""
    text = Path(CONFIG).read_text()
    dup = tmp_path / "dup.yaml"
    dup.write_text(text + "run:\n  num_steps: 3\n")
    first = 1 + text.splitlines().index("run:")
    last = len(text.splitlines()) + 1
    laughs = 'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n' + "".join(
        f"{n}: &{n} [" + ", ".join([f"*{p}"] * 9) + "]\n" for p, n in zip("abcdefgh", "bcdefghi"))
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(laughs + "run: *i\n")
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing yet\n")
    latin = tmp_path / "latin.yaml"
    latin.write_bytes(text.encode() + "# caf\u00e9\n".encode("latin-1"))
    cases = [(dup, [str(dup), "duplicate key 'run'", f"line {last}", f"first at line {first}"]),
             (bomb, [str(bomb), "more than 100000 nodes"]),
             (empty, [str(empty), "empty"]),
             (latin, [str(latin), "not UTF-8", f"offset {len(text.encode()) + 5}"])]
    for path, fragments in cases:
        t0 = time.monotonic()
        code, out, err = config_file_run(command, path, capfd,
                                         f"run.output_dir={tmp_path / 'run'}")
        assert time.monotonic() - t0 < 10
        assert_one_message(code, out, err, command, *fragments)
        assert len(err) < 1000, err[:2000]
