"""Sampling of the local rollout server, with SGLang 0.5.23's semantics
(``sglang.srt.layers.sampler.Sampler.forward``).

* temperature < 1e-6 means greedy (``top_k = 1`` at temperature 1);
* the returned log-probs are those of the **temperature-scaled** distribution
  ``log_softmax(logits / T)`` over the full vocabulary, *before* top-k / top-p / min-p truncation
  (SGLang's default);
* the token is drawn from the truncated distribution by inverse-CDF sampling with one uniform per
  step from the request's own ``torch.Generator``, so a request's random numbers do not depend on
  what else is in the batch.

Shape legend: B rows, V vocabulary.
"""

from __future__ import annotations

import torch

from pipeline.local.request import EngineRequest


def sample(reqs: list[EngineRequest], logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen token per row ``[B]`` long, the log-probs SGLang returns ``[B, V]``) for the rows of
    ``logits`` ``[B, V]`` (already cut to the vocabulary), each row sampled as its request asks."""
    temps = torch.tensor([[r.sampling.temperature] for r in reqs], dtype=logits.dtype)
    logprobs = torch.log_softmax(logits / temps, dim=-1)  # [B, V], what SGLang returns
    chosen = torch.empty(len(reqs), dtype=torch.long)
    greedy = [i for i, r in enumerate(reqs) if r.sampling.is_greedy]
    sampled = [i for i, r in enumerate(reqs) if not r.sampling.is_greedy]
    if greedy:
        chosen[greedy] = torch.argmax(logits[greedy], dim=-1)
    if sampled:
        # Inverse-CDF sampling from the truncated distribution: one uniform per row from the
        # request's own generator (float64 CDF; side="right" never picks a zero-mass token).
        probs = logprobs[sampled].double().exp()
        for j, i in enumerate(sampled):
            s = reqs[i].sampling
            if (0 < s.top_k < probs.shape[1]) or s.top_p < 1.0 or s.min_p > 0.0:
                probs[j] = truncate(probs[j], s.top_k, s.top_p, s.min_p)
        cdf = probs.cumsum(dim=-1)
        u = torch.cat([torch.rand(1, generator=reqs[i].generator, dtype=torch.float64)
                       for i in sampled])
        picks = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
        chosen[sampled] = picks.clamp_(max=cdf.shape[1] - 1)
    return chosen, logprobs


def truncate(probs: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Zero the probabilities outside top-k, the top-p nucleus and the min-p floor (one row)."""
    if top_k > 0 and top_k < probs.numel():
        kth = torch.topk(probs, top_k).values[-1]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_p, 0) - sorted_p  # mass strictly above each token
        sorted_p = torch.where(before > top_p, torch.zeros_like(sorted_p), sorted_p)
        probs = torch.zeros_like(probs).scatter(0, order, sorted_p)
    if min_p > 0.0:
        probs = torch.where(probs >= probs.max() * min_p, probs, torch.zeros_like(probs))
    return probs
