"""Tensor and data parallelism: the rank group, the sharded layers, the rank-0 -> follower
command stream (see docs/parallel.md)."""
