"""MoE routing in one place (docs/routing.md): what the routers chose (stats), watching it during
training (monitor), pictures of it (plots), a checkpoint's routing on a dataset (report, `erniekit
eval --routing`, over the examples data reads), and the routing an RL policy is compared with (replay)."""
