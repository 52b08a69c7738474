"""What makes two evaluated runs the same experiment, so that the report pools only those (over seeds).

A run's identity is its resolved training config without the seed, paths and logging (``RUNTIME_KEYS``), plus
the corpus fingerprint, plus the evaluation settings that change the numbers (everything in ``results["eval"]``
but plots and batching): a re-evaluation with another eval-time option is another column. Runs of one scheme
with different identities get separate columns whose labels name the difference (``alibi · max_steps=40``,
``alibi · data=text``, ``rope · rope_scaling=yarn``). A run fine-tuned from another (``init_from``) or trained with
a RoPE context scaling says so in its column's label whatever else is reported beside it (``nope · from alibi``,
``rope · yarn×4 in training · from rope``): it is never a plain column of its scheme.

Older results carry no config: it is read from the run's ``done.json`` or ``.hydra/config.yaml``. A key missing
from one run compares equal to the project's default for it when the default is known, and differs otherwise.
"""

from __future__ import annotations

import contextlib
import functools
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from posenc.config import CONF_DIR
from posenc.jsonio import read_record, record_path
from posenc.runs import DONE_FILE, INTRODUCED, RUN_FILE, experiment_settings, provenance

# Never part of an identity: the seed is what is pooled over; paths name where data lies (the fingerprint says
# what it is); the training config's own eval section is replaced by the settings the results were made with.
NOT_IDENTITY = ("seed", "data.corpus_options.paths", "eval", "label", "data_info")
# Evaluation settings that change how, not what, is computed (sliding_fractions adds evaluations of their own).
# The report's equivalence margins say how results are read, not what was computed: a mismatch is refused by the
# report itself (``claims.margin``), never a column of its own.
EVAL_RUNTIME = (
    "plots", "at_end", "tokens_per_batch", "sliding_fractions", "equivalence_margin", "equivalence_accuracy",
)  # fmt: skip
# Settings added after results were written (``posenc.runs.INTRODUCED``): a result that does not record one did what
# that says (it scored the head of the split), so it never pools with a result that scored every document.
# What every results.json holds besides settings: identity, figures, bookkeeping.
RESULT_FIELDS = {
    "label",
    "train_len",
    "seed",
    "encoding",
    "model",
    "data",
    "run_name",
    "config",
    "eval",
    "summary",
    "training",
    "trained_task",
    # measurements that may be null (no learnable or no bias parameter), never settings; where weights came from
    # is a setting already (init_from), the lineage record says what carried over
    "learned_bias",
    "learned_settings",
    "positional_drift",
    "stability",
    "lineage",
    # what the run's settings imply (the resolved length settings, what training reaches, the budget): not settings
    "length_settings",
    "coverage",
    "budget",
    "attention_scale",  # the evaluation's inference-time scaling, a setting already as eval.attention_scale
}
SEPARATOR = " · "
UNSET = "(unset)"


def _saved_config(result: Mapping[str, Any]) -> dict[str, Any] | None:
    """The training config of a result: recorded in it, else in its run directory (``<run>/eval/results.json``)."""
    if isinstance(result.get("config"), Mapping):
        return dict(result["config"])
    source = result.get("_source")
    if not source:
        return None
    run_dir = Path(source).parent.parent
    try:
        if record_path(run_dir / DONE_FILE) is not None:
            return read_record(run_dir / DONE_FILE).get("config")
        saved = run_dir / ".hydra" / "config.yaml"
        if saved.is_file():
            return OmegaConf.to_container(OmegaConf.load(saved), resolve=True)  # type: ignore[return-value]
    except (SystemExit, Exception):  # an unreadable record: the identity falls back to label and eval settings
        return None
    return None


@functools.cache
@functools.cache
def _defaults() -> dict[str, Any]:
    """The project's default settings (every group's default yaml), flattened: what an older run left unsaid.

    Read once a process: every run of a report is filled in from it, and the yaml files do not change meanwhile.
    Callers only read it.
    """
    main = OmegaConf.load(CONF_DIR / "train.yaml")
    top = OmegaConf.to_container(main, resolve=False)
    defaults = {k: v for k, v in experiment_settings(top).items() if not k.startswith(("hydra", "defaults"))}
    for entry in main.get("defaults", []):
        if isinstance(entry, Mapping) or OmegaConf.is_dict(entry):
            for group, option in dict(entry).items():
                path = CONF_DIR / str(group) / f"{option}.yaml"
                if option and path.is_file():
                    node = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
                    defaults.update({f"{group}.{key}": value for key, value in experiment_settings(node).items()})
    return defaults


