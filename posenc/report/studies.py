"""The studies ``posenc.report --study <name>`` writes into ``docs/results/``.

Each one's title and the commands that produce its runs, so that a document opens with how to regenerate it
(``posenc/report/study.py`` writes it).
"""

from __future__ import annotations

from dataclasses import dataclass

from posenc.report.preset import DEFAULT_REFERENCES
from posenc.report.tuning import TIES


@dataclass(frozen=True)
class Study:
    """A study's title and the command that produces its runs."""

    title: str
    runs_command: str
    inputs: str = "<their sweep or run directories>"  # what the report reads of those runs
    cost_only: bool = False  # the report's cost table, protocols and chart only (``build_report``)
    tuning: bool = False  # the tuning grid alone, and the selection written beside the document (selection.json)
    ties: str = TIES  # a tuning's sweep (-cn, and its overrides) that runs a tied point at more seeds
    budgets: bool = False  # each scheme's rank at every budget its runs trained for, alone
    stability: bool = False  # learning-rate sensitivity and spikes per scheme over a grid of rates, alone
    references: tuple[str, ...] = DEFAULT_REFERENCES  # the comparisons fixed in advance (``preset.py``)


# The reproduction's encoding configs (sweeps/repro.yaml): every scheme of the ALiBi-era comparison and two hybrids.
REPRODUCTION = (
    "alibi,alibi_dd,cope,dape,fire,kerple_log,kerple_power,learned,nope,rope,sandwich,sinusoidal,xpos,t5,rnope,"
    "rope_alibi"
)

