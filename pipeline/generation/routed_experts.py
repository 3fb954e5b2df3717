"""Routed experts (routing replay ``rollout``, R3): SGLang's wire format and the training layout.

What SGLang 0.5.23 returns for a ``/generate`` request with ``"return_routed_experts": true``
(server started with ``--enable-return-routed-experts``; read from its wheel:
``state_capturer/base.py`` ``BaseTopkCapturer.get_topk``, ``detokenizer_manager.py``
``_b64_encode_per_request``, ``tokenizer_manager.py``, ``state_capturer/routed_experts.py``
``extract_routed_experts_from_meta_info``):

* ``meta_info["routed_experts"]``: one base64 string per sample (per element of a batch or of
  ``n``), the bytes of a C-contiguous **int32** array ``[rows, num_hidden_layers, top_k]``
  (``tensor.numpy().tobytes()``: native byte order, little-endian on every machine SGLang runs
  on), i.e. the flat ``np.frombuffer(b64decode(s), dtype=np.int32)``;
* row ``j`` is sequence position ``start + j`` of ``prompt + output`` for positions
  ``[start, seqlen - 1)``, ``seqlen = len(prompt) + len(output)``, ``start`` =
  ``routed_experts_start_len`` (default 0, at most the prompt length): the experts every layer
  routed that position's token to when it was an *input* of the forward pass. The last output
  token is never fed back, so it has no row;
* the ids are logical expert ids (captured before any EPLB logical -> physical mapping), in the
  order of the top-k kernel (descending router weight); a layer without routed experts (a dense
  layer) keeps the capture buffer's zeros.

The training batch (:func:`batch_routed_experts`) puts them in the layout of ``tokens``
(``megatron_gspo.train.batching.rl_batch``): ``routed_experts[i, t]`` are the experts that routed
input token ``t`` of row ``i``; ``-1`` where unknown (right padding, positions before ``start``,
samples without routing data).
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Optional

import numpy as np
import torch

from pipeline.generation import answers

UNKNOWN = -1
"""The ``routed_experts`` value of positions without routing data (padding, not returned)."""

WIRE_DTYPE = answers.ROUTED_DTYPE
"""int32, little-endian: what SGLang's ``tensor.numpy().tobytes()`` writes on x86 and ARM."""


def expected_rows(prompt_len: int, output_len: int, start_len: int = 0) -> int:
    """Rows SGLang returns: positions ``[start_len, prompt_len + output_len - 1)``."""
    return answers.expected_rows(prompt_len, output_len, start_len)


def encode(experts: "torch.Tensor") -> str:
    """``[rows, num_layers, top_k]`` integer expert ids -> SGLang's base64 string."""
    array = experts.detach().cpu().to(torch.int32).contiguous().numpy()
    return base64.b64encode(array.astype(WIRE_DTYPE, copy=False).tobytes()).decode("ascii")


def decode(text: str, rows: int, num_layers: int, top_k: int) -> "torch.Tensor":
    """SGLang's base64 string -> int32 ``[rows, num_layers, top_k]``; ValueError if the payload
    is not base64 of exactly that many int32 values (``answers.routed_bytes``)."""
    return from_bytes(answers.routed_bytes(text, rows, num_layers, top_k), rows, num_layers, top_k)


def from_bytes(raw: bytes, rows: int, num_layers: int, top_k: int) -> "torch.Tensor":
    """The int32 bytes of a checked answer (``answers.routed_bytes``) -> ``[rows, layers, top_k]``."""
    flat = np.frombuffer(raw, dtype=WIRE_DTYPE).astype(np.int32)
    return torch.from_numpy(flat.reshape(rows, num_layers, top_k))


def batch_routed_experts(prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]],
                         routed: Sequence[Optional["torch.Tensor"]], seq_length: int,
                         num_layers: int, top_k: int) -> "torch.Tensor":
    """int16 ``[num_seqs, seq_length, num_layers, top_k]`` (expert ids below 32768: a quarter
    of int64's memory for every position of every padded row) in the layout of ``rl_batch``'s
    ``tokens`` (``prompt + output`` without its last token, right-padded): row ``i``, position
    ``t`` = ``routed[i][t]`` (routing data from position 0, as the client asks for it), ``-1``
    at padding and for a sample whose ``routed[i]`` is None. ValueError naming the sample when
    its routing data does not have one row per input token or the wrong layers / top-k."""
    dtype = torch.int16
    largest = torch.iinfo(dtype).max
    out = torch.full((len(prompts), seq_length, num_layers, top_k), UNKNOWN, dtype=dtype)
    for i, (prompt, output, experts) in enumerate(zip(prompts, outputs, routed, strict=True)):
        if experts is None:
            continue
        rows = expected_rows(len(prompt), len(output))
        if tuple(experts.shape) != (rows, num_layers, top_k):
            raise ValueError(f"sample {i}: routed_experts of shape {list(experts.shape)}; "
                             f"expected [{rows}, {num_layers}, {top_k}] (prompt {len(prompt)} + "
                             f"response {len(output)} tokens - 1, model.num_layers, "
                             "model.moe_router_topk)")
        if rows > seq_length:
            raise ValueError(f"sample {i}: {rows} routed positions exceed run.seq_length "
                             f"{seq_length}")
        if experts.numel() and int(experts.max()) > largest:
            raise ValueError(f"sample {i}: expert id {int(experts.max())} does not fit the "
                             f"int16 routed_experts batch tensor (ids up to {largest})")
        out[i, :rows] = experts.to(dtype)
    return out
