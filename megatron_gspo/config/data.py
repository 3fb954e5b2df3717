"""The sections about the prompts and their scoring: ``data`` (:class:`DataConfig`, a synthetic
task or prompt files), ``reward`` (:class:`RewardConfig`) and ``tools`` (:class:`ToolsConfig`,
multi-turn tool-using rollouts)."""

from __future__ import annotations

import typing
from dataclasses import dataclass, field
from typing import Literal, Optional

from megatron_gspo.config.checks import require


@dataclass(kw_only=True, slots=True)
class DataConfig:
    """Where prompts come from: a synthetic ``task`` (no files needed) or prompt files.

    Exactly one of ``task`` and ``train_path`` is set; a file run writes ``task: null``. The
    datasets are built by ``pipeline.scoring.data.build_datasets``.
    """

    task: Optional[Literal["addition", "carry_addition", "tool_addition"]] = "addition"
    """Synthetic task (byte-level tokens): "addition" = exact sums "a+b=" -> "c";
    "carry_addition" = the same sums with a digit-by-digit carry trace before the answer (long
    responses, ~10 tokens per column; the reward checks the final answer only);
    "tool_addition" = sums of two digits-digit numbers, the reference response a call of the
    calculator tool pipeline.scoring.tasks:add, its response and the answer (with tools.functions, the
    multi-turn demo: docs/tools.md); null with data.train_path."""
    digits: int = 2
    """addition: operands have up to this many digits; carry_addition: the number of columns is
    drawn from [ceil(digits / 4), digits] (digits 24: responses of 62-243 tokens);
    tool_addition: operands have exactly this many digits."""
    num_eval_prompts: Optional[int] = 64
    """Held-out prompts evaluated every run.eval_interval steps (and at the start and the end):
    the task's "eval" split, or the first this many rows of data.eval_path (null: all rows)."""
    train_path: Optional[str] = None
    """Training prompts: JSONL (one JSON object per line) or Parquet, one prompt per row."""
    eval_path: Optional[str] = None
    """Held-out prompts, same format and keys as train_path; without it a file run has no
    evaluation."""
    format: Literal["auto", "jsonl", "parquet"] = "auto"
    """File format; auto: from the suffix (.jsonl / .ndjson / .json, .parquet)."""
    prompt_key: str = "prompt"
    """Row field holding the prompt: a string, or a list of chat messages {role, content}.
    Dotted paths reach into nested objects ("question.text")."""
    label_key: Optional[str] = "label"
    """Row field holding the reference answer (string or number; dotted allowed); null: no labels
    (only a reward.kind that needs none: function or http)."""
    tokenizer_dir: Optional[str] = None
    """Local Hugging Face tokenizer directory (read with local_files_only, never downloaded);
    null: byte-level tokens (id = UTF-8 byte), as the synthetic task uses."""
    apply_chat_template: bool = True
    """With tokenizer_dir: wrap each prompt in the tokenizer's chat template, with the generation
    prompt. Without it prompts are encoded as plain text."""
    shuffle: bool = True
    """Reshuffle the training prompts every epoch from (run.seed, epoch)."""
    skip_malformed: bool = False
    """Count and report malformed rows instead of stopping at the first one (never silent)."""

    def __post_init__(self) -> None:
        require(1 <= self.digits <= 32, f"data.digits: must be in [1, 32], got {self.digits}")
        require(self.num_eval_prompts is None or self.num_eval_prompts >= 1,
                f"data.num_eval_prompts: must be >= 1 (or null for all rows of data.eval_path), "
                f"got {self.num_eval_prompts}")
        require((self.task is None) != (self.train_path is None),
                "data.task: exactly one of data.task and data.train_path must be set "
                f"(got task {self.task!r}, train_path {self.train_path!r}); "
                "write task: null to train on a prompt file")
        if self.task is not None:
            require(self.num_eval_prompts is not None,
                    f"data.num_eval_prompts: must be set for data.task {self.task!r}")
            for name in ("eval_path", "tokenizer_dir"):
                require(getattr(self, name) is None,
                        f"data.{name}: only used with data.train_path (data.task {self.task!r} "
                        "generates its own byte-level prompts and eval split); unset it")
        require(bool(self.prompt_key and self.prompt_key.strip(".")),
                f"data.prompt_key: must name a field, got {self.prompt_key!r}")
        require(self.label_key is None or bool(self.label_key.strip(".")),
                f"data.label_key: must name a field or be null, got {self.label_key!r}")


