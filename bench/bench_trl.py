"""The same GSPO task run by our pipeline and by TRL's ``GRPOTrainer``, equal wall time, one run.

Needs TRL, which is NOT a dependency of megatron-gspo (benchmark only)::

    .venv/bin/pip install trl==1.16.0      # installs accelerate, datasets; keeps torch / transformers

Then::

    .venv/bin/python bench/bench_trl.py --out runs/bench_trl --budget-s 300
    .venv/bin/python bench/bench_trl.py ... --async-modes off,one_step   # ours in each mode too

What is compared (both start from the same SFT policy, an HF directory written by
``megatron-gspo sft``, which this script runs first if ``<out>/sft/hf`` does not exist):

- ours: ``megatron-gspo train`` (2 Megatron ranks, EP 2 over gloo, 2 local rollout servers
  behind the sglang-router, disk weight sync), GSPO with the paper's sequence clip range.
- TRL: ``GRPOTrainer`` in one process (2 torch threads, generation with transformers'
  ``generate``, no vLLM) with ``importance_sampling_level="sequence"``, ``loss_type="grpo"``
  (mean over each sequence's tokens, then over sequences: exactly the GSPO objective for a
  sequence-level ratio), ``epsilon=3e-4``, ``epsilon_high=4e-4``, ``beta=0``,
  ``scale_rewards="group"``. Ours skips the routing-volatility pass (``gspo.routing_metrics:
  false``: one forward per step that TRL does not have).

Identical for both: the task (2-digit AdditionTask, byte tokens, exact-match reward), the prompts
and their order (TRL gets our PromptSampler's order with shuffling off), G samples per prompt,
P prompts per rollout step, k mini-batch updates per rollout (ours ``gspo.updates_per_rollout``,
TRL ``steps_per_generation=k``, old log-probs recomputed by a forward pass in both), max new
tokens, temperature 1 / top-p 1 / no top-k, Adam (weight decay 0, beta2, eps), constant lr, grad
clip 1.0, float32, no gradient checkpointing, model size.

Budget and measurement (identical rule for both): the clock starts when the process is launched
(so start-up, model loading, server start are included). Training stops at the end of the first
rollout step (generate + k updates) that ends at or after ``--budget-s``; ``wall_s`` = launch ->
end of that step. Saving / converting the final policy is not timed.

- rollout tokens = sum of generated response tokens (end token included) over all steps;
- trained tokens = sum over all steps of the real (unpadded) prompt + response tokens of every
  sequence of the step's batch, counted once per step (not once per update or forward pass);
- end-to-end tokens/s = (rollout tokens + trained tokens) / wall_s.

Held-out reward: the final policy of each (ours: the Megatron checkpoint written on stop,
converted with ``megatron-gspo convert mcore-to-hf``; TRL: ``trainer.save_model``) and the SFT
start are evaluated by ONE evaluator in this process: transformers ``generate`` with sampling at
the training temperature, ``--eval-samples`` samples for each of the ``--eval-prompts`` prompts of
the task's held-out split (never trained on), exact match, a fixed seed.

Peak memory: the process tree of each run (ours: launcher, 2 ranks, 2 servers, router), sampled
every 0.5 s: peak of the summed RSS (counts shared library pages once per process) and peak of
the summed PSS (shares them out).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TRL_VERSION = "1.16.0"


# ------------------------------------------------------------------------------------------------
# settings shared by both sides


def model_overrides(args) -> list[str]:
    m = {"num_layers": args.layers, "hidden_size": args.hidden, "num_attention_heads": args.heads,
         "num_query_groups": args.kv_heads, "head_dim": args.head_dim, "num_experts": args.experts,
         "moe_router_topk": args.topk, "moe_ffn_hidden_size": args.ffn,
         # RoPE's position range must cover the longest sequence (the tiny configs say 64)
         "max_position_embeddings": max(64, args.seq_length)}
    return [x for k, v in m.items() for x in ("--set", f"model.{k}={v}")]


def model_desc(args) -> str:
    return (f"{args.layers} layers, hidden {args.hidden}, {args.heads} heads / {args.kv_heads} KV "
            f"groups x head_dim {args.head_dim}, {args.experts} experts (top-{args.topk}, ffn "
            f"{args.ffn})")


def packing_overrides(args) -> list[str]:
    """Ours: packed micro-batches of at most ``--token-budget`` tokens (0: padded rows)."""
    if not args.token_budget:
        return []
    return ["--set", f"run.max_tokens_per_micro_batch={args.token_budget}"]


def cli(*cmd: str) -> list[str]:
    return [sys.executable, "-m", "launch.cli", *cmd]


def make_task(args):
    """The task both sides train on: ``--task addition`` (answers of ~3.5 tokens) or
    ``carry_addition`` (a digit-by-digit carry trace before the answer: 10 n + 3 tokens for n
    columns, n uniform in [ceil(digits / 4), digits]; digits 24 gives 62-243, mean ~152)."""
    from pipeline.scoring.tasks import AdditionTask, CarryAdditionTask

    cls = {"addition": AdditionTask, "carry_addition": CarryAdditionTask}[args.task]
    return cls(digits=args.digits, seed=args.seed)


def problems(args, split: str, count: int, start: int = 0):
    return make_task(args).problems(start, count, split=split)


def train_prompt_order(args, steps: int) -> list:
    """The prompts our trainer samples, step by step (run.seed, shuffled epochs)."""
    from pipeline.scoring.data import PromptSampler, TaskPromptDataset

    task = make_task(args)
    sampler = PromptSampler(TaskPromptDataset(task, split="train"), seed=args.seed, shuffle=True)
    return [sampler.next_batch(args.prompts) for _ in range(steps)]


# ------------------------------------------------------------------------------------------------
# process-tree memory sampler and budgeted run


class TreeMonitor(threading.Thread):
    """Peak summed RSS and PSS of a process and all its descendants."""

    def __init__(self, pid: int, interval: float = 0.5):
        super().__init__(daemon=True)
        self.pid, self.interval = pid, interval
        self.peak_rss = self.peak_pss = 0
        self._halt = threading.Event()

    def run(self) -> None:
        import psutil

        try:
            root = psutil.Process(self.pid)
        except psutil.NoSuchProcess:
            return
        while not self._halt.is_set():
            try:
                procs = [root] + root.children(recursive=True)
            except psutil.NoSuchProcess:
                return
            rss = pss = 0
            for p in procs:
                try:
                    info = p.memory_full_info()
                    rss += info.rss
                    pss += getattr(info, "pss", info.rss)
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    pass
            self.peak_rss, self.peak_pss = max(self.peak_rss, rss), max(self.peak_pss, pss)
            self._halt.wait(self.interval)

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=5)


def run_ours(args, sft_hf: Path, out: Path, mode: str = "off") -> dict:
    """Ours with ``rollout.async: mode`` (``full``: ``rollout.max_staleness`` from
    ``--max-staleness``); the run's directory is ``<out>/ours`` (off) or ``<out>/ours_<mode>``."""
    import shutil

    run_dir = out / ("ours" if mode == "off" else f"ours_{mode}")
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    cmd = cli("train", "--config", "launch/configs/tiny_cpu.yaml", *model_overrides(args),
              "--set", f"run.output_dir={run_dir}", "--set", f"run.init_from={sft_hf}",
              "--set", f"run.seed={args.seed}", "--set", f"data.task={args.task}",
              "--set", f"data.digits={args.digits}", *packing_overrides(args),
              "--set", "run.num_steps=100000", "--set", "run.eval_interval=0",
              "--set", "run.save_interval=0", "--set", "run.log_interval=1",
              "--set", f"run.global_batch_size={args.prompts * args.group_size}",
              "--set", f"run.micro_batch_size={args.micro_batch}",
              "--set", f"run.seq_length={args.seq_length}",
              "--set", f"gspo.group_size={args.group_size}",
              "--set", f"gspo.updates_per_rollout={args.k}",
              "--set", f"rollout.max_new_tokens={args.max_new_tokens}",
              "--set", "rollout.temperature=1.0",
              # TRL computes no routing-volatility metrics: skip their extra forward pass
              "--set", "gspo.routing_metrics=false",
              "--set", f"optim.lr={args.lr}", "--set", f"optim.adam_beta2={args.beta2}",
              "--set", f"rollout.async={mode}",
              "--set", f"rollout.max_staleness={args.max_staleness}")
    print(f"ours ({mode}):", " ".join(cmd[1:]), flush=True)
    log = open(run_dir / "train.log", "w")
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    mon = TreeMonitor(proc.pid)
    mon.start()
    metrics = run_dir / "metrics.jsonl"
    step_end: dict[int, float] = {}
    records: dict[int, dict] = {}
    signalled = False
    offset = 0
    while True:
        if metrics.exists():
            with open(metrics) as f:
                f.seek(offset)
                chunk = f.read()
            # only complete lines
            cut = chunk.rfind("\n") + 1
            offset += len(chunk[:cut].encode())
            now = time.time()
            for line in chunk[:cut].splitlines():
                rec = json.loads(line)
                if "train/reward_mean" in rec:
                    step_end.setdefault(rec["step"], now)
                    records[rec["step"]] = rec
        if not signalled and time.time() - t0 >= args.budget_s:
            pids = sorted((run_dir / "pids").glob("rank*.pid"))
            for p in pids:  # the ranks finish the current step, save a checkpoint, exit 75
                os.kill(int(p.read_text()), signal.SIGTERM)
            signalled = bool(pids)
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    mon.stop()
    log.close()
    if not records:
        raise SystemExit(f"ours: no step finished; see {run_dir / 'train.log'}")
    latest = (run_dir / "checkpoints" / "latest")
    ckpt = run_dir / "checkpoints" / latest.read_text().strip() / "model_optim"
    final = run_dir / "final_hf"
    conv = subprocess.run(cli("convert", "mcore-to-hf", "--mcore", str(ckpt), "--out", str(final),
                              "--hf-config", str(sft_hf / "config.json"), "--tokenizer", str(sft_hf),
                              "--no-progress", "--overwrite"),
                          cwd=ROOT, capture_output=True, text=True)
    if conv.returncode != 0:
        raise SystemExit(f"ours: convert failed\n{conv.stdout[-2000:]}\n{conv.stderr[-3000:]}")
    steps = sorted(records)
    order = train_prompt_order(args, len(steps))
    G = args.group_size
    gen = sum(records[s]["train/response_length_mean"] * args.prompts * G for s in steps)
    prompt_tok = sum(len(p.prompt_ids) * G for batch in order for p in batch)
    last = steps[-1]
    first_step_s = step_end[steps[0]] - t0
    steady = ((step_end[last] - step_end[steps[0]]) / (len(steps) - 1)) if len(steps) > 1 else None
    name = "ours (megatron-gspo)" if mode == "off" else f"ours (megatron-gspo, async {mode})"
    return {"name": name, "steps": len(steps), "wall_s": step_end[last] - t0,
            "first_step_end_s": first_step_s, "steady_step_s": steady,
            "rollout_tokens": gen, "trained_tokens": gen + prompt_tok,
            "train_reward_first": records[steps[0]]["train/reward_mean"],
            "train_reward_last": records[last]["train/reward_mean"],
            "peak_rss": mon.peak_rss, "peak_pss": mon.peak_pss, "final_hf": str(final),
            "exit_code": proc.returncode, "stopped_by_budget": signalled}


