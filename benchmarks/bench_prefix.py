"""Prefix sharing (DESIGN.md "Prefix sharing"): N requests with a shared P-token prefix and distinct
suffixes; TTFT, throughput and prefix-cache hit rate. Runs with prefix caching, then (unless
--only-cached) again with --no-enable-prefix-caching in a fresh process, and prints both rows.

    python benchmarks/bench_prefix.py --model llama-3.1-8b --load-format dummy --dtype bfloat16 \
        --num-prompts 64 --shared-prefix-len 1024 --input-len 128 --output-len 64 --output-json prefix.json
"""

import subprocess
import sys
import tempfile
from pathlib import Path


from fastllm.bench import report
from fastllm.entrypoints.cli import main


def run_both(argv: list[str]) -> int:
    out = None
    if "--output-json" in argv:
        i = argv.index("--output-json")
        out, argv = argv[i + 1], argv[:i] + argv[i + 2:]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for flags in ([], ["--no-enable-prefix-caching"]):
            path = str(Path(tmp) / f"prefix{len(results)}.json")
            cmd = [sys.executable, "-m", "fastllm.entrypoints.cli", "bench", "prefix", *argv, *flags,
                   "--output-json", path]
            rc = subprocess.run(cmd).returncode
            if rc != 0:
                return rc
            results.append(report.load(path))
    combined = {**results[0], "rows": results[0]["rows"] + results[1]["rows"]}
    print("\nwith and without prefix caching:")
    print(report.table(combined))
    if out:
        report.write_json(combined, out)
    return 0


if __name__ == "__main__":
    args = sys.argv[1:]
    if "--only-cached" in args:
        args.remove("--only-cached")
        sys.exit(main(["bench", "prefix", *args]))
    sys.exit(run_both(args))
