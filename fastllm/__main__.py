"""`python -m fastllm ...` is the `fastllm` command (for machines where the package is not installed)."""

from fastllm.entrypoints.cli import main

if __name__ == "__main__":
    main()
