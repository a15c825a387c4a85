"""Parallel layouts (config degrees -> ProcessMesh + placements) and the multi-process launch."""
