"""Every setting of ``posenc.train`` and ``posenc.evaluate``: its type, its range, what it is for.

One model per config group (``conf/<group>/*.yaml`` give the defaults and say more); ``TrainConfig`` and
``EvaluateConfig`` are the composed configs. A composed config is validated against these once, before any
directory, logger or process starts (``posenc.schema.refusal``). A scheme's own options (``encoding.*`` beyond its
name) are the scheme's to check, in ``posenc/encodings/``. The validators here say only what a type cannot: two keys
that must agree.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from posenc.schema.types import (
    AtLeastOne,
    Auto,
    Count,
    Fraction,
    Multiples,
    Natural,
    NonNegative,
    Positive,
    Share,
    Text,
    as_override,
)

# The backends of posenc/attention (``auto`` picks one per scheme and device).
BACKENDS = Literal["auto", "eager", "sdpa", "flex", "flex_learnable", "triton", "scheme"]
# RoPE's context scalings (posenc/encodings/rope.py, SCALINGS).
ROPE_SCALINGS = Literal["pi", "ntk", "dynamic_ntk", "yarn", "yarn_paper", "llama3"]
SPLITS = Literal["train", "validation", "test"]
# Lightning's accelerators, strategies and precisions (its Trainer's arguments), and posenc's own "auto" precision.
ACCELERATORS = Literal["auto", "cpu", "gpu", "cuda", "mps", "tpu"]
STRATEGIES = Literal[
    "auto", "ddp", "ddp_spawn", "ddp_fork", "ddp_notebook", "ddp_find_unused_parameters_true",
    "ddp_find_unused_parameters_false", "ddp_spawn_find_unused_parameters_true",
    "ddp_spawn_find_unused_parameters_false", "ddp_fork_find_unused_parameters_true",
    "ddp_fork_find_unused_parameters_false", "ddp_notebook_find_unused_parameters_true",
    "ddp_notebook_find_unused_parameters_false", "fsdp", "fsdp_cpu_offload", "deepspeed", "deepspeed_stage_1",
    "deepspeed_stage_2", "deepspeed_stage_2_offload", "deepspeed_stage_3", "deepspeed_stage_3_offload",
    "deepspeed_stage_3_offload_nvme", "single_device", "single_xla", "single_tpu", "xla", "xla_debug",
]  # fmt: skip
PRECISIONS = Literal[
    "auto", "transformer-engine", "transformer-engine-float16", "16-true", "16-mixed", "bf16-true", "bf16-mixed",
    "32-true", "64-true", "64", "32", "16", "bf16", 64, 32, 16,
]  # fmt: skip
ATTENTION_SCALES = Literal["log_n", "llama4"]
SEED = Annotated[int, Field(ge=0, le=2**32 - 1)]


class Section(BaseModel):
    """A config group: every key declared (a key not here is refused), every value of its declared type."""

    model_config = ConfigDict(extra="forbid", strict=True)


class Encoding(Section):
    """The positional scheme (``+encoding=<name>``, ``conf/encoding``): its options are the scheme's own."""

    model_config = ConfigDict(extra="allow", strict=True)
    name: Text | Annotated[list[Text], Field(min_length=1)] = Field(
        description="the scheme (posenc/encodings), a stack `rope+alibi`, or one scheme per layer in turn"
    )


class ContextScaling(Section):
    """A RoPE context scaling the model trains with (PI, YaRN: docs/fine-tuning.md)."""

    method: ROPE_SCALINGS = Field(description="how the rotary frequencies are stretched")
    factor: AtLeastOne = Field(description="how many times the original length the model is stretched to")
    original_length: Count = Field(description="the length the stretched model was trained at")


