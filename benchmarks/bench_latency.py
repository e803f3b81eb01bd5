"""Decode latency sweep (DESIGN.md "Decode latency"): the same code as `fastllm bench latency`.

    python benchmarks/bench_latency.py --model llama-3.1-8b --load-format dummy --dtype bfloat16 \
        --batch-sizes 1,8,32,128,256 --cuda-graph-sizes 1,8,32,128,256 --input-len 128 --output-len 256 --matmul-floor \
        --output-json latency.json --output-csv latency.csv --plot latency.png
"""

import sys

from fastllm.entrypoints.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "latency", *sys.argv[1:]]))
