"""Training across clusters over a slow link (issue #30, docs/cross_cluster.md)."""
