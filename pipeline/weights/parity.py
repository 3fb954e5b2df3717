"""The parity watchdog: do the rollout servers serve the policy the trainer holds?

After every weight sync (``pipeline.step.loop``), a fixed set of probe sequences (prompt + a fixed
response) is scored by every rollout server and by the trainer, and the per-token gap
``|log pi_server - log pi_trainer|`` over the responses' tokens is logged as ``parity/*``
(docs/parity.md). A server whose mean gap exceeds ``parity.max_gap_mean`` makes the loop sync the
weights once more and check again; if a server is still past it, the run stops with
:class:`ParityError` naming the gap, the server and the threshold.

The probes (``ProbeSet``) are fixed for a run: ``parity.num_probes`` prompts drawn once with
``run.seed`` from the held-out prompts (the training prompts if there are none), each with the
response the servers generate greedily at the first check (at most ``rollout.max_new_tokens``
tokens, stopping at EOS), written to ``<run_dir>/parity_probes.json`` and read back by a resumed
run, so every check of a run scores the same token sequences.

The servers' side is the engine's scorer (``pipeline.engines.base.ProbeScorer``, chosen with
``rollout.engine``): prompt + response as the input, prefill only, the raw (T = 1) log-probs of
the response tokens (SGLang: ``/generate`` with ``input_token_logprobs``,
``pipeline.engines.sglang.SGLangScorer``; vLLM: ``/inference/v1/generate`` with
``prompt_logprobs``, ``pipeline.engines.vllm.client.VllmScorer``). The trainer's side is
``RLTrainer.score_log_probs`` (the RL loss's log-prob function, Megatron, every rank) at T = 1.

Each server is asked directly (not through the router, which would pick one), one request per
probe. A server that does not answer at all (it died after the sync) is left out of that check
and counted (``parity/servers_unreachable``): the server pool drops it at the next sync; one that
answers with an error fails the check. Router disagreement: when the servers return
``routed_experts`` (SGLang's ``return_routed_experts``), the raw answers are handed to
``routing_hook(probes, routed_by_server)``, whose metrics are logged with the gaps; without a
hook nothing is asked for.

Pure parts (request body, answer parsing, gap statistics, the decision) are plain functions; the
collective part (:meth:`ParityWatchdog.measure`, :func:`check`) follows ``pipeline.step.loop``'s rule:
rank 0 talks to the servers, its outcome is broadcast, the trainer scores on every rank.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch

from megatron_gspo.config import Config
from megatron_gspo.train.batching import rl_batch
from pipeline.generation.client import RolloutError, SamplingParams, error_message, http_json
from pipeline.scoring.tasks import PAD_ID

if TYPE_CHECKING:
    from pipeline.engines.base import ProbeScorer
    from pipeline.scoring.data import Prompt

PROBES_FILE = "parity_probes.json"
PROBE_TEMPERATURE = 1.0
"""The engines' scores are raw log-probs (T = 1); the trainer scores at the same."""


class ParityError(RuntimeError):
    """A rollout server's log-probs stayed past ``parity.max_gap_mean`` after a re-sync."""


@dataclass
class Probe:
    prompt_ids: list[int]
    response_ids: list[int]
    origin: str = ""


# ------------------------------------------------------------------------------------------------
# Probes


def draw_probe_prompts(eval_set, train_set, num: int, seed: int) -> list[Prompt]:
    """``num`` prompts drawn without replacement with ``seed`` from ``eval_set`` (or ``train_set``
    when there is no held-out set); all of them when there are fewer."""
    source = eval_set if eval_set is not None and len(eval_set) > 0 else train_set
    if source is None or len(source) == 0:
        raise ValueError("parity.num_probes: no prompts to draw probes from")
    gen = torch.Generator().manual_seed(int(seed) * 1_000_003 + 17)
    order = torch.randperm(len(source), generator=gen)[:num]
    return [source[int(i)] for i in order]


def save_probes(path: Path, probes: Sequence[Probe]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps([{"prompt_ids": p.prompt_ids, "response_ids": p.response_ids,
                                "origin": p.origin} for p in probes]))
    os.replace(tmp, path)


def load_probes(path: Path) -> list[Probe]:
    try:
        rows = json.loads(path.read_text())
        probes = [Probe([int(t) for t in r["prompt_ids"]], [int(t) for t in r["response_ids"]],
                        str(r.get("origin", ""))) for r in rows]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{path}: not a parity probe file ({type(err).__name__}: {err}); delete "
                         "it to draw new probes") from None
    if not probes or any(not p.prompt_ids or not p.response_ids for p in probes):
        raise ValueError(f"{path}: a probe without prompt or response tokens; delete it to draw "
                         "new probes")
    return probes


