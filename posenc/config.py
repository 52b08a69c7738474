"""Hydra plumbing shared by the entry points: where ``conf/`` is, resolvers, and config helpers.

``check_command_line`` reads a command line before Hydra starts, so that a typo is refused in one line.
"""

from __future__ import annotations

import contextlib
import difflib
import fnmatch
import functools
import inspect
import io
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from pydantic import BaseModel

from posenc.layout import encoding_label
from posenc.schema.composed import check_composed, settings_help

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


def _label(encoding: Any) -> str:
    if encoding is None:
        return "no-encoding"
    if isinstance(encoding, DictConfig):
        encoding = OmegaConf.to_container(encoding, resolve=True)
    return encoding_label(encoding)


def _data_tag(task: str | None) -> str:
    return f"-{task}" if task else ""


def _scaling_tag(scaling: Any) -> str:
    """``-yarn4`` for a run trained with ``model.context_scaling={method:yarn,factor:4,...}``, else nothing."""
    if isinstance(scaling, DictConfig):
        scaling = OmegaConf.to_container(scaling, resolve=True)
    if not isinstance(scaling, dict) or not scaling.get("method"):
        return ""
    factor = scaling.get("factor")
    return f"-{scaling['method']}{'' if factor is None else f'{float(factor):g}'}"


@functools.cache
def _lineage_tag(target: str | None) -> str:
    """``-from-alibi`` for a run started from an ALiBi run's weights (``init_from``), else nothing.

    The parent's scheme is read from its saved config (``.hydra/config.yaml``, else ``done.json``); a parent that
    cannot be read names itself ``-finetuned`` here, and the run is refused with its own line once checked.
    """
    if target is None:
        return ""
    path = Path(str(target)).expanduser()
    run_dir = path if path.is_dir() else path.parent.parent if path.parent.name == "checkpoints" else path.parent
    for saved in (run_dir / ".hydra" / "config.yaml", run_dir / "done.json"):
        try:
            config = OmegaConf.load(saved)
            encoding = OmegaConf.select(config, "encoding") or OmegaConf.select(config, "config.encoding")
            if encoding is not None:
                return f"-from-{encoding_label(OmegaConf.to_container(encoding, resolve=False))}"
        except Exception:  # unreadable: try the next record, else the plain mark below
            continue
    return "-finetuned"


def _sink_tag(sink: str | None, tokens: Any = 1) -> str:
    """``-sink_learned`` for a run with ``model.sink=learned`` (``-sink_tokens4`` for four tokens), else nothing."""
    if sink is None or sink == "none":
        return ""
    count = "" if sink != "tokens" or tokens in (None, 1) else str(tokens)
    return f"-sink_{sink}{count}"


def _gpus(accelerator: str, devices: Any) -> Any:
    """GPUs a SLURM job asks for on each node: none for a CPU run (a partition without GPUs refuses any request)."""
    return None if accelerator == "cpu" else devices


def register_resolvers() -> None:
    """The resolvers run names are made of.

    ``${posenc.label:${encoding}}``: the readable scheme name used in run names and directories;
    ``${posenc.data_tag:${oc.select:data.task,null}}``: ``-passkey`` for a task run, nothing for text, so that a
    text run and a task run of one scheme never share a directory;
    ``${posenc.scaling:${oc.select:model.context_scaling,null}}``: ``-yarn4`` for a run trained with a RoPE context
    scaling, and ``${posenc.lineage:${oc.select:init_from,null}}``: ``-from-alibi`` for a run fine-tuned from an
    ALiBi run, so that the run name says both (``rope-yarn4-from-rope-L256-s0``);
    ``${posenc.sink:${oc.select:model.sink,none},${oc.select:model.sink_tokens,1}}``: ``-sink_learned`` for a run whose
    attention has a sink (``alibi-sink_learned-L64-s0``);
    ``${posenc.gpus:${trainer.accelerator},${trainer.devices}}``: the GPUs per node a SLURM job asks for;
    ``${posenc.options:evaluate}``: every setting as ``key=default``, with what it accepts (the ``--help`` of
    ``posenc.evaluate``).
    """
    resolvers = {
        "posenc.label": _label,
        "posenc.data_tag": _data_tag,
        "posenc.scaling": _scaling_tag,
        "posenc.lineage": _lineage_tag,
        "posenc.sink": _sink_tag,
        "posenc.gpus": _gpus,
        "posenc.options": settings_help,
    }
    for name, resolver in resolvers.items():
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, resolver)


def encoding_choices() -> list[str]:
    """Names accepted by ``+encoding=``: the yaml files of ``conf/encoding``."""
    return sorted(path.stem for path in (CONF_DIR / "encoding").glob("*.yaml"))


