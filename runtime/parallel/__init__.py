"""Tensor-parallel execution: per-rank weight shards, the process group, and the proxy executable
that lets the unchanged engine on rank 0 drive every rank (docs/parallel.md)."""