RewardKind = Literal["exact_match", "math", "addition", "carry_addition", "tool_addition",
                     "function", "http"]
REWARD_KINDS: tuple[str, ...] = typing.get_args(RewardKind)


@dataclass(kw_only=True, slots=True)
class RewardConfig:
    """How a response is scored (``pipeline.scoring.rewards.build_reward``)."""

    kind: Optional[RewardKind] = None
    """exact_match: stripped response == label; math: equivalence through math-verify;
    addition: the synthetic task's exact match (up to the end token); carry_addition: exact
    match of the final segment (the answer after the carry trace); tool_addition: exact match
    of a trajectory's last model turn with the sum; function: reward.function;
    http: a reward service at reward.url. null: the reward of data.task (required with files)."""
    function: Optional[str] = None
    """kind function: "package.module:function" or "path/to/file.py:function", called as
    fn(prompt, response_ids, response_text) -> float, in a worker process of rank 0 (started
    once, kept for the run) with reward.timeout_s per sample; a stop signal abandons a call."""
    url: Optional[str] = None
    """kind http: the service's URL; POST a JSON list of {prompt, response, label, prompt_index,
    sample_index}, answered by {"rewards": [...]}."""
    timeout_s: float = 30.0
    """The deadline of a reward, in seconds. kind function: per sample; the function runs in a
    worker process (``pipeline.scoring.rewards.FunctionReward``), which is killed when a call passes the
    deadline, and the sample fails with a RewardError naming the function and the deadline
    (then on_error: "raise" stops the run, "zero" counts it as 0 in train/reward_failures).
    kind http: per request (each retry has its own). The built-in rewards have none (math
    bounds math-verify's work itself)."""
    step_timeout_s: float = 600.0
    """kind function: the deadline of one step's rewards (the samples scored together: the
    step's rollout or an evaluation; one group at a time under rollout.async full), in seconds. Past it the worker is killed and every sample not
    scored yet fails with a RewardError naming this field (then on_error as for one sample), so
    that a reward that hangs on many samples costs at most this long per step instead of
    samples x timeout_s. Each deadline passed is said on the console when it passes. With
    on_error "raise" the first failure ends the scoring of the step at once."""
    max_retries: int = 2
    """kind http: further attempts after a connection error, timeout, 429 or 5xx answer."""
    batch_size: int = 64
    """kind http: samples per request."""
    on_error: Literal["raise", "zero"] = "raise"
    """An exception or a non-finite reward: raise (naming the sample) or count it as 0 and report
    it in the step's metrics."""

    def __post_init__(self) -> None:
        require(self.kind != "function" or bool(self.function),
                "reward.function: required when reward.kind is 'function' "
                "(\"package.module:function\" or \"file.py:function\")")
        require(self.function is None or ":" in self.function,
                f"reward.function: expected \"module:function\", got {self.function!r}")
        require(self.kind != "http" or bool(self.url),
                "reward.url: required when reward.kind is 'http'")
        require(self.url is None or self.url.startswith(("http://", "https://")),
                f"reward.url: expected an http:// or https:// URL, got {self.url!r}")
        require(self.timeout_s > 0, f"reward.timeout_s: must be > 0, got {self.timeout_s}")
        require(self.step_timeout_s >= self.timeout_s,
                f"reward.step_timeout_s: must be >= reward.timeout_s ({self.timeout_s:g}), got "
                f"{self.step_timeout_s:g}")
        require(self.max_retries >= 0, f"reward.max_retries: must be >= 0, got {self.max_retries}")
        require(self.batch_size >= 1, f"reward.batch_size: must be >= 1, got {self.batch_size}")


