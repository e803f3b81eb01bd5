"""`python -m fastllm ...` is the `fastllm` command (for machines where the package is not installed)."""

import sys

from fastllm.entrypoints.cli import main

if __name__ == "__main__":
    sys.exit(main())
