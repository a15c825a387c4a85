"""Helpers for code that must work on plain tensors and on auto-parallel DistTensors alike.

In a multi-process run the model's parameters are DistTensors (placements over the job's
ProcessMesh); a single-process run never creates one, so each helper is the identity there.
Anything that turns a DistTensor into a full value is a collective: every rank must call it.
"""

from __future__ import annotations

import os

import numpy as np
import paddle


def is_dist(t) -> bool:
    return isinstance(t, paddle.Tensor) and t.is_dist()


def launched_world() -> int:
    """Processes in the `paddle.distributed.launch` job this process belongs to (1 outside one)."""
    return int(os.environ.get("PADDLE_TRAINERS_NUM", "1"))


def process_rank() -> int:
    """This process's rank in a `paddle.distributed.launch` job (0 outside one)."""
    return int(os.environ.get("PADDLE_TRAINER_ID", "0"))


def is_main_process() -> bool:
    """The process that writes files and prints progress."""
    return process_rank() == 0


def replicated_local(t: paddle.Tensor) -> paddle.Tensor:
    """A DistTensor replicated on every rank as its local value (the same numbers, without the
    SPMD bookkeeping of an op on a DistTensor); anything else as it is."""
    return t._local_value() if is_dist(t) and all(pl.is_replicated() for pl in t.placements) else t


def host_view(t: paddle.Tensor) -> np.ndarray | None:
    """A writable numpy view of the memory of a dense (or replicated) float32 contiguous CPU
    tensor, through DLPack (no copy); None for anything else."""
    t = replicated_local(t)
    if is_dist(t) or t.dtype != paddle.float32 or not t.place.is_cpu_place() or not t.is_contiguous():
        return None
    return np.from_dlpack(t.detach())


def host_array(t: paddle.Tensor) -> np.ndarray:
    """t's values as a float32 numpy array to read: `host_view` where it can (no copy; ~20x cheaper
    than .numpy() at expert sizes), else a converted contiguous copy."""
    view = host_view(t)
    return view if view is not None else np.ascontiguousarray(t.astype("float32").numpy())


def to_dense(t: paddle.Tensor) -> paddle.Tensor:
    """The full (unsharded, reduced) value as a plain tensor on this rank; collective for DistTensors."""
    if not is_dist(t):
        return t
    import paddle.distributed as dist

    if not all(p.is_replicated() for p in t.placements):
        t = dist.reshard(t, t.process_mesh, [dist.Replicate() for _ in t.placements])
    return t._local_value()


def scalar(t) -> float:
    """float() of a 0-d/1-element tensor, reducing a partial or sharded DistTensor first."""
    if isinstance(t, (int, float)):
        return float(t)
    return float(to_dense(t))


def like(ref: paddle.Tensor, value: paddle.Tensor) -> paddle.Tensor:
    """`value` (a full plain tensor) placed as `ref` is: the same mesh and placements."""
    if not is_dist(ref):
        return value
    import paddle.distributed as dist

    return dist.shard_tensor(value, ref.process_mesh, ref.placements)


def assign_full(param: paddle.Tensor, value: paddle.Tensor) -> None:
    """Set a (possibly sharded) parameter from its full value, keeping its placements."""
    if not is_dist(param):
        param.set_value(value)
        return
    # contiguous: a transposed view (HF [out, in] -> [in, out]) was split by its storage order (wrong rows)
    param._local_value().set_value(like(param, value.astype(param.dtype).contiguous())._local_value())


def barrier() -> None:
    """Wait for every rank of a launched job; nothing outside one."""
    if launched_world() > 1:
        import paddle.distributed as dist

        dist.barrier()
