"""Serving (DESIGN.md "Serving"): requests arriving at a given rate to `fastllm serve`; the same code as
`fastllm bench serving`. Without --url it starts the server itself, from the engine arguments given.

    python benchmarks/bench_serving.py --model llama-3.1-8b --load-format dummy --dtype bfloat16 \
        --num-prompts 500 --request-rates 8,16,32,inf --input-len 512 --output-len 128 --output-json serving.json
    python benchmarks/bench_serving.py --url http://127.0.0.1:8000 --served-model-name my-model --num-prompts 100
"""

import sys

from fastllm.entrypoints.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "serving", *sys.argv[1:]]))
