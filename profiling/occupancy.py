"""Registers, spilled bytes, shared memory and programs a SM of decode attention's kernel variants, read from
sm_90 machine code compiled on this machine (no GPU needed; Triton's own ptxas). The code is
fastllm/bench/occupancy.py; run with TRITON_INTERPRET unset.

    python profiling/occupancy.py
"""

import os
import sys

if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("unset TRITON_INTERPRET: the interpreter's kernels do not compile")
    from fastllm.bench.occupancy import main

    main()
