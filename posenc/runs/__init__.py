"""The run directory, in one place: config checks before any work, checkpoints, run.json, done/failed markers.

Every entry point (train, evaluate, sweep, report) reads and writes runs through this package, so what makes a
run "finished", "failed" or "resumable" is decided once:

- ``records``: the files a run directory holds (``done.json``, ``failed.json``, ``run.json``, ``wandb_id``) and
  ``RunError``, the one-line message for a user;
- ``checks``: what a config must satisfy before anything is built or written;
- ``checkpoints``: building the data, the run's identity and the trained module from a saved run.
"""

from posenc.runs.checkpoints import (
    EVALUATE_USAGE,
    build_datamodule,
    check_consistency,
    checkpoint_training,
    load_checkpoint,
    load_module,
    read_checkpoint,
    resolve_checkpoint,
    resume_checkpoint,
    run_info,
)
from posenc.runs.checks import (
    INTRODUCED,
    RUNTIME_KEYS,
    check_data,
    check_device,
    check_model,
    config_problems,
    eval_problems,
    experiment_settings,
    validate,
)
from posenc.runs.records import (
    CHECKPOINT,
    DONE_FILE,
    FAILED_FILE,
    RUN_FILE,
    WANDB_ID_FILE,
    RunError,
    global_batch,
    global_rank,
    now,
    read_json,
    training_record,
    update_run_summary,
    wandb_id,
    write_done,
    write_failed,
    write_json,
)

__all__ = [
    "CHECKPOINT",
    "DONE_FILE",
    "EVALUATE_USAGE",
    "FAILED_FILE",
    "INTRODUCED",
    "RUNTIME_KEYS",
    "RUN_FILE",
    "WANDB_ID_FILE",
    "RunError",
    "build_datamodule",
    "check_consistency",
    "check_data",
    "check_device",
    "check_model",
    "checkpoint_training",
    "config_problems",
    "eval_problems",
    "experiment_settings",
    "global_batch",
    "global_rank",
    "load_checkpoint",
    "load_module",
    "now",
    "read_checkpoint",
    "read_json",
    "resolve_checkpoint",
    "resume_checkpoint",
    "run_info",
    "training_record",
    "update_run_summary",
    "validate",
    "wandb_id",
    "write_done",
    "write_failed",
    "write_json",
]
