"""``python -m posenc.gpu.commands <stage>``: compose every Hydra command of a stage's GPU plan, without running any.

A rehearsal on CPU runs each step with tiny settings, which proves the steps work but not that the GPU-sized
command lines parse: those set other keys (bf16, the paper-sized experiment, the GPU's lengths). This composes
each of them the way ``python -m posenc.train`` / ``posenc.bench`` would, in one process, and names the first
override Hydra refuses. The proof's training commands are the ones ``posenc.gpucheck`` would start.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf import OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from posenc.config import CONF_DIR, register_resolvers
from posenc.gpu import check, plan

ENTRY_CONFIGS = {"posenc.train": "train", "posenc.bench": "bench"}


def hydra_commands(steps: list[plan.Step], work: Path) -> list[tuple[str, str, list[str]]]:
    """(step, config name, overrides) of every Hydra command the steps start, gpucheck's runs included."""
    found = []
    for step in steps:
        argv = step.argv
        if "-m" not in argv:
            continue
        module = argv[argv.index("-m") + 1]
        if module in ENTRY_CONFIGS:
            found.append((step.name, ENTRY_CONFIGS[module], argv[argv.index("-m") + 2 :]))
        elif module == "posenc.gpucheck":
            args = check.parse_args(argv[argv.index("-m") + 2 :])
            for run in check.plan(args, work / "gpucheck"):
                found.append((f"{step.name}:{run.name}", "train", run.overrides))
    return found


def compose_all(commands: list[tuple[str, str, list[str]]]) -> list[str]:
    """Compose each command; the errors, one line each (empty when every command parses)."""
    register_resolvers()
    errors = []
    for name, config, overrides in commands:
        try:
            with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
                cfg = compose(config_name=config, overrides=overrides, return_hydra_config=True)
                if config == "train":  # resolving the run's config checks every interpolation the run resolves
                    with open_dict(cfg):
                        cfg.pop("hydra")
                    OmegaConf.to_container(cfg, resolve=True)
        except (HydraException, OmegaConfBaseException, ValueError) as err:
            errors.append(f"{name}: {type(err).__name__}: {str(err).splitlines()[0]}")
    return errors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m posenc.gpu.commands", description=__doc__.splitlines()[0])
    parser.add_argument("stage", choices=plan.STAGES)
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--scheme", default="alibi")
    parser.add_argument("--part", default="attention")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as work:
        options = plan.Options(args.stage, Path(work), length=args.length, scheme=args.scheme, part=args.part)
        commands = hydra_commands(plan.build(options), Path(work))
    errors = compose_all(commands)
    for name, config, overrides in commands:
        print(
            f"{'refused' if any(e.startswith(name + ':') for e in errors) else 'parses'}: {name} ({config}, "
            f"{len(overrides)} overrides)"
        )
    for error in errors:
        print(f"error: {error}", file=sys.stderr)
    print(f"{len(commands) - len(errors)} of {len(commands)} commands of the {args.stage} stage parse")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