STUDIES = {
    "reproduction": Study(
        "Reproduction: which scheme extrapolates",
        "python -m posenc.train -m -cd sweeps -cn repro seed=0,1,2 'eval.sliding_fractions=[0.5]'  # 16 configs x 3 "
        "seeds; on 2 cores, as two single-threaded halves side by side:\n"
        "#   OMP_NUM_THREADS=1 ... +encoding=alibi,alibi_dd,cope,dape,fire,kerple_log,kerple_power,learned &\n"
        "#   OMP_NUM_THREADS=1 ... +encoding=nope,rope,sandwich,sinusoidal,xpos,t5,rnope,rope_alibi",
        "outputs/sweeps/repro",
    ),
    "cost": Study(
        "Cost of each scheme: its train step timed side by side, beside how far it extrapolates",
        "python -m posenc.train -m -cd sweeps -cn repro seed=0,1,2 'eval.sliding_fractions=[0.5]'  # the "
        "reproduction's runs\n"
        "OMP_NUM_THREADS=1 python -m posenc.bench model=tiny train_step.seq_len=64 train_step.batch_size=32 "
        f"'train_step.schemes=[{REPRODUCTION}]' 'attention.lengths=[]' long_context.length=null repeats=40 "
        "case_budget_s=60 hydra.run.dir=outputs/bench/cost",
        "outputs/sweeps/repro outputs/bench/cost",
        cost_only=True,
    ),
    "controlled": Study(
        "The controlled comparison: six schemes, five seeds, both protocols, positional parameters that learned",
        "python -m posenc.train -m -cd sweeps -cn controlled  # 6 schemes x 5 seeds; on 2 cores, as two single-"
        "threaded halves side by side:\n"
        "#   OMP_NUM_THREADS=1 ... +encoding=alibi,nope,fire & OMP_NUM_THREADS=1 ... +encoding=rope,t5,kerple_log",
        "outputs/sweeps/controlled",
    ),
    "controlled-1200": Study(
        "The controlled comparison's learnable schemes at twice the steps: do FIRE and KERPLE-log settle?",
        "python -m posenc.train -m -cd sweeps -cn controlled +encoding=fire,kerple_log trainer.max_steps=1200 "
        "sweep_name=controlled_1200  # read beside the same schemes' 600-step runs of sweeps/controlled",
        "outputs/sweeps/controlled_1200 outputs/sweeps/controlled/{fire,kerple_log}-L64-s*",
    ),
    "tuning": Study(
        "The same tuning for every scheme: one grid, selected on validation",
        "python -m posenc.train -m -cd sweeps -cn tune  # the schemes with parameters, the whole grid\n"
        "python -m posenc.train -m -cd sweeps -cn tune +encoding=alibi,rope,nope optim.scheme_lr_multiplier=1\n"
        "python -m posenc.train -m -cd sweeps -cn tune +encoding=t5 optim.scheme_lr_multiplier=1000  # past T5's edge",
        "outputs/sweeps/tune",
        tuning=True,
    ),
    "tuning-2400": Study(
        "The tuning's tied points at 2,400 steps: does the choice the 2,400-step comparison reuses still hold?",
        "python -m posenc.train -m -cd sweeps -cn tune_ties trainer.max_steps=2400 sweep_name=tune_ties_2400 "
        "seed=10,11,12 +encoding=<scheme> optim.lr=<lr> optim.scheme_lr_multiplier=<m>  # each point tied at 600 "
        "steps (docs/results/tuning.md): KERPLE-log 4e-3 and 8e-3 at ×10, stick-breaking 4e-3 at ×1 and ×10",
        "outputs/sweeps/tune_ties_2400",
        tuning=True,
        ties="tune_ties trainer.max_steps=2400 sweep_name=tune_ties_2400 seed=13,14",
    ),
    "comparison": Study(
        "A comparison fair by construction: settings scaled to the length, one tuning, the test split",
        "python -m posenc.train -m -cd sweeps -cn tune  # then +encoding=alibi,rope,nope "
        "optim.scheme_lr_multiplier=1, and the tuning study (docs/results/tuning.md)\n"
        "python -m posenc.train -m -cd sweeps -cn comparison  # 8 schemes x 5 seeds; on 2 cores, as two "
        "single-threaded halves side by side:\n"
        "#   OMP_NUM_THREADS=1 ... +encoding=alibi,nope,t5,fire & "
        "OMP_NUM_THREADS=1 ... +encoding=rope,kerple_log,stick_breaking_trained,fox\n"
        "python -m posenc.train -m -cd sweeps -cn comparison seed=5,6,7,8,9  # five more seeds, ten a scheme",
        "outputs/sweeps/comparison",
    ),
    "layouts": Study(
        "Deployed local/global layouts and the 2025–26 schemes on the comparison's recipe",
        "python -m posenc.train -m -cd sweeps -cn tune_additions  # then the layouts, and the tuning study "
        "(sweeps/tune_additions.yaml, docs/results/tuning.md)\n"
        "python -m posenc.train -m -cd sweeps -cn comparison_additions  # 7 entries x 5 seeds; on 2 cores, as two "
        "single-threaded halves side by side\n"
        "python -m posenc.train -m -cd sweeps -cn comparison_additions +encoding=gemma3 model.depth=6\n"
        "# iRoPE's and SWAN's inference-time scaling, on the comparison's split and sample, under both protocols:\n"
        "for run in outputs/sweeps/comparison_additions/{irope,swan}-*; do "
        "s=$(case $run in *irope*) echo llama4;; *) echo log_n;; esac); "
        "for p in '' 'eval.mode=sliding eval.stride_fraction=0.5'; do python -m posenc.evaluate $run "
        "eval.split=test eval.sample=long_documents eval.attention_scale=$s $p; done; done\n"
        "# ALiBi, RoPE and NoPE beside them are the comparison's own runs, read from its kept records",
        "outputs/sweeps/comparison_additions docs/results/comparison/runs/{alibi,rope,nope}-L64-s[0-4]",
        # each inference-time scaling against the same runs without it, beside the two default references
        references=(*DEFAULT_REFERENCES, "* · llama4", "* · log_n"),
    ),
    "comparison-2400": Study(
        "The fair comparison at four times the tokens (2,400 steps)",
        "python -m posenc.train -m -cd sweeps -cn comparison trainer.max_steps=2400 sweep_name=comparison_2400  # "
        "the same halves side by side",
        "outputs/sweeps/comparison_2400",
    ),
    "comparison-all-windows": Study(
        "Every window of the test split: the comparison's second five seeds scored on all of them",
        "python -m posenc.train -m -cd sweeps -cn comparison seed=5,6,7,8,9  # the comparison's second five seeds\n"
        "# each run again on every 2,048-token window of the test split (no token cap), nonoverlapping; on 2 cores "
        "as two single-threaded lanes side by side:\n"
        "for run in outputs/sweeps/comparison/*-s[5-9]; do python -m posenc.evaluate $run eval.split=test "
        "eval.sample=long_documents eval.max_tokens=null; done",
        "outputs/sweeps/comparison/*-s[5-9]/eval_max_tokensNone",
    ),
    "comparison-budgets": Study(
        "Does the fair comparison's ranking hold at four times the tokens?",
        "python -m posenc.train -m -cd sweeps -cn comparison  # 600 steps, then 2,400:\n"
        "python -m posenc.train -m -cd sweeps -cn comparison trainer.max_steps=2400 sweep_name=comparison_2400\n"
        "# then the comparison and comparison-2400 studies, whose kept records this one reads: the seeds both budgets "
        "have (0-4), so neither budget's tests have more power than the other's",
        "docs/results/comparison/runs/*-s[0-4] docs/results/comparison-2400/runs",
        budgets=True,
    ),
    "sensitivity": Study(
        "Which verdicts survive every setting: FIRE's threshold and T5's buckets, three values each",
        "python -m posenc.train -m -cd sweeps -cn sensitivity_fire  # FIRE's threshold at L and 512, 5 seeds each\n"
        "python -m posenc.train -m -cd sweeps -cn sensitivity_t5  # T5's 32 buckets up to L and 2L, 5 seeds each\n"
        "# their third setting (the comparison's) and ALiBi are the comparison's own runs, read from its kept records",
        "outputs/sweeps/sensitivity docs/results/comparison/runs/{alibi,fire,t5}-L64-s[0-4]",
    ),
    "frontier": Study(
        "The 2024–2025 frontier on the reproduction's backbone (one seed)",
        "python -m posenc.train -m -cd sweeps -cn frontier",
        "outputs/sweeps/frontier",
    ),
    "recall": Study(
        "Associative recall by length",
        "python -m posenc.train -m -cd sweeps -cn retrieval  # 6 schemes x 3 rates x 5 seeds; on 2 cores, as two "
        "halves side by side:\n"
        "#   OMP_NUM_THREADS=1 ... +encoding=alibi,rope,xpos & OMP_NUM_THREADS=1 ... +encoding=nope,kerple_log,t5",
        "outputs/sweeps/mqar",
    ),
    "recall-3000": Study(
        "Associative recall: the three schemes still rising at 1,500 steps, trained for 3,000",
        "python -m posenc.train -m -cd sweeps -cn retrieval +encoding=alibi,nope,kerple_log optim.lr=3e-3 "
        "trainer.max_steps=3000 sweep_name=mqar_3000",
        "outputs/sweeps/mqar_3000",
    ),
    "recall-offset": Study(
        "Associative recall with the key–value block at a random offset: distance apart from position",
        "python -m posenc.train -m -cd sweeps -cn retrieval_offset  # 6 schemes x 3 rates x 5 seeds; in parts, the "
        "rate every scheme took in the recall study first:\n"
        "#   python -m posenc.train -m -cd sweeps -cn retrieval_offset optim.lr=3e-3",
        "outputs/sweeps/mqar_offset",
    ),
    "recall-tuning": Study(
        "The tuning of recall at a random offset: one grid for every scheme, selected on validation",
        "python -m posenc.train -m -cd sweeps -cn retrieval_offset_tune  # the schemes with parameters: whole grid\n"
        "python -m posenc.train -m -cd sweeps -cn retrieval_offset_tune +encoding=alibi,rope,nope "
        "optim.scheme_lr_multiplier=1",
        "outputs/sweeps/mqar_offset_tune",
        tuning=True,
        ties="retrieval_offset_tune seed=11,12",
    ),
    "recall-offset-tuned": Study(
        "Associative recall at a random offset under the comparison's recipe: tuned on validation, settings scaled",
        "python -m posenc.train -m -cd sweeps -cn retrieval_offset_tune  # then +encoding=alibi,rope,nope "
        "optim.scheme_lr_multiplier=1, and the recall-tuning study (docs/results/recall-tuning.md)\n"
        "python -m posenc.train -m -cd sweeps -cn retrieval_offset_tuned  # 6 schemes x 5 seeds; on 2 cores, as two "
        "single-threaded halves side by side:\n"
        "#   OMP_NUM_THREADS=1 ... +encoding=alibi,rope,nope,t5 & OMP_NUM_THREADS=1 ... +encoding=kerple_log,fire",
        "outputs/sweeps/mqar_offset_tuned",
    ),
    "recall-tuning-layouts": Study(
        "The recall tuning at depth 4 for the deployed layouts and the 2025–26 schemes, ALiBi, RoPE and NoPE beside",
        "python -m posenc.train -m -cd sweeps -cn retrieval_offset_tune_layouts  # the schemes with parameters\n"
        "python -m posenc.train -m -cd sweeps -cn retrieval_offset_tune_layouts "
        "+encoding=alibi,rope,nope,irope,rnope_swa,swan optim.scheme_lr_multiplier=1\n"
        "python -m posenc.train -m -cd sweeps -cn retrieval_offset_tune_layouts +encoding=gemma3 "
        "optim.scheme_lr_multiplier=1 model.depth=6",
        "outputs/sweeps/mqar_offset_tune_layouts",
        tuning=True,
        ties="retrieval_offset_tune_layouts seed=11,12",
    ),
    "recall-layouts": Study(
        "Deployed layouts and the 2025–26 schemes on recall at a random offset (depth 4, tuned on validation)",
        "python -m posenc.train -m -cd sweeps -cn retrieval_offset_tune_layouts  # and its two other lines, then the "
        "recall-tuning-layouts study (docs/results/recall-tuning-layouts.md)\n"
        "python -m posenc.train -m -cd sweeps -cn retrieval_offset_layouts  # 10 entries x 5 seeds\n"
        "python -m posenc.train -m -cd sweeps -cn retrieval_offset_layouts +encoding=gemma3 model.depth=6\n"
        "# iRoPE's and SWAN's inference-time scaling, on the same evaluation windows:\n"
        "for run in outputs/sweeps/mqar_offset_layouts/{irope,swan}-*; do s=$(case $run in *irope*) echo llama4;; "
        "*) echo log_n;; esac); python -m posenc.evaluate $run eval.attention_scale=$s; done",
        "outputs/sweeps/mqar_offset_layouts",
        references=(*DEFAULT_REFERENCES, "* · llama4", "* · log_n"),  # as the layouts study: each scaling vs none
    ),
    "ruler-tasks": Study(
        "Two RULER tasks, multikey and variable tracking (one seed)",
        "python -m posenc.train -m +encoding=rope data=multikey,vartrack trainer.max_steps=2000 model.init=pytorch "
        "model.tie_embeddings=false sweep_name=ruler",
        "outputs/sweeps/ruler",
    ),
    "passkey": Study("Passkey retrieval", "python -m posenc.train -m -cd sweeps -cn passkey", "outputs/sweeps/passkey"),
    "rope-scaling": Study(
        "RoPE scaled at evaluation (PI, NTK, YaRN)",
        "python -m posenc.train -m -cd sweeps -cn frontier  # its rope-L64-s0 run, then at factor 8:\n"
        "for m in pi ntk dynamic_ntk yarn yarn_paper llama3; do python -m posenc.evaluate "
        "outputs/sweeps/frontier/rope-L64-s0 eval.rope_scaling=$m eval.rope_scaling_factor=8; "
        "done",
        "outputs/sweeps/frontier/rope-L64-s0/eval outputs/sweeps/frontier/rope-L64-s0/eval_*x8",
    ),
    "scheme-lr": Study(
        "The scheme parameters' learning rate: how far T5, KERPLE-log and FIRE learn in the reproduction's budget",
        "python -m posenc.train -m -cd sweeps -cn scheme_lr  # GPT-2's initialisation, as the reproduction\n"
        "python -m posenc.train -m -cd sweeps -cn scheme_lr optim.scheme_lr_multiplier=1,10,30,100 model.init=pytorch "
        "model.tie_embeddings=false sweep_name=scheme_lr_pytorch  # the controlled comparison's initialisation",
        "outputs/sweeps/scheme_lr outputs/sweeps/scheme_lr_pytorch",
    ),
    "initialisation": Study(
        "One initialisation for every task: GPT-2's with a tied head against PyTorch's with an untied head",
        "python -m posenc.train -m -cd sweeps -cn frontier  # its alibi and rope runs: GPT-2's, tied (the default)\n"
        "python -m posenc.train -m -cd sweeps -cn passkey  # its alibi and rope runs: the same\n"
        "python -m posenc.train -m experiment=repro +encoding=alibi,rope model.init=pytorch "
        "model.tie_embeddings=false 'eval.sliding_fractions=[]' sweep_name=init_pytorch\n"
        "python -m posenc.train -m -cd sweeps -cn passkey +encoding=alibi,rope model.init=pytorch "
        "model.tie_embeddings=false sweep_name=passkey_init_pytorch\n"
        "python -m posenc.train -m -cd sweeps -cn retrieval_offset +encoding=alibi,rope optim.lr=3e-3 seed=0 "
        "trainer.max_steps=1500 model.init=gpt2 model.tie_embeddings=true sweep_name=mqar_init_gpt2\n"
        "python -m posenc.train -m -cd sweeps -cn retrieval_offset +encoding=alibi,rope optim.lr=3e-3 seed=0 "
        "trainer.max_steps=1500 model.init=pytorch model.tie_embeddings=false sweep_name=mqar_init_pytorch",
        "outputs/sweeps/frontier/{alibi,rope}-L64-s0/eval outputs/sweeps/passkey/{alibi,rope}-L64-s0 "
        "outputs/sweeps/init_pytorch outputs/sweeps/passkey_init_pytorch outputs/sweeps/mqar_init_*",
    ),
    "offset-pilot": Study(
        "MQAR with the key–value block at a random offset: the budget it needs",
        "python -m posenc.train -m -cd sweeps -cn retrieval_offset +encoding=alibi,rope optim.lr=1e-3,3e-3,1e-2 "
        "seed=0 trainer.max_steps=1500 sweep_name=offset_pilot_lr\n"
        "python -m posenc.train -m -cd sweeps -cn retrieval_offset +encoding=alibi,rope optim.lr=3e-3 seed=0 "
        "trainer.max_steps=4500 sweep_name=offset_pilot_steps",
        "outputs/sweeps/offset_pilot_lr outputs/sweeps/offset_pilot_steps",
    ),
    "controlled-passkey": Study(
        "Passkey retrieval in the controlled comparison (one seed)",
        "python -m posenc.train -m -cd sweeps -cn controlled_passkey",
        "outputs/sweeps/controlled_passkey",
    ),
    "attention-statistics": Study(
        "Attention statistics by length",
        "python -m posenc.train -m -cd sweeps -cn frontier  # then, for each of its runs named below:\n"
        "for r in alibi nope rope fox stick_breaking; do python -m posenc.evaluate outputs/sweeps/frontier/$r-L64-s0 "
        "eval.attention_stats=true; done",
        "outputs/sweeps/frontier/*/eval_attention_statsTrue",
    ),
    "stability": Study(
        "Stability per scheme: learning-rate sensitivity, the highest stable rate, loss and gradient-norm spikes",
        "python -m posenc.train -m -cd sweeps -cn stability  # schemes with a multiplier of 1, nine rates, seed 10\n"
        "python -m posenc.train -m -cd sweeps -cn stability +encoding=fire,kerple_log optim.scheme_lr_multiplier=10\n"
        "python -m posenc.train -m -cd sweeps -cn stability +encoding=t5 optim.scheme_lr_multiplier=100\n"
        "# then the edges: a scheme unstable inside the grid, its highest stable rate and the next at seeds 11, 12;\n"
        "# one stable throughout it (every scheme here) runs one step further at seed 10 and its top at seeds 11, 12:\n"
        "python -m posenc.train -m -cd sweeps -cn stability optim.lr=0.512  # and likewise at x10 and x100, as above\n"
        "python -m posenc.train -m -cd sweeps -cn stability optim.lr=0.256 seed=11,12",
        "outputs/sweeps/stability",
        stability=True,
    ),
    "sinks": Study(
        "Attention sinks by scheme: does an explicit sink change extrapolation, and does ALiBi still cut the far sink?",
        "python -m posenc.train -m -cd sweeps -cn sinks  # 4 schemes x 3 sinks x 5 seeds; on 2 cores, as two "
        "single-threaded halves side by side:\n"
        "#   OMP_NUM_THREADS=1 ... +encoding=alibi,nope & OMP_NUM_THREADS=1 ... +encoding=rope,kerple_log",
        "outputs/sweeps/sinks",
        references=("* · sink=none",),  # each sink against no sink, within its scheme
    ),
}