def require_encoding(cfg: DictConfig, command: str, run_dir: Path | None = None) -> None:
    """Exit with one line naming the choices when no scheme was given (the group has no default on purpose).

    Hydra has already created the run directory by then; it holds nothing but Hydra's bookkeeping, so it is
    removed (with any parents left empty) to leave nothing half-written behind.
    """
    if OmegaConf.select(cfg, "encoding") is None:
        if run_dir is not None:
            remove_if_only_bookkeeping(run_dir)
        raise SystemExit(
            f"{command} needs a positional scheme: add +encoding=<name>, one of: {', '.join(encoding_choices())}"
        )


def remove_if_only_bookkeeping(run_dir: Path, bookkeeping: tuple[str, ...] = (".hydra", "train.log")) -> None:
    """Remove a run directory (and parents left empty) that holds nothing but Hydra's bookkeeping."""
    if not run_dir.is_dir() or any(p.name not in bookkeeping for p in run_dir.iterdir()):
        return
    shutil.rmtree(run_dir, ignore_errors=True)
    parent = run_dir.parent
    while parent != parent.parent and parent.is_dir() and not any(parent.iterdir()) and parent != Path.cwd():
        parent.rmdir()
        parent = parent.parent


def to_container(cfg: DictConfig) -> dict[str, Any]:
    """Resolved plain-Python copy of a config (what checkpoints and loggers store)."""
    return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)  # type: ignore[return-value]


# The command line, checked before Hydra starts. Hydra's flags that print something and run nothing: such command
# lines are Hydra's to read.
_HYDRA_PRINTS = ("help", "hydra_help", "version", "cfg", "info", "shell_completion", "experimental_rerun")
# Lightning's Trainer arguments the training loop sets itself: a +trainer.<key> naming one would clash with it.
_TRAINER_SET_BY_LOOP = ("self", "logger", "callbacks", "default_root_dir")


def check_command_line(
    args: Sequence[str],
    config_name: str,
    command: str,
    read_elsewhere: Sequence[str] = (),
    schema: type[BaseModel] | None = None,
) -> dict[str, Any] | None:
    """Refuse in one line, before Hydra starts, a command line naming an option or a key the config does not have.

    Hydra's own refusals are a paragraph (a group option it cannot find ends with its config search path), and a key
    added with ``+`` that nothing reads is no refusal at all: ``+trainer.max_step=50`` reached Lightning as a keyword
    it rejects with a traceback, ``+eval.multiple=[1,4]`` was ignored. Here an unknown option of a config group names
    the nearest option, an unknown key the nearest known key, and ``+`` adds only a group or a keyword of Lightning's
    ``Trainer`` (``+trainer.max_time=...``). ``read_elsewhere``: top-level keys the command checks itself
    (``posenc.evaluate`` compares ``encoding`` and ``model`` with the checkpoint's). The config is composed here the
    way Hydra will compose it (a sweep as its first job); nothing is written.

    ``schema``: the settings' types and ranges (``posenc.schema``), which a single run's values are checked against
    here, with the directory Hydra would make for it; a sweep's every job is checked so before its first starts
    (``posenc.training.sweep.SweepPreflight``), where each can be named. Returns a single run's checked config
    (plain, resolved), for checks of the machine it will run on; ``None`` otherwise.
    """
    from hydra._internal.utils import get_args_parser  # Hydra's own reading of its command line
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    try:
        with contextlib.redirect_stderr(io.StringIO()):  # a malformed flag: Hydra's parser says so when it starts
            parsed = get_args_parser().parse_args(list(args))
    except SystemExit:
        return None
    if any(getattr(parsed, flag, None) for flag in _HYDRA_PRINTS):
        return None
    try:
        everything = OverridesParser.create().parse_overrides(parsed.overrides)
    except OverrideParseException as err:
        reason = str(err).splitlines()[0]
        raise SystemExit(
            f"cannot read the override {err.override}: {reason} (quote a value with brackets or spaces for the "
            "shell, e.g. 'eval.multiples=[1,2]')"
        ) from None
    overrides = [o for o in everything if not o.is_hydra_override()]
    config_dir = Path(parsed.config_dir).expanduser().resolve() if parsed.config_dir else None
    groups = _groups(config_dir)
    _check_once(overrides, groups)
    for override in overrides:
        if override.key_or_group in groups:
            _check_options(override, groups[override.key_or_group])
    composer = _Composer(parsed.config_name or config_name, config_dir, groups, command)
    config = composer.compose(overrides, parsed.multirun, [o.input_line for o in everything if o.is_hydra_override()])
    added = [o for o in overrides if (o.is_add() or o.is_force_add()) and o.key_or_group not in groups]
    for override in added:
        key = override.key_or_group
        if key.split(".")[0] in read_elsewhere:
            continue
        if key.startswith("trainer.") and key.count(".") == 1 and _trainer_keyword(key.split(".")[1]):
            continue
        if override.is_force_add() and key in composer.known([o for o in overrides if o is not override]):
            continue  # ++ on a key the config has: an ordinary override
        others = [o for o in overrides if o not in added]
        raise SystemExit(
            f"unknown key {key} (in {override.input_line}): {_nearest(key, composer.known(others))}; "
            f"{command} --help lists the config"
        )
    if schema is None:
        return None
    if schema.model_fields["encoding"].is_required() and not parsed.multirun:  # a sweep's preflight names the job
        require_encoding(config, command)
    return check_composed(config, schema, parsed.multirun)


