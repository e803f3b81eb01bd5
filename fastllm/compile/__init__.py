"""torch.compile and CUDA graphs for the model runner."""