def run_trl(args, sft_hf: Path, out: Path) -> dict:
    import shutil

    run_dir = out / "trl"
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    t0 = time.time()
    cmd = [sys.executable, str(Path(__file__).resolve()), "--trl-worker", str(run_dir),
           "--launch-time", repr(t0), "--sft-hf", str(sft_hf), *sys.argv[1:]]
    # the worker reads the same flags (it ignores --out / --only)
    print("trl: bench/bench_trl.py --trl-worker ...", flush=True)
    log = open(run_dir / "train.log", "w")
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), TOKENIZERS_PARALLELISM="false")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    mon = TreeMonitor(proc.pid)
    mon.start()
    code = proc.wait()
    mon.stop()
    log.close()
    if code != 0:
        tail = (run_dir / "train.log").read_text()[-4000:]
        raise SystemExit(f"trl worker failed (exit {code}):\n{tail}")
    events = [json.loads(l) for l in (run_dir / "steps.jsonl").read_text().splitlines()]
    gen = sum(e["completion_tokens"] for e in events)
    prompt_tok = sum(e["prompt_tokens"] for e in events)
    steady = ((events[-1]["t"] - events[0]["t"]) / (len(events) - 1)) if len(events) > 1 else None
    return {"name": f"TRL {TRL_VERSION} GRPOTrainer", "steps": len(events),
            "wall_s": events[-1]["t"] - t0, "first_step_end_s": events[0]["t"] - t0,
            "steady_step_s": steady, "rollout_tokens": gen, "trained_tokens": gen + prompt_tok,
            "train_reward_first": events[0]["reward_mean"],
            "train_reward_last": events[-1]["reward_mean"],
            "peak_rss": mon.peak_rss, "peak_pss": mon.peak_pss,
            "final_hf": str(run_dir / "final_hf"), "exit_code": code, "stopped_by_budget": True}


