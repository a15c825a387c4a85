#!/usr/bin/env python
"""Floats per token one dense decoder layer keeps for the backward, at tp=1 and on a tp rank, beside
the planner's count (docs/planner.md, "Attention and dense MLP whole over tp: what moved").

    python tools/measure_saved_activations.py [--hidden 256 --heads 8 --kv-heads 4 --head-dim 32
        --inter 768 --batch 8 --seq 256 --tp 2] [--lora-rank R --lora-targets RE --lora-dropout P
        --dora] [--launch] [--list] [--out FILE.json]

What is measured: the attention block x + attn(norm(x)), the MLP block x + mlp(norm(x)), and the
whole layer under each recompute mode. A part's figure is malloc's live bytes (erniekit/utils/
malloc.py `live_bytes`) after its forward less before, less its output, over the tokens, plus the
input's H (allocated before, kept by the norm on every rank, counted by the planner); the second
of two forwards (the first warms the kernels' and the allocator's caches).

Without --launch, one process, for both paths a layer takes on the CPU:
  kernel  plain tensors: the C kernels of norm, rope, attention and SwiGLU (1 process, replicas);
  plain   every parameter and input as a DistTensor on a one-process mesh, so each op takes
          Paddle's own path, as a tp rank's DistTensors do (tp, ZeRO, ep on the CPU);
each at tp=1 and as a tp rank's share: the layer built with heads, KV heads and intermediate size
/ tp, whose weights are the slices runtime.py places on a rank (the row-parallel output's
all-reduce an identity there). The share misses what a rank holds whole because it meets a
replicated tensor (rope's cos and sin, the LoRA factors): only --launch shows that.

--launch: the real thing, 2 processes (gloo) started by paddle.distributed.launch, the layer's
parameters placed by runtime.py's ParallelContext at tp=2 (and at tp=1 on a one-rank mesh, in the
same processes), rank 0's figures. With LoRA only the forward runs (Paddle's CPU build has no
reduce-scatter for the adapters' backward, nor for a row-parallel adapter's forward: target
column-parallel modules, e.g. --lora-targets '.*(q|k|v|gate|up)_proj').

--list: each saved tensor (global shape, this rank's shape, placements, floats per token) of the
attention and MLP blocks, from paddle.autograd.saved_tensors_hooks (deduplicated by address).
Eager auto-parallel saves an op's inputs as they were given, before the reshard its SPMD rule makes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from erniekit.utils.malloc import live_bytes  # noqa: E402  (paddle-free)

BLOCKS = ("attention", "mlp")
MODES = ("none", "core_attn", "full_attn", "mlp", "full")
SHAPE_KEYS = ("hidden", "heads", "kv_heads", "head_dim", "inter", "batch", "seq", "tp")
LORA_KEYS = ("lora_rank", "lora_targets", "lora_dropout")


def _config(a, tp: int):
    """The layer's config as one rank of `tp` computes it (heads, KV heads and MLP width / tp)."""
    from dataclasses import replace

    from erniekit.models.ernie4_5 import get_preset

    return replace(
        get_preset("tiny-dense"),
        hidden_size=a.hidden,
        num_attention_heads=a.heads // tp,
        num_key_value_heads=a.kv_heads // tp,
        head_dim=a.head_dim,
        intermediate_size=a.inter // tp,
        num_hidden_layers=1,
    )


def _layer(a, c):
    import paddle

    from erniekit.models.ernie4_5.modeling import DecoderLayer

    paddle.seed(0)
    layer = DecoderLayer(c, 0)
    if a.lora_rank:
        from erniekit.nn.lora import LoraConfig, apply_lora

        cfg = LoraConfig(r=a.lora_rank, target_modules=[a.lora_targets], lora_dropout=a.lora_dropout, use_dora=a.dora)
        apply_lora(layer, cfg)
    layer.train()
    return layer


def _inputs(a, c):
    """x [B, S, H] (a gradient wanted), cos / sin and the additive causal mask of the CPU path."""
    import paddle

    from erniekit.nn.attention import additive_mask, rope_cos_sin

    x = paddle.randn([a.batch, a.seq, a.hidden])
    x.stop_gradient = False
    pos = paddle.arange(a.seq, dtype="int64").unsqueeze(0).expand([a.batch, a.seq])
    cos, sin = rope_cos_sin(pos, c.head_dim, c.rope_theta)
    return x, cos, sin, ("bias", additive_mask(None, a.seq, a.seq, paddle.float32))


