"""Tensor parallelism at run time: rank 0's leader (TPLeader: it starts the followers and sends them
each step's commands), the followers' loop, the command stream, rank failures and the state-slot ops
a step carries (see docs/parallel.md). The building blocks the models use (the rank group, sharded
layers, shard plans) are serving/parallel/, which imports nothing of this package."""
