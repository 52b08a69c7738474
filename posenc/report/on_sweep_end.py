"""The Hydra callback that writes a sweep's report when the sweep ends.

Hydra builds its callbacks before it looks at the command line's values, so whatever this module imports, every
``python -m posenc.train`` pays, a refused one included. It imports the report's machinery (Lightning's and
matplotlib's imports among it, seconds on a small machine) only when a sweep has ended and there is a report to
write.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig


class ReportOnSweepEnd(Callback):
    """Hydra callback: when a multirun ends, write report.md and plots into the sweep directory.

    Enable it in a sweep config with ``hydra.callbacks.report._target_: posenc.report.ReportOnSweepEnd``.
    """

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from posenc.jsonio import DiskFullError
        from posenc.report.build import build_report
        from posenc.report.collect import find_results
        from posenc.report.cost import log_cost_scatter

        sweep_dir = Path(config.hydra.sweep.dir)
        unreadable: list[str] = []
        results = find_results([sweep_dir], unreadable)
        if not results:
            print(f"posenc.report: no results.json under {sweep_dir}; nothing to report")
            return
        try:
            print(build_report(results, sweep_dir, left_out=unreadable))
        except DiskFullError as full:
            raise SystemExit(f"posenc.report: {full}. Free space, then: python -m posenc.report {sweep_dir}") from None
        print(f"wrote {sweep_dir / 'report.md'}")
        wandb = sys.modules.get("wandb")  # imported only when a W&B logger ran in this process
        if wandb is not None and getattr(wandb, "run", None) is not None:
            log_cost_scatter(results, wandb.run)
        failed = [run["run_name"] for run in results if run.get("failed")]
        if failed:  # the sweep ran every job, but it did not succeed: say so in the exit status
            raise SystemExit(
                f"{len(failed)} job(s) of this sweep failed ({', '.join(failed)}): see failed.json in their "
                "directories; relaunching the sweep retries them"
            )