class Model(Section):
    """The shared decoder (``conf/model``): the same for every scheme compared."""

    dim: Count = Field(description="width of the residual stream: a multiple of heads")
    depth: Count = Field(description="transformer blocks")
    heads: Count = Field(description="attention heads per block")
    mlp_ratio: Count = Field(description="MLP width as a multiple of dim")
    dropout: Annotated[float, Field(ge=0, lt=1)] = Field(description="dropout after attention and MLP")
    tie_embeddings: bool = Field(description="the output head shares the token embedding")
    init: Literal["gpt2", "pytorch"] = Field(description="weight initialisation (posenc/model.py says what it changed)")
    context_scaling: ContextScaling | None = Field(description="a RoPE context scaling built into the model")
    sink: Literal["none", "zero", "learned", "tokens"] = Field(
        description="every layer's attention sink: none, a zero logit, a learned logit per head, or sink tokens"
    )
    sink_tokens: Count = Field(description="sink=tokens: key-value pairs in front of every layer's keys")

    @model_validator(mode="after")
    def _tokens_with_tokens(self) -> Model:
        if self.sink_tokens != 1 and self.sink != "tokens":
            raise ValueError(
                f"model.sink_tokens={self.sink_tokens} counts sink tokens, and model.sink={self.sink}: set "
                "model.sink=tokens, or leave model.sink_tokens at 1"
            )
        return self

    @model_validator(mode="after")
    def _heads_divide_dim(self) -> Model:
        if self.dim % self.heads:
            near = max(self.heads, round(self.dim / self.heads) * self.heads)
            raise ValueError(
                f"model.dim={self.dim} is not divisible by model.heads={self.heads}: choose a multiple, "
                f"e.g. model.dim={near}"
            )
        return self


class CorpusOptions(Section):
    """A corpus's options (each corpus's yaml has the ones it reads)."""

    paths: Annotated[list[Text], Field(min_length=1, examples=["[notes.txt,'docs/**/*.md']"])] | None = Field(
        None, description="data=text: files or globs"
    )
    val_percent: Annotated[float, Field(gt=0, lt=100)] | None = Field(None, description="share held out to validate")
    test_percent: Annotated[float, Field(gt=0, lt=100)] | None = Field(None, description="share held out to test")
    min_bytes: Natural | None = Field(None, description="data=stdlib: leave out files shorter than this")
    path: Text | None = Field(None, description="data=hf: the dataset's name on the Hub")
    name: Text | None = Field(None, description="data=hf: the dataset's configuration")
    text_column: Text | None = Field(None, description="data=hf: the column holding the text")


class TaskOptions(Section):
    """A synthetic task's generator options (posenc/data/mqar.py, posenc/data/retrieval.py)."""

    num_pairs: Count | None = Field(None, description="mqar: key-value pairs in the block")
    power_a: Fraction | None = Field(None, description="mqar: Zoology's power law of query slots (1: uniform)")
    kv_offset: Literal["zoology", "random"] | None = Field(None, description="mqar: where the block sits")
    num_keys: Count | None = Field(None, description="multikey: needles in the window")
    num_queries: Count | None = Field(None, description="multikey: needles asked")
    value_len: Count | None = Field(None, description="multikey: digits of a needle's value")
    train_queries: Count | None = Field(None, description="multikey: questions per training window")
    num_chains: Count | None = Field(None, description="vartrack: variable chains")
    hops: Count | None = Field(None, description="vartrack: assignments per chain after the first")
    value_digits: Count | None = Field(None, description="vartrack: digits of the value")


class Data(Section):
    """What a run trains on (``conf/data``): a text corpus, or a synthetic task."""

    corpus: Literal["stdlib", "text", "hf"] | None = Field(None, description="the text corpus (data=stdlib|text|hf)")
    corpus_options: CorpusOptions | None = None
    task: Literal["passkey", "copy", "multikey", "vartrack", "mqar"] | None = Field(
        None, description="the synthetic task (data=passkey|copy|multikey|vartrack|mqar)"
    )
    task_options: TaskOptions | None = None
    seq_len: Count = Field(description="training length in tokens (bytes)")
    batch_size: Count = Field(description="windows per step on each device")
    val_windows: Count = Field(description="validation windows")
    cache_dir: Text | None = Field(None, description="where tokenized corpora are cached")
    num_workers: Natural = Field(description="data loader worker processes")

    @model_validator(mode="after")
    def _one_source(self) -> Data:
        if (self.corpus is None) == (self.task is None):
            raise ValueError("data needs one of data.corpus and data.task: choose data=<option> (e.g. data=stdlib)")
        return self


class Attention(Section):
    """The attention backend (``attention=<name>``)."""

    name: BACKENDS = Field(description="auto: the fastest that honours the scheme on this device")


