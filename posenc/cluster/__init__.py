"""posenc on SLURM: the launcher a sweep is submitted through, and a one-node cluster on this machine to try it on.

- ``launcher``: Hydra's submitit launcher (``launcher=submitit_slurm``), told what a posenc sweep knows: finished
  jobs are not submitted again, a refused ``sbatch`` or a job that could not finish is one line saying what to do.
- ``local``: ``python -m posenc.cluster.local up|down``, a real slurmctld + slurmd + munged on this machine (the
  tests start one per session), so the SLURM path runs against the scheduler itself, not a mock.

The requeue signal itself is caught where training runs (``posenc.training.callbacks.SaveOnInterrupt``).
"""