def _check_once(overrides: list[Any], groups: dict[str, list[str]]) -> None:
    """A config group added twice (``+encoding=alibi +encoding=rope``): say how to give one, or sweep both.

    Hydra refuses it with advice for a YAML defaults list; a group replaced twice (``logger=none logger=csv``) is
    Hydra's to settle: the last one counts.
    """
    seen: dict[str, Any] = {}
    for override in overrides:
        group = override.key_or_group
        if group in groups and override.is_add():
            if group in seen:
                first = seen[group]
                plus = "+" if group == "encoding" else ""
                raise SystemExit(
                    f"{group} is chosen twice ({first.input_line} and {override.input_line}): give one; to train "
                    f"each in turn, sweep them: -m {plus}{group}={first.value()},{override.value()}"
                )
            seen[group] = override


def _groups(config_dir: Path | None) -> dict[str, list[str]]:
    """{config group: its options} of the project's ``conf/`` and of a ``-cd`` directory (a sweep's)."""
    found: dict[str, set[str]] = {}
    for root in (CONF_DIR, config_dir):
        if root is None or not root.is_dir():
            continue
        for folder in root.iterdir():
            if folder.is_dir() and any(folder.glob("*.yaml")):
                found.setdefault(folder.name, set()).update(path.stem for path in folder.glob("*.yaml"))
    return {group: sorted(options) for group, options in found.items()}


def _check_options(override: Any, options: list[str]) -> None:
    """Every option an override of a group names exists, each choice of a sweep (``+encoding=alibi,rope``) too."""
    if override.is_delete() or (override.is_sweep_override() and not override.is_choice_sweep()):
        return  # a glob is matched against the options by Hydra, and may match none of them on purpose
    asked = list(override.sweep_string_iterator()) if override.is_sweep_override() else [override.value()]
    group = override.key_or_group
    for value in asked:
        if value is not None and str(value) not in options:
            what = "positional scheme" if group == "encoding" else f"{group} config"
            near = difflib.get_close_matches(str(value), options, n=1, cutoff=0.5)
            hint = f"did you mean {near[0]}? " if near else ""
            raise SystemExit(
                f"unknown {what} '{value}' ({override.input_line}): {hint}"
                f"{'add +' if group == 'encoding' else 'choose '}{group}=<name>, one of: {', '.join(options)}"
            )


def _first_choice(override: Any, groups: dict[str, list[str]]) -> str | None:
    """The override as the first job of a sweep has it; ``None`` where it has no value to compose (an interval)."""
    from hydra.core.override_parser.types import Glob

    if not override.is_sweep_override():
        return override.input_line
    if override.is_interval_sweep():
        return None
    sweep = override.value()
    if isinstance(sweep, Glob):
        matches = [
            option
            for option in groups.get(override.key_or_group, [])
            if any(fnmatch.fnmatch(option, pattern) for pattern in sweep.include)
            and not any(fnmatch.fnmatch(option, pattern) for pattern in sweep.exclude)
        ]
        return f"{override.get_key_element()}={matches[0]}" if matches else None
    return f"{override.get_key_element()}={next(iter(override.sweep_string_iterator()))}"


