"""``lightning-hpp-check``: a user's module under HPPStrategy against Lightning's own strategy, rank by rank.

Usage::

    lightning-hpp-check cli examples/cli/train.py --config examples/cli/config.yaml [more LightningCLI arguments]
    lightning-hpp-check module pkg.models:make_model --data pkg.data:make_data [--trainer '{...}'] [--strategy '{...}']

Either runs ``--steps`` training steps (default 4) under Lightning's DDP with one process per replica and under
HPPStrategy with pp=2 (and pp=2 × dp=2: ``--layouts``), and prints, per layout, "equal to the reference on every
rank" or a table of what differs and where: losses, parameters, logged and callback metrics, hook calls and their
arguments, files written. Exit status 0 when every layout is equal, 1 when something differs, 2 on a bad input or
a failed job.
"""

from __future__ import annotations

import argparse
import json
import sys

from lightning_hpp.check.run import LAYOUTS, Target, check


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lightning-hpp-check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=4, help="training steps of each run (default 4)")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, from {sorted(LAYOUTS)}")
    p.add_argument("--out", default=None, help="keep the runs and their records here (default: a temporary dir)")
    sub = p.add_subparsers(dest="how", required=True)
    cli = sub.add_parser("cli", help="a LightningCLI script, with its configuration and arguments")
    cli.add_argument("script")
    cli.add_argument(
        "args", nargs=argparse.REMAINDER, help="the script's arguments after `fit` (e.g. --config cfg.yaml)"
    )
    mod = sub.add_parser("module", help="factories of the module and the data")
    mod.add_argument("model", help="'pkg.module:name' or 'path/file.py:name', called with no arguments")
    mod.add_argument("--data", default=None, help="the data: a LightningDataModule, a DataLoader or (train, val)")
    mod.add_argument("--trainer", default="{}", help="Trainer keyword arguments as JSON")
    mod.add_argument("--strategy", default="{}", help="HPPStrategy keyword arguments as JSON (pp_degree is 2)")
    mod.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.how == "cli":
            configs = [args.args[i + 1] for i, a in enumerate(args.args[:-1]) if a == "--config"]
            rest = [
                a for i, a in enumerate(args.args) if a != "--config" and (i == 0 or args.args[i - 1] != "--config")
            ]
            target = Target(script=args.script, config=tuple(configs), args=tuple(rest))
        else:
            target = Target(
                model=args.model,
                data=args.data,
                trainer=json.loads(args.trainer),
                strategy=json.loads(args.strategy),
                seed=args.seed,
            )
        report = check(target, layouts=tuple(x for x in args.layouts.split(",") if x), steps=args.steps, out=args.out)
    except (ValueError, RuntimeError) as e:
        print(f"lightning-hpp-check: {e}", file=sys.stderr)
        return 2
    print(report.text)
    return 0 if report.equal else 1


if __name__ == "__main__":
    sys.exit(main())
