"""Tensor and pipeline parallelism over torch.distributed.

parallel_state.py  where this process sits among the engine's ranks (ParallelRank) and its process groups
communication.py   the collectives the model calls, as custom ops: the tensor-parallel all-reduce (inside
                   the compiled forward and the CUDA graphs), the logits gather, the pipeline send/recv
one_shot.py        the one-shot all-reduce over symmetric memory, used for small (decode) messages on GPUs
"""