# ------------------------------------------------------------------------------------------------
# TRL worker (a separate process, so its start-up and memory are measured like ours)


def trl_worker(args) -> int:
    import torch

    torch.set_num_threads(args.threads)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    import trl
    from trl import GRPOConfig, GRPOTrainer

    from pipeline.scoring.tasks import Problem, encode

    task_cls = type(make_task(args))
    assert trl.__version__ == TRL_VERSION, f"benchmark written for trl=={TRL_VERSION}, got {trl.__version__}"
    run_dir, t0 = Path(args.trl_worker), float(args.launch_time)
    G, P, k = args.group_size, args.prompts, args.k
    max_rollouts = int(args.budget_s) + 10  # more rollout steps than can ever run in the budget
    order = train_prompt_order(args, max_rollouts)
    rows = [{"prompt": p.text, "answer": p.label} for batch in order for p in batch]
    dataset = Dataset.from_list(rows)
    tok = AutoTokenizer.from_pretrained(args.sft_hf)
    for r in rows[:50]:
        assert tok(r["prompt"], add_special_tokens=True)["input_ids"] == encode(r["prompt"]), r
    model = AutoModelForCausalLM.from_pretrained(args.sft_hf, dtype=torch.float32)
    events_path = run_dir / "steps.jsonl"
    last_batch: dict = {}

    def addition_reward(prompts, completions, completion_ids, answer, **kwargs):
        rewards = [task_cls.reward(Problem(prompt=p, answer=a), list(ids))
                   for p, a, ids in zip(prompts, answer, completion_ids)]
        last_batch.update(prompt_tokens=sum(len(encode(p)) for p in prompts),
                          completion_tokens=sum(len(ids) for ids in completion_ids),
                          reward_mean=sum(rewards) / len(rewards), n=len(rewards))
        return rewards

    class Budget(TrainerCallback):
        def on_step_end(self, targs, state, control, **kw):
            if state.global_step % k:
                return control
            now = time.time()
            with open(events_path, "a") as f:
                f.write(json.dumps({"t": now, "rollout_step": state.global_step // k,
                                    **last_batch}) + "\n")
            if now - t0 >= args.budget_s:
                control.should_training_stop = True
            return control

    config = GRPOConfig(
        output_dir=str(run_dir / "trainer"), seed=args.seed, use_cpu=True, bf16=False, fp16=False,
        gradient_checkpointing=False, report_to="none", logging_steps=1, save_strategy="no",
        dataloader_pin_memory=False, dataloader_num_workers=0,
        # batch: P prompts x G samples per rollout, split into k optimizer steps
        num_generations=G, per_device_train_batch_size=P * G // k, steps_per_generation=k,
        gradient_accumulation_steps=1, num_iterations=1, max_steps=max_rollouts * k,
        shuffle_dataset=False,
        # sampling
        max_completion_length=args.max_new_tokens, temperature=1.0, top_p=1.0, top_k=0,
        use_vllm=False,
        # GSPO
        importance_sampling_level="sequence", loss_type="grpo", epsilon=3e-4, epsilon_high=4e-4,
        beta=0.0, scale_rewards="group", mask_truncated_completions=False,
        router_aux_loss_coef=0.0,
        # optimizer: Adam, constant lr, as ours
        learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        adam_beta1=0.9, adam_beta2=args.beta2, adam_epsilon=1e-8, max_grad_norm=1.0,
        optim="adamw_torch",
    )
    trainer = GRPOTrainer(model=model, reward_funcs=[addition_reward], args=config,
                          train_dataset=dataset, processing_class=tok, callbacks=[Budget()])
    trainer.train()
    final = run_dir / "final_hf"
    trainer.save_model(str(final))
    tok.save_pretrained(str(final))
    (final / "generation_config.json").write_text(json.dumps({"eos_token_id": 10}))
    return 0


