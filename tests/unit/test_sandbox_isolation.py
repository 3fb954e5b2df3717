"""Issue 38, item 10: the tool sandbox isolates processes, files, the user and the environment
(``tools.isolation``, ``pipeline.tools.isolation``), not only time, memory, output and network.

A tool tries what an attacker's tool would: read ``/etc/passwd``, the run's files and the
project's, the run's secrets in the environment; write outside its directory; SIGKILL a process
of the run (here a stand-in for rank 0); leave a child behind with ``setsid()``, also from a
call that times out. Under ``namespaces`` each attempt fails (or sees nothing) and nothing of a
call survives it; under ``process`` the environment, the private directory and the killing of
what a call started still hold. A machine whose kernel refuses user namespaces is told so
before the run starts, naming ``tools.isolation``.

Before (6787025) the tool read every one of those files, saw the secret, wrote next to the
checkpoints, killed the stand-in and its setsid() children outlived the call.

Run: ``.venv/bin/python -m pytest -q tests/unit/test_sandbox_isolation.py``
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from pipeline.tools.isolation import TOOL_UID
from pipeline.tools.sandbox import ToolExecutor, ToolLimits, load_tools

ROOT = Path(__file__).resolve().parents[2]
M = "tests.unit.sandbox_tools"
NAMES = ("add", "read_file", "write_file", "listdir", "environment", "identity", "signal_pid",
         "leave_daemon")
SECRET, DECLARED = "MGSPO_TEST_SECRET_TOKEN", "MGSPO_TEST_DECLARED"


def _executor(isolation: str) -> ToolExecutor:
    return ToolExecutor(load_tools([f"{M}:{n}" for n in NAMES]),
                        ToolLimits(timeout_s=1.0, memory_mb=64, output_bytes=65536), workers=1,
                        isolation=isolation, pass_env=[DECLARED])


@contextlib.contextmanager
def _executor_with_secrets(isolation: str):
    before = {k: os.environ.get(k) for k in (SECRET, DECLARED)}
    os.environ[SECRET], os.environ[DECLARED] = "s3cret", "declared"
    try:
        with _executor(isolation) as ex:
            yield ex
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture(scope="module", params=["namespaces", "process"])
def sandbox(request):
    """Either level: what both give."""
    with _executor_with_secrets(request.param) as ex:
        yield ex


@pytest.fixture(scope="module")
def namespaces():
    """What only the namespaces give."""
    with _executor_with_secrets("namespaces") as ex:
        yield ex


def _alive_with(tag: str) -> list[int]:
    """Processes of this machine whose command line holds ``tag`` (zombies excluded)."""
    found = []
    for d in os.listdir("/proc"):
        try:
            cmd = Path(f"/proc/{d}/cmdline").read_bytes()
            state = Path(f"/proc/{d}/stat").read_text().rpartition(")")[2].split()[0]
        except (OSError, IndexError):
            continue
        if tag.encode() in cmd and state != "Z":
            found.append(int(d))
    return found


def test_the_environment_holds_only_what_the_tools_declare(sandbox):
    out = sandbox.call("environment", {})
    env = json.loads(out.output)
    assert SECRET not in env and "s3cret" not in out.output
    assert env[DECLARED] == "declared"
    assert set(env) <= {"PATH", "LANG", "LC_CTYPE", "PYTHONPATH", "HOME", "TMPDIR", "PWD",
                        DECLARED}, sorted(env)


def test_a_setsid_child_does_not_outlive_its_call(sandbox):
    tag = f"mgspo-daemon-{uuid.uuid4().hex}"
    assert sandbox.call("leave_daemon", {"tag": tag}).output == "started"
    assert _alive_with(tag) == []  # gone when the answer came
    assert sandbox.call("add", {"a": 1, "b": 2}).output == "3"


def test_a_setsid_child_does_not_outlive_a_call_killed_at_its_timeout(sandbox):
    tag = f"mgspo-daemon-{uuid.uuid4().hex}"
    out = sandbox.call("leave_daemon", {"tag": tag, "then_hang": True})
    assert out.error == "timeout"
    deadline = time.monotonic() + 5
    while _alive_with(tag) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _alive_with(tag) == []


def test_the_private_directory_is_the_home_and_is_emptied_after_each_call(sandbox):
    who = json.loads(sandbox.call("identity", {}).output)
    assert who["cwd"] == who["home"] and who["home"] != os.environ.get("HOME")
    assert sandbox.call("write_file", {"path": "note.txt"}).ok
    assert sandbox.call("listdir", {}).output == "[]"


def test_a_tool_cannot_signal_a_process_of_the_run(namespaces):
    victim = subprocess.Popen(["sleep", "60"])  # a stand-in for rank 0
    try:
        out = namespaces.call("signal_pid", {"pid": victim.pid})
        assert not out.ok and "ProcessLookupError" in out.output
        time.sleep(0.2)
        assert victim.poll() is None
    finally:
        victim.kill()
        victim.wait()


def test_a_tool_reads_nothing_of_the_machine_but_its_minimal_root(namespaces, tmp_path):
    checkpoint = tmp_path / "run" / "checkpoints" / "step_000001" / "secret.bin"
    checkpoint.parent.mkdir(parents=True)
    checkpoint.write_text("weights")
    for path in (checkpoint, ROOT / "README.md", ROOT / ".git" / "HEAD", "/root/.bashrc",
                 f"/proc/{os.getpid()}/environ"):
        out = namespaces.call("read_file", {"path": str(path)})
        assert not out.ok and ("FileNotFoundError" in out.output
                               or "PermissionError" in out.output), (path, out.output)
    passwd = namespaces.call("read_file", {"path": "/etc/passwd"}).output
    assert "root:" not in passwd and f"tool:x:{TOOL_UID}" in passwd
    assert json.loads(namespaces.call("identity", {}).output)["uid"] == TOOL_UID
    # what Python needs is there, read-only: the tools' modules, the standard library
    assert "sandbox_tools.py" in namespaces.call("listdir", {"path": str(ROOT / "tests" / "unit")}).output


def test_a_tool_writes_nowhere_but_its_private_directory(namespaces, tmp_path):
    mine = ROOT / "tests" / "unit" / f"pwned-{uuid.uuid4().hex}"  # a directory of its modules
    try:
        for path in (tmp_path / "pwned", mine, "/usr/pwned", "/pwned"):
            out = namespaces.call("write_file", {"path": str(path)})
            assert not out.ok, path
        assert not (tmp_path / "pwned").exists() and not mine.exists()
    finally:
        mine.unlink(missing_ok=True)


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs util-linux's unshare")
def test_a_kernel_without_user_namespaces_is_refused_before_the_run_naming_the_field():
    """In a user namespace whose limit of user namespaces is 0 (what a kernel with unprivileged
    user namespaces disabled does to the sandbox), the preflight's check names tools.isolation;
    ``process`` runs there."""
    probe = ("import sys\n"
             "from pipeline.tools.sandbox import ToolExecutor, ToolIsolationError, ToolLimits\n"
             "try:  # what the preflight's check_tools runs\n"
             "    ToolExecutor({}, ToolLimits(), isolation=sys.argv[1]).check()\n"
             "except ToolIsolationError as err:\n"
             "    print('refused:', err); sys.exit(2)\n"
             "print('ok')")
    limit = "echo 0 > /proc/sys/user/max_user_namespaces"
    if subprocess.run(["unshare", "-Ur", "sh", "-c", limit], capture_output=True).returncode:
        pytest.skip("this machine cannot make a user namespace without user namespaces")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))

    def run(isolation: str) -> subprocess.CompletedProcess:
        return subprocess.run(["unshare", "-Ur", "sh", "-c", f'{limit} && exec "$@"', "sh",
                               sys.executable, "-c", probe, isolation],
                              capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)

    refused = run("namespaces")
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "refused: tools.isolation: 'namespaces' cannot be set up" in refused.stdout
    assert "tools.isolation: process" in refused.stdout
    ran = run("process")
    assert ran.returncode == 0 and ran.stdout.strip() == "ok", ran.stdout + ran.stderr
