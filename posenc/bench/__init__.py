"""The benchmarks behind ``python -m posenc.bench``: what each positional scheme costs, measured in one run.

- ``run``: the command: attention table, whole-model train step, long context, and the comparison below;
- ``attention``: one attention call per scheme and backend, timed against the fastest unbiased attention;
- ``step``: the whole-model train step of every scheme (an encoding config or a scheme), timed in turn against NoPE's;
- ``profile``: where a timed step spent its time, under torch.profiler;
- ``compare``: posenc's decoder against x-transformers' on CPU, the same scheme each, steps timed in turns.
"""