# ------------------------------------------------------------------------------------------------
# the one evaluator


def evaluate(args, hf_dir: str) -> dict:
    """Exact-match reward of n samples per held-out prompt (sampling at temperature 1)."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    from pipeline.scoring.tasks import EOS_ID, PAD_ID

    task_cls = type(make_task(args))
    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    gen_cfg = GenerationConfig(do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                               max_new_tokens=args.max_new_tokens, eos_token_id=EOS_ID,
                               pad_token_id=PAD_ID, num_return_sequences=args.eval_samples)
    probs = problems(args, "eval", args.eval_prompts)
    by_len: dict[int, list] = {}
    for p in probs:  # same-length prompts batched together: no padding at all
        by_len.setdefault(len(p.prompt_ids), []).append(p)
    torch.manual_seed(args.seed + 7)
    rewards, lengths = [], []
    with torch.no_grad():
        for n, group in sorted(by_len.items()):
            ids = torch.tensor([p.prompt_ids for p in group])
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                 generation_config=gen_cfg)[:, n:]
            for i, row in enumerate(out.tolist()):
                p = group[i // args.eval_samples]
                resp = row[:row.index(EOS_ID) + 1] if EOS_ID in row else row
                rewards.append(task_cls.reward(p, resp))
                lengths.append(len(resp))
    # standard error over the prompts (a prompt's samples are correlated): std of the per-prompt
    # means / sqrt(prompts)
    import statistics

    k = args.eval_samples
    means = [statistics.fmean(rewards[i:i + k]) for i in range(0, len(rewards), k)]
    se = statistics.stdev(means) / len(means) ** 0.5 if len(means) > 1 else 0.0
    return {"reward": sum(rewards) / len(rewards), "n": len(rewards), "se": se,
            "response_len": sum(lengths) / len(lengths)}


# ------------------------------------------------------------------------------------------------


def table(args, res: dict, start_eval: dict) -> str:
    gib = lambda b: b / 2**30
    lines = [
        "| run | rollout steps | wall s (launch -> end of last step) | first step ends at s | "
        "steady s/step | rollout tokens | trained tokens | end-to-end tokens/s | "
        "generated tokens/s | train reward first -> last step | held-out reward (final policy) | "
        "peak RSS sum (GiB) | peak PSS sum (GiB) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|"]
    for r in res.values():
        e2e = e2e_tokens_per_s(r)
        steady = f"{r['steady_step_s']:.1f}" if r["steady_step_s"] else "-"
        lines.append(
            f"| {r['name']} | {r['steps']} | {r['wall_s']:.0f} | {r['first_step_end_s']:.0f} | "
            f"{steady} | {r['rollout_tokens']:.0f} | {r['trained_tokens']:.0f} | {e2e:.0f} | "
            f"{r['rollout_tokens'] / r['wall_s']:.1f} | {r['train_reward_first']:.3f} -> "
            f"{r['train_reward_last']:.3f} | {r['eval']['reward']:.3f} | {gib(r['peak_rss']):.2f} | "
            f"{gib(r['peak_pss']):.2f} |")
    lines.append(f"| SFT start (both) | 0 | - | - | - | - | - | - | - | - | "
                 f"{start_eval['reward']:.3f} | - | - |")
    return "\n".join(lines)


def e2e_tokens_per_s(r: dict) -> float:
    return (r["rollout_tokens"] + r["trained_tokens"]) / r["wall_s"]


def summary(res: dict) -> str:
    """The last line: each of our modes against TRL (end-to-end tokens/s ratio, held-out reward
    with its standard error) and against our synchronous run."""
    ours = {k: r for k, r in res.items() if k.startswith("ours")}
    if not ours or "trl" not in res:
        return ""
    trl = res["trl"]
    parts = []
    for key, r in ours.items():
        mode = "off" if key == "ours" else key[len("ours_"):]
        text = (f"{mode} {e2e_tokens_per_s(r) / e2e_tokens_per_s(trl):.2f}x TRL "
                f"(held-out {r['eval']['reward']:.3f} +- {r['eval']['se']:.3f})")
        if "ours" in res and key != "ours":
            text += f", {e2e_tokens_per_s(r) / e2e_tokens_per_s(res['ours']):.2f}x ours sync"
        parts.append(text)
    return (f"ours vs TRL (end-to-end tokens/s): {'; '.join(parts)}; TRL held-out "
            f"{trl['eval']['reward']:.3f} +- {trl['eval']['se']:.3f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/bench_trl")
    parser.add_argument("--budget-s", type=float, default=300.0,
                        help="wall-time budget of each run, from its launch (default 300)")
    parser.add_argument("--only", choices=["ours", "trl", "sft"], default=None,
                        help="run only ours (every --async-modes), only TRL, or only make the SFT "
                             "start")
    parser.add_argument("--async-modes", default="off",
                        help="comma list of our rollout.async modes to run (off, one_step, full), "
                             "each with the same budget")
    parser.add_argument("--max-staleness", type=int, default=1,
                        help="rollout.max_staleness of --async-modes full")
    parser.add_argument("--seed", type=int, default=1234)
    # model (one size for SFT, ours, TRL)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--ffn", type=int, default=256)
    # task, batch, optimizer
    parser.add_argument("--task", choices=["addition", "carry_addition"], default="addition")
    parser.add_argument("--digits", type=int, default=2)
    parser.add_argument("--token-budget", type=int, default=0,
                        help="ours: run.max_tokens_per_micro_batch (packed micro-batches by token budget; "
                             "0: padded rows of --micro-batch)")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=32, help="prompts per rollout step")
    parser.add_argument("--k", type=int, default=2, help="mini-batch updates per rollout")
    parser.add_argument("--max-new-tokens", type=int, default=6)
    parser.add_argument("--seq-length", type=int, default=16)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--beta2", type=float, default=0.98)
    parser.add_argument("--threads", type=int, default=2, help="torch threads of TRL and the evaluator")
    parser.add_argument("--sft-steps", type=int, default=600)
    parser.add_argument("--sft-lr", type=float, default=1e-3)
    parser.add_argument("--eval-prompts", type=int, default=64)
    parser.add_argument("--eval-samples", type=int, default=8)
    # internal: the TRL worker process
    parser.add_argument("--trl-worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--launch-time", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--sft-hf", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_worker:
        return trl_worker(args)

    out = (ROOT / args.out) if not Path(args.out).is_absolute() else Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sft_hf = out / "sft" / "hf"
    started = time.time()
    if not (sft_hf / "config.json").is_file():
        print("SFT ...", flush=True)
        cmd = cli("sft", "--config", "launch/configs/tiny_cpu_sft.yaml", *model_overrides(args),
                  "--set", f"run.output_dir={out / 'sft'}", "--set", f"run.seed={args.seed}",
                  "--set", f"data.task={args.task}",
                  "--set", f"data.digits={args.digits}", "--set", f"run.num_steps={args.sft_steps}",
                  "--set", f"optim.lr={args.sft_lr}", "--set", f"run.seq_length={args.seq_length}",
                  "--set", "run.log_interval=50", "--set", f"run.eval_interval={args.sft_steps}")
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"SFT failed\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
        print(f"SFT done in {time.time() - started:.0f} s: {sft_hf}", flush=True)
    if args.only == "sft":
        return 0
    modes = [m.strip() for m in args.async_modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in ("off", "one_step", "full")]
    if unknown or not modes:
        raise SystemExit(f"--async-modes: {unknown or modes} (choose from off, one_step, full)")
    res: dict = {}
    if args.only in (None, "ours"):
        for mode in modes:
            key = "ours" if mode == "off" else f"ours_{mode}"
            res[key] = run_ours(args, sft_hf, out, mode)
            print(key, res[key], flush=True)
    if args.only in (None, "trl"):
        res["trl"] = run_trl(args, sft_hf, out)
        print("trl", res["trl"], flush=True)
    start_eval = evaluate(args, str(sft_hf))
    for key in res:
        res[key]["eval"] = evaluate(args, res[key]["final_hf"])
    (out / "results.json").write_text(json.dumps({"start": start_eval, **res}, indent=1))
    import psutil

    cmdline = "bench/bench_trl.py " + " ".join(sys.argv[1:])
    md = table(args, res, start_eval)
    setup = (f"Model: Qwen3-MoE {model_desc(args)}; task: {args.task} (digits {args.digits}), G = "
             f"{args.group_size}, {args.prompts} prompts/step ({args.prompts * args.group_size} "
             f"sequences), k = {args.k}, max new tokens {args.max_new_tokens}, lr {args.lr}; budget "
             f"{args.budget_s:.0f} s per run; held-out: {args.eval_prompts} prompts x "
             f"{args.eval_samples} samples. Load average at the end: "
             f"{', '.join(f'{x:.1f}' for x in psutil.getloadavg())}; total {time.time() - started:.0f} s.")
    last = summary(res)
    print(f"\nCommand: `.venv/bin/python {cmdline}`\n\n{setup}\n\n{md}\n\n{last}", flush=True)
    (out / "table.md").write_text(f"{setup}\n\n{md}\n\n{last}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