def identity(result: Mapping[str, Any]) -> dict[str, Any]:
    """Dotted settings that must all match for two results to be pooled."""
    config = _saved_config(result)
    settings: dict[str, Any] = {}
    if config is not None:
        settings = {
            key: value
            for key, value in experiment_settings(config).items()
            if not any(key == k or key.startswith(f"{k}.") for k in NOT_IDENTITY) and value != {}
        }
    else:
        settings["encoding"] = result.get("label")
    steps = (result.get("training") or {}).get("steps")
    if steps is not None:  # weights trained for fewer steps (an interrupted run) are another experiment
        settings["training.steps"] = steps
    data = result.get("data") or {}
    settings["data.fingerprint"] = data.get("fingerprint") or data.get("task")
    for key, value in experiment_settings(result.get("eval") or {}).items():
        if key.split(".")[0] not in EVAL_RUNTIME:
            settings[f"eval.{key}"] = value
    # Evaluation-time options recorded beside the run info (e.g. a RoPE scaling applied at evaluation): scalars,
    # and mappings named for evaluation; figures (lists, the summary) never are settings.
    for key, value in result.items():
        if key in RESULT_FIELDS or key.startswith("_"):
            continue
        if isinstance(value, str | int | float | bool) or value is None:
            settings[f"run.{key}"] = value
        elif isinstance(value, Mapping) and "eval" in key:
            settings.update({f"run.{key}.{k}": v for k, v in experiment_settings(value).items()})
    return settings


def _short(key: str, value: Any) -> str:
    name = key.rsplit(".", 1)[-1]
    if isinstance(value, float):
        value = f"{value:g}"
    return f"{name}={value}"


def _suffix(settings: Mapping[str, Any], keys: Sequence[str]) -> str:
    """The readable difference of one identity from the others of its scheme."""
    if "data.corpus" in keys or "data.task" in keys:  # another corpus: say which, not its fingerprint or options
        what = settings.get("data.corpus") or settings.get("data.task") or "?"
        keys = [k for k in keys if not k.startswith("data.")]
        return SEPARATOR.join([f"data={what}", *(_short(k, settings.get(k, "default")) for k in keys)][:4])
    if keys == ["data.fingerprint"]:
        return f"corpus {str(settings.get('data.fingerprint'))[:8]}"
    shown = [_short(k, settings.get(k, "default")) for k in keys if k != "data.fingerprint"]
    return SEPARATOR.join(shown[:3] + (["…"] if len(shown) > 3 else []))


def filled_in(settings: Mapping[str, Any], keys: Sequence[str]) -> dict[str, Any]:
    """``settings`` at ``keys``, with what an older run did not record filled in.

    Such a key takes the project's default (or what runs did before the key existed, ``INTRODUCED``); with no
    default known it reads ``(unset)`` and differs.
    """
    defaults = _defaults()
    return {key: settings.get(key, INTRODUCED.get(key, defaults.get(key, UNSET))) for key in keys}


def shown_label(result: Mapping[str, Any]) -> str:
    """A result's label with what its run is beyond its scheme: ``rope · yarn×4 in training · from rope``.

    The lineage is the result's own (training's evaluation), else its run's ``run.json`` (a re-evaluation's).
    """
    lineage = result.get("lineage")
    if lineage is None and result.get("_source"):
        with contextlib.suppress(SystemExit, OSError):
            record = Path(str(result["_source"])).parent.parent / RUN_FILE
            lineage = read_record(record).get("lineage") if record_path(record) is not None else None
    parts = provenance(_saved_config(result) or {}, lineage, short=True)
    return SEPARATOR.join([str(result["label"]), *parts])


def columns(runs: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """{column label: runs pooled in it}: runs of one label are split by identity, labels name the difference."""
    by_label: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for run in runs:
        by_label[shown_label(run)].append(run)
    out: dict[str, list[dict[str, Any]]] = {}
    for label, group in by_label.items():
        settings = [identity(run) for run in group]
        keys = sorted({key for one in settings for key in one})
        filled = [filled_in(one, keys) for one in settings]
        identities: dict[str, tuple[dict[str, Any], list[dict[str, Any]]]] = {}
        for run, one in zip(group, filled, strict=True):
            identities.setdefault(repr(list(one.items())), (one, []))[1].append(run)
        if len(identities) == 1:
            out[label] = group
            continue
        differing = [key for key in keys if len({repr(one[key]) for one, _ in identities.values()}) > 1]
        # Every column is named by its values of all the differing keys (``alibi · max_steps=40`` next to
        # ``alibi · max_steps=30``): a name by difference from one column would leave a reader to guess the rest
        # where two settings vary (``fire · scheme_lr_multiplier=1`` under which initialisation?).
        for one, members in identities.values():
            keys = [key for key in differing if one[key] != UNSET] or differing
            name = f"{label}{SEPARATOR}{_suffix(one, keys)}"
            while name in out:  # two identities that read the same once shortened
                name += "′"
            out[name] = members
    return out
