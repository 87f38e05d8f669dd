"""Attention with context parallelism: the sequence sharded over GPUs, KV exchanged between them."""
