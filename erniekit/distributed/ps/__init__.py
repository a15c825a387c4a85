"""Heterogeneous parameter-server mode (`distributed_mode: ps`, docs/ps.md): CPU servers hold the
token-embedding and LM-head rows with their optimizer state; workers run the transformer blocks."""
