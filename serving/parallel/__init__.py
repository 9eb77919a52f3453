"""Tensor parallelism's building blocks: the rank group, the sharded layers and shard plans the
models use and the window-page map a follower mirrors (see
docs/parallel.md). The run time (leader, followers, the command stream) is serving/tp/."""