# ------------------------------------------------------------------------------------------------
# The servers' side


def score_on_server(url: str, probes: Sequence[Probe], scorer: ProbeScorer, *, timeout_s: float,
                    routed_experts: bool = False) -> tuple[list[list[float]], list[Any]]:
    """Every probe scored by the server at ``url`` through the engine's ``scorer``: (log-probs per
    probe, routed experts per probe or None). One request per probe, sent straight to the
    server."""
    tag = uuid.uuid4().hex[:10]
    values, routed = [], []
    for i, probe in enumerate(probes):
        path, body = scorer.score_call(f"parity-{tag}-{i}", probe.prompt_ids, probe.response_ids,
                                       routed_experts=routed_experts)
        status, answer = http_json("POST", url.rstrip("/") + path, body, timeout_s=timeout_s)
        if status != 200:
            raise RolloutError(url, status, error_message(json.dumps(answer)
                                                          if not isinstance(answer, str) else answer))
        got, experts = scorer.read_scores(answer, probe.prompt_ids, probe.response_ids, url)
        values.append(got)
        routed.append(experts)
    return values, routed


# ------------------------------------------------------------------------------------------------
# The comparison (pure)


def probe_batch(probes: Sequence[Probe], seq_length: int) -> dict[str, torch.Tensor]:
    """The probes as ``rl_batch`` rows (the trainer's input); ValueError if one does not fit."""
    num = len(probes)
    try:
        return rl_batch([p.prompt_ids for p in probes], [p.response_ids for p in probes],
                        [[0.0] * len(p.response_ids) for p in probes], torch.zeros(num),
                        seq_length, PAD_ID)
    except ValueError as err:
        raise ValueError(f"parity probe {err} (run.seq_length)") from None


def response_values(scored: torch.Tensor, probes: Sequence[Probe]) -> list[list[float]]:
    """Row i's values at probe i's response label positions (``rl_batch``'s layout)."""
    out = []
    for i, p in enumerate(probes):
        start = len(p.prompt_ids) - 1
        out.append([float(v) for v in scored[i, start:start + len(p.response_ids)]])
    return out


def gap_stats(server: Sequence[Sequence[float]], trainer: Sequence[Sequence[float]]) -> dict:
    """``{"mean", "max", "signed_mean", "num_tokens"}`` of |server - trainer| over every token
    (float64)."""
    a = torch.tensor([v for row in server for v in row], dtype=torch.float64)
    b = torch.tensor([v for row in trainer for v in row], dtype=torch.float64)
    if a.shape != b.shape or a.numel() == 0:
        raise ValueError(f"gap_stats: {a.numel()} server values for {b.numel()} trainer values")
    diff = a - b
    return {"mean": float(diff.abs().mean()), "max": float(diff.abs().max()),
            "signed_mean": float(diff.mean()), "num_tokens": int(diff.numel())}


@dataclass
class ParityResult:
    """One check: the gaps of every server, in the order of ``urls``."""

    urls: list[str]
    gaps: list[dict]
    threshold: float
    extra: dict = field(default_factory=dict)
    """Metrics of the routing hook."""

    def worst(self) -> tuple[str, dict]:
        i = max(range(len(self.gaps)), key=lambda j: self.gaps[j]["mean"])
        return self.urls[i], self.gaps[i]

    @property
    def failed(self) -> bool:
        return bool(self.gaps) and self.worst()[1]["mean"] > self.threshold

    def metrics(self) -> dict:
        if not self.gaps:
            return {}
        out = {"parity/logprob_gap_mean": max(g["mean"] for g in self.gaps),
               "parity/logprob_gap_max": max(g["max"] for g in self.gaps),
               "parity/num_tokens": self.gaps[0]["num_tokens"],
               "parity/servers": len(self.gaps)}
        if len(self.gaps) > 1:
            for i, g in enumerate(self.gaps):
                out[f"parity/server{i}_logprob_gap_mean"] = g["mean"]
                out[f"parity/server{i}_logprob_gap_max"] = g["max"]
        return {**out, **self.extra}

    def describe(self) -> str:
        url, gap = self.worst()
        return (f"rollout server {url}: mean per-token log-prob gap {gap['mean']:.3g} "
                f"(max {gap['max']:.3g}, signed mean {gap['signed_mean']:+.3g}, over "
                f"{gap['num_tokens']} probe tokens) exceeds parity.max_gap_mean {self.threshold:g}")