class _Composer:
    """Composes the command's config with Hydra's compose API, turning a refusal into one line."""

    def __init__(self, name: str, config_dir: Path | None, groups: dict[str, list[str]], command: str) -> None:
        own = config_dir is not None and (config_dir / f"{name}.yaml").is_file()
        self.name, self.groups, self.command = name, groups, command
        self.primary = config_dir if own and config_dir is not None else CONF_DIR
        # -cd adds a directory to the search path (a sweep's yaml extends conf/train.yaml)
        self.search = [f"hydra.searchpath=[file://{CONF_DIR}]"] if own else []
        self.sweep_params: list[Any] = []

    def _compose(self, lines: list[str], hydra: bool = False) -> DictConfig:
        from hydra import compose, initialize_config_dir

        with initialize_config_dir(config_dir=str(self.primary), version_base="1.3"):
            return compose(config_name=self.name, overrides=[*self.search, *lines], return_hydra_config=hydra)

    def _lines(self, overrides: list[Any]) -> list[str]:
        given = {o.key_or_group for o in overrides}
        swept = [o for o in self.sweep_params if o.key_or_group not in given]
        return [line for o in [*swept, *overrides] if (line := _first_choice(o, self.groups)) is not None]

    def compose(self, overrides: list[Any], multirun: bool, hydra_lines: Sequence[str] = ()) -> DictConfig:
        """The config of ``overrides`` (of a sweep's first job) with Hydra's node; one line where Hydra refuses them.

        ``hydra_lines``: the command line's overrides of Hydra's own settings (``hydra.run.dir=...``).
        """
        from hydra.core.override_parser.overrides_parser import OverridesParser
        from hydra.errors import HydraException, MissingConfigException
        from omegaconf.errors import OmegaConfBaseException

        try:
            if multirun:  # the sweep's own parameters (hydra.sweeper.params) choose groups its keys may live in
                params = OmegaConf.select(self._compose([], hydra=True), "hydra.sweeper.params") or {}
                lines = [f"{key}={value}" for key, value in params.items()]
                self.sweep_params = OverridesParser.create().parse_overrides(lines)
            return self._compose([*self._lines(overrides), *hydra_lines], hydra=True)
        except MissingConfigException as err:
            value = str(err.missing_cfg_file or "").rpartition("/")[2]
            options = list(err.options or [])
            near = difflib.get_close_matches(value, options, n=1, cutoff=0.5)
            hint = f"did you mean {near[0]}? " if near else ""
            raise SystemExit(f"no config {err.missing_cfg_file}: {hint}one of: {', '.join(options)}") from None
        except (HydraException, OmegaConfBaseException) as err:
            raise SystemExit(self._refusal(err, overrides)) from None

    def known(self, overrides: list[Any]) -> list[str]:
        """The dotted keys of the config ``overrides`` compose to (of the bare config where they cannot)."""
        try:
            config = self._compose(self._lines(overrides))
        except Exception:  # another refusal among them: the keys of the config alone
            config = self._compose([])
        return _dotted_keys(OmegaConf.to_container(config, resolve=False))

    def _refusal(self, err: Exception, overrides: list[Any]) -> str:
        """Hydra's refusal of an override as one line that says what to write instead."""
        text = str(err)
        first = text.splitlines()[0] if text else type(err).__name__
        quoted = first.split("'")[1] if first.count("'") >= 2 else ""
        culprit = next((o for o in overrides if o.key_or_group == quoted), None)
        line = culprit.input_line if culprit is not None else quoted
        if first.startswith("Could not override") and "No match in the defaults list" in text:
            return f"{line}: the config has no {quoted} to replace: add it with +{line.lstrip('+~')}"
        if first.startswith("Could not append to config. An item is already at"):
            return f"{quoted} is already in the config: set it without the + ({line.lstrip('+')})"
        if first.startswith("Could not override") and culprit is not None:
            nearest = _nearest(quoted, self.known([o for o in overrides if o is not culprit]))
            return f"unknown key {quoted} (in {line}): {nearest}; {self.command} --help lists the config"
        cause = str(err.__cause__).splitlines()[0] if err.__cause__ is not None else ""
        return first + (f": {cause}" if cause else "")


def _nearest(key: str, known: list[str]) -> str:
    """``did you mean trainer.max_steps?``: the known key nearest ``key``, its siblings first; else the siblings."""
    parent, _, name = key.rpartition(".")
    siblings = [k for k in known if k.rpartition(".")[0] == parent]
    for pool in (siblings, known):  # by the last part of the key: model.width is not near model.depth
        names = {k.rpartition(".")[2]: k for k in reversed(pool)}
        near = difflib.get_close_matches(name, list(names), n=1, cutoff=0.75)
        if near:
            return f"did you mean {names[near[0]]}?"
    if siblings:
        return f"{parent or 'the config'} has " + ", ".join(k.rpartition(".")[2] for k in siblings)
    return "no key of the config is near it"


def _dotted_keys(node: Any, prefix: str = "") -> list[str]:
    """Every key of a plain config, dotted (``eval.passkey.multiples``), Hydra's own node left out."""
    if not isinstance(node, dict):
        return []
    keys = []
    for key, value in node.items():
        if prefix or key != "hydra":
            keys += [f"{prefix}{key}", *_dotted_keys(value, f"{prefix}{key}.")]
    return keys


def _trainer_keyword(name: str) -> bool:
    """Whether Lightning's ``Trainer`` takes ``name`` and the training loop leaves it to the config."""
    from lightning.pytorch import Trainer

    return name in inspect.signature(Trainer.__init__).parameters and name not in _TRAINER_SET_BY_LOOP


register_resolvers()
