"""Extrapolation metrics: perplexity at growing lengths, loss by position, synthetic retrieval tasks."""

RESULTS_FILE = "results.json"  # what an evaluation writes and the report reads, in <run>/eval/
# Axes that cannot exaggerate (run plots and the report's): perplexity spans at least ×1.25, its ratio to 1× at
# least ×1.1 with 1.0 in view, loss half a nat; accuracy always 0 to 1.
PPL_MIN_SPAN, RATIO_MIN_SPAN, LOSS_MIN_SPAN = 1.25, 1.1, 0.5
ACCURACY_LIMITS = (-0.02, 1.02)


def sliding_dir(fraction: float) -> str:
    """The folder of a sliding-window evaluation whose stride is ``fraction`` of each length: ``eval_sliding_f0.5``."""
    return f"eval_sliding_f{float(fraction):g}"
