"""posenc's SLURM launcher, where Hydra looks for launchers (it instantiates plugins only from ``hydra_plugins``).

Hydra imports every module here at each start, for every application: this one stays a thin class, and its work
(submitting only unfinished jobs, one-line refusals, a wait bounded by the jobs) is in ``posenc.cluster.launcher``,
imported when a sweep is launched.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

try:
    from hydra_plugins.hydra_submitit_launcher import submitit_launcher
except ImportError:  # hydra-submitit-launcher is optional (pip install -e ".[slurm]")
    submitit_launcher = None

if submitit_launcher is not None:

    class PosencSlurmLauncher(submitit_launcher.SlurmLauncher):
        """hydra-submitit-launcher's SLURM launcher, submitting only a sweep's unfinished jobs."""

        def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[Any]:
            """Submit the jobs that have not finished as one array, wait until each has ended, return outcomes."""
            from posenc.cluster.launcher import launch

            return launch(self, job_overrides, initial_job_idx)
