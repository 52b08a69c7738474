"""Training and its pieces, below the ``python -m posenc.train`` entry point.

- ``loop``: the run itself: Lightning's trainer, checkpoints, token accounting, the end-of-training evaluation;
- ``callbacks``: token accounting (tokens/s, the conditions it was measured under) and saving where a run stops;
- ``lit``: the thin LightningModule around the one decoder (loss, optimiser, divergence checks);
- ``compiling``: when and how the decoder's blocks are compiled;
- ``identity``: what makes two runs the same experiment (a report's column), seed aside;
- ``sweep``: a multirun's bookkeeping: what to skip, resume or refuse before the first job starts.

The pieces sit at different depths of the package (the compile switch just above the model, the loop above the
evaluation it ends with), so nothing here is imported by this ``__init__``: each is imported by its own name.
"""
