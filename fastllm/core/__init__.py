"""The policy half of the engine: scheduling and KV-block bookkeeping. Pure Python, no tensors."""
