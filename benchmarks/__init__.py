"""Benchmarks of remat against eager PyTorch and other checkpointing methods."""
