"""Bench results: print a run's table, convert it to CSV, plot it. The code lives in
fastllm/bench/report.py (shared with `fastllm bench`); this is its command line.

    python benchmarks/results.py latency.json [--csv latency.csv] [--plot latency.png]
"""

import argparse
import sys

from fastllm.bench.report import header, load, plot_latency, table, write_csv, write_json  # noqa: F401


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", help="JSON written by fastllm bench --output-json")
    parser.add_argument("--csv", default=None)
    parser.add_argument("--plot", default=None, help="latency runs: tokens/s and %% bandwidth vs batch size")
    args = parser.parse_args()
    result = load(args.run)
    print(header(result))
    print(table(result))
    if args.csv:
        write_csv(result, args.csv)
    if args.plot:
        plot_latency(result, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
