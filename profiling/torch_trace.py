"""A torch-profiler Chrome trace of a few decode steps, plus the top kernels and engine ranges.
The same as `fastllm bench --profile DIR`, without the latency sweep; the code is
fastllm/bench/profile.py.

    python profiling/torch_trace.py --model llama-3.1-8b --load-format dummy --dtype bfloat16 \
        --batch-size 32 --input-len 128 --steps 5 --out prof/ [--layers]
"""

import argparse
import sys

from fastllm.bench.profile import print_profile, profile_decode
from fastllm.entrypoints.cli import add_engine_args, engine_kwargs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5, help="decode steps recorded")
    parser.add_argument("--out", default="prof", help="directory for the trace")
    parser.add_argument("--layers", action="store_true", help="a range per decoder layer too")
    add_engine_args(parser)
    args = parser.parse_args()
    from fastllm.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_kwargs(args.model, **engine_kwargs(args))
    print_profile(profile_decode(engine, args.batch_size, args.input_len, args.out, args.steps, layers=args.layers))
    return 0


if __name__ == "__main__":
    sys.exit(main())
