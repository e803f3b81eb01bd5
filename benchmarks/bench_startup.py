"""Startup (DESIGN.md "Startup"): seconds from LLMEngine(...) to ready, per phase, in fresh processes:
the first with an empty Inductor cache (cold), the next ones reusing it (warm).

    python benchmarks/bench_startup.py --model llama-3.1-8b --load-format dummy --dtype bfloat16 \
        --runs 2 --output-csv startup.csv
"""

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd

from fastllm.bench import report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=2, help="fresh processes; the first is cold")
    parser.add_argument("--output-csv", default=None)
    parser.add_argument("--output-json", default=None)
    args, engine_args = parser.parse_known_args()
    rows, result = [], None
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(Path(tmp) / "inductor")}
        for i in range(args.runs):
            path = str(Path(tmp) / f"startup{i}.json")
            cmd = [sys.executable, "-m", "fastllm.entrypoints.cli", "bench", "startup", *engine_args,
                   "--output-json", path]
            rc = subprocess.run(cmd, env=env).returncode
            if rc != 0:
                return rc
            result = report.load(path)
            rows.append({"run": i, "cache": "cold" if i == 0 else "warm", **result["startup"]})
    df = pd.DataFrame(rows)
    print(f"\n{result['meta']['model']} on {result['meta']['device']}, commit {result['meta']['commit']}:")
    print(report.format_frame(df))
    stamp = {k: result["meta"].get(k) for k in report.STAMP}
    if args.output_csv:
        df.assign(**stamp).to_csv(args.output_csv, index=False)
    if args.output_json:
        report.write_json({**result, "rows": rows}, args.output_json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