class Optim(Section):
    """AdamW with warmup and cosine decay (``conf/optim/adamw.yaml``)."""

    lr: Positive = Field(description="peak learning rate", examples=["1e-3"])
    betas: Annotated[list[Annotated[float, Field(ge=0, lt=1)]], Field(min_length=2, max_length=2)] = Field(
        description="AdamW's β1, β2", examples=["[0.9,0.95]"]
    )
    eps: Positive = Field(description="AdamW's ε")
    weight_decay: NonNegative = Field(description="decoupled weight decay")
    warmup_steps: Natural = Field(description="linear warmup steps")
    min_lr_ratio: Share = Field(description="the cosine decay's floor, as a share of lr")
    scheme_lr_multiplier: Positive = Field(description="the positional parameters' lr as a multiple of lr")
    tuned: Text | None = Field(description="a tuning's selection.json: the scheme's lr and multiplier come from it")


class Trainer(Section):
    """Lightning's Trainer (``conf/trainer``); ``+trainer.<keyword>`` adds any other of its arguments."""

    model_config = ConfigDict(extra="allow", strict=True)
    max_steps: Count = Field(description="optimizer steps")
    accelerator: ACCELERATORS = Field(description="auto: a GPU when there is one")
    devices: Count | Literal[-1, "auto"] | Annotated[list[Natural], Field(min_length=1)] = Field(
        description="devices per node (-1 or auto: all), or their indices"
    )
    num_nodes: Count = Field(description="nodes")
    strategy: STRATEGIES = Field(description="Lightning's parallel strategy")
    precision: PRECISIONS = Field(description="auto: bf16-mixed on a bf16 GPU, 32-true elsewhere")
    gradient_clip_val: NonNegative | None = Field(description="gradient norm clip (null: none)")
    accumulate_grad_batches: Count = Field(description="batches per optimizer step")
    val_check_interval: Count | Fraction | None = Field(description="validate every this many steps")
    check_val_every_n_epoch: Count | None = Field(description="null: validation follows val_check_interval")
    log_every_n_steps: Count = Field(description="logging interval in steps")
    enable_progress_bar: bool
    enable_model_summary: bool
    deterministic: bool | Literal["warn"] | None = Field(description="deterministic algorithms only")


class Logger(Section):
    """Where metrics go (``logger=wandb|csv|none``); the W&B keys are read for ``kind: wandb`` only."""

    kind: Literal["wandb", "csv", "none"]
    project: Text | None = Field(None, description="W&B project")
    entity: Text | None = Field(None, description="W&B entity (null: your default)")
    mode: Literal["auto", "online", "offline", "disabled"] = Field(
        "auto", description="auto: online with a key and a network, else offline"
    )
    group: Text | None = Field(None, description="W&B group (a sweep sets its own)")
    tags: list[Text] = Field([], description="extra W&B tags")
    id: Text | None = Field(None, description="W&B run id to continue (a sweep's job sets its own)")


class TaskEval(Section):
    """One synthetic task's evaluation."""

    enabled: bool | Auto = Field(description="auto: only for a model trained on the task")
    multiples: Multiples = Field(description="lengths as multiples of the training length")
    samples: Count = Field(description="samples per length")


class PasskeyEval(TaskEval):
    depths: Annotated[list[Share], Field(min_length=1)] = Field(description="where the passkey sits (0: start)")


