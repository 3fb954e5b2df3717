"""bench/gpu_smoke.py: every check runs on CPU / gloo here (``--device cpu``), and on a CUDA GPU
with NCCL where there is one.

The CPU run covers every code path of the script except what only a GPU has: bf16 weights (CPU:
float32, the same distributed optimizer with overlapped gradient reduce and parameter gather),
NCCL, CUDA-IPC handles in the weight sync (CPU: shared memory), and CUDA kernels' determinism.
The GPU test is skipped, with that reason, on machines without CUDA. The wheel closure's
selection (torch's closure out, the optional router only within the carry budget) is tested here
with a stand-in for pip; the real download and offline install in the extended tier.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_smoke.py"
CHECKS = ["environment", "sft_bf16_distributed_optimizer", "rl_update_and_weight_sync",
          "checkpoint_exact_resume", "converted_checkpoint", "train_command"]


def _run(device: str, timeout: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--device", device], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def _verdicts(stdout: str) -> dict[str, str]:
    return {line.split()[1]: line.split()[0] for line in stdout.splitlines()
            if line.startswith(("PASS ", "FAIL "))}


@pytest.mark.slow
def test_every_check_passes_on_cpu():
    proc = _run("cpu", timeout=1500)
    assert _verdicts(proc.stdout) == {name: "PASS" for name in CHECKS}, proc.stdout + proc.stderr[-4000:]
    assert proc.returncode == 0
    assert proc.stdout.strip().splitlines()[-1] == f"gpu_smoke: {len(CHECKS)}/{len(CHECKS)} checks passed on cpu"


def test_lists_missing_dependencies_and_installs_only_from_its_wheel_directory(tmp_path):
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import gpu_smoke
    finally:
        sys.path.pop(0)
    assert gpu_smoke.missing_modules() == []  # this environment has every dependency
    assert gpu_smoke.install_missing(tmp_path / "none") == []  # nothing to install: no pip call
    out = subprocess.run([sys.executable, str(SCRIPT), "--list-missing"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "(nothing missing)"
    assert gpu_smoke.DEPENDENCIES["megatron.core"] == "megatron-core==0.19.2"  # the 3.12 stack


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (NCCL, bf16, the "
                                                          "distributed optimizer)")
def test_every_check_passes_on_the_gpu():
    proc = _run("cuda", timeout=900)
    assert _verdicts(proc.stdout) == {name: "PASS" for name in CHECKS}, proc.stdout + proc.stderr[-4000:]
    assert proc.returncode == 0


# ---- the offline install of the downloaded closure (issue 21 item 3) ----------------------------

# what the H200 image lacks (issue 21): the rest of the closure is there with its torch
H200_LACKS = {"megatron-core", "math-verify", "latex2sympy2-extended", "antlr4-python3-runtime",
              "fastapi", "starlette", "pydantic", "pydantic-core", "annotated-types",
              "typing-inspection", "opentelemetry-api", "uvicorn", "sglang-router", "orjson",
              "setproctitle"}


def _smoke_module():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import gpu_smoke
    finally:
        sys.path.pop(0)
    return gpu_smoke


def _python312():
    import glob
    import shutil

    for candidate in [shutil.which("python3.12"), *sorted(glob.glob(
            str(Path.home() / ".pyenv/versions/3.12*/bin/python3.12")))]:
        if candidate and subprocess.run([candidate, "-c", "import sys; assert sys.version_info[:2]"
                                         " == (3, 12)"], capture_output=True).returncode == 0:
            return candidate
    return None


def _index_reachable() -> bool:
    import urllib.request

    try:
        urllib.request.urlopen("https://pypi.org/simple/megatron-core/", timeout=15).close()
        return True
    except Exception:  # noqa: BLE001 - any failure: no index here
        return False


def _offline(argv: list[str]) -> tuple[list[str], dict]:
    """``argv`` with the network cut: a new user + network namespace (``unshare -rn``: only a
    down loopback), else a dead proxy; pip's own configuration ignored either way (a bare
    machine: no find-links, no extra index)."""
    env = {k: v for k, v in __import__("os").environ.items()
           if not k.startswith("PIP_") and k.lower() not in ("http_proxy", "https_proxy")}
    env.update(PIP_CONFIG_FILE="/dev/null", PYTHONNOUSERSITE="1")
    if subprocess.run(["unshare", "-rn", "true"], capture_output=True).returncode == 0:
        return ["unshare", "-rn", *argv], env
    env.update(http_proxy="http://127.0.0.1:9", https_proxy="http://127.0.0.1:9",
               PIP_INDEX_URL="http://127.0.0.1:9/simple")
    return argv, env


def _lock_names(lock: Path) -> dict[str, str]:
    gpu_smoke = _smoke_module()
    return {gpu_smoke._canonical(line.split("==")[0]): line.split("==")[1].split()[0]
            for line in lock.read_text().splitlines() if line and not line.startswith("#")}


@pytest.mark.slow
@pytest.mark.extended
def test_downloaded_closure_installs_offline_into_an_empty_target(tmp_path):
    """``--download`` fetches the closure for CPython 3.12 (manylinux x86_64, without torch's
    closure); Python 3.12 installs it with the network cut into an empty target through the
    script's own install step; every module then imports (megatron.core up to ``import torch``,
    which this machine has no 3.12 build of: it is the one thing the GPU machine brings), and every
    requirement of every installed distribution is met by the target or torch's closure."""
    python312 = _python312()
    if python312 is None:
        pytest.skip("no Python 3.12 interpreter here (pyenv / python3.12)")
    if not _index_reachable():
        pytest.skip("the package index (pypi.org) is unreachable: nothing to download")
    gpu_smoke = _smoke_module()
    wheels, target, device = tmp_path / "wheels", tmp_path / "target", tmp_path / "device"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--download", str(wheels)], cwd=ROOT,
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lock = wheels / gpu_smoke.LOCK
    names = _lock_names(lock)
    assert names["megatron-core"] == "0.19.2"
    # everything fits but the router's own closure (29 MiB), left out over the carry budget
    over_budget = {"sglang-router", "orjson", "setproctitle"}
    assert H200_LACKS - over_budget <= set(names), H200_LACKS - over_budget - set(names)
    assert "sglang-router==0.3.2" in next(l for l in lock.read_text().splitlines()
                                          if l.startswith("# left out (over the carry budget"))
    assert sum(p.stat().st_size for p in wheels.glob("*.whl")) <= gpu_smoke.carry_budget()
    assert not {n for n in names if n in ("torch", "triton") or n.startswith(("nvidia-", "cuda-"))}
    assert sorted(p.name for p in wheels.glob("*.whl")) and len(list(wheels.glob("*.whl"))) == len(names)

    # the device's side: torch's closure without torch and the CUDA wheels (pure Python here)
    left_out = next(l for l in lock.read_text().splitlines() if l.startswith("# left out (the"))
    provided = [req for req in left_out.split(": ", 1)[1].split()
                if not gpu_smoke._canonical(req.split("==")[0]).startswith(("nvidia-", "cuda-"))
                and gpu_smoke._canonical(req.split("==")[0]) not in ("torch", "triton")]
    assert any(r.lower().startswith("sympy==") for r in provided), provided
    dl = subprocess.run([python312, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                         "-d", str(tmp_path / "device_wheels"), *provided],
                        capture_output=True, text=True, timeout=600)
    assert dl.returncode == 0, dl.stderr[-3000:]

    # network cut from here: the script's install step into an empty target, then imports
    argv, env = _offline([python312, str(SCRIPT), "--wheels", str(wheels), "--install-target",
                          str(target), "--install-only"])
    inst = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert inst.returncode == 0, inst.stdout[-3000:] + inst.stderr[-3000:]
    assert f"installed from {wheels}" in inst.stdout
    argv, env = _offline([python312, "-m", "pip", "install", "--no-index", "--no-deps",
                          "--target", str(device), *sorted(map(str, (tmp_path / "device_wheels").glob("*.whl")))])
    dev = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    assert dev.returncode == 0, dev.stderr[-3000:]

    check = r'''
import importlib, importlib.metadata as md, sys
from pip._vendor.packaging.requirements import Requirement
target, device, modules = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
sys.path[:0] = [target, device]
for m in modules:
    try:
        importlib.import_module(m)
    except ModuleNotFoundError as err:
        assert m == "megatron.core" and err.name == "torch", (m, err)
        print("needs torch:", m)
    else:
        print("imports:", m)
have = {}
for d in md.distributions(path=[target, device]):
    have[d.metadata["Name"].lower().replace("_", "-").replace(".", "-")] = d
have["torch"] = None
unmet = []
for name, d in sorted(have.items()):
    if d is None:
        continue
    for line in d.requires or []:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        key = req.name.lower().replace("_", "-").replace(".", "-")
        dep = have.get(key, "absent")
        if dep == "absent" or (dep is not None and not req.specifier.contains(dep.version, prereleases=True)):
            unmet.append(f"{name}: {line} ({'absent' if dep == 'absent' else dep.version})")
assert not unmet, unmet
print("requirements met:", len(have))
'''
    modules = ",".join(gpu_smoke.REQUIRED)
    argv, env = _offline([python312, "-c", check, str(target), str(device), modules])
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "needs torch: megatron.core" in out.stdout and "imports: math_verify" in out.stdout

    # the H200 image (has all but H200_LACKS): its closure is small enough to carry (64 MiB)
    has = tmp_path / "h200_freeze.txt"
    everything = set(names) | {gpu_smoke._canonical(r.split("==")[0]) for r in left_out.split(": ", 1)[1].split()}
    has.write_text("\n".join(sorted(everything - H200_LACKS)) + "\n")
    small = tmp_path / "h200_wheels"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--download", str(small), "--device-has",
                           str(has)], cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert set(_lock_names(small / gpu_smoke.LOCK)) == H200_LACKS
    total = sum(p.stat().st_size for p in small.glob("*.whl"))
    assert total < 64 * 2**20, total


