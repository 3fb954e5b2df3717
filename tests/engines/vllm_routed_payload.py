"""A ``/inference/v1/generate`` choice with routed experts, made by vLLM 0.32's own code: run by
the vLLM environment's interpreter (tests/engines/test_vllm_routed_experts.py), it reads one JSON
request on stdin ``{"experts": [[[...]]], "token_ids": [...], "dtype": "uint8"}`` and prints the
JSON of a ``GenerateTokensChoice`` whose ``routed_experts`` is ``numpy2base64`` of that array
(what ``serving.py`` puts there on a GPU server started with --enable-return-routed-experts)."""

import json
import sys

import numpy as np
from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateTokensChoice
from vllm.utils.serial_utils import numpy2base64

request = json.loads(sys.stdin.readline())
array = np.asarray(request["experts"], dtype=request["dtype"])
choice = GenerateTokensChoice(index=0, finish_reason="length", token_ids=request["token_ids"],
                              routed_experts=numpy2base64(array))
print(choice.model_dump_json())
