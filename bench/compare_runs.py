"""Are two runs the same run? Every non-timing value of ``metrics.jsonl`` and every tensor of the
final policy (``hf/*.safetensors``), compared exactly.

The check behind "behaviour unchanged" for a refactor: the same deterministic run
(``rollout.deterministic: true``) on the code before and after, then this script::

    megatron-gspo train --config launch/configs/tiny_cpu.yaml --set run.num_steps=6 \\
        --set rollout.deterministic=true --set run.eval_interval=3 --set run.save_interval=3 \\
        --set run.init_from=SFT/hf --set run.output_dir=A          # on the old checkout
    ...                                         --set run.output_dir=B          # on the new one
    python bench/compare_runs.py A B

Time metrics (keys ending in ``_s``, ``per_s``, ``idle_frac`` or ``seconds``) differ between any
two runs and are skipped (listed). Exit status 0 when every compared value and tensor is equal,
1 otherwise (each difference printed).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

TIMING = re.compile(r"(_s|per_s|idle_frac|seconds)$")
"""Metric names that are wall-clock measurements."""


def metric_differences(a: Path, b: Path) -> tuple[list[str], int, set[str]]:
    """(differences, values compared, timing keys skipped) of two ``metrics.jsonl`` files."""
    rows_a = [json.loads(line) for line in a.read_text().splitlines()]
    rows_b = [json.loads(line) for line in b.read_text().splitlines()]
    out, compared, skipped = [], 0, set()
    if len(rows_a) != len(rows_b):
        out.append(f"{len(rows_a)} rows vs {len(rows_b)}")
    for ra, rb in zip(rows_a, rows_b):
        step = ra.get("step")
        if list(ra) != list(rb):
            out.append(f"step {step}: keys {sorted(set(ra) ^ set(rb))} or their order differ")
        for key, value in ra.items():
            if TIMING.search(key):
                skipped.add(key)
                continue
            compared += 1
            if value != rb.get(key):
                out.append(f"step {step}: {key} {value!r} != {rb.get(key)!r}")
    return out, compared, skipped


def weight_differences(a: Path, b: Path) -> tuple[list[str], int]:
    """(differences, tensors compared) of two Hugging Face directories' safetensors."""
    def tensors(d: Path) -> dict[str, torch.Tensor]:
        found: dict[str, torch.Tensor] = {}
        for path in sorted(d.glob("*.safetensors")):
            found.update(load_file(path))
        return found
    ta, tb = tensors(a), tensors(b)
    out = [f"{name}: only in one" for name in sorted(set(ta) ^ set(tb))]
    out += [f"{name}: differs" for name in sorted(set(ta) & set(tb))
            if ta[name].dtype != tb[name].dtype or not torch.equal(ta[name], tb[name])]
    return out, len(set(ta) & set(tb))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_a", type=Path)
    parser.add_argument("run_b", type=Path)
    args = parser.parse_args(argv)
    metrics, compared, skipped = metric_differences(args.run_a / "metrics.jsonl",
                                                    args.run_b / "metrics.jsonl")
    weights, tensors = weight_differences(args.run_a / "hf", args.run_b / "hf")
    for line in metrics + weights:
        print(line)
    print(f"metrics: {compared} values compared, {len(metrics)} differ (timing keys skipped: "
          f"{', '.join(sorted(skipped))}); final policy: {tensors} tensors compared, "
          f"{len(weights)} differ")
    return 1 if metrics or weights or not compared or not tensors else 0


if __name__ == "__main__":
    sys.exit(main())
