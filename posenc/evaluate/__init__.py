"""Extrapolation metrics: perplexity at growing lengths, loss by position, synthetic retrieval tasks."""

import re

RESULTS_FILE = "results.json"  # what an evaluation writes and the report reads, in <run>/eval/
# Axes that cannot exaggerate (run plots and the report's): perplexity spans at least ×1.25, its ratio to 1× at
# least ×1.1 with 1.0 in view, loss half a nat; accuracy always 0 to 1.
PPL_MIN_SPAN, RATIO_MIN_SPAN, LOSS_MIN_SPAN = 1.25, 1.1, 0.5
ACCURACY_LIMITS = (-0.02, 1.02)


def sliding_dir(fraction: float) -> str:
    """The folder of a sliding-window evaluation whose stride is ``fraction`` of each length: ``eval_sliding_f0.5``."""
    return f"eval_sliding_f{float(fraction):g}"


def protocol_name(eval_cfg: dict) -> str:
    """The evaluation protocol as a metric namespace: ``nonoverlap``, ``sliding_f0.5``, ``sliding_s32``.

    An evaluation-time scaling makes another model, and is named too (``nonoverlap_yarnx8``, ``nonoverlap_log_n``);
    nothing else is (max_tokens, split, multiples change the sample, not the protocol), so the keys ``eval/<protocol>/
    ppl@4x`` stay the same across re-evaluations of a protocol.
    """
    name = str(eval_cfg.get("mode", "nonoverlap"))
    if name == "sliding":
        fraction = eval_cfg.get("stride_fraction")
        name += f"_f{float(fraction):g}" if fraction is not None else f"_s{eval_cfg.get('stride')}"
    if eval_cfg.get("rope_scaling") is not None:
        name += f"_{eval_cfg['rope_scaling']}x{float(eval_cfg.get('rope_scaling_factor') or 0):g}"
    if eval_cfg.get("attention_scale") is not None:
        name += f"_{eval_cfg['attention_scale']}"
    return name


def wandb_namespace(eval_cfg: dict, folder: str) -> str:
    """Where an evaluation written to ``folder`` logs: ``eval/<protocol>``, plus what names a side evaluation.

    The run's own evaluation (``eval/``) and a protocol's folder (``eval_sliding_f0.5/``, ``eval_yarnx8/``) log under
    the protocol (``eval/nonoverlap``, ``eval/sliding_f0.5``, ``eval/nonoverlap_yarnx8``), as training does; a folder
    named for other settings adds them (``eval_max_tokens4096/`` → ``eval/nonoverlap_max_tokens4096``), so that a side
    evaluation never replaces the figures of the run's own in its W&B summary.
    """
    protocol = protocol_name(eval_cfg)
    own = "eval" + (protocol.removeprefix("nonoverlap") if protocol.startswith("nonoverlap") else f"_{protocol}")
    if folder in ("eval", own):
        return f"eval/{protocol}"
    return f"eval/{protocol}{folder.removeprefix(own) if folder.startswith(own + '_') else '_' + folder}"


def sortable(key: str) -> str:
    """``ppl@004x`` for ``ppl@4x``: the multiple zero-padded to three digits, for loggers that order keys as text.

    W&B sorts its keys alphabetically, which put ``@16x`` before ``@2x``; padded, they sort numerically up to 999×.
    """
    return re.sub(r"@(\d+)((?:\.\d+)?x)", lambda match: f"@{int(match.group(1)):03d}{match.group(2)}", key)