# ---- the closure's selection, with a stand-in for pip (issue 37 item 8) --------------------------

# name -> (version, MiB, requires): a resolution as pip's --report gives it, in miniature
_RESOLVED = {
    "torch": ("2.11.0", 0, ["filelock", "nvidia-nccl-cu13"]),
    "filelock": ("3.20.0", 0, []),
    "nvidia-nccl-cu13": ("2.28.3", 0, []),
    "megatron-core": ("0.19.2", 2, ["torch", "numpy", "packaging"]),
    "numpy": ("2.5.5", 15, []),
    "packaging": ("26.4", 0, []),
    "transformers": ("5.25.0", 13, ["numpy", "packaging"]),
    "sglang-router": ("0.3.2", 29, ["setproctitle", "packaging"]),
    "setproctitle": ("1.3.8", 0, []),
}


def _fake_pip(resolved, roots):
    def pip(*args, check=True):
        if args[0] == "install":  # --dry-run --report FILE: the metadata of the closure
            report = args[args.index("--report") + 1]
            Path(report).write_text(json.dumps({"install": [
                {"metadata": {"name": n, "version": v, "requires_dist": list(r)}}
                for n, (v, _, r) in resolved.items()]}))
            roots.extend(a for a in args if "==" in a or ">=" in a)
        elif args[0] == "download":  # --no-deps -d DIR ... name==version ...
            dest = Path(args[args.index("-d") + 1])
            for spec in (a for a in args if "==" in a):
                name, version = spec.split("==")
                size = resolved[name][1] << 20
                (dest / f"{name.replace('-', '_')}-{version}-py3-none-any.whl").write_bytes(
                    b"w" * max(size, 1))
        return subprocess.CompletedProcess(args, 0, "", "")
    return pip


