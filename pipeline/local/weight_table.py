"""The served model's weights by their Hugging Face names, and the checked loading of updates.

:class:`WeightTable` maps the on-disk / on-the-wire names to views of the transformers model's
parameters and applies every kind of weight update there (engine thread, through
``LocalEngine.call``): full tensors and bf16 deltas (:meth:`WeightTable.apply_update`), safetensors
shards read straight into the parameters (:meth:`WeightTable.load_shards`). Each is checked first
(:func:`shard_headers` for a directory), so a refused update changes nothing.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
from pathlib import Path
from typing import Optional

import torch

from megatron_gspo.hf.fp8 import SCALE_SUFFIX, dequantize, is_quantized, quantize, scale_shape
from pipeline.weights.transport import (checksum_digest, delta_apply, read_shard_header,
                                        tensor_sums, weights_checksum)

FP8 = torch.float8_e4m3fn


class WeightFileError(ValueError):
    """A weight directory, index or shard this server refuses to load (the message says why)."""


class WeightTable:
    """Hugging Face on-disk names -> (parameter, index) of the in-memory transformers model.

    transformers 5 fuses a layer's experts into ``experts.gate_up_proj`` [E, 2I, H] (gate rows
    first) and ``experts.down_proj`` [E, H, I]; on disk (and on the wire) they are the per-expert
    ``experts.{e}.{gate,up,down}_proj.weight``. transformers 4 keeps the per-expert modules.
    """

    _FUSED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")

    def __init__(self, model: torch.nn.Module, *, fp8: bool = False):
        self.fp8 = fp8
        """``--quantization fp8``: the projections (``megatron_gspo.hf.fp8.is_quantized``) arrive
        as float8_e4m3fn blocks with their ``<name>_scale_inv``, and the model computes with
        their dequantized values (the weights SGLang's FP8 kernels use; its activations' FP8
        quantization is not imitated)."""
        self.entries: dict[str, tuple[torch.nn.Parameter, tuple, bool]] = {}  # param, index, transposed
        modules = dict(model.named_modules())
        for name, param in model.named_parameters():
            fused = self._FUSED.match(name)
            if fused and param.dim() == 3:
                prefix, kind = fused.groups()
                transposed = bool(getattr(modules.get(prefix), "is_transposed", False))
                for e in range(param.shape[0]):
                    if kind == "gate_up_proj":
                        inter = param.shape[2 if transposed else 1] // 2
                        for j, w in enumerate(("gate", "up")):
                            rows = slice(j * inter, (j + 1) * inter)
                            index = (e, slice(None), rows) if transposed else (e, rows)
                            self.entries[f"{prefix}.{e}.{w}_proj.weight"] = (param, index, transposed)
                    else:
                        self.entries[f"{prefix}.{e}.down_proj.weight"] = (param, (e,), transposed)
            else:
                self.entries[name] = (param, (), False)
        # Tied embeddings: lm_head.weight is not a separate parameter; accept it as an alias.
        self.aliases = {}
        if "lm_head.weight" not in self.entries and "model.embed_tokens.weight" in self.entries:
            self.aliases["lm_head.weight"] = "model.embed_tokens.weight"

    def names(self) -> list[str]:
        return sorted(self.entries)

    def _resolve(self, name: str):
        name = self.aliases.get(name, name)
        if name not in self.entries:
            raise KeyError(name)
        return self.entries[name]

    def scale_of(self, name: str) -> Optional[str]:
        """With :attr:`fp8`: the weight whose per-block scale ``name`` is (None: not a scale)."""
        if not (self.fp8 and name.endswith(SCALE_SUFFIX)):
            return None
        base = name[:-len(SCALE_SUFFIX)]
        try:
            return base if is_quantized(base, self.shape(base)) else None
        except KeyError:
            return None

    def shape(self, name: str) -> tuple[int, ...]:
        base = self.scale_of(name)
        if base is not None:
            return scale_shape(self.shape(base))
        param, index, transposed = self._resolve(name)
        view = param.data[index]
        return tuple(view.t().shape) if transposed else tuple(view.shape)

    def get(self, name: str) -> torch.Tensor:
        return self.view(name).clone()

    def view(self, name: str) -> torch.Tensor:
        """The live weight in HF layout (a view of the parameter: writes go to the model)."""
        param, index, transposed = self._resolve(name)
        view = param.data[index]
        return view.t() if transposed else view

    def fp8_problems(self, dtypes: dict[str, torch.dtype]) -> list[str]:
        """What stops a set of tensors (name -> dtype: one update, or one shard) from loading as
        FP8 weights and scales: each FP8 projection with its scale, both here; no FP8 at all
        without :attr:`fp8`."""
        problems = []
        for name, dtype in dtypes.items():
            base = self.scale_of(name)
            if base is not None:
                if dtypes.get(base) != FP8:
                    problems.append(f"{name}: a scale without its float8_e4m3fn weight {base} in "
                                    "the same update")
                continue
            try:
                quantized = self.fp8 and is_quantized(name, self.shape(name))
            except KeyError:
                continue  # named by the shape check
            if quantized and (dtype != FP8 or name + SCALE_SUFFIX not in dtypes):
                problems.append(f"{name}: {dtype} without {name}{SCALE_SUFFIX}: this server runs "
                                "FP8 weights (--quantization fp8); a projection comes as "
                                "float8_e4m3fn with its per-block scale")
            elif dtype == FP8 and not quantized:
                problems.append(f"{name}: float8_e4m3fn, but this server "
                                + ("keeps it unquantized" if self.fp8 else
                                   "runs without --quantization fp8"))
        return problems

    def check(self, tensors: dict[str, torch.Tensor]) -> list[str]:
        """Every problem that would stop ``tensors`` from being loaded (empty: loadable)."""
        problems = self.fp8_problems({n: t.dtype for n, t in tensors.items()})
        for name, t in tensors.items():
            try:
                shape = self.shape(name)
            except KeyError:
                problems.append(f"{name}: no such parameter in the served model")
                continue
            if tuple(t.shape) != shape:
                problems.append(f"{name}: shape {list(t.shape)} does not match the model's {list(shape)}")
            elif not (t.is_floating_point()):
                problems.append(f"{name}: dtype {t.dtype} is not a floating-point type")
        return problems

    @torch.no_grad()
    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy (casting to the parameter dtype; FP8 weights dequantized with their scales);
        call :meth:`check` first."""
        for name, t in tensors.items():
            if self.scale_of(name) is not None:
                continue  # loaded with its weight
            if t.dtype == FP8:
                t = dequantize(t, tensors[name + SCALE_SUFFIX], self.view(name).dtype)
            param, index, transposed = self._resolve(name)
            param.data[index].copy_(t.t() if transposed else t)

    @torch.no_grad()
    def round_to_fp8(self) -> None:
        """At the start, with :attr:`fp8`: every projection of the loaded checkpoint replaced by
        its FP8 blocks' value, as a server started from it serves (later updates send FP8)."""
        for name in self.names():
            if is_quantized(name, self.shape(name)):
                view = self.view(name)
                view.copy_(dequantize(*quantize(view), view.dtype))

    def checksum(self) -> str:
        return weights_checksum((n, self.get(n)) for n in self.names())

    def apply_update(self, full: dict[str, torch.Tensor],
                     deltas: dict[str, tuple[torch.Tensor, torch.Tensor]], *,
                     checksum: bool = False) -> Optional[str]:
        """Full tensors and bf16 deltas (``pipeline.weights.transport.delta_apply``); checked first, so a
        bad update changes nothing. ``checksum``: returns :meth:`bucket_checksum` of every
        touched weight, each summed right after it is written (while its bytes are in cache)."""
        problems = self.check(full)
        for name, (index, values) in deltas.items():
            try:
                numel = torch.Size(self.shape(name)).numel()
            except KeyError:
                problems.append(f"{name}: no such parameter in the served model")
                continue
            if index.numel() != values.numel() or (index.numel() and (
                    int(index.min()) < 0 or int(index.max()) >= numel)):
                problems.append(f"{name}: delta indices out of range or unpaired")
        if problems:
            raise ValueError("; ".join(problems[:10]) + (
                f" (and {len(problems) - 10} more)" if len(problems) > 10 else ""))
        parts = {}
        for name, t in full.items():
            if self.scale_of(name) is not None or t.dtype == FP8:
                if t.dtype == FP8:
                    self.load({name: t, name + SCALE_SUFFIX: full[name + SCALE_SUFFIX]})
                if checksum:  # FP8: the blocks and scales received (what it computes from)
                    parts[name] = tensor_sums(t)
                continue
            self.load({name: t})
            if checksum:
                parts[name] = tensor_sums(self.view(name).to(t.dtype))
        for name, (index, values) in deltas.items():
            target = self.view(name)
            if target.is_contiguous():
                delta_apply(target, index, values)
            else:  # a transposed fused-expert view: apply on a copy, write it back
                work = target.contiguous()
                delta_apply(work, index, values)
                target.copy_(work)
            if checksum:
                parts[name] = tensor_sums(target.to(values.dtype))
        return checksum_digest(parts) if checksum else None

    def header_problems(self, headers: dict[str, tuple[list, int]], *,
                        whose: str = "the model's") -> list[str]:
        """Every tensor of the shards ``headers`` (:func:`shard_headers`) this model has no
        place for or whose shape differs from its parameter's (``whose``, in the message),
        naming the file, the tensor and both shapes (empty: they fit)."""
        problems = []
        for f, (layout, _) in headers.items():
            problems += [f"{f}: {p}" for p in self.fp8_problems({e[0]: e[1] for e in layout})]
            for name, dtype, shape, _, _ in layout:
                try:
                    want = self.shape(name)
                except KeyError:
                    problems.append(f"{f}: {name}: no such parameter in the served model")
                    continue
                if tuple(shape) != tuple(want):
                    problems.append(f"{f}: {name}: shape {list(shape)} does not match "
                                    f"{whose} {list(want)}")
        return problems

    def load_shards(self, path: str | Path) -> dict[str, str]:
        """``update_weights_from_disk``: read every safetensors file of ``path`` straight into
        the parameters (``readinto`` where the weight is contiguous and of the file's dtype);
        returns {file name: bucket checksum of what is now loaded}. Every header is checked
        first, so a bad directory changes nothing."""
        headers = shard_headers(path)
        problems = self.header_problems(headers)
        if problems:
            raise ValueError("; ".join(problems[:10]))

        def load_one(f: str) -> str:
            layout, data_start = headers[f]
            parts = {}  # each tensor summed right after its read, while it is in cache
            fp8 = {}  # FP8 weights and their scales, dequantized once the file is read
            with open(Path(path) / f, "rb", buffering=0) as fh:
                for name, dtype, shape, start, end in layout:
                    if dtype == FP8 or self.scale_of(name) is not None:
                        fh.seek(data_start + start)
                        raw = torch.empty(end - start, dtype=torch.uint8)
                        if _read_into(fh, memoryview(raw.numpy())) != end - start:
                            raise ValueError(f"{f}: {name}: file ends early")
                        fp8[name] = raw.view(dtype).view(shape)
                        parts[name] = tensor_sums(fp8[name])
                        continue
                    target = self.view(name)
                    fh.seek(data_start + start)
                    if (target.is_contiguous() and target.dtype == dtype
                            and target.device.type == "cpu"):
                        dst = target.view(-1).view(torch.uint8) if target.numel() else None
                    else:
                        dst = torch.empty(end - start, dtype=torch.uint8)
                    if dst is not None and _read_into(fh, memoryview(dst.numpy())) != end - start:
                        raise ValueError(f"{f}: {name}: file ends early")
                    if dst is not None and dst.data_ptr() != target.data_ptr():
                        target.copy_(dst.view(dtype).view(shape))
                    parts[name] = tensor_sums(target.to(dtype))
            self.load(fp8)
            return checksum_digest(parts)

        # Shards hold disjoint tensors: read them on up to 2 threads (readinto and torch release
        # the GIL), so one shard's read overlaps another's checksum.
        files = list(headers)
        threads = min(2, len(files), os.cpu_count() or 1)
        if threads <= 1:
            return {f: load_one(f) for f in files}
        with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="load") as pool:
            return dict(zip(files, pool.map(load_one, files)))



