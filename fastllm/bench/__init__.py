"""Measurement code behind `fastllm bench`, profiling/ and benchmarks/: engine runs (runner,
latency, throughput), the model's bytes/FLOPs and roofline (roofline), GPU ceilings and run
stamps (ceilings), the matmul-chain floor (matmul_floor), torch-profiler traces (profile) and
tables/files/plots (report)."""