@pytest.mark.parametrize("budget_mib, router", [(80, True), (40, False)])
def test_the_closure_leaves_out_torch_and_the_router_only_over_budget(tmp_path, monkeypatch,
                                                                      budget_mib, router):
    _smoke_module()
    smoke_wheels = sys.modules["smoke_wheels"]  # bench/smoke_wheels.py, as gpu_smoke imports it
    roots = []
    monkeypatch.setattr(smoke_wheels, "_pip", _fake_pip(_RESOLVED, roots))
    monkeypatch.setattr(smoke_wheels, "REQUIRED", {"megatron.core": "megatron-core==0.19.2",
                                                   "transformers": "transformers>=4.57,<6"})
    monkeypatch.setattr(smoke_wheels, "OPTIONAL", {"sglang_router": "sglang-router==0.3.2"})
    monkeypatch.setattr(smoke_wheels, "DEPENDENCIES", {**smoke_wheels.REQUIRED,
                                                       **smoke_wheels.OPTIONAL})
    kept, left_out = smoke_wheels.download_closure(tmp_path, budget=budget_mib << 20)
    names = {n for n, _, _ in kept}
    assert {"torch", "filelock", "nvidia-nccl-cu13"}.isdisjoint(names)  # the machine's torch
    assert {"megatron-core", "numpy", "packaging", "transformers"} <= names
    assert ("sglang-router" in names) == router and ("setproctitle" in names) == router
    assert bool(left_out) != router
    lock = (tmp_path / smoke_wheels.LOCK).read_text().splitlines()
    pinned = {line.split("==")[0] for line in lock if not line.startswith("#")}
    assert pinned == names and all("--hash=sha256:" in l for l in lock if not l.startswith("#"))
    assert sorted(p.name.split("-")[0] for p in tmp_path.glob("*.whl")) == sorted(
        n.replace("-", "_") for n in names)
    with pytest.raises(SystemExit, match="the required wheels take 30.0 MiB, over the 20.0 MiB"):
        smoke_wheels.download_closure(tmp_path / "small", budget=20 << 20)