def _local(t):
    return t._local_value() if t.is_dist() else t


def _run(layer, part: str, x, cos, sin, mask):
    """The part's output: a block with its residual add, or the layer under a recompute mode ("layer rc=MODE")."""
    if part == "attention":
        return x + layer._attn(x, cos, sin, mask, None)
    if part == "mlp":
        return x + layer._mlp(x)
    mode = part.removeprefix("layer rc=")
    layer.recompute = mode if mode in ("full", "full_attn", "mlp") else None
    layer.self_attn.recompute_core = mode == "core_attn"
    return layer(x, cos, sin, mask, None)


def kept_per_token(layer, part: str, inputs, backward: bool) -> float:
    """float32 elements per token the part's forward keeps, its input's H included (second of two runs)."""
    x = inputs[0]
    tokens, H = x.shape[0] * x.shape[1], x.shape[2]
    kept = 0
    for _ in range(2):
        before = live_bytes()
        y = _run(layer, part, *inputs)
        kept = live_bytes() - before - int(_local(y).numel()) * 4
        if backward:
            y.sum().backward()
            x.clear_gradient()
            for p in layer.parameters():
                p.clear_gradient()
        del y
    return kept / 4 / tokens + H


def saved_list(layer, part: str, inputs) -> list:
    """[global shape, local shape, placements, floats per token] of each tensor the part's forward saves."""
    import paddle

    seen: dict = {}
    tokens = inputs[0].shape[0] * inputs[0].shape[1]

    def pack(t):
        if t is None:  # a PyLayer's save_for_backward may hold None (the attention kernel's p or stats)
            return t
        loc = _local(t)
        placements = str(t.placements) if t.is_dist() else "plain"
        key = loc.data_ptr() if int(loc.numel()) else id(t)
        seen.setdefault(key, [list(t.shape), list(loc.shape), placements, int(loc.numel()) / tokens])
        return t

    with paddle.autograd.saved_tensors_hooks(pack, lambda t: t):
        y = _run(layer, part, *inputs)
    del y
    return list(seen.values())


def _as_dist(layer, inputs, mesh):
    """Every parameter and input as a replicated DistTensor on `mesh` (one process)."""
    import paddle.distributed as dist

    def shard_fn(name, sub, m):
        for pname, p in list(sub.named_parameters(include_sublayers=False)):
            setattr(sub, pname, dist.shard_tensor(p, m, [dist.Replicate()]))

    dist.shard_layer(layer, mesh, shard_fn)
    x, cos, sin, (_, bias) = inputs
    out = [dist.shard_tensor(t.detach(), mesh, [dist.Replicate()]) for t in (x, cos, sin, bias)]
    out[0].stop_gradient = False
    return (*out[:3], ("bias", out[3]))


def _measure(a, layer, inputs, backward: bool) -> dict:
    if a.list:
        return {b: saved_list(layer, b, inputs) for b in BLOCKS}
    out = {b: kept_per_token(layer, b, inputs, backward) for b in BLOCKS}
    for mode in () if a.lora_rank else MODES:  # recompute needs the backward's second run
        out[f"layer rc={mode}"] = kept_per_token(layer, f"layer rc={mode}", inputs, backward)
    return out


def one_process(a) -> dict:
    """{path: {tp: {part: floats per token}}} for the kernel and plain paths, tp 1 and a.tp."""
    import paddle.distributed as dist

    out: dict = {}
    for path in ("kernel", "plain"):
        out[path] = {}
        for tp in (1, a.tp):
            c = _config(a, tp)
            layer = _layer(a, c)
            inputs = _inputs(a, c)
            if path == "plain":
                inputs = _as_dist(layer, inputs, dist.ProcessMesh([0], dim_names=["tp"]))
            out[path][tp] = _measure(a, layer, inputs, backward=True)
    return out


