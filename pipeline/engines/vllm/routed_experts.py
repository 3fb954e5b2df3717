"""Routed experts (routing replay ``rollout``, R3) from vLLM 0.32, in the project's format.

What vLLM 0.32 returns, on GPUs, for every request of a server started with
``--enable-return-routed-experts`` (``pipeline.engines.vllm.server_args``; it needs Model Runner
V2, hence Triton, so never on the CPU build), read from its code:

* the field ``routed_experts`` of each choice of ``/inference/v1/generate`` and
  ``/v1/completions`` (``entrypoints/scale_out/token_in_token_out/protocol.py``
  ``GenerateResponseChoice``, ``entrypoints/openai/completion/protocol.py``): the base64 of the
  ``.npy`` serialisation of one array (``utils/serial_utils.py`` ``numpy2base64``:
  ``np.save(buffer, array, allow_pickle=False)``), or ``null`` when the request was aborted
  before any forward pass or the server records none;
* the array: ``[rows, num_hidden_layers, num_experts_per_tok]``
  (``model_executor/layers/fused_moe/routed_experts_capturer.py`` ``_get_routed_experts_shape``),
  dtype **uint8** for up to 256 experts, else **uint16** (``output_dtype_name``: the narrowest
  type that holds every logical expert id); the ids are logical (checkpoint) expert ids, in the
  top-k kernel's order;
* the rows are sequence positions ``[start, prompt_len + output_len - 1)`` of ``prompt + output``
  (``distributed/aux_output_connector/connector.py`` ``take_output``: ``token_end =
  request.num_tokens - 1``; the last sampled token is never fed back, so it has no row), ``start``
  = ``sampling_params.routed_experts_prompt_start`` (default 0; what the project asks for);
  positions served from the prefix cache keep their rows (the connector stores them per cached
  block, which is why vLLM refuses routed experts without prefix caching).

That is SGLang 0.5.23's row layout (``pipeline.generation.routed_experts``) with another
encoding: :func:`decode` checks the payload against the shape the request implies and returns
the project's int32 ``[rows, num_layers, top_k]`` array, :func:`to_wire_bytes` the int32 bytes an
``answers.Answer.routed`` holds, so the training batch (``routed_experts.batch_routed_experts``)
takes vLLM's rows as it takes SGLang's. numpy only: the client's parse process imports it.
"""

from __future__ import annotations

import io
from typing import Any, Optional

import numpy as np

from pipeline.generation.answers import ROUTED_DTYPE, expected_rows, routed_base64

WIRE_DTYPES = ("uint8", "uint16")
"""The dtypes vLLM 0.32 sends: uint8 for up to 256 experts, uint16 above."""

SERVER_FLAG = "--enable-return-routed-experts"


def decode(text: Any, *, prompt_len: int, output_len: int, num_layers: int, top_k: int,
           num_experts: Optional[int] = None, prompt_start: int = 0) -> np.ndarray:
    """One choice's ``routed_experts`` -> int32 ``[rows, num_layers, top_k]``, rows = positions
    ``[prompt_start, prompt_len + output_len - 1)``. ValueError naming what is wrong when the
    payload is not base64 ``.npy`` of that shape, of vLLM's dtypes, with ids below
    ``num_experts`` (when given; the training batch checks the ids again)."""
    raw = routed_base64(text)
    try:
        array = np.load(io.BytesIO(raw), allow_pickle=False)
    except (ValueError, OSError, EOFError) as err:
        raise ValueError(f"routed_experts is not a .npy array: {err}") from None
    if array.dtype.name not in WIRE_DTYPES:
        raise ValueError(f"routed_experts has dtype {array.dtype.name}; vLLM sends "
                         f"{' or '.join(WIRE_DTYPES)}")
    rows = expected_rows(prompt_len, output_len, prompt_start)
    if array.shape != (rows, num_layers, top_k):
        raise ValueError(f"routed_experts has shape {list(array.shape)}; expected [{rows}, "
                         f"{num_layers}, {top_k}] (prompt {prompt_len} + response {output_len} "
                         f"tokens - 1 - {prompt_start} skipped, model.num_layers, "
                         "model.moe_router_topk)")
    if num_experts is not None and array.size and int(array.max()) >= num_experts:
        raise ValueError(f"routed_experts names expert {int(array.max())}; the model has "
                         f"{num_experts} (model.num_experts)")
    return array.astype(np.int32)


def from_choice(choice: dict, *, prompt_len: int, output_len: int, num_layers: int, top_k: int,
                num_experts: Optional[int] = None) -> Optional[np.ndarray]:
    """:func:`decode` of ``choice["routed_experts"]`` (rows from position 0, what the client asks
    for); None when the choice has none: the request was aborted before its first forward pass.
    A finished choice without them means the server does not record them: ValueError naming
    :data:`SERVER_FLAG`."""
    text = choice.get("routed_experts")
    if text is None:
        if choice.get("finish_reason") == "abort":
            return None
        raise ValueError("the vLLM server returned no routed_experts (gspo.routing_replay: "
                         f"rollout needs its servers started with {SERVER_FLAG})")
    return decode(text, prompt_len=prompt_len, output_len=output_len, num_layers=num_layers,
                  top_k=top_k, num_experts=num_experts)


def to_wire_bytes(experts: np.ndarray) -> bytes:
    """int32 ``[rows, layers, top_k]`` -> the little-endian int32 bytes of ``Answer.routed``
    (``pipeline.generation.routed_experts.from_bytes`` reads them)."""
    return np.ascontiguousarray(experts, dtype=ROUTED_DTYPE).tobytes()