def test_a_check_that_cannot_run_here_is_skipped_not_failed(monkeypatch, capsys):
    gpu_smoke = _smoke_module()

    class Fake:
        def environment(self):
            return "ok"

        def train_command(self):
            raise gpu_smoke.Skipped("sglang-router==0.3.2 not installed")

        def converted_checkpoint(self):
            raise AssertionError("wrong")

    verdicts = gpu_smoke.run_checks(Fake(), ["environment", "train_command"])
    assert verdicts == ["PASS", "SKIP"]
    assert "SKIP train_command: sglang-router==0.3.2 not installed" in capsys.readouterr().out
    assert gpu_smoke.run_checks(Fake(), ["converted_checkpoint"]) == ["FAIL"]
    # the real check skips where the router does not import
    monkeypatch.setattr(gpu_smoke, "missing_modules", lambda modules=None: list(modules or []))
    with pytest.raises(gpu_smoke.Skipped, match=r"sglang-router==0\.3\.2 not installed"):
        gpu_smoke.Smoke("cpu", Path("/nonexistent")).train_command()


def test_the_recorded_stream_keeps_what_this_rank_sends():
    gpu_smoke = _smoke_module()
    flat = torch.arange(6, dtype=torch.float32)

    class Bucket:
        def __init__(self, flat):
            self.flat = flat

        def named_tensors(self):
            return [("a", self.flat[:2]), ("b", self.flat[2:].view(2, 2))]

    class Stream:
        tensor_hook = None

        def __len__(self):
            return 2

        def __iter__(self):
            yield Bucket(flat)
            yield Bucket(None)  # another rank's bucket

    stream = gpu_smoke.RecordedStream(Stream())
    stream.tensor_hook = "hook"  # what the pusher sets lands on the stream itself
    assert stream._stream.tensor_hook == "hook" and len(stream) == 2
    assert len(list(stream)) == 2
    flat.zero_()  # the buffer is reused for the next bucket: the record is a copy
    assert stream.sent["a"].tolist() == [0.0, 1.0] and stream.sent["b"].tolist() == [[2.0, 3.0],
                                                                                     [4.0, 5.0]]


def test_optimizer_check_looks_inside_megatrons_chained_optimizer():
    """megatron-core 0.16.1's get_megatron_optimizer returns a ChainedOptimizer (dense / expert
    groups), whose members are the DistributedOptimizers the check asks for."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import ChainedOptimizer

    gpu_smoke = _smoke_module()
    chained = ChainedOptimizer.__new__(ChainedOptimizer)
    chained.chained_optimizers = [DistributedOptimizer.__new__(DistributedOptimizer)] * 2
    assert gpu_smoke.optimizer_classes(chained) == "DistributedOptimizer + DistributedOptimizer"
    assert gpu_smoke.optimizer_classes(torch.optim.Adam([torch.zeros(1, requires_grad=True)])) == "Adam"


def test_exact_resume_names_the_kernels_pytorch_warns_about():
    gpu_smoke = _smoke_module()
    msg = ("scatter_reduce_cuda does not have a deterministic implementation, but you set "
           "'torch.use_deterministic_algorithms(True, warn_only=True)'.")
    flash = ("Flash attention defaults to a non-deterministic algorithm. To explicitly enable "
             "determinism call torch.use_deterministic_algorithms(True, warn_only=False).")
    assert gpu_smoke._is_nondeterminism(msg) and gpu_smoke._is_nondeterminism(flash)
    assert not gpu_smoke._is_nondeterminism("some other warning")
    assert gpu_smoke._kernel_of(msg) == "scatter_reduce_cuda"
    assert gpu_smoke._kernel_of(flash) == "Flash attention"
    named = gpu_smoke.nondeterministic_kernels({"scatter_reduce_cuda"}, cuda=True)
    assert "warned by PyTorch: scatter_reduce_cuda" in named and "scaled_dot_product_attention" in named
    assert gpu_smoke.nondeterministic_kernels(set(), cuda=False) == "none"
