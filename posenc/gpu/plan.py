"""What a GPU session runs, stage by stage, and how long each step is planned to take.

Each stage fits one command on a lent GPU (ten minutes at most, ``--deadline`` 540 s by default):

- ``proof``: every encoding config trains a few steps in bf16, compiled, and evaluates at 1× and 32×, plus one
  ``attention=triton`` run (``posenc.gpucheck``), beside the GPU tests named by path (``tests/test_gpu.py``);
- ``speed``: the attention table at one length (``--length``, 8,192 first), or (``--part train-step``) the
  whole-model train step, or (``--part bias``) the decomposition of a learnable bias's attention step against SDPA
  flash at one shape (``posenc/bench/bias.py``), or (``--part kernels``) stick-breaking's fused kernels
  (``attention=triton``) beside its blocked form and SDPA flash at L 2k to 16k, each alone on the machine;
- ``repro``: one paper-scale scheme (``--scheme``) at L 512, trained until the time the evaluation needs is all
  that is left, a checkpoint only at the end.

Why the plan counts compiled graphs: on a GPU machine a step's time is mostly compilation. Every distinct graph
(a block's training graph, its validation graph, a FlexAttention kernel per score_mod and evaluation shape) is
compiled once; a graph already compiled in the process, or found in the work folder's caches, is not. The count is
what the plan can know before running; ``COMPILE_S`` turns it into seconds, and it is a planning figure: replace it
with what a session measures. Where a result is the same, the plan compiles less: the proof evaluates at 1× and
32× only, and trains with one validation at its end.

Which steps overlap, and why: in the proof, the GPU tests run beside the config trainings. Both spend most of their
time compiling on the machine's cores while the GPU idles, and neither measures speed. Speed steps run alone
(``exclusive``): a timing beside another job measures the other job too.

``--rehearse`` builds the same steps with tiny settings for a CPU, and adds one step that composes every Hydra
command of the GPU plan, so a rehearsal proves the real commands parse.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from posenc.gpu.runner import RESERVE_S, Step

STAGES = ("proof", "speed", "repro")
COMPILE_S = 15.0  # planning figure: one compiled graph on the GPU machine (FlexAttention: seconds to tens of them)
START_S = 20.0  # a process importing torch, Lightning and Hydra
VERSIONS_S = 10.0  # the first step: which device and versions the session runs on
CASE_S = 5.0  # one timed benchmark case (conf/bench.yaml's case_budget_s, set to this in a session)
PROFILE_S = 3.0  # the same train step, three more calls under torch.profiler, and its table
# A learnable bias trained through plain ``flex`` adds into its parameters atomically per score: seconds per call,
# and the benchmark still makes its warm-up and three timed calls (docs/benchmarks.md).
ATOMIC_CASE_S = 20.0
PROOF_STEPS = 20  # training steps per config in the proof: enough to see the loss move, a few seconds on a GPU
PROOF_MULTIPLES = (1, 32)
TRITON_CONFIG = "kerple_log"  # a learnable distance-only scheme: the Triton kernels' end-to-end check
REPRO_EVAL_GRAPHS = 6  # one FlexAttention kernel per evaluation length, 1× … 32× (static shapes)
REPRO_EVAL_COMPUTE_S = 60.0  # the evaluation's forward passes at L 512 … 16k on one GPU (planning figure)
GPU_TESTS = "tests/test_gpu.py"
# Measured, not derived: the GPU tests took 395 s on an H200 beside the proof's config trainings (torch 2.11.0+cu130).
GPU_TESTS_S = 400.0
VERSIONS = (
    "import platform, torch; print('python', platform.python_version(), 'torch', torch.__version__, "
    "'cuda', torch.version.cuda); print('device', torch.cuda.get_device_name(0) if torch.cuda.is_available() "
    "else 'cpu (no CUDA)')"
)


@dataclass(frozen=True)
class Options:
    """What the command line chose: the stage, its argument, the deadline and whether this is a rehearsal."""

    stage: str
    work: Path
    deadline_s: float = 540.0
    length: int = 8192
    part: str = "attention"  # speed: the attention table at ``length``, the train step, the bias, or the kernels
    scheme: str = "alibi"
    configs: tuple[str, ...] = ()  # the proof's configs (default: every one)
    rehearse: bool = False
    jobs: int = 8  # proof trainings at once; the compile workers are shared out among them


def compile_threads(jobs: int) -> int:
    """Inductor's compile workers per process, so that ``jobs`` processes together use the machine's cores."""
    return max(1, (os.cpu_count() or 1) // max(1, jobs))


def build(options: Options) -> list[Step]:
    """The steps of ``options.stage`` (see the module docstring), GPU-sized or tiny for a rehearsal."""
    if options.stage not in STAGES:
        raise ValueError(f"unknown stage {options.stage}: choose from {', '.join(STAGES)}")
    python = [sys.executable]
    steps = [Step(options.stage, "versions", [*python, "-c", VERSIONS], planned_s=VERSIONS_S)]
    if options.rehearse:
        scheme = f"--scheme={options.scheme}"
        steps.append(
            Step(
                options.stage,
                "commands-parse",
                [
                    *python,
                    "-m",
                    "posenc.gpu.commands",
                    options.stage,
                    f"--length={options.length}",
                    scheme,
                    f"--part={options.part}",
                ],
                planned_s=START_S,
            )
        )
    stage_steps = {"proof": _proof, "speed": _speed, "repro": _repro}[options.stage](options)
    return steps + stage_steps


def _proof(options: Options) -> list[Step]:
    from posenc.config import encoding_choices

    configs = list(options.configs) or encoding_choices()
    work = options.work
    tests = [sys.executable, "-m", "pytest", GPU_TESTS, "-m", "gpu and not slow", "-q", "-rfE"]
    tests += ["-p", "no:cacheprovider", "--timeout=240", f"--junitxml={work / 'gpu-tests' / 'junit.xml'}"]
    multiples = ",".join(map(str, PROOF_MULTIPLES))
    check = [sys.executable, "-m", "posenc.gpucheck", "--configs", ",".join(configs), "--multiples", multiples]
    check += ["--no-tests", "--no-ddp", "--jobs", str(options.jobs), "--out", str(work / "gpucheck")]
    check += ["--set", f"trainer.val_check_interval={PROOF_STEPS}", "--set", "eval.plots=false"]
    if options.rehearse:
        check += ["--device", "cpu", "--steps", "3", "--triton", "", "--set", "eval.max_tokens=1024"]
    else:
        check += ["--steps", str(PROOF_STEPS), "--triton", TRITON_CONFIG, "--set", "trainer.precision=bf16-mixed"]
    runs = len(configs) + (0 if options.rehearse else 1)
    # Per run: the block's training graph, its validation graph, and a FlexAttention kernel per evaluation length.
    graphs = runs * (2 + len(PROOF_MULTIPLES))
    waves = math.ceil(runs / max(1, options.jobs))
    planned = waves * (START_S + (2 + len(PROOF_MULTIPLES)) * COMPILE_S)
    threads = {"TORCHINDUCTOR_COMPILE_THREADS": str(compile_threads(options.jobs + 1))}
    return [
        Step("proof", "gpu-tests", tests, planned_s=GPU_TESTS_S, graphs=0, overlap=True, env=threads),
        Step("proof", "train-configs", check, planned_s=planned, graphs=graphs, env=threads),
    ]


def bench_graphs(length: int | None, train_step: bool) -> tuple[int, float, list[str]]:
    """(compiled graphs, seconds of timing, train-step schemes) of ``posenc.bench`` with conf/bench.yaml.

    The schemes come back with the count so that the plan reads conf/bench.yaml once.

    A FlexAttention graph is one per distinct score_mod, forward and training apart: NoPE, RoPE and xPos share the
    graph without a score_mod (their rotation runs before it), so it is counted once with the references.
    ``flex_learnable`` adds, per learnable scheme, its training graph and the gradient forms' forward. ``auto``
    reuses the measurement of the backend it picks and compiles nothing more; for a scheme that supplies its own
    attention that is ``scheme``, a case of its own.
    """
    from omegaconf import OmegaConf

    from posenc.config import CONF_DIR
    from posenc.encodings import build as build_scheme

    bench = OmegaConf.load(CONF_DIR / "bench.yaml")
    graphs, seconds, step_schemes = 0, 0.0, []
    if length:
        backends = list(bench.attention.backends)
        schemes = [build_scheme(s, num_heads=2, head_dim=8) for s in bench.attention.schemes]
        biased = [s for s in schemes if s.adds_bias]
        learnable = [s for s in biased if s.learnable_bias]
        graphs += 2  # FlexAttention without a score_mod: forward, training
        graphs += 2 * len(biased) if "flex" in backends else 0
        graphs += 2 * len(learnable) if "flex_learnable" in backends else 0
        graphs += len({type(s.members[0]) for s in schemes if s.rotates})  # the fused rotation, one per kind
        # Timed: sdpa and flex for every scheme, flex_learnable where the bias learns (elsewhere it is flex), and
        # the four unbiased references; auto is the backend it picks, measured once.
        timed = [b for b in backends if b in ("sdpa", "flex")]
        own = len([s for s in schemes if s.supplies_attention]) if "auto" in backends else 0
        cases = len(schemes) * len(timed) + (len(learnable) if "flex_learnable" in backends else 0) + 4 + own
        seconds += cases * CASE_S + (len(learnable) * (ATOMIC_CASE_S - CASE_S) if "flex" in backends else 0)
    if train_step:
        step_schemes = list(bench.train_step.schemes)
        graphs += len(dict.fromkeys(["nope", *step_schemes]))
        seconds += (len(step_schemes) + 1) * (CASE_S + PROFILE_S)
    return graphs, seconds, step_schemes


# The bias decomposition's compiled graphs (posenc/bench/bias.py): FlexAttention's forward and training graphs of the
# constant bias, the captured-buffer gradient and ALiBi's table and formula; the extra forwards with an lse (Identity 1,
# and T5's tiles for the band); flex_learnable's two training graphs.
BIAS_GRAPHS = 2 * 4 + 2 + 2
BIAS_ITEMS = 14  # items timed, one or two modes each (each mode one case); two of them also profiled
BIAS_CASE_S = 3.0  # a bias item's case: milliseconds a call, so three seconds hold warm-up and every timed call
# The fused kernel's value checks compile its four Triton kernels (forward, dq, deterministic dq, dk/dv) per head dim
# and per length class (a multiple of 16 or not: Triton specialises on it); the timings reuse them.
BIAS_TRITON_COMPILES = 4 * 2 * 2
TRITON_COMPILE_S = 2.0  # planning figure: one Triton kernel to a cubin (0.4-1.3 s to PTX on a 2-core CPU, then ptxas)


def bias_graphs() -> tuple[int, float]:
    """(compiled graphs, seconds of timing and of Triton's compiles) of the bias decomposition.

    The captured-buffer gradient adds into its table atomically per score: seconds a call, an atomic case's time.
    """
    timing = (BIAS_ITEMS * 2 - 1) * BIAS_CASE_S + ATOMIC_CASE_S + 2 * PROFILE_S
    return BIAS_GRAPHS, timing + BIAS_TRITON_COMPILES * TRITON_COMPILE_S


# The kernels part: every scheme with a fused kernel of its own attention (a ``stick_form``) through ``triton`` and
# through ``auto`` (its blocked form), beside the unbiased references, at each length.
KERNEL_LENGTHS = (2048, 8192, 16384)
KERNEL_BACKENDS = ("triton", "auto")
KERNEL_COMPILES = 2  # stick-breaking's forward and backward (every length is divisible by 16: one specialisation)
REFERENCES = 5  # sdpa, sdpa:flash, sdpa:cudnn, sdpa:efficient, and flex without a score_mod (CUDA)


def kernel_schemes() -> list[str]:
    """The registry's schemes that declare a fused kernel for their own attention (``stick_form``)."""
    from posenc.encodings import available
    from posenc.encodings import build as build_scheme

    return [name for name in available() if build_scheme(name, num_heads=2, head_dim=8).stick_form() is not None]


def kernel_graphs(schemes: list[str]) -> tuple[int, float]:
    """(compiled graphs, seconds of timing and of Triton's compiles) of the kernels part.

    FlexAttention's reference without a score_mod compiles per length, forward and training apart; each length times
    the references and every scheme through ``KERNEL_BACKENDS``.
    """
    cases = len(KERNEL_LENGTHS) * (REFERENCES + len(schemes) * len(KERNEL_BACKENDS))
    return 2 * len(KERNEL_LENGTHS), cases * CASE_S + KERNEL_COMPILES * TRITON_COMPILE_S


def profiled(schemes: list[str]) -> str:
    """The bench override that profiles each timed train step (what a slow one spends its time on)."""
    return "train_step.profile_schemes=[" + ",".join(dict.fromkeys(["nope", *schemes])) + "]"


def _speed(options: Options) -> list[Step]:
    work, length = options.work, options.length
    case_s = BIAS_CASE_S if options.part == "bias" else CASE_S
    bench = [sys.executable, "-m", "posenc.bench", f"case_budget_s={case_s:g}", "long_context.length=null"]
    if options.rehearse:
        bench += ["device=cpu", "model=tiny", "attention.heads=2", "attention.head_dim=16", "attention.tokens=256"]
        bench += ["train_step.seq_len=32", "train_step.batch_size=2", "warmup=1", "repeats=2"]
    if options.part == "bias":
        graphs, timing = bias_graphs()
        argv = [
            *bench,
            "attention.lengths=[]",
            "train_step.schemes=[]",
            "bias.run=true",
            f"hydra.run.dir={work / 'bias'}",
        ]
        if options.rehearse:
            argv += ["bias.batch=1", "bias.heads=2", "bias.length=32", "bias.head_dim=16", "bias.profile_steps=1"]
            argv += ["bias.check_head_dims=[16]", "bias.check_batch=1"]
        name = "bench-bias"
    elif options.part == "kernels":
        schemes = kernel_schemes()
        graphs, timing = kernel_graphs(schemes)
        lengths = "[32]" if options.rehearse else "[" + ",".join(map(str, KERNEL_LENGTHS)) + "]"
        argv = [*bench, f"attention.lengths={lengths}", f"attention.schemes=[{','.join(schemes)}]"]
        argv += [f"attention.backends=[{','.join(KERNEL_BACKENDS)}]", "train_step.schemes=[]"]
        argv += [f"hydra.run.dir={work / 'kernels'}"]
        name = "bench-kernels"
    elif options.part == "train-step":
        graphs, timing, schemes = bench_graphs(None, True)
        argv = [*bench, "attention.lengths=[]", profiled(schemes), f"hydra.run.dir={work / 'train-step'}"]
        name = "bench-train-step"
    else:
        graphs, timing, _ = bench_graphs(length, False)
        argv = [*bench, f"attention.lengths=[{length}]", "train_step.schemes=[]", f"hydra.run.dir={work / 'attention'}"]
        name = f"bench-attention-{length}"
    planned = START_S + graphs * COMPILE_S + timing
    return [Step("speed", name, argv, planned_s=planned, graphs=graphs, exclusive=True)]


def repro_training_s(deadline_s: float) -> int:
    """Seconds of training that leave the evaluation, its compilation and the summary inside the deadline."""
    rest = RESERVE_S + VERSIONS_S + START_S + REPRO_EVAL_GRAPHS * COMPILE_S + REPRO_EVAL_COMPUTE_S
    return max(30, int(deadline_s - rest))


def _repro(options: Options) -> list[Step]:
    train_s = repro_training_s(options.deadline_s)
    minutes, seconds = divmod(train_s, 60)
    train = [sys.executable, "-m", "posenc.train", "experiment=repro_gpu", f"+encoding={options.scheme}"]
    train += ["logger=csv", "trainer.enable_progress_bar=false", f"+trainer.max_time=00:00:{minutes:02d}:{seconds:02d}"]
    # One checkpoint, at the end: the paper-sized model's checkpoint is about 1 GB, and writing one every few
    # hundred steps costs the training time the deadline allows.
    train += ["checkpoint_every_n_steps=1000000", f"hydra.run.dir={options.work / 'repro' / options.scheme}"]
    if options.rehearse:
        train += ["model=tiny", "data.seq_len=16", "data.batch_size=4", "trainer.max_steps=3", "eval.max_tokens=1024"]
        train += ["trainer.accelerator=cpu", "trainer.precision=32-true", "trainer.val_check_interval=3"]
    # Two graphs in training (the block's training and validation graphs), one kernel per evaluation length.
    graphs = 2 + REPRO_EVAL_GRAPHS
    planned = train_s + START_S + REPRO_EVAL_GRAPHS * COMPILE_S + REPRO_EVAL_COMPUTE_S
    return [Step("repro", f"repro-{options.scheme}", train, planned_s=planned, graphs=graphs)]
