"""What one rank holds of a built model under a collective layout, counted from the runtime's own
placements without launching processes (planner and lora_cost tests compare the planner's shares)."""


def _local_sizes(model, lay):
    """(parameter, elements on one rank of layout `lay`): each shape divided as the runtime places it
    (ParallelContext.param_placements, as shard_model calls it)."""
    from erniekit.distributed.collective.layout import DIMS
    from erniekit.distributed.collective.runtime import ParallelContext
    from erniekit.nn.moe import StackedExperts

    ctx = ParallelContext(lay)
    stacks = [l for _, l in model.named_sublayers() if isinstance(l, StackedExperts)]
    experts = {id(p) for l in stacks for p in l.expert_params().values()}
    for name, p in model.named_parameters():
        n = int(p.numel())
        for axis, placement in enumerate(ctx.param_placements(name, p, True if id(p) in experts else None)):
            if placement.is_shard():
                n //= getattr(lay, DIMS[axis])
        yield p, n


def local_elements(model, lay) -> tuple[int, int]:
    """(held, trained) elements of `model` on one rank of layout `lay`."""
    sizes = list(_local_sizes(model, lay))
    return sum(n for _, n in sizes), sum(n for p, n in sizes if not p.stop_gradient)


def local_bytes(model, lay) -> int:
    """Bytes of `model`'s parameters on one rank of layout `lay`, each in its own dtype."""
    return sum(n * p.element_size() for p, n in _local_sizes(model, lay))
