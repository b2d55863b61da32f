"""Write docs/trend/trend.md and docs/trend/figures/trend.{png,svg} from point summaries.

The summaries are the JSON files `fcaudit reproduce --preset trend` writes to
OUT/points/, copied to docs/trend/results/ and committed. A script beside them rather
than a subcommand: the study already writes the same page into its own folder with
the same function (fcaudit.study.trend.write_trend); this only re-renders the committed
numbers, so anyone can rebuild the docs figure without training anything. The same
summaries give byte-identical files.

    python docs/trend/make_trend.py [--results DIR] [--out DIR]
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from fcaudit.study.trend import write_trend

HERE = Path(__file__).resolve().parent


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=HERE / "results",
                        help="folder of point summaries (default: docs/trend/results)")
    parser.add_argument("--out", type=Path, default=HERE,
                        help="where trend.md and figures/ go (default: docs/trend)")
    args = parser.parse_args(argv)
    write_trend(args.results, args.out)
    print(f"wrote {args.out / 'trend.md'} and {args.out / 'figures' / 'trend.png'} (+ .svg)")


if __name__ == "__main__":
    main()
