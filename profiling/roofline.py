"""Roofline report of a `fastllm bench` run, or one step's bytes/FLOPs for a model.
The math lives in fastllm/bench/roofline.py (the bench uses it too); this is its command line.

    python profiling/roofline.py latency.json
    python profiling/roofline.py --model llama-3.1-8b --batch-size 32 --context 256 --ceilings ceilings.json
"""

import sys

from fastllm.bench.roofline import ModelShape, floor_seconds, main, report  # noqa: F401

if __name__ == "__main__":
    sys.exit(main())