def fp8_update(full: dict[str, torch.Tensor], dtype: torch.dtype
               ) -> tuple[dict[str, torch.Tensor], dict[str, tuple]]:
    """An update's FP8 weights (float8_e4m3fn, each with its ``<name>_scale_inv``) as the
    dequantized values to load, in ``dtype``, the other tensors as they are; and the checksum
    parts of the FP8 entries as received (their blocks and scales). What a TP rank that holds
    plain tensors (``pipeline.local.tp_ranks``) does with what :class:`WeightTable` loads."""
    out, parts = {}, {}
    for name, t in full.items():
        if name.endswith(SCALE_SUFFIX) and name[:-len(SCALE_SUFFIX)] in full:
            parts[name] = tensor_sums(t)
            continue
        if t.dtype == FP8:
            scale = full.get(name + SCALE_SUFFIX)
            if scale is None:
                raise ValueError(f"{name}: float8_e4m3fn without {name}{SCALE_SUFFIX}")
            parts[name] = tensor_sums(t)
            t = dequantize(t, scale, dtype)
        out[name] = t
    return out, parts


def _read_into(fh, buf: memoryview) -> int:
    """readinto until ``buf`` is full or the file ends (one read may return less)."""
    got = 0
    while got < len(buf):
        n = fh.readinto(buf[got:])
        if not n:
            break
        got += n
    return got


