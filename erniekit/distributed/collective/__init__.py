"""Collective parallelism on Paddle's auto-parallel API: the layout from the config's degrees
(layout), the mesh and placements of a joined job (runtime), pipeline segments and their links
(pipeline), and the expert-parallel token exchange (expert_exchange)."""
