"""``python -m posenc.report <sweep or run dirs…>`` (see ``posenc/report/__init__.py``)."""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from posenc.jsonio import DiskFullError
from posenc.report import __doc__ as about
from posenc.report.build import build_report
from posenc.report.collect import find_results, results_from_wandb
from posenc.report.preset import DEFAULT_REFERENCES
from posenc.report.study import write_study


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m posenc.report", description=about.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", help="sweep or run directories (searched for results.json), or files")
    parser.add_argument("--out", type=Path, help="output directory (default: the first path, or ./report)")
    parser.add_argument("--wandb", metavar="ENTITY/PROJECT", help="read run summaries from W&B instead")
    parser.add_argument("--group", help="with --wandb: only this W&B group (a sweep); with --wandb-view: its group")
    parser.add_argument(
        "--wandb-view",
        metavar="ENTITY/PROJECT",
        help="also save a W&B view of the sweep's runs (--group, else the runs' own): perplexity by length per "
        "scheme, its ratio to 1x, drift curves and the cost chart (needs wandb-workspaces: the wandb extra)",
    )
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument(
        "--study",
        metavar="NAME",
        help="write the study document --out (docs/results/<NAME>.md), its runs' records kept beside it",
    )
    parser.add_argument(
        "--include-unfinished",
        action="store_true",
        help="count runs whose training stopped before trainer.max_steps (as columns of their own)",
    )
    parser.add_argument(
        "--paired",
        nargs=2,
        metavar=("A", "B"),
        help="add a paired comparison (matched by seed) of perplexity between columns A and B",
    )
    parser.add_argument(
        "--references",
        nargs="+",
        default=list(DEFAULT_REFERENCES),
        metavar="SCHEME",
        help="the schemes every column is compared with, fixed in advance (default: alibi nope)",
    )
    for flag, what in (
        ("--ppl-threshold", "effective length, absolute rule: the perplexity every column must stay under"),
        ("--acc-threshold", "effective length, absolute rule: the accuracy every column must reach (RULER: 0.856)"),
        ("--ppl-ratio", "the ratio to in-length perplexity (relative rule; absolute: to the best column's)"),
        ("--acc-fraction", "the fraction of in-length accuracy (relative rule; absolute: of the best column's)"),
    ):
        parser.add_argument(flag, type=float, help=what)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    for flag, number, valid in (
        ("--ppl-threshold", args.ppl_threshold, lambda x: x >= 1),
        ("--acc-threshold", args.acc_threshold, lambda x: 0 < x <= 1),
        ("--ppl-ratio", args.ppl_ratio, lambda x: x >= 1),
        ("--acc-fraction", args.acc_fraction, lambda x: 0 < x <= 1),
    ):
        if number is not None and not valid(number):
            bounds = "≥ 1" if "ppl" in flag else "in (0, 1]"
            raise SystemExit(f"{flag} {number:g} must be {bounds}")
    if not args.paths and not args.wandb:
        parser.error("give run/sweep directories, or --wandb ENTITY/PROJECT")
    missing = [path for path in args.paths if not Path(path).exists()]
    if missing:
        raise SystemExit(f"{missing[0]} does not exist: give sweep or run directories, or results.json files")
    unreadable: list[str] = []
    if args.study:  # before any record is read: the study reads its runs itself
        if args.out is None or args.out.suffix != ".md" or args.wandb:
            raise SystemExit("--study writes a document from run directories: give --out docs/results/<name>.md")
        write_study(args.study, args.paths, args.out, unreadable, make_plots=not args.no_plots)
        for problem in dict.fromkeys(unreadable):
            print(f"left out: {problem}", file=sys.stderr)
        records = args.out.with_suffix("") / "runs"
        kept = f" and its records in {records}" if records.is_dir() else " from the studies' records it names"
        print(f"wrote {args.out}{kept}")
        return
    results = find_results(args.paths, unreadable)
    if not results and unreadable:
        raise SystemExit(f"no readable results: {unreadable[0]}. Re-run `python -m posenc.evaluate <run>` for it")
    for problem in unreadable:
        print(f"left out (named in report.md): {problem}", file=sys.stderr)
    if args.wandb:
        results += results_from_wandb(args.wandb, args.group)
    view_group = _view_group(args.wandb_view, args.group, results) if args.wandb_view else None
    first = Path(args.paths[0]) if args.paths else None
    out_dir = args.out or (first if first is not None and first.is_dir() else Path("report"))
    try:
        markdown = build_report(
            results,
            out_dir,
            make_plots=not args.no_plots,
            include_unfinished=args.include_unfinished,
            paired=tuple(args.paired) if args.paired else None,
            thresholds={
                "ppl_threshold": args.ppl_threshold,
                "acc_threshold": args.acc_threshold,
                "ppl_ratio": args.ppl_ratio,
                "acc_fraction": args.acc_fraction,
            },
            left_out=unreadable,
            references=args.references,
        )
    except DiskFullError as full:
        again = shlex.join(["python", "-m", "posenc.report", *(argv if argv is not None else sys.argv[1:])])
        raise SystemExit(f"posenc.report: {full}; report.md is as it was. Free space, then: {again}") from None
    print(markdown)
    print(f"wrote {out_dir / 'report.md'}")
    if args.wandb_view and view_group is not None:
        from posenc.report.wandb_view import save_view
        from posenc.runs.loggers import resolve_wandb_mode

        print(save_view(args.wandb_view, view_group, results, out_dir, resolve_wandb_mode("auto")))


def _view_group(entity_project: str, group: str | None, results: list[dict]) -> str:
    """The W&B group ``--wandb-view`` shows (``posenc/report/wandb_view.py``), checked before the report is built."""
    from posenc.report.wandb_view import view_target

    view_target(entity_project)
    groups = {((r.get("config") or {}).get("logger") or {}).get("group") for r in results} - {None}
    if group is None and len(groups) != 1:
        found = f"the runs log to {', '.join(sorted(groups))}" if groups else "the runs name no W&B group"
        raise SystemExit(f"--wandb-view needs --group <W&B group>: {found}")
    return group or groups.pop()


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # every file is written whole or not at all: what was there is intact
        raise SystemExit("interrupted: report.md and each plot are either as they were or whole") from None
