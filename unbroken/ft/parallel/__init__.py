"""Parallelism inside a replica: FSDP2 shards, tensor parallelism, pipeline stages, and the replica's own group."""
