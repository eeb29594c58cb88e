"""Tensor and expert parallelism over torch.distributed: the process group and the workers."""