@dataclass(kw_only=True, slots=True)
class ToolsConfig:
    """Multi-turn, tool-using rollouts (docs/tools.md): each training and evaluation sample is a
    trajectory of model turns and tool responses (``pipeline.generation.multiturn``), token-in / token-out,
    the loss over the model's tokens only. Empty ``functions`` and no ``environment``: one
    prompt, one response."""

    functions: list[str] = field(default_factory=list)
    """The tools, as "package.module:function" (the tool's name is the function's); each call
    runs fn(**arguments) out of process in the sandbox (``pipeline.tools.sandbox``)."""
    environment: Optional[str] = None
    """"package.module:Class" of a custom environment (``pipeline.generation.environment.Environment``),
    constructed for each trajectory as Class(executor=..., tool_format=...) (executor: the
    sandbox of tools.functions); null: ``ToolEnvironment`` (tool calls in, tool responses out,
    the first turn without a call ends the trajectory)."""
    format: Literal["qwen3", "plain"] = "qwen3"
    """How tool responses are appended (``pipeline.generation.tool_calls.FORMATS``): qwen3: Qwen3's chat
    template glue (<|im_start|>user <tool_response>... <|im_end|> and the generation prompt);
    plain: <tool_response>...</tool_response> only (a vocabulary without special tokens)."""
    max_turns: int = 4
    """Model turns per trajectory (end reason max_turns)."""
    max_tokens: Optional[int] = None
    """Output tokens per trajectory, the model's and the appended ones together (end reason
    max_tokens); null: run.seq_length + 1 - the prompt's length, so every trajectory fits."""
    max_tool_time_s: float = 30.0
    """Tool wall time per trajectory, all calls together; a call may not run past what is left,
    and when it is spent the trajectory ends (end reason tool_error)."""
    timeout_s: float = 5.0
    """Wall-clock limit of one tool call (the call fails with error timeout, its worker process
    is killed and replaced; the trajectory goes on)."""
    memory_mb: int = 512
    """Memory one call may allocate: its worker's address-space limit (RLIMIT_AS) is what the
    worker maps after importing the tools plus this many MiB (error memory past it)."""
    output_bytes: int = 4096
    """The most bytes a call may print and return together (error output_limit past it)."""
    workers: int = 4
    """Sandbox worker processes on rank 0: tool calls that run at once."""
    isolation: Literal["namespaces", "process"] = "namespaces"
    """What shuts the tools in (docs/tools.md, ``pipeline.tools.isolation``). namespaces: each
    worker in its own user, pid, mount, network and IPC namespace, in a minimal read-only root
    (the system's and Python's files, the tools' modules) whose only writable directory is a
    private /tmp, without capabilities; every process a call started is killed when it ends.
    Needs unprivileged user namespaces (or root): where the kernel refuses them the run is
    refused before it starts, naming this field. process: no namespaces (the tools can read and
    write what the run's user can, and see its processes), a private working directory, no
    capabilities, what a call started killed when it ends: chosen explicitly, never a
    fallback."""
    pass_env: list[str] = field(default_factory=list)
    """Names of the run's environment variables the tools see (those set); their environment is
    otherwise empty but for PATH, LANG, PYTHONPATH, HOME and TMPDIR (the private directory)."""

    def enabled(self) -> bool:
        return bool(self.functions) or self.environment is not None

    def __post_init__(self) -> None:
        for i, spec in enumerate(self.functions):
            require(":" in spec and all(spec.split(":", 1)),
                    f"tools.functions[{i}]: expected \"package.module:function\", got {spec!r}")
        require(self.environment is None or ":" in self.environment,
                f"tools.environment: expected \"package.module:Class\", got {self.environment!r}")
        require(self.max_turns >= 1, f"tools.max_turns: must be >= 1, got {self.max_turns}")
        require(self.max_tokens is None or self.max_tokens >= 1,
                f"tools.max_tokens: must be >= 1, got {self.max_tokens}")
        for name in ("max_tool_time_s", "timeout_s"):
            require(getattr(self, name) > 0, f"tools.{name}: must be > 0, got {getattr(self, name)}")
        for name in ("memory_mb", "output_bytes", "workers"):
            require(getattr(self, name) >= 1, f"tools.{name}: must be >= 1, got {getattr(self, name)}")
        for i, name in enumerate(self.pass_env):
            require(isinstance(name, str) and bool(name) and "=" not in name and "\0" not in name,
                    f"tools.pass_env[{i}]: expected the name of an environment variable, "
                    f"got {name!r}")