# ------------------------------------------------------------------------------------------------
# The watchdog (collective)


class ParityWatchdog:
    """Every rank holds one (built by ``launch.rl_session``); rank 0's holds the probe prompts.

    ``scorer``: the engine's (``Engine.scorer``; rank 0 asks the servers through it).
    ``routing_hook(probes, routed_by_server) -> dict``: optional metrics of the routers'
    disagreement from the servers' ``routed_experts`` (asked for only when it is set)."""

    def __init__(self, cfg: Config, run_dir: str | Path, scorer: ProbeScorer, *,
                 prompts: Sequence[Prompt] = (),
                 routing_hook: Optional[Callable[[list[Probe], dict[str, list]], dict]] = None):
        self.cfg = cfg
        self.scorer = scorer
        self.path = Path(run_dir) / PROBES_FILE
        self.prompts = list(prompts)
        self.probes: Optional[list[Probe]] = None
        self.routing_hook = routing_hook

    # rank 0 -----------------------------------------------------------------------------------
    def ensure_probes(self, client, stop_token_ids: Sequence[int]) -> list[Probe]:
        """Rank 0: the run's probes: read from the run directory, or made now (the prompts with
        the servers' greedy responses) and written there."""
        if self.probes is not None:
            return self.probes
        if self.path.is_file():
            self.probes = load_probes(self.path)
            return self.probes
        if not self.prompts:
            raise ValueError("parity: no probe prompts on rank 0")
        sampling = SamplingParams(temperature=0.0, max_new_tokens=self.cfg.rollout.max_new_tokens,
                                  stop_token_ids=list(stop_token_ids))
        results = client.generate_sync([(f"parity-probe-{uuid.uuid4().hex[:8]}-{i}",
                                          p.prompt_ids, sampling)
                                         for i, p in enumerate(self.prompts)])
        probes = []
        for prompt, result in zip(self.prompts, results):
            if not result.output_ids:
                raise ValueError(f"parity: the servers gave probe {prompt.origin} no response "
                                 f"tokens (finish {result.finish_reason})")
            probes.append(Probe(list(prompt.prompt_ids), list(result.output_ids), prompt.origin))
        save_probes(self.path, probes)
        self.probes = probes
        return probes

    def server_scores(self, urls: Sequence[str], client, stop_token_ids) -> dict:
        """Rank 0: the probes and every server's scores of them (what is broadcast)."""
        probes = self.ensure_probes(client, stop_token_ids)
        want_routing = self.routing_hook is not None
        scores, routed, unreachable = {}, {}, []
        for url in urls:
            try:
                scores[url], routed[url] = score_on_server(
                    url, probes, self.scorer, timeout_s=self.cfg.rollout.request_timeout_s,
                    routed_experts=want_routing)
            except RolloutError as err:
                if err.status is not None:  # it answered, wrongly: that is an error
                    raise
                # no answer: the server died after the sync; the server pool drops (and in
                # embedded mode restarts and syncs) it at the next sync
                print(f"parity watchdog: {url} did not answer ({err.message}); not checked",
                      flush=True)
                unreachable.append(url)
        if not scores:
            raise RolloutError(", ".join(urls), None, "parity: no rollout server answered")
        return {"probes": probes, "urls": [u for u in urls if u in scores], "scores": scores,
                "routed": routed if want_routing else None, "unreachable": unreachable}

    # every rank -------------------------------------------------------------------------------
    def compare(self, served: dict, trainer) -> ParityResult:
        """Every rank (collective: the trainer scores): the gaps of each server."""
        probes = served["probes"]
        batch = probe_batch(probes, self.cfg.run.seq_length)
        scored = trainer.score_log_probs(batch, temperature=PROBE_TEMPERATURE)
        mine = response_values(scored, probes)
        gaps = [gap_stats(served["scores"][url], mine) for url in served["urls"]]
        extra = {}
        if self.routing_hook is not None and served.get("routed") is not None:
            extra = dict(self.routing_hook(probes, served["routed"]))
        if served.get("unreachable"):
            extra["parity/servers_unreachable"] = len(served["unreachable"])
        return ParityResult(list(served["urls"]), gaps, self.cfg.parity.max_gap_mean, extra)
