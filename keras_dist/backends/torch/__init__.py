"""The PyTorch backend: DistributedDataParallel and DTensor, `torch.distributed`."""
