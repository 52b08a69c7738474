"""The run directory, in one place: config checks before any work, checkpoints, run.json, done/failed markers.

Every entry point (train, evaluate, sweep, report) reads and writes runs through this package, so what makes a
run "finished", "failed" or "resumable" is decided once:

- ``records``: the files a run directory holds (``done.json``, ``failed.json``, ``run.json``, ``wandb_id``) and
  ``RunError``, the one-line message for a user;
- ``checks``: what a config must satisfy before anything is built or written;
- ``checkpoints``: building the data, the run's identity and the trained module from a saved run, which
  checkpoint a resume starts from, and the line a full disk ends a run with;
- ``checkpoint_io``: how Lightning writes checkpoints (atomically, the one before kept); imported by the training
  loop only, since it needs Lightning;
- ``lineage``: starting a run from another run's weights (``init_from``) and recording what carried over;
- ``loggers``: where a run's metrics go, W&B (online or offline) and CSV; imported by the training loop and a
  re-evaluation only, since it needs Lightning.
"""

from posenc.runs.checkpoints import (
    EVALUATE_USAGE,
    build_datamodule,
    check_consistency,
    checkpoint_training,
    disk_full_message,
    last_good_checkpoint,
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
    apply_tuning,
    check_data,
    check_device,
    check_model,
    check_wandb,
    experiment_settings,
    resolve,
    resolve_length_settings,
    validate,
)
from posenc.runs.lineage import Parent, inherit, lineage_tags, load_parent_weights, provenance, read_parent
from posenc.runs.records import (
    CHECKPOINT,
    DONE_FILE,
    FAILED_FILE,
    PREVIOUS_CHECKPOINT,
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
    "PREVIOUS_CHECKPOINT",
    "RUNTIME_KEYS",
    "RUN_FILE",
    "WANDB_ID_FILE",
    "Parent",
    "RunError",
    "apply_tuning",
    "build_datamodule",
    "check_consistency",
    "check_data",
    "check_device",
    "check_model",
    "check_wandb",
    "checkpoint_training",
    "disk_full_message",
    "experiment_settings",
    "global_batch",
    "global_rank",
    "inherit",
    "last_good_checkpoint",
    "lineage_tags",
    "load_checkpoint",
    "load_module",
    "load_parent_weights",
    "now",
    "provenance",
    "read_checkpoint",
    "read_json",
    "read_parent",
    "resolve",
    "resolve_checkpoint",
    "resolve_length_settings",
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
