"""The GPU smoke's wheel closure: what bench/gpu_smoke.py needs beyond the lent GPU machine's torch,
fetched here by one command and installed there without a network.

    python bench/gpu_smoke.py --fetch-wheels bench/wheels     # here: a package index is reachable
    # device: carry ["bench/wheels"]; python3 bench/gpu_smoke.py --wheels bench/wheels ...

**What the machine has.** The lent machine (one H100 or H200) has Python 3.12 and torch 2.11 for
CUDA 13, and no megatron-core, Transformer Engine, SGLang or vLLM; nothing else about it is
known here, and nothing beyond the machine can be reached from it. So the closure is everything
:data:`REQUIRED` resolves to for CPython 3.12 on manylinux x86_64 except torch and torch's own
dependency closure (read from the resolution; ``--device-has FREEZE`` leaves out, in addition, what
a ``pip list --format=freeze`` of the machine names).

**What is carried.** At most :data:`CARRY_LIMIT` travels with the working tree (64 MiB in all),
so the closure must fit in that less the tree itself (:func:`carry_budget`). Measured on
2026-12-07 (megatron-core 0.19.2, transformers 5.25, numpy 2.5): :data:`REQUIRED` is about 53 MiB;
sglang-router alone is 29 MiB (a Rust binary) and tensorboard with grpcio, protobuf and pillow 14
MiB. The smoke needs neither (its rollout server is the project's own, its loggers ``jsonl``);
:data:`OPTIONAL` (the router, for the ``train_command`` check, which starts the command line's
embedded router) is fetched only when it fits the budget, and the smoke skips ``train_command``,
naming why, where the router does not import.

**The install.** ``requirements.lock`` in the directory pins every wheel (``name==version
--hash=sha256:...``); on the machine ``pip install --no-index --no-deps --require-hashes
--find-links DIR`` installs the closure into ``--install-target`` (all of it) or this Python's
environment (what it lacks), only when a required module does not import.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]

# module -> requirement (the project's ranges, pyproject.toml): what the checks import
REQUIRED = {
    "megatron.core": "megatron-core==0.19.2",  # the stack slurm/Dockerfile's Python 3.12 image gets
    "yaml": "pyyaml>=6.0,<7",
    "transformers": "transformers>=4.57,<6",
    "tokenizers": "tokenizers",
    "safetensors": "safetensors>=0.5,<1",
    "numpy": "numpy>=1.26,<3",
    "psutil": "psutil>=5.9,<8",
    "tqdm": "tqdm>=4.66,<5",
    "math_verify": "math-verify>=0.8,<1",
    "aiohttp": "aiohttp>=3.9,<4",
    "fastapi": "fastapi>=0.110,<1",   # the project's rollout server
    "uvicorn": "uvicorn>=0.29,<1",
}
OPTIONAL = {
    "sglang_router": "sglang-router==0.3.2",  # train_command: the command line's embedded router
}
DEPENDENCIES = {**REQUIRED, **OPTIONAL}

# CPython 3.12 on linux x86_64, manylinux wheels only (the GPU image's Python; glibc >= 2.28)
PYTHON_VERSION = "3.12"
PLATFORMS = ([f"manylinux_2_{minor}_x86_64" for minor in range(28, 4, -1)]
             + ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"])
DEVICE_HAS = ("torch",)
LOCK = "requirements.lock"
"""In the wheel directory: ``name==version --hash=sha256:...`` per wheel, the exact closure."""
CARRY_LIMIT = 64 * 2**20
"""What the device tool carries with the working tree, in all."""


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_name(requirement: str) -> str:
    return _canonical(re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0])


def _target_environment(python_version: str) -> dict:
    return {"python_version": python_version, "python_full_version": f"{python_version}.0",
            "implementation_name": "cpython", "implementation_version": f"{python_version}.0",
            "platform_python_implementation": "CPython", "os_name": "posix",
            "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
            "platform_release": "", "platform_version": "", "extra": ""}


def _requires(requires_dist, env: dict, extras=()) -> list[tuple[str, frozenset]]:
    """(canonical name, extras) of the requirements that apply in ``env`` with ``extras`` of
    the requiring distribution (torch asks for ``cuda-toolkit[cublas, ...]``, whose wheels come
    in through those extras' markers)."""
    try:
        from packaging.requirements import Requirement
    except ImportError:  # pip's own copy
        from pip._vendor.packaging.requirements import Requirement
    out = []
    for line in requires_dist or []:
        req = Requirement(line)
        if req.marker is None or any(req.marker.evaluate({**env, "extra": extra})
                                     for extra in ("", *extras)):
            out.append((_canonical(req.name), frozenset(_canonical(e) for e in req.extras)))
    return out


def _closure(items: dict, roots, env: dict) -> set[str]:
    """The names ``roots`` need, over the resolution's ``requires_dist`` (with extras)."""
    out, seen = set(), set()
    todo = [(r, frozenset()) for r in roots if r in items]
    while todo:
        name, extras = todo.pop()
        if (name, extras) in seen:
            continue
        seen.add((name, extras))
        out.add(name)
        todo += [(dep, dep_extras) for dep, dep_extras in
                 _requires(items[name].get("requires_dist"), env, extras) if dep in items]
    return out


def _pip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise SystemExit(f"gpu_smoke: pip {args[0]} failed ({proc.returncode}):\n"
                         f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def _platform_args(python_version: str) -> list[str]:
    args = ["--only-binary=:all:", "--python-version", python_version, "--implementation", "cp"]
    for platform in PLATFORMS:
        args += ["--platform", platform]
    return args


def working_tree_bytes() -> int:
    """The bytes of the files the device tool copies: tracked, and untracked but not ignored."""
    proc = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                          cwd=ROOT, capture_output=True, check=True)
    return sum((ROOT / n).stat().st_size for n in proc.stdout.decode().split("\0")
               if n and (ROOT / n).is_file())


def carry_budget() -> int:
    """What the wheels may take: the carry limit less the working tree."""
    return CARRY_LIMIT - working_tree_bytes()


def download_closure(dest: Path, *, python_version: str = PYTHON_VERSION,
                     device_has: Optional[Path] = None,
                     budget: Optional[int] = None) -> tuple[list[tuple[str, str, int]], list[str]]:
    """Resolve :data:`DEPENDENCIES` for CPython ``python_version`` on manylinux x86_64 (``pip
    install --dry-run --report``: the wheels' metadata, nothing installed), leave out torch and
    its own closure (and what ``device_has`` names), download the rest (``pip download
    --no-deps``) into ``dest``, and, when the whole exceeds ``budget`` (None: no limit), remove
    what only :data:`OPTIONAL` needs. Writes ``dest/requirements.lock`` with the sha256 of each
    wheel kept. Returns ([(name, version, bytes)] kept, ["name==version (MiB)"] left out)."""
    dest.mkdir(parents=True, exist_ok=True)
    platform = _platform_args(python_version)
    with tempfile.TemporaryDirectory(prefix="gpu_smoke_resolve_") as tmp:
        report = Path(tmp) / "report.json"
        # the finder picks candidates for --python-version; pip's final Requires-Python check
        # of a dry-run install reads the running interpreter (3.11 here: megatron-core 0.19.2
        # needs >= 3.12), hence --ignore-requires-python
        _pip("install", "--dry-run", "--ignore-installed", "--ignore-requires-python", "--quiet",
             "--report", str(report), "--target", str(Path(tmp) / "target"), *platform,
             *DEPENDENCIES.values())
        resolved = json.loads(report.read_text())["install"]
    env = _target_environment(python_version)
    items = {_canonical(i["metadata"]["name"]): i["metadata"] for i in resolved}
    excluded = _closure(items, DEVICE_HAS, env)  # what the GPU machine's torch came with
    if device_has is not None:
        for line in device_has.read_text().splitlines():
            line = line.split("#")[0].strip()
            if line:
                excluded.add(_canonical(line.split("==")[0].split(" @ ")[0].strip()))
    required = _closure(items, [_requirement_name(r) for r in REQUIRED.values()], env)
    wanted = sorted((items[n]["name"], items[n]["version"]) for n in items if n not in excluded)
    _pip("download", "--no-deps", "--quiet", "-d", str(dest), *platform,
         *[f"{name}=={version}" for name, version in wanted])
    files = {}
    for wheel in dest.glob("*.whl"):
        parts = wheel.name.split("-")
        files[(_canonical(parts[0]), parts[1])] = wheel
    sizes = {}
    for name, version in wanted:
        wheel = files.get((_canonical(name), version))
        if wheel is None:
            raise SystemExit(f"gpu_smoke: pip download did not fetch {name}=={version}")
        sizes[(name, version)] = wheel.stat().st_size
    left_out = []
    if budget is not None and sum(sizes.values()) > budget:
        for name, version in [w for w in wanted if _canonical(w[0]) not in required]:
            size = sizes.pop((name, version))
            files.pop((_canonical(name), version)).unlink()
            left_out.append(f"{name}=={version} ({size / 2**20:.1f} MiB)")
        wanted = [w for w in wanted if w in sizes]
        if sum(sizes.values()) > budget:
            raise SystemExit(f"gpu_smoke: the required wheels take {sum(sizes.values()) / 2**20:.1f}"
                             f" MiB, over the {budget / 2**20:.1f} MiB the device carries beside "
                             "the working tree; pass --device-has (the machine's pip freeze)")
    lines = [f"# gpu_smoke --fetch-wheels: CPython {python_version}, manylinux x86_64 wheels; "
             f"install with: pip install --no-index --no-deps --require-hashes --find-links "
             f"DIR -r {LOCK}",
             "# left out (the GPU machine has them, torch's closure"
             + (f" and {device_has.name}" if device_has else "") + "): "
             + " ".join(f"{items[n]['name']}=={items[n]['version']}" for n in sorted(excluded)
                        if n in items)]
    if left_out:
        lines.append("# left out (over the carry budget; only optional checks need them): "
                     + " ".join(left_out))
    out = []
    for name, version in wanted:
        wheel = files[(_canonical(name), version)]
        digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
        lines.append(f"{name}=={version} --hash=sha256:{digest}")
        out.append((name, version, sizes[(name, version)]))
    (dest / LOCK).write_text("\n".join(lines) + "\n")
    return out, left_out


def missing_modules(modules=None) -> list[str]:
    """Of ``modules`` (default: :data:`REQUIRED`), those that do not import here."""
    out = []
    for module in (REQUIRED if modules is None else modules):
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # a parent package is absent
            found = False
        if not found:
            out.append(module)
    return out


def install_missing(wheels: Path, target: Optional[Path] = None) -> list[str]:
    """When a required module does not import: install the wheel directory's exact closure
    (``requirements.lock``, written by ``--fetch-wheels``) from that directory only, ``--no-index
    --no-deps --require-hashes``: into ``target`` all of it, else the distributions this Python
    does not have (the ones it has, torch's among them, stay as they are). Returns the
    ``name==version`` installed."""
    missing = missing_modules()
    if not missing:
        return []
    lock = wheels / LOCK
    if not lock.is_file():
        raise SystemExit(f"gpu_smoke: missing {', '.join(REQUIRED[m] for m in missing)} and no "
                         f"{lock} (run `python bench/gpu_smoke.py --fetch-wheels {wheels}` on a "
                         "machine with a package index, then carry the directory here)")
    wanted = []
    for line in lock.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        name = line.split("==")[0]
        if target is None:
            try:
                importlib.metadata.distribution(name)
                continue  # this Python has it
            except importlib.metadata.PackageNotFoundError:
                pass
        wanted.append(line)
    if not wanted:
        return []
    with tempfile.TemporaryDirectory(prefix="gpu_smoke_install_") as tmp:
        req = Path(tmp) / "requirements.txt"
        req.write_text("\n".join(wanted) + "\n")
        args = ["install", "--no-index", "--no-deps", "--require-hashes", "--find-links",
                str(wheels), "-r", str(req)]
        if target is not None:
            args += ["--target", str(target)]
        _pip(*args)
    return [line.split(" ")[0] for line in wanted]
