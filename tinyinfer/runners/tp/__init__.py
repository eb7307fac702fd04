"""Tensor parallelism: each rank's shard of the weights and its runner (shard), the rank-0
runner that drives the others over pipes (runner), and starting the rank processes (launch)."""
