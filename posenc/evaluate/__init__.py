"""Extrapolation metrics: perplexity at growing lengths, loss by position, synthetic retrieval tasks."""

RESULTS_FILE = "results.json"  # what an evaluation writes and the report reads, in <run>/eval/