def launched_rank(a) -> dict:
    """This rank's figures, the layer placed by runtime.py at tp=2 (tp=1: on a one-rank mesh)."""
    import paddle.distributed as dist

    from erniekit.distributed.collective import runtime
    from erniekit.distributed.collective.layout import Layout
    from erniekit.nn import attention

    dist.init_parallel_env()
    out: dict = {}
    c = _config(a, 1)
    for tp in (1, 2):
        attention._ROTATIONS.clear()  # a mixed op made the cached rotation a DistTensor of the last mesh
        layer = _layer(a, c)
        inputs = _inputs(a, c)
        if tp == 1:
            inputs = _as_dist(layer, inputs, dist.ProcessMesh([dist.get_rank()], dim_names=["tp"]))
        else:
            ctx = runtime.ParallelContext(Layout(tp=2))
            ctx.shard_model(layer)
            x = dist.shard_tensor(inputs[0].detach(), ctx.mesh, [dist.Replicate()] * len(ctx.mesh.shape))
            x.stop_gradient = False
            inputs = (x, *inputs[1:])
        out[tp] = _measure(a, layer, inputs, backward=not a.lora_rank)
    return out


def launch(a) -> dict:
    """This script's rank mode in 2 processes; rank 0's figures."""
    with tempfile.TemporaryDirectory() as tmp:
        res = os.path.join(tmp, "rank0.json")
        cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", "2", "--log_dir", tmp]
        cmd += [os.path.abspath(__file__), "--rank-out", res, *_forwarded(a)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOG_minloglevel": "1"}
        done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
        if done.returncode or not os.path.exists(res):
            logs = [os.path.join(tmp, f) for f in sorted(os.listdir(tmp)) if f.startswith("workerlog")]
            tail = "".join(open(f, encoding="utf-8", errors="replace").read()[-3000:] for f in logs)
            raise SystemExit(f"launch failed (exit {done.returncode}):\n{done.stderr[-2000:]}\n{tail}")
        with open(res) as f:
            return json.load(f)


def _forwarded(a) -> list[str]:
    out = [x for k in SHAPE_KEYS + LORA_KEYS for x in (f"--{k.replace('_', '-')}", str(getattr(a, k)))]
    return out + (["--dora"] if a.dora else []) + (["--list"] if a.list else [])


def planner_count(a) -> dict:
    """The planner's floats per token at tp=1 and a.tp: each block (the attention without its [S, S]
    probabilities) and the layer per recompute mode, the residual stream (other_saved) included there."""
    from erniekit.distributed import planner as P

    layers = P.layer_costs(_config(a, 1))
    out = {}
    for tp in (1, a.tp):
        (l,) = layers
        parts = {
            "attention": P._attn_saved_on_rank(l, tp, 0.0),
            "mlp": P._mlp_saved_on_rank(l, tp),
        }
        for mode in MODES:
            parts[f"layer rc={mode}"] = P._saved_per_token(layers, 1, tp, a.seq, a.hidden, False, mode)
        out[tp] = parts
    return out


def _args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for k, v in (("hidden", 256), ("heads", 8), ("kv-heads", 4), ("head-dim", 32), ("inter", 768)):
        ap.add_argument(f"--{k}", type=int, default=v)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--lora-rank", type=int, default=0, help="LoRA adapters of this rank (0: none)")
    ap.add_argument("--lora-targets", default=".*_proj", help="the adapted Linears (re.fullmatch)")
    ap.add_argument("--lora-dropout", type=float, default=0.0)
    ap.add_argument("--dora", action="store_true")
    ap.add_argument("--launch", action="store_true", help="2 processes, runtime.py's placements at tp=2")
    ap.add_argument("--list", action="store_true", help="the saved tensors instead of the bytes")
    ap.add_argument("--rank-out", help=argparse.SUPPRESS)
    ap.add_argument("--out")
    return ap.parse_args(argv)


def main() -> None:
    a = _args()
    if live_bytes() is None:
        raise SystemExit("measure_saved_activations needs glibc >= 2.33 (mallinfo2)")
    from erniekit.utils.paddle_import import import_paddle

    import_paddle()
    if a.rank_out is not None:
        import paddle.distributed as dist

        got = launched_rank(a)
        if dist.get_rank() == 0:
            with open(a.rank_out, "w") as f:
                json.dump(got, f)
        return
    result = {"shape": {k: getattr(a, k) for k in SHAPE_KEYS + LORA_KEYS}, "planner": planner_count(a)}
    result["launched" if a.launch else "one_process"] = launch(a) if a.launch else one_process(a)
    text = json.dumps(result, indent=1)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