class Eval(Section):
    """The extrapolation evaluation (``conf/eval/default.yaml`` says what each does)."""

    at_end: bool = Field(description="evaluate when training ends")
    multiples: Multiples = Field(description="evaluation lengths as multiples of the training length")
    mode: Literal["nonoverlap", "sliding"] = Field(description="disjoint windows, or windows advancing by a stride")
    stride: Count | None = Field(description="sliding: tokens a window advances", examples=["32"])
    stride_fraction: Fraction | None = Field(description="sliding: the stride as a share of each length")
    sliding_fractions: list[Fraction] = Field(description="end of training: also evaluate sliding at these strides")
    split: SPLITS = Field(description="the held-out split scored")
    max_containment: Share | None = Field(description="drop held-out documents this much contained in training")
    near_copies: Literal["lines", "bytes"] = Field(
        default="lines", description="containment in 5-line shingles, or in sampled 64-byte windows"
    )
    max_tokens: Count | None = Field(description="scored tokens at every length (null: the whole split)")
    sample: Literal["documents", "head", "long_documents"] = Field(description="which held-out tokens are scored")
    tokens_per_batch: Count = Field(description="memory bound: windows per batch = this // length")
    seed: SEED = Field(description="the sample's and the tasks' seed")
    plots: bool = Field(description="write PNG plots")
    equivalence_margin: Fraction = Field(
        description="the report's margin: perplexities within ± this share are equivalent"
    )
    equivalence_accuracy: Fraction = Field(description="the report's margin: accuracies within ± this are equivalent")
    effective_ppl_ratio: AtLeastOne = Field(description="effective length: perplexity within this × in-length")
    effective_acc_fraction: Fraction = Field(description="effective length: accuracy within this × in-length")
    effective_ppl_threshold: AtLeastOne | None = Field(description="effective length: one shared perplexity bound")
    effective_acc_threshold: Fraction | None = Field(description="effective length: one shared accuracy bound")
    rope_scaling: ROPE_SCALINGS | None = Field(description="RoPE scaling at evaluation")
    rope_scaling_factor: AtLeastOne | None = Field(description="its factor: times the training length")
    attention_scale: ATTENTION_SCALES | None = Field(description="length scaling of attention at evaluation")
    passkey: PasskeyEval
    copy_: TaskEval = Field(alias="copy")  # the key is copy: the name would hide BaseModel.copy
    multikey: TaskEval
    vartrack: TaskEval
    mqar: TaskEval
    attention_stats: bool = Field(description="attention statistics per layer and head")
    attention_stats_tokens: Count = Field(description="tokens the attention statistics read per length")

    @model_validator(mode="after")
    def _agree(self) -> Eval:
        if self.mode == "sliding" and (self.stride is None) == (self.stride_fraction is None):
            raise ValueError(
                "eval.mode=sliding needs one stride: eval.stride (tokens, e.g. 32) or eval.stride_fraction (of each "
                f"evaluation length, e.g. 0.5), got stride={as_override(self.stride)}, "
                f"stride_fraction={as_override(self.stride_fraction)}"
            )
        if self.rope_scaling is not None and self.rope_scaling_factor is None:
            raise ValueError(
                f"eval.rope_scaling={self.rope_scaling} needs eval.rope_scaling_factor (e.g. 8: eight times L)"
            )
        return self


class TrainConfig(Section):
    """``python -m posenc.train``: ``conf/train.yaml`` and its groups."""

    encoding: Encoding
    model: Model
    data: Data
    attention: Attention
    optim: Optim
    trainer: Trainer
    logger: Logger
    eval: Eval
    seed: SEED = Field(description="the run's seed (weights, data order)")
    run_name: Text = Field(description="the run's directory name")
    output_root: Text = Field(description="where runs/ and sweeps/ are written")
    compile: bool | Auto = Field(description="torch.compile each block (auto: on a CUDA GPU)")
    checkpoint_every_n_steps: Count = Field(description="how far back an interrupted run resumes from")
    resume: Text | None = Field(description="a checkpoint to resume, or last: this run directory's")
    init_from: Text | None = Field(description="a run or checkpoint whose weights this run starts from")
    sweep_name: Text = Field(description="a sweep's directory name")
    # Written by the run itself, not set: what the scheme's length settings resolved to, where tuned rates came from.
    length_settings: dict[str, Any] | None = None
    tuning: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_rope_scaling(self) -> TrainConfig:
        if self.model.context_scaling is not None and self.eval.rope_scaling is not None:
            raise ValueError(
                "model.context_scaling and eval.rope_scaling both stretch RoPE, and the evaluation's would replace "
                "the one the model trains with: drop eval.rope_scaling"
            )
        return self


class EvaluateConfig(Section):
    """``python -m posenc.evaluate <run>``: ``conf/evaluate.yaml``."""

    target: Text = Field(description="the run directory or checkpoint evaluated")
    out_dir: Text | None = Field(description="where results go (null: a folder of the run named for the settings)")
    device: Literal["auto", "cpu", "cuda", "mps"] | Annotated[str, Field(pattern=r"^cuda:\d+$", title="cuda:N")] = (
        Field(description="auto: cuda when available")
    )
    attention: BACKENDS | None = Field(description="the backend (null: the one the run trained with)")
    wandb: bool | Auto = Field(description="log to the run's own W&B run (auto: when it logged to W&B)")
    eval: Eval
    # The checkpoint's own, compared with it: an override that contradicts the trained model is refused.
    encoding: dict[str, Any] | None = None
    model: dict[str, Any] | None = None
