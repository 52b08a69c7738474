"""The GPU check and the GPU session: proving and measuring posenc's CUDA path in the time a GPU is lent.

- ``check``: ``python -m posenc.gpucheck``, every encoding config trained and evaluated on one GPU, one table;
- ``plan``: what a session runs per stage (proof, speed, repro), each step's command, its compiled graphs and the
  seconds it is planned to take, and the same plan with tiny settings for a rehearsal on CPU;
- ``runner``: runs the steps against one deadline, kills a step with its whole process group, and never leaves a
  process behind (``watchdog``), even when the session itself is killed;
- ``pack``: what comes back from the machine: at most eight files, written after every step;
- ``session``: ``python -m posenc.gpusession``, the command that puts them together.
"""
