"""Extrapolation metrics: perplexity at growing lengths, loss by position, synthetic retrieval tasks."""
