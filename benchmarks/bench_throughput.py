"""Offline throughput (DESIGN.md "Offline throughput"): the same code as `fastllm bench throughput`.

    python benchmarks/bench_throughput.py --model llama-3.1-8b --load-format dummy --dtype bfloat16 \
        --num-prompts 256 --input-len 512 --output-len 256 --output-json throughput.json
    python benchmarks/bench_throughput.py --dataset prompts.jsonl --num-prompts 100   # {"prompt": ...} per line
"""

import sys

from fastllm.entrypoints.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "throughput", *sys.argv[1:]]))