def shard_files(path: str | Path) -> list[str]:
    """The safetensors files of a directory (those of its index, if it has one). The index must
    be a JSON object whose ``weight_map`` maps names to plain file names of that directory
    (:class:`WeightFileError` otherwise: no ``../``, no absolute paths, no missing file)."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: not a directory")
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as err:
            raise WeightFileError(f"{index}: malformed index ({type(err).__name__}: {err}); "
                                  "expected a JSON object with a 'weight_map'") from None
        if not isinstance(weight_map, dict) or not weight_map:
            raise WeightFileError(f"{index}: 'weight_map' must be a non-empty object of "
                                  "tensor name -> file name")
        files = set()
        for name, file in weight_map.items():
            if (not isinstance(file, str) or not file or Path(file).name != file
                    or file in (".", "..") or "\\" in file):
                raise WeightFileError(f"{index}: {name!r} -> {file!r}: not a file name of this "
                                      "directory")
            if not (path / file).is_file():
                raise WeightFileError(f"{index}: {name!r} -> {file!r}: no such file in {path}")
            files.add(file)
        files = sorted(files)
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files")
    return files


_MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on the JSON header


def shard_headers(path: str | Path) -> dict[str, tuple[list, int]]:
    """{file: (layout, data start)} of every shard of ``path`` (:func:`shard_files`), each
    header checked against its file: a header that is not JSON, an unknown dtype, offsets that
    do not match the shape or run past the end of the file (a truncated shard) are a
    :class:`WeightFileError` naming the file - before any weight is touched."""
    headers = {}
    for f in shard_files(path):
        file = Path(path) / f
        size = file.stat().st_size
        if size < 8:
            raise WeightFileError(f"{file}: {size} bytes: not a safetensors file (truncated?)")
        with open(file, "rb") as fh:
            header_len = int.from_bytes(fh.read(8), "little")
        if header_len > min(_MAX_HEADER_BYTES, size - 8):
            raise WeightFileError(f"{file}: header of {header_len} bytes in a file of {size} "
                                  "bytes (truncated or not safetensors)")
        try:
            layout, data_start = read_shard_header(file)
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise WeightFileError(f"{file}: malformed safetensors header ({type(err).__name__}: "
                                  f"{err})") from None
        for entry in layout:
            try:
                name, dtype, shape, start, end = entry
                numel = torch.Size([int(d) for d in shape]).numel()
                if not all(isinstance(v, int) for v in (start, end, *shape)):
                    raise TypeError("non-integer shape or offsets")
            except (TypeError, ValueError) as err:
                raise WeightFileError(f"{file}: {entry[0]}: malformed header entry ({err})"
                                      ) from None
            if not 0 <= start <= end or end - start != numel * dtype.itemsize:
                raise WeightFileError(f"{file}: {name}: data_offsets [{start}, {end}] do not "
                                      f"hold a {dtype} tensor of shape {list(shape)}")
            if data_start + end > size:
                raise WeightFileError(f"{file}: {name} ends at byte {data_start + end}, the file "
                                      f"has {size} (truncated)")
        headers[f] = (layout, data_start)
    return headers
