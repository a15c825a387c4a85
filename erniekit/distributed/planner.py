"""Global cost model and planner: which parallel layout trains a model fastest on a described cluster.

`plan(model_config, cluster, workload)` enumerates layouts (dp, tp, pp, ep, sharding stage,
recompute, micro-batch) for the world size of the cluster, drops those that do not split the
model evenly or do not fit in device memory, predicts step time and per-device peak memory for
the rest, and ranks them. Paddle is not imported: the model is the formulas below (docs/planner.md
gives them with the calibration against measured runs).

Step time = compute + communication, per optimizer step:
  compute   FLOPs / (devices working in parallel x device_flops) + a fixed cost per op launch
            (op_overhead_s x ops, + spmd_op_overhead_s where the parameters are DistTensors) + the
            memory-bound ops' traffic / memory_bandwidth (what the forward writes, read back by the
            backward, + what recompute writes again), times (m + pp - 1) / m for the pipeline
            bubble (1F1B over the m micro-batches of a step); FLOPs = 3 x forward (backward = 2 x
            forward) plus the forward of what recompute runs again; + the optimizer step (8 passes
            over this rank's parameters at memory_bandwidth, a launch per tensor).
  comm      each collective costs latency + bytes / bandwidth (ring all-reduce moves
            2(n-1)/n x the buffer): gradient all-reduce over the data ranks (whole-model replicas:
            one sum of all gradients, through shared memory on one CPU host when the cluster gives
            host_sum_*; DistTensors: one call per parameter tensor, as the optimizer issues them;
            sharding: reduce-scatter + all-gather,
            the same bytes in twice the calls), tp all-reduces of activations (4 per
            layer per micro-batch; per MoE layer 2 more, the routed experts' partial output and
            its input's gradient, and the gate weights' gradient), expert all-to-all (dispatch +
            combine, forward and backward),
            stage-3 parameter all-gathers, pipeline send/recv of activations. Links inside a node
            use the intra-node figures, a group that spans nodes the inter-node ones.
Memory (per device, float32 training) = params + grads + Adam moments (split by the sharding
stage; over tp as runtime.py places them: projections and routed experts split, norms, routers
and the vision model whole on every tp rank) + the activations the forward keeps for the backward (per layer and token, counted from
the tensors this model's forward saves, split over tp but what every tp rank keeps whole, measured:
the tensors of width H, a MoE layer's of width E or k, LoRA factors'
products beside a partial sum or a replicated input: `attention_saved`, `dense_mlp_saved`,
`moe_saved`, lora_cost.saved_whole_over_tp; recompute keeps only the recomputed part's input) x the
micro-batches in flight (1F1B: pp on the first stage) + the logits + the buffer whole-model
replicas sum their gradients through + the CPU heap's holes (+ a 16-bit LoRA base's upcast
buffer) + runtime overhead.
LoRA (`Workload.lora`, counted by lora_cost.py): the base is held and frozen; gradients, moments,
the optimizer step and the gradient traffic are the adapters'; a frozen weight's backward computes
its input's gradient only (2 x forward instead of 3 x), the adapters' own GEMMs are added.
The adapted base is held in lora_base_dtype (on the CPU the forward and the backward each upcast
its weights, one at a time, into one float32 buffer the size of the largest); DoRA's output scale
and norms, and the adapters of the MTP blocks and of the vision model (per image token,
Workload.image_tokens) are added too.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

from erniekit.distributed.lora_cost import Adapters, adapters_from_config, trains_adapters
from erniekit.errors import ConfigError
from erniekit.nn import kernel_memory

RECOMPUTE_MODES = ("none", "core_attn", "full_attn", "mlp", "full")
BYTES = 4  # float32 on CPU; bf16 runs keep fp32 master weights and moments, counted the same


# ---- inputs ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Cluster:
    """Devices and links (SI units: FLOP/s, bytes, bytes/s, seconds). One device = one process."""

    nodes: int = 1
    devices_per_node: int = 1
    device_flops: float = 50e9  # achieved float32 GEMM FLOP/s of one device (not the datasheet peak)
    device_memory: float = 16e9
    op_overhead_s: float = 30e-6  # fixed cost of one op launch (framework + kernel), forward or backward
    memory_bandwidth: float = 1e11  # bytes/s of the memory-bound ops' activation traffic
    memory_overhead: float = 0.5e9  # framework memory of a process outside tensors
    intra_node_bandwidth: float = 5e9
    intra_node_latency_s: float = 100e-6
    inter_node_bandwidth: float = 1.25e9
    inter_node_latency_s: float = 50e-6
    # layouts whose parameters are DistTensors (tp, ep, sharding) pay this on top of op_overhead_s
    # per op: Paddle's dynamic SPMD infers placements and inserts reshards on every op
    spmd_op_overhead_s: float = 0.0
    # data-parallel replicas on one CPU host sum their gradients through shared memory
    # (erniekit/distributed/collective/host_sum.py): one sum of n bytes = latency + n / bandwidth;
    # 0: not measured, the intra-node all-reduce figures apply
    host_sum_bandwidth: float = 0.0
    host_sum_latency_s: float = 0.0
    name: str = "cluster"
    # what the devices are: "cpu" (Paddle's CPU kernels: the attention kernel, the chunked head, no
    # stage 3) or "gpu" (flash attention keeps no [S, S] scores; the head makes whole logits)
    device: str = "cpu"

    @property
    def world(self) -> int:
        return self.nodes * self.devices_per_node


def read_yaml(path: str, kind: str, hint: str):
    """A planner YAML file's content; one-line errors name the file (and line): kind 'cluster' or 'sites',
    hint what to give instead of a missing file."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            return yaml.safe_load(f)
    except OSError as e:
        raise ConfigError(f"{kind} file {path}: {e.strerror}; {hint}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{kind} file {path}: not UTF-8 text; {hint}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else path
        raise ConfigError(f"{where}: not valid YAML ({getattr(e, 'problem', e)}); fix the {kind} file") from None


def load_cluster(path: str) -> Cluster:
    """A cluster YAML (keys as the Cluster fields) -> Cluster; one-line errors name file and key."""
    raw = read_yaml(path, "cluster", "give the path of a cluster YAML (examples/clusters/)") or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: a cluster file is a mapping of keys (nodes, devices_per_node, device_flops, ...)")
    return cluster_from_mapping(raw, path)


DEVICES = ("cpu", "gpu")
_MAY_BE_ZERO = {"spmd_op_overhead_s", "host_sum_bandwidth", "host_sum_latency_s"}  # 0: not measured / none
# The most devices a cluster file may declare (nodes x devices_per_node): 2**20 = 1,048,576, several
# times the largest training clusters built (1e5-2e5 GPUs), so no real cluster is refused; and the
# enumeration stays bounded (a world below 2**20 has at most 240 divisors). Beyond it a typo
# (`nodes: 1e12`) would only enumerate for minutes.
MAX_WORLD = 2**20
# Every other figure, where not 0, lies in [FIGURE_MIN, FIGURE_MAX] (seconds, bytes, bytes/s, FLOP/s):
# a picosecond latency or a zettaFLOP/s device is a unit slip, and beyond these the model's quotients
# and sums overflow to inf (a table of inf step times and 0 tokens/s).
FIGURE_MIN, FIGURE_MAX = 1e-12, 1e21


def _number(value: object, integer: bool) -> float | int:
    """A cluster figure as a finite float (or an integer written as 2 or 2.0); ValueError otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError
    if integer and isinstance(value, int):
        return value  # exact, however large (checked against MAX_WORLD by the caller)
    try:
        x = float(value)  # a YAML string such as "1e12" (no dot) too
    except OverflowError:  # an integer beyond float's range
        raise ValueError from None
    if not math.isfinite(x) or (integer and x != int(x)):
        raise ValueError
    return int(x) if integer else x


def cluster_from_mapping(raw: dict, where: str) -> Cluster:
    """Cluster keys (a cluster file's, or a cluster written inline in a sites file) -> Cluster;
    one-line errors name `where` and the key. Integers may be written as 2.0, numbers as 1.5e14."""
    known = {f: type(v) for f, v in asdict(Cluster()).items()}
    values = {}
    for key, value in raw.items():
        if key not in known:
            raise ConfigError(f"{where}: unknown key {key!r}; known keys: {', '.join(known)}")
        if key == "device" and value not in DEVICES:
            raise ConfigError(f"{where}: device={value!r} must be one of {', '.join(DEVICES)}")
        kind = known[key]
        if kind is str:
            values[key] = str(value)
            continue
        shown = _count(value) if isinstance(value, int) and not isinstance(value, bool) else repr(value)
        try:
            values[key] = _number(value, kind is int)
        except ValueError:
            what = "an integer" if kind is int else "a finite number"
            raise ConfigError(f"{where}: {key}={shown} must be {what}") from None
        x = values[key]
        if not (x > 0 or (key in _MAY_BE_ZERO and x == 0)):
            raise ConfigError(f"{where}: {key}={shown} must be > 0")
        if kind is float and x and not FIGURE_MIN <= x <= FIGURE_MAX:
            raise ConfigError(
                f"{where}: {key}={shown} is out of range: figures are SI units (seconds, bytes, bytes/s, "
                f"FLOP/s) in [{FIGURE_MIN:g}, {FIGURE_MAX:g}]; check the unit of {key}"
            )
    cluster = Cluster(**values)
    if cluster.world > MAX_WORLD:
        raise ConfigError(
            f"{where}: nodes={_count(cluster.nodes)} x devices_per_node={_count(cluster.devices_per_node)} = "
            f"{_count(cluster.world)} devices, more than the {MAX_WORLD} (2**20) the planner takes; lower nodes "
            "or devices_per_node"
        )
    return cluster


def _count(n: int) -> str:
    """n for a message: exact up to 15 digits, else 1.2e+40 (an integer of any size)."""
    digits = str(n)
    return digits if len(digits) <= 15 else f"{digits[0]}.{digits[1]}e+{len(digits) - 1}"


@dataclass(frozen=True)
class Workload:
    """What one optimizer step trains: global batch (sequences) x sequence length."""

    global_batch: int
    seq_len: int
    fused_attention: bool = False  # GPU flash attention keeps no [S, S] scores
    # the stage's loss sums over rows (pretrain, SFT, Distill, VL-SFT): a layout that only splits
    # the batch runs as whole-model replicas on plain tensors, with one gradient sum per step
    replicas: bool = True
    # the head's loss chunk by chunk without the batch's logits (fused_head_loss: pretrain, SFT and
    # VL-SFT on the CPU, outside DistTensor and pipeline layouts): one chunk's logits instead of
    # 3 x [mb, S, V]
    fused_head: bool = False
    # fine_tuning: LoRA: what the adapters train (lora_cost.py); the base is frozen. None: every
    # parameter trains
    lora: Adapters | None = None
    # image placeholder tokens per sequence (VL): what the vision adapters run on (the frozen vision
    # model's own compute is not modelled)
    image_tokens: float = 0.0


# ---- the model's costs ----------------------------------------------------------------------
@dataclass(frozen=True)
class LayerCost:
    """One decoder layer, per token: forward FLOPs (parts), parameters, saved float32 elements."""

    attn_flops: float  # projections
    core_flops_per_s: float  # softmax(qk)v, times the sequence length
    mlp_flops: float  # active MLP / experts (k of E) + shared experts + router
    attn_params: int
    mlp_params: int  # all experts
    expert_params: (
        int  # of mlp_params: routed experts (split by ep, and by tp over their width, as runtime places them)
    )
    attn_saved: float  # saved elements outside the [S, S] part; split over tp but for `attn_saved_whole`
    core_saved_per_s: float  # the attention probabilities: heads per position
    mlp_saved: float  # split over tp but for `mlp_saved_whole`
    other_saved: float  # residual adds, norms' inputs
    ops: int  # op launches forward (backward counted twice that)
    moe_k: int = 0
    is_moe: bool = False
    num_experts: int = 0
    routed_per_token: int = 0  # weights one token's routed experts multiply (the larger modality's size)
    router_params: int = 0  # of mlp_params: the routers (whole on every tp rank)
    # held, never trained (stop_gradient; the aux-loss-free balancing moves it): the routers'
    # e_score_correction_bias, E per MoE layer, whole on every tp rank
    frozen_params: int = 0
    # of mlp_saved: what every tp rank keeps whole (a MoE layer's tensors of width H, E or k, which
    # each tp rank computes on the same tokens: `moe_saved`; a dense MLP's of width H: `dense_mlp_saved`)
    mlp_saved_whole: float = 0.0
    # of attn_saved: what every tp rank keeps whole (`attention_saved`; LoRA: lora_cost.py)
    attn_saved_whole: float = 0.0


def layer_costs(c) -> list[LayerCost]:
    """LayerCost of every layer of an Ernie4_5Config (dense or MoE)."""
    H, q, kv = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    attn_params = _attn_params(c)
    out = []
    for i in range(c.num_hidden_layers):
        common = dict(
            attn_flops=2.0 * attn_params,
            core_flops_per_s=4.0 * q,
            attn_params=attn_params,
            attn_saved=sum(attention_saved(H, q, kv)),
            attn_saved_whole=attention_saved(H, q, kv)[0],
            core_saved_per_s=float(c.num_attention_heads),
            other_saved=2.0 * H,
        )
        if c.is_moe and c.is_moe_layer(i):
            # expert groups per modality (ERNIE-4.5-VL: text and vision experts of different sizes);
            # a token runs k experts of its own group: the larger size bounds its cost
            k, E, inter = c.moe_k, c.total_experts, max(c.expert_sizes)
            shared = c.moe_num_shared_experts * c.expert_sizes[0]
            routed = k * 3 * H * inter
            experts = sum(n * 3 * H * size for n, size in zip(c.experts_per_modality, c.expert_sizes))
            out.append(
                LayerCost(
                    **common,
                    mlp_flops=2.0 * (routed + 3 * H * shared + H * E),
                    mlp_params=experts + 3 * H * shared + H * E,
                    expert_params=experts,
                    mlp_saved=sum(moe_saved(H, E, k, inter, shared)),
                    mlp_saved_whole=moe_saved(H, E, k, inter, shared)[0],
                    ops=60,
                    moe_k=k,
                    is_moe=True,
                    num_experts=E,
                    routed_per_token=routed,
                    router_params=H * E,
                    frozen_params=E,
                )
            )
        else:
            I = c.intermediate_size
            out.append(
                LayerCost(
                    **common,
                    mlp_flops=2.0 * 3 * H * I,
                    mlp_params=3 * H * I,
                    expert_params=0,
                    mlp_saved=sum(dense_mlp_saved(H, I)),
                    mlp_saved_whole=dense_mlp_saved(H, I)[0],
                    ops=30,
                )
            )
    return out


def attention_saved(H: int, q: int, kv: int) -> tuple[float, float]:
    """(whole on every tp rank, split over tp) float32 elements per token the attention block keeps
    for the backward, outside its [S, S] part: 2H + 3q + 3kv + H in all. Measured at tp=2 (runtime.py's
    placements, 2 processes: tools/measure_saved_activations.py --launch, docs/planner.md): each tp
    rank keeps whole the tensors of width H (the block's input, the norm's normalized input and
    output; o_proj's output is a partial sum of width H, freed by the residual add); the q- and
    kv-wide ones are split with the heads (rope's cos and sin broadcast there, nn/attention.py)."""
    return 3 * H, 3 * q + 3 * kv


def dense_mlp_saved(H: int, I: int) -> tuple[float, float]:
    """(whole on every tp rank, split over tp) float32 elements per token a dense MLP keeps for the
    backward: its norm's of width H whole, gate, up, their SwiGLU and product (4I) split (measured at
    tp=2 as `attention_saved`)."""
    return 2 * H, 4 * I


def moe_saved(H: int, E: int, k: int, inter: int, shared: int) -> tuple[float, float]:
    """(whole on every tp rank, split over tp) float32 elements per token a MoE layer's forward keeps
    for the backward. Routed experts split over tp by width (local_experts.py) run every tp rank's
    slice on the same tokens, so only their width-`inter` activations are split: the whole part is
    the block's input and the routed, shared and combined outputs [T, H] (4H; the routed ones are
    partial sums before the tp all-reduce), the routing tensors (3E), the dispatched rows and the
    experts' outputs [T x k, H] (2kH); the split part the routed experts' gate, up and SwiGLU
    activations (4k inter) and the shared experts' (4 shared, as a dense MLP's). One process running
    a tp=2 rank's slices keeps half of the split part and all of the rest (docs/planner.md)."""
    return 4 * H + 3 * E + 2 * k * H, 4 * k * inter + 4 * shared


def _attn_params(c) -> int:
    """q, k, v and o of one decoder layer (no biases: use_bias is not counted)."""
    H, q, kv = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    return H * (q + 2 * kv) + q * H


def mtp_params(c) -> tuple[int, int]:
    """(split over tp, whole on every tp rank) parameters of the MTP depths (erniekit/nn/mtp.py):
    each a dense decoder layer (its projections split; its two norms whole), an embedding and a
    hidden norm and the 2H -> H input projection (whole: runtime.py splits no `mtp_linear_proj`)."""
    d, H = getattr(c, "num_nextn_predict_layers", 0), c.hidden_size
    return d * (_attn_params(c) + 3 * H * c.intermediate_size), d * (4 * H + 2 * H * H)


@dataclass(frozen=True)
class ParamCounts:
    """The model's parameters by how erniekit/distributed/collective/runtime.py `param_placements`
    places them over tp, which sets each part's share on a rank."""

    split: int  # over tp: projections (attention, dense MLP, shared experts, MTP blocks), embedding, untied head
    whole: int  # on every tp rank: norms, routers, the MTP input projections, the vision model
    experts: int  # routed experts: split over tp (their width) and over ep (by expert)
    frozen: int  # held, never trained, whole on every tp rank: the routers' e_score_correction_bias

    @property
    def total(self) -> int:
        return self.split + self.whole + self.experts + self.frozen

    def on_rank(self, p: Plan, trained_only: bool = False) -> float:
        """One rank's share (a pipeline stage taken as 1 / pp of each part); trained_only: without
        the frozen ones."""
        whole = self.whole + (0 if trained_only else self.frozen)
        return self.split / (p.tp * p.pp) + whole / p.pp + self.experts / (p.tp * p.pp * p.ep)


def param_counts(c) -> ParamCounts:
    """Every parameter of the model built from Ernie4_5Config `c` (no biases: use_bias is not
    counted), by placement over tp."""
    layers = layer_costs(c)
    H, V = c.hidden_size, c.vocab_size
    mtp_split, mtp_whole = mtp_params(c)
    routers = sum(l.router_params for l in layers)
    split = sum(l.attn_params + l.mlp_params - l.expert_params for l in layers) - routers
    return ParamCounts(
        split=split + V * H * (1 if c.tie_word_embeddings else 2) + mtp_split,
        whole=routers + (2 * len(layers) + 1) * H + vision_params(c) + mtp_whole,
        experts=sum(l.expert_params for l in layers),
        frozen=sum(l.frozen_params for l in layers),
    )


def vision_params(c) -> int:
    """Parameters of a VL model's vision transformer and resampler (0 for a text model); their
    compute is not modelled (a workload says nothing of its images)."""
    v = getattr(c, "vision", None)
    if v is None:
        return 0
    d, inner, H = v.hidden_size, v.intermediate_size, c.hidden_size
    block = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + (d * inner + inner) + (inner * d + d)
    vit = v.in_channels * v.patch_size**2 * d + v.depth * block + 2 * d
    sp = d * v.spatial_merge_size**2
    spatial = 2 * (sp * sp + sp) + 2 * sp
    temporal = (sp * v.temporal_merge_size * sp + sp) + (sp * sp + sp) + 2 * sp
    return vit + spatial + temporal + sp * H + H + H


# ---- a layout and its prediction ------------------------------------------------------------
@dataclass(frozen=True)
class Plan:
    dp: int  # data ranks (with sharding: the ranks that shard)
    tp: int
    pp: int
    ep: int
    sharding_stage: int
    recompute: str
    micro_batch: int
    accumulation: int

    def describe(self) -> str:
        parts = [f"dp={self.dp}", f"tp={self.tp}", f"pp={self.pp}", f"ep={self.ep}"]
        if self.sharding_stage:
            parts.append(f"zero{self.sharding_stage}")
        parts.append(f"rc={self.recompute}")
        parts.append(f"mb={self.micro_batch}x{self.accumulation}")
        return " ".join(parts)

    def config_overrides(self) -> dict[str, object]:
        """The training-config keys that apply this plan."""
        out: dict[str, object] = {
            "tensor_parallel_degree": self.tp,
            "pipeline_parallel_degree": self.pp,
            "expert_parallel_degree": self.ep,
            "per_device_train_batch_size": self.micro_batch,
            "gradient_accumulation_steps": self.accumulation,
            "recompute": self.recompute != "none",
            "sharding": f"stage{self.sharding_stage}" if self.sharding_stage else "",
            "data_parallel_degree": -1,
            "sharding_parallel_degree": 1,
        }
        if self.recompute != "none":
            out["recompute_granularity"] = self.recompute
        return out


@dataclass
class Prediction:
    plan: Plan
    step_s: float
    memory: float  # peak bytes on the fullest device
    parts: dict[str, float] = field(default_factory=dict)  # seconds and bytes by cause
    fits: bool = True
    why: str = ""  # when it does not fit or cannot run
    refused: str = ""  # why `erniekit train` refuses this layout for the config planned (config_refusal)

    @property
    def tokens_per_s(self) -> float:
        return self.parts.get("tokens", 0.0) / self.step_s if self.step_s else 0.0


def _link(cluster: Cluster, group: int, span_nodes: bool) -> tuple[float, float]:
    """(bandwidth, latency) of a collective group."""
    if span_nodes:
        return cluster.inter_node_bandwidth, cluster.inter_node_latency_s
    return cluster.intra_node_bandwidth, cluster.intra_node_latency_s


def _allreduce_s(nbytes: float, n: int, bw: float, lat: float, calls: int = 1) -> float:
    if n <= 1:
        return 0.0
    return calls * lat + 2.0 * (n - 1) / n * nbytes / bw


def predict(c, cluster: Cluster, work: Workload, p: Plan) -> Prediction:
    """Step time and peak memory of plan `p` for model config `c` (see the module docstring)."""
    lora = work.lora
    base = layer_costs(c)
    gpu = cluster.device == "gpu"
    layers = _with_adapters(base, lora, p.ep, gpu)
    L, S, H, V = len(layers), work.seq_len, c.hidden_size, c.vocab_size
    tokens = work.global_batch * S
    outside = _outside_adapters(lora, work, gpu)  # the MTP blocks' and vision model's adapters, per token
    # ---- compute
    attn = sum(l.attn_flops + l.core_flops_per_s * S for l in layers)
    core = sum(l.core_flops_per_s * S for l in layers)
    mlp = sum(l.mlp_flops for l in layers)
    head = 2.0 * H * V + (lora.head_flops + outside.flops if lora else 0.0)
    fwd = (attn + mlp + head) * tokens
    again = {"none": 0.0, "core_attn": core, "full_attn": attn, "mlp": mlp, "full": attn + mlp}[p.recompute] * tokens
    flops = 3 * fwd + again
    if lora:  # frozen weights: the backward computes their inputs' gradients (1 x forward), not theirs
        flops -= _weight_flops(base, H, V) * tokens
        flops += lora.dora_flops * p.accumulation * p.dp  # DoRA's column norms: every forward of every replica
    workers = p.dp * p.tp * p.pp
    # routed experts split over tp by width (runtime.py): each tp rank runs 1/tp of their GEMMs, as of
    # the rest; their adapters' tensors whole on every tp rank run in full on each
    flops += (p.tp - 1) * _whole_adapter_flops(lora, p.recompute) * tokens
    m = p.accumulation
    bubble = (m + p.pp - 1) / m
    ops_per_micro = sum(l.ops for l in layers) / p.pp + 10 + outside.ops  # + embedding/head/loss
    ops_again = {"none": 0, "core_attn": 4, "full_attn": 12, "mlp": 20, "full": 30}[p.recompute] * L / p.pp
    ops_again += _adapter_ops_again(lora, p.recompute, p.ep) / p.pp
    replicas = _runs_as_replicas(p, work)
    # DistTensors: every multi-process layout but replicas and pipeline stages (plain tensors per stage)
    spmd = workers > 1 and p.pp == 1 and not replicas
    per_op = cluster.op_overhead_s + (cluster.spmd_op_overhead_s if spmd else 0.0)
    scores = _keeps_scores(c, p, work, spmd, S)
    if not scores:  # the backward computes q k^T again (the CPU kernel's statistics, flash attention)
        flops += 0.5 * core * tokens
    op_time = (3 * ops_per_micro + ops_again) * m * per_op
    # memory-bound ops (norms, activations, softmax, adds): traffic ~ what the forward writes (the
    # saved activations, per_token below, without recompute), read back once per backward pass;
    # recompute writes again what the forward did not keep
    written = _saved_per_token(layers, p.pp, p.tp, S, H, scores, "none")
    again_written = written - _saved_per_token(layers, p.pp, p.tp, S, H, scores, p.recompute)
    traffic = BYTES * (3 * written + again_written) * p.micro_batch * S * m
    traffic += _upcast_traffic(lora, p, gpu)
    compute = (flops / (workers * cluster.device_flops) + op_time + traffic / cluster.memory_bandwidth) * bubble
    # ---- communication (per step)
    per_node = cluster.devices_per_node
    tp_span = p.tp > per_node
    dp_span = p.tp * p.dp > per_node  # data ranks are strided by tp (tp innermost)
    counts = param_counts(c)
    tensors = _trained_tensors(c, layers)  # one all-reduce each
    # this rank's share of the model's parameters, and of those that train (LoRA: the adapters only,
    # which tp, pp and ep split as they split the modules they adapt)
    params = counts.on_rank(p)
    trainable = counts.on_rank(p, trained_only=True) if lora is None else _adapters_on_rank(lora, p)
    held = params + (trainable if lora else 0.0)  # the base and the adapters
    held_bytes = BYTES * held - _base_bytes_saved(lora, p)  # lora_base_dtype: the adapted base in 16 bits
    train_tensors = lora.tensors if lora else tensors
    all_tensors = tensors + (lora.tensors if lora else 0)
    bw, lat = _link(cluster, p.dp, dp_span)
    grad_bytes = BYTES * trainable
    if replicas and not dp_span and cluster.host_sum_bandwidth > 0:  # one sum through shared memory
        comm_dp = cluster.host_sum_latency_s + grad_bytes / cluster.host_sum_bandwidth
    else:  # replicas: the gradients in one buffer; DistTensors: one all-reduce per trained tensor
        comm_dp = _allreduce_s(grad_bytes, p.dp, bw, lat, calls=1 if replicas else math.ceil(train_tensors / p.pp))
    if p.sharding_stage and p.dp > 1:  # reduce-scatter + all-gather: the same bytes, twice the calls
        comm_dp += math.ceil(train_tensors / p.pp) * lat
    if p.sharding_stage == 3:  # every parameter (frozen too) gathered for the forward and again for the backward
        comm_dp += 2 * _allreduce_s(held_bytes / 2, p.dp, bw, lat, calls=math.ceil(all_tensors / p.pp))
    bw, lat = _link(cluster, p.tp, tp_span)
    act_bytes = BYTES * p.micro_batch * S * H
    comm_tp = (4 * L / p.pp + 2) * m * _allreduce_s(act_bytes, p.tp, bw, lat) if p.tp > 1 else 0.0
    comm_tp += sum(m * _allreduce_s(n, p.tp, bw, lat, calls) for n, calls in _expert_tp_sums(layers, lora, p, S, H))
    comm_ep = 0.0
    if p.ep > 1:
        bw, lat = _link(cluster, p.ep, p.tp * p.ep > per_node)
        moe_layers = sum(l.is_moe for l in layers) / p.pp
        a2a = BYTES * p.micro_batch * S * H * max(l.moe_k for l in layers) * (p.ep - 1) / p.ep
        comm_ep = 4 * moe_layers * m * (lat + a2a / bw)
    comm_pp = 0.0
    if p.pp > 1:
        bw, lat = _link(cluster, 2, p.tp * p.dp * p.pp > per_node)
        comm_pp = 2 * m * (lat + act_bytes / p.tp / bw)
    comm = comm_dp + comm_tp + comm_ep + comm_pp
    # ---- memory on the first pipeline stage (the fullest under 1F1B)
    shard = p.dp if p.sharding_stage else 1
    weights = held_bytes / (shard if p.sharding_stage == 3 else 1)
    grads = BYTES * trainable / (shard if p.sharding_stage >= 2 else 1)
    moments = 2 * BYTES * trainable / shard
    # the optimizer step (not in the bubble): AdamW reads weight, gradient and both moments and writes
    # three of them, the clip's norm reads the gradient again: 8 passes over this rank's trained
    # share, and one launch per trained tensor
    optimizer = 8 * BYTES * trainable / shard / cluster.memory_bandwidth + math.ceil(train_tensors / p.pp) * per_op
    compute += optimizer
    per_token = _saved_per_token(layers, p.pp, p.tp, S, H, scores, p.recompute) + outside.saved
    in_flight = min(p.pp, m)
    activations = BYTES * per_token * p.micro_batch * S * in_flight
    upcast_buffer = _upcast_buffer(lora, p, gpu)
    biggest_layer = max(
        _attn_saved_on_rank(l, p.tp, l.core_saved_per_s * S if scores else 0.0) + _mlp_saved_on_rank(l, p.tp)
        for l in layers
    )
    # the backward's working set: one layer's, or at its end the embedding's dense [V, H] gradient,
    # made whole and then added into the weight's (the tied head's dW, or an accumulated gradient);
    # none under LoRA (the embedding is frozen)
    embedding_grad = BYTES * V * H / p.tp if lora is None and (c.tie_word_embeddings or m > 1) else 0.0
    transient = max(BYTES * biggest_layer * p.micro_batch * S, embedding_grad, _dora_norm_bytes(lora, p))
    # (a pipeline's last stage and MTP read the whole logits)
    if work.fused_head and not spmd and p.pp == 1 and not getattr(c, "num_nextn_predict_layers", 0):
        # one chunk's logits, their gradient written over them; the head's dW, made in the forward,
        # waits beside an accumulated gradient for the backward (a frozen head, LoRA: no dW)
        head_dw = BYTES * V * H if m > 1 and lora is None else 0.0
        logits = BYTES * kernel_memory.chunk_rows(V, p.micro_batch * S) * V + head_dw
    else:
        logits = 3 * BYTES * p.micro_batch * S * V / p.tp
    sum_buffer = _sum_buffer(cluster, p, replicas, dp_span, grads)
    # the CPU heap's holes (glibc keeps freed blocks: erniekit/utils/malloc.py): a step's activations
    # and logits are freed during the backward and the holes they leave are split by the next
    # allocations, so a later step may need fresh heap for its own. Measured on dense-1024 at 1-32
    # rows, the resident peak exceeded the other terms by up to 0.98x the activations + logits; the
    # bound taken is 1x (docs/planner.md). GPU allocators were not measured
    slack = activations + logits if cluster.device == "cpu" else 0.0
    memory = weights + grads + moments + activations + transient + logits + sum_buffer + upcast_buffer + slack
    memory += cluster.memory_overhead
    parts = {
        "compute_s": compute,
        "optimizer_s": optimizer,
        "comm_dp_s": comm_dp,
        "comm_tp_s": comm_tp,
        "comm_ep_s": comm_ep,
        "comm_pp_s": comm_pp,
        "bubble": bubble,
        "tokens": float(tokens),
        "params_bytes": weights,
        "grads_bytes": grads,
        "moments_bytes": moments,
        "activations_bytes": activations,
        "logits_bytes": logits,
        "sum_buffer_bytes": sum_buffer,
        "upcast_buffer_bytes": upcast_buffer,
        "heap_slack_bytes": slack,
        "trainable_params": trainable,
        "comm_bytes": _comm_bytes(grad_bytes, held_bytes, act_bytes, p, L, layers, m, S, H, lora),
    }
    pred = Prediction(p, compute + comm, memory, parts)
    if memory > cluster.device_memory:
        pred.fits, pred.why = False, f"needs {memory / 1e9:.2f} GB per device, has {cluster.device_memory / 1e9:.2f}"
    return pred


def _with_adapters(layers: list[LayerCost], lora: Adapters | None, ep: int, gpu: bool = False) -> list[LayerCost]:
    """The layers' costs with what their LoRA adapters add per token (forward FLOPs, saved
    activations, op launches: the routed experts' per expert, of this rank's E / ep); the parameter
    counts stay the base's (the adapters' are apart). On a GPU a 16-bit base's GEMMs keep their
    input cast to it (lora_cost.LayerAdapters)."""
    if lora is None:
        return layers
    return [
        replace(
            l,
            attn_flops=l.attn_flops + a.attn_flops,
            mlp_flops=l.mlp_flops + a.mlp_flops,
            routed_per_token=l.routed_per_token + a.routed,
            attn_saved=l.attn_saved + a.attn_saved + (a.attn_cast_saved if gpu else 0.0),
            mlp_saved=l.mlp_saved + a.mlp_saved + (a.mlp_cast_saved if gpu else 0.0),
            attn_saved_whole=l.attn_saved_whole + a.attn_saved_whole + (a.attn_cast_saved_whole if gpu else 0.0),
            mlp_saved_whole=l.mlp_saved_whole + a.mlp_saved_whole + (a.mlp_cast_saved_whole if gpu else 0.0),
            ops=l.ops + a.attn_ops + a.mlp_ops + a.expert_ops / ep,
        )
        for l, a in zip(layers, lora.layers, strict=True)
    ]


@dataclass(frozen=True)
class _Outside:
    """The adapters outside the trunk's layers, per text token: forward FLOPs, saved float32
    elements, op launches per micro-batch."""

    flops: float = 0.0
    saved: float = 0.0
    ops: float = 0.0


def _outside_adapters(lora: Adapters | None, work: Workload, gpu: bool) -> _Outside:
    """The MTP blocks' adapters (every token runs them) and the vision model's (per image token:
    `work.image_tokens` of each sequence); their frozen base's compute is not modelled, in LoRA
    as in a full fine-tune."""
    if lora is None:
        return _Outside()
    share = work.image_tokens / work.seq_len
    flops = saved = ops = 0.0
    for a, per_token in ((lora.mtp, 1.0), (lora.vision, share)):
        flops += (a.attn_flops + a.mlp_flops) * per_token
        cast = a.attn_cast_saved + a.mlp_cast_saved if gpu else 0.0
        saved += (a.attn_saved + a.mlp_saved + cast) * per_token
        ops += (a.attn_ops + a.mlp_ops) if per_token else 0
    return _Outside(flops, saved, ops)


def _base_bytes_saved(lora: Adapters | None, p: Plan) -> float:
    """What holding the adapted base weights in lora_base_dtype saves on this rank (0: float32)."""
    if lora is None:
        return 0.0
    return (BYTES - lora.base_bytes) * _adapted_base_on_rank(lora, p)


def _upcast_total(lora: Adapters | None, p: Plan) -> float:
    """float32 elements a CPU rank upcasts per pass of a micro-batch from a 16-bit base (every adapted
    weight of its share: erniekit/nn/lora.py `_UpcastMatmul` casts the weight for each GEMM)."""
    if lora is None or lora.base_bytes == BYTES:
        return 0.0
    return _adapted_base_on_rank(lora, p)


def _adapted_base_on_rank(lora: Adapters, p: Plan) -> float:
    """This rank's share of the adapted base weights: split over tp as runtime.py places them (the
    vision model's and the MTP input projections whole), over pp, routed experts' over ep."""
    split = lora.base_dense - lora.base_dense_whole
    return ParamCounts(split, lora.base_dense_whole, lora.base_experts, frozen=0).on_rank(p)


def _upcast_traffic(lora: Adapters | None, p: Plan, gpu: bool) -> float:
    """Bytes the CPU's upcasts move per step: the 16-bit weight read, its float32 copy written, in the
    forward and again in the backward (`_UpcastMatmul` keeps the 16-bit weight only), and a third time
    for the recomputed parts' weights (their forward runs again)."""
    if gpu or not _upcast_total(lora, p):
        return 0.0
    passes = 2 * _upcast_total(lora, p) + _upcast_recomputed(lora, p)
    return (lora.base_bytes + BYTES) * passes * p.accumulation


def _upcast_recomputed(lora: Adapters, p: Plan) -> float:
    """This rank's adapted base elements in the parts `p.recompute` runs forward again (the head, MTP
    and vision modules never are; core attention has no adapted weight)."""
    split = p.tp * p.pp
    attn = sum(a.attn_upcast for a in lora.layers) / split
    mlp = sum(a.mlp_upcast / split + a.expert_upcast / (split * p.ep) for a in lora.layers)
    return {"none": 0.0, "core_attn": 0.0, "full_attn": attn, "mlp": mlp, "full": attn + mlp}[p.recompute]


def _upcast_buffer(lora: Adapters | None, p: Plan, gpu: bool) -> float:
    """Bytes of the one float32 buffer a CPU rank upcasts a 16-bit base into (erniekit/nn/lora.py
    `_upcast`: per thread, grown to the largest adapted weight and reused by every call, so nothing
    per micro-batch): a Linear's weight over tp where runtime.py splits it, one routed expert's over tp.
    A float16 base takes Paddle's cast, a block freed after each GEMM: the same bytes at a time.
    Model-wide: LoRA runs no pipeline, so every rank holds the largest."""
    if gpu or not _upcast_total(lora, p):
        return 0.0
    largest = max(lora.base_largest / p.tp, lora.base_largest_whole, lora.base_largest_expert / p.tp)
    return BYTES * largest


def _dora_norm_bytes(lora: Adapters | None, p: Plan) -> float:
    """DoRA's norm working set, W + s A B of the largest adapted module (no gradient, freed after):
    a Linear split over tp, a routed-experts projection over ep and tp."""
    if lora is None:
        return 0.0
    return max(lora.dora_transient / p.tp, lora.dora_transient_experts / (p.tp * p.ep))


def _adapters_on_rank(lora: Adapters, p: Plan) -> float:
    """This rank's share of the adapters: over tp as runtime.py places them (lora_cost.py
    `linear_whole_over_tp`, `expert_adapter_split`), over pp, routed experts' over ep."""
    dense = (lora.params_dense - lora.params_dense_whole) / (p.tp * p.pp) + lora.params_dense_whole / p.pp
    whole = lora.params_experts - lora.params_experts_split
    return dense + whole / (p.pp * p.ep) + lora.params_experts_split / (p.tp * p.pp * p.ep)


def _whole_adapter_flops(lora: Adapters | None, recompute: str) -> float:
    """FLOPs per token, forward + backward (+ recompute's forward), of the routed experts' adapter
    tensors whole on every tp rank (gate/up A, down B): each tp rank runs them in full."""
    if lora is None:
        return 0.0
    passes = 3 + (1 if recompute in ("mlp", "full") else 0)
    return passes * sum(2.0 * a.routed_whole for a in lora.layers)


def _expert_tp_sums(layers: list[LayerCost], lora: Adapters | None, p: Plan, S: int, H: int) -> list[tuple[float, int]]:
    """(bytes, calls) of the all-reduces over tp a micro-batch adds for routed experts split by
    width (erniekit/distributed/collective/local_experts.py), on this stage: per MoE layer the
    experts' partial output [tokens, H] (forward, again under mlp / full recompute), its input's
    gradient [tokens, H] and the gate weights' [tokens, k] (backward); LoRA: the gradients of the
    expert adapter tensors whole on every tp rank, one call per tensor."""
    moe = [l for l in layers[: math.ceil(len(layers) / p.pp)] if l.is_moe]
    if p.tp == 1 or not moe:
        return []
    rows = p.micro_batch * S
    hidden = (2 + (1 if p.recompute in ("mlp", "full") else 0)) * len(moe)
    out = [(BYTES * rows * H * hidden, hidden), (BYTES * rows * sum(l.moe_k for l in moe), len(moe))]
    if lora is not None and lora.tensors_experts_whole:
        whole = lora.params_experts - lora.params_experts_split
        out.append((BYTES * whole / (p.pp * p.ep), math.ceil(lora.tensors_experts_whole / p.pp)))
    return out


def _trained_tensors(c, layers: list[LayerCost]) -> int:
    """Trained parameter tensors of a full fine-tune: 9 per dense layer, 12 per MoE layer (router,
    three routed stacks, three shared), the embedding and final norm, 12 per MTP depth (its layer's
    9, two norms, the input projection); the vision model's are not counted."""
    return 9 * len(layers) + 2 + sum(3 for l in layers if l.is_moe) + 12 * getattr(c, "num_nextn_predict_layers", 0)


def _weight_flops(layers: list[LayerCost], H: int, V: int) -> float:
    """Forward FLOPs per token of the products by weights (projections, MLP / experts, router, head):
    the weight-gradient half of their backward, which frozen weights skip."""
    return sum(l.attn_flops + l.mlp_flops for l in layers) + 2.0 * H * V


def _adapter_ops_again(lora: Adapters | None, recompute: str, ep: int) -> float:
    """The adapters' op launches a recompute mode runs again (those of the recomputed attention / MLP)."""
    if lora is None:
        return 0.0
    attn = sum(a.attn_ops for a in lora.layers)
    mlp = sum(a.mlp_ops + a.expert_ops / ep for a in lora.layers)
    return {"none": 0, "core_attn": 0, "full_attn": attn, "mlp": mlp, "full": attn + mlp}[recompute]


def _layout(p: Plan):
    """The launch's Layout of plan p (its data ranks shard when p has a sharding stage)."""
    from erniekit.distributed.collective.layout import Layout

    return Layout(
        pp=p.pp,
        dp=1 if p.sharding_stage else p.dp,
        sharding=p.dp if p.sharding_stage else 1,
        tp=p.tp,
        ep=p.ep,
        sharding_stage=p.sharding_stage,
    )


def _runs_as_replicas(p: Plan, work: Workload) -> bool:
    """Whole-model replicas on plain tensors: `Layout.data_only`, for a stage whose loss sums over rows."""
    return work.replicas and _layout(p).data_only


def _sum_buffer(cluster: Cluster, p: Plan, replicas: bool, dp_span: bool, grads: float) -> float:
    """What whole-model replicas hold to sum their gradients (erniekit/distributed/collective/replicas.py),
    beside the gradients themselves. On one CPU host: this rank's slot of the shared mapping, which it
    fills, and its chunk of every other slot, which it sums and writes back (host_sum.py): (2 - 1/dp)
    x the gradients, kept between steps. CPU ranks on several hosts: gloo's buffer, a numpy copy of the
    gradients kept between steps. GPU: Paddle's concat of the gradients and the split back, for the
    length of the sum. All three counted from the code; on 2 CPU ranks sharing memory (dense-1024)
    the measured peaks agree (docs/planner.md), gloo and GPUs were not measured."""
    if not replicas or p.dp == 1:
        return 0.0
    if cluster.device == "gpu":
        return 2.0 * grads
    return grads * (1.0 if dp_span else 2.0 - 1.0 / p.dp)


def _keeps_scores(c, p: Plan, work: Workload, spmd: bool, S: int) -> bool:
    """Whether the layers keep their [heads, S, S] probabilities for the backward: GPU flash attention
    (`work.fused_attention`) never does; Paddle's math path (DistTensors, heads not a multiple of 16
    wide) always; the CPU kernel only while a micro-batch's are small (nn/kernel_memory.py)."""
    if work.fused_attention:
        return False
    if spmd or not kernel_memory.kernel_head_dim(c.head_dim):
        return True
    return kernel_memory.keeps_probs(p.micro_batch, c.num_attention_heads, S, S)


def _saved_per_token(layers, pp: int, tp: int, S: int, H: int, scores: bool, recompute: str) -> float:
    """float32 elements per token the first pipeline stage's layers keep for the backward (`scores`:
    with the attention's [heads, S, S] probabilities)."""
    out = 0.0
    for l in layers[: math.ceil(len(layers) / pp)]:
        core_s = l.core_saved_per_s * S if scores else 0.0
        attn_s = _attn_saved_on_rank(l, tp, core_s)
        mlp_s = _mlp_saved_on_rank(l, tp)
        out += {
            "none": attn_s + mlp_s + l.other_saved,
            "core_attn": attn_s - core_s / tp + 3 * H / tp + mlp_s + l.other_saved,
            "full_attn": H + mlp_s + l.other_saved,
            "mlp": attn_s + H + l.other_saved,
            "full": H,
        }[recompute]
    return out


def _attn_saved_on_rank(l: LayerCost, tp: int, core_s: float) -> float:
    """A tp rank's share of the attention's saved elements per token, with `core_s` of [S, S]
    probabilities (split with the heads): `attn_saved_whole` on every rank."""
    return (l.attn_saved - l.attn_saved_whole + core_s) / tp + l.attn_saved_whole


def _mlp_saved_on_rank(l: LayerCost, tp: int) -> float:
    """A tp rank's share of the MLP's saved elements per token: the MoE's whole part on every rank."""
    return (l.mlp_saved - l.mlp_saved_whole) / tp + l.mlp_saved_whole


def _comm_bytes(
    grad_bytes: float,
    param_bytes: float,
    act_bytes: float,
    p: Plan,
    L: int,
    layers,
    m: int,
    S: int,
    H: int,
    lora: Adapters | None = None,
) -> float:
    """Bytes one device sends per step (ring collectives: 2(n-1)/n of the buffer); stage 3 adds the
    parameters' gathers, counted at twice the buffer (forward and backward)."""
    gathers = 2 * param_bytes if p.sharding_stage == 3 else 0.0
    out = 2.0 * (p.dp - 1) / p.dp * (grad_bytes + gathers) if p.dp > 1 else 0.0
    if p.tp > 1:
        out += (4 * L / p.pp + 2) * m * 2.0 * (p.tp - 1) / p.tp * act_bytes
        out += sum(m * 2.0 * (p.tp - 1) / p.tp * n for n, _ in _expert_tp_sums(layers, lora, p, S, H))
    if p.ep > 1:
        k = max(l.moe_k for l in layers)
        out += 4 * sum(l.is_moe for l in layers) / p.pp * m * act_bytes * k * (p.ep - 1) / p.ep
    if p.pp > 1:
        out += 2 * m * act_bytes / p.tp
    return out


# ---- enumeration ----------------------------------------------------------------------------
@functools.lru_cache(maxsize=1024)
def _divisors(n: int) -> tuple[int, ...]:
    """The divisors of n, ascending, in O(sqrt(n)): each d <= sqrt(n) with its pair n // d."""
    small, large = [], []
    for d in range(1, math.isqrt(n) + 1 if n > 0 else 1):
        if n % d == 0:
            small.append(d)
            if d != n // d:
                large.append(n // d)
    return tuple(small + large[::-1])


def why_not(c, p: Plan, fp8_block: int = 0) -> str:
    """'' when plan p splits the model and batch evenly, else the reason: the same checks as a launch
    (`layout.check_model_fits`; fp8_block: the run's fp8_block_size, 0 without FP8, which must tile
    each tp rank's slice of the experts). What this version does not run for a config is
    `config_refusal`'s."""
    from erniekit.distributed.collective.layout import check_model_fits

    if p.ep not in (1, p.dp):
        return f"ep={p.ep} is neither 1 nor the {p.dp} data ranks"
    try:
        check_model_fits(_layout(p), c, fp8_block=fp8_block)
    except ConfigError as e:
        return str(e)
    return ""


def enumerate_plans(
    c,
    world: int,
    work: Workload,
    micro_batches: list[int] | None = None,
    recompute_modes: tuple[str, ...] = RECOMPUTE_MODES,
    sharding_stages: tuple[int, ...] = (0, 1, 2, 3),
    pipeline: bool = True,
) -> list[Plan]:
    """Every (dp, tp, pp, ep, sharding, recompute, micro-batch) for `world` devices that splits the
    model and the global batch evenly. pipeline=False: pp = 1 only (a config the pipeline cannot run)."""
    plans = []
    for tp, pp in itertools.product(_divisors(world), _divisors(world)):
        if world % (tp * pp) or (pp > 1 and not pipeline):
            continue
        if tp > c.num_attention_heads or pp > c.num_hidden_layers:
            continue  # tp divides the heads, pp is at most the layers (check_model_fits): skip the inner loop
        dp = world // (tp * pp)
        if work.global_batch % dp:
            continue
        per_rank = work.global_batch // dp
        mbs = [b for b in (micro_batches or _divisors(per_rank)) if per_rank % b == 0]
        eps = [1, dp] if c.is_moe and dp > 1 else [1]  # experts split over all data ranks, or none
        for ep, stage, rc, mb in itertools.product(eps, sharding_stages, recompute_modes, mbs):
            if stage and dp == 1:
                continue
            p = Plan(dp, tp, pp, ep, stage, rc, mb, per_rank // mb)
            if p.pp > 1 and p.accumulation < p.pp:
                continue  # 1F1B needs at least pp micro-batches per step
            if not why_not(c, p):
                plans.append(p)
    return plans


def plan(c, cluster: Cluster, work: Workload, **kw) -> list[Prediction]:
    """Predictions for every plan that splits the model and batch evenly, fitting ones first, fastest
    first (ties: less memory); what runs follows the cluster's `device`. Which of them `erniekit
    train` runs for a config is `config_refusal`'s to say."""
    preds = [predict(c, cluster, work, p) for p in enumerate_plans(c, cluster.world, work, **kw)]
    preds.sort(key=lambda r: (not r.fits, r.step_s, r.memory))
    return preds


def best_plan(
    c,
    cluster: Cluster,
    work: Workload,
    pipeline: bool = True,
    refusal: Callable[[Plan], str] | None = None,
) -> Prediction:
    """The fastest plan that fits and `refusal` (config_refusal) does not refuse; ConfigError naming
    the smallest need when none fits, or the fastest fitting layout's refusal when only refused ones fit.
    Without `refusal` every layout that splits the model counts, runnable by this version or not."""
    preds = plan(c, cluster, work, pipeline=pipeline)
    if refusal is not None and preds:
        preds = _runnable(preds, refusal, cluster.world)
    if not preds:
        raise ConfigError(
            f"no layout of {cluster.world} devices splits this model and a global batch of "
            f"{work.global_batch} evenly; change the batch size or the cluster"
        )
    if not preds[0].fits:
        low = min(preds, key=lambda r: r.memory)
        raise ConfigError(
            f"no layout fits in {cluster.device_memory / 1e9:.2f} GB per device (the least memory, "
            f"{low.plan.describe()}, needs {low.memory / 1e9:.2f} GB); add devices or memory, or "
            "shorten max_seq_len"
        )
    return preds[0]


def _note(r: Prediction) -> str:
    if r.refused:
        return "refused: " + r.refused
    return "" if r.fits else "does not fit: " + r.why


def _runnable(preds: list[Prediction], refusal: Callable[[Plan], str], world: int) -> list[Prediction]:
    """The predictions `refusal` does not refuse; ConfigError with a refusal when every layout is
    refused, or when none of the others fits but a refused one does."""
    marked = [(r, refusal(r.plan)) for r in preds]
    kept = [r for r, why in marked if not why]
    if not kept:
        raise ConfigError(f"erniekit train refuses every layout of {world} devices for this config: {marked[0][1]}")
    fitting = next((why for r, why in marked if why and r.fits), "")
    if fitting and not any(r.fits for r in kept):
        raise ConfigError(
            f"every layout of {world} devices that fits is one erniekit train refuses for this config; "
            f"the fastest: {fitting}"
        )
    return kept


def format_table(preds: list[Prediction], top: int = 15) -> str:
    """Ranked plans as a text table."""
    head = f"{'#':>3}  {'layout':44s} {'step s':>9} {'tok/s':>9} {'mem GB':>7} {'compute':>8} {'comm':>8}  note"
    rows = [head, "-" * len(head)]
    for i, r in enumerate(preds[:top], 1):
        comm = sum(v for k, v in r.parts.items() if k.startswith("comm_") and k.endswith("_s"))
        rows.append(
            f"{i:>3}  {r.plan.describe():44s} {r.step_s:9.4f} {r.tokens_per_s:9.0f} {r.memory / 1e9:7.2f} "
            f"{r.parts['compute_s']:8.4f} {comm:8.4f}  {_note(r)}"
        )
    if len(preds) > top:
        rows.append(f"... {len(preds) - top} more (--top N)")
    return "\n".join(rows)


def workload_from_config(cfg, world: int | None = None, device: str = "cpu", model=None) -> Workload:
    """The global batch a training config asks for (per-device batch x accumulation x its data
    ranks), what its stage runs on `device` (a Cluster's: on "gpu" flash attention, whole logits),
    and with fine_tuning: LoRA the adapters it trains (on `model`, the model config; default: the
    config's, `model_config_of`)."""
    from erniekit.config.checks import fused_head_wanted, stage_supports
    from erniekit.distributed.collective.layout import layout_from_config

    lay = layout_from_config(cfg.parallelism, world)
    supports = stage_supports(cfg)
    return Workload(
        cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps * lay.dp * lay.sharding,
        cfg.max_seq_len,
        fused_attention=device == "gpu",
        replicas=supports.row_losses,
        fused_head=device == "cpu" and supports.fused_head and fused_head_wanted(cfg),
        **_lora_work(cfg, model),
    )


def _lora_work(cfg, model) -> dict:
    """A LoRA config's Workload fields: the adapters it trains on `model` (None: the config's model
    config) and a VL model's image tokens per sequence; none for Full."""
    if not trains_adapters(cfg):
        return {}
    c = model if model is not None else model_config_of(cfg)
    return {"lora": adapters_from_config(cfg, c), "image_tokens": image_tokens(cfg, c)}


def image_tokens(cfg, c) -> float:
    """Image tokens per sequence of a VL model, taken as one image of `image_max_pixels` (each
    (patch_size x spatial_merge_size)^2 pixels one token), at most the sequence; 0 for a text model.
    The data's own count is not read: it is a bound for rows of one image."""
    v = getattr(c, "vision", None)
    if v is None:
        return 0.0
    return float(min(cfg.max_seq_len, cfg.image_max_pixels // (v.patch_size * v.spatial_merge_size) ** 2))


def with_plan(cfg, p: Plan):
    """A copy of the training config that runs plan p."""
    return replace(cfg, **p.config_overrides())


def config_refusal(cfg, device: str, model=None) -> Callable[[Plan], str]:
    """Why `erniekit train` refuses a plan for this (normalised) training config on `device` ("cpu"
    or "gpu"); "" when it runs it: the checks train runs, in its order (config/checks.py
    layout_refusal, then train/model_checks.py's check_model_fits with the config's fp8_block_size
    on `model`, the model config; default: the config's, `model_config_of`)."""
    from erniekit.config.checks import layout_refusal

    fp8_block = cfg.expert_fp8_block
    c = (model if model is not None else model_config_of(cfg)) if fp8_block else None

    def refusal(p: Plan) -> str:
        why = layout_refusal(cfg, _layout(p), cuda=device == "gpu") or ""
        return why or (why_not(c, p, fp8_block) if fp8_block else "")

    return refusal


def model_config_of(cfg):
    """The model config a training config trains (preset or checkpoint config.json, plus
    model_overrides), without loading weights or paddle."""
    from erniekit.models.registry import model_config

    return model_config(cfg.model_name_or_path, cfg.model_overrides or None)


def auto_plan(cfg) -> Prediction:
    """`parallel: auto`: the best runnable plan for the config's model, global batch and cluster file
    (its device count must equal the launch's process count)."""
    from erniekit.distributed.collective.layout import world_size

    if not cfg.cluster:
        raise ConfigError(
            "parallel: auto needs cluster: FILE, a cluster description (examples/clusters/"
            "cpu-2core.yaml describes this kind of 2-core machine)"
        )
    cluster = load_cluster(cfg.cluster)
    world = world_size(cfg.parallelism)
    if cluster.world != world:
        raise ConfigError(
            f"cluster {cfg.cluster} has {cluster.world} devices (nodes x devices_per_node) but the "
            f"launch has {world} processes (nproc_per_node {cfg.nproc_per_node} x nnodes {cfg.nnodes}); "
            "make them equal"
        )
    from erniekit.config.checks import pipeline_refusal
    from erniekit.utils.device import cuda_visible

    runs_on = "gpu" if cuda_visible() else "cpu"
    if cluster.device != runs_on:  # the plan's attention, head and stage-3 rules would be the other kind's
        raise ConfigError(
            f"cluster {cfg.cluster} describes {cluster.device.upper()} devices (device: {cluster.device}) but this "
            f"run trains on the {runs_on.upper()}; describe this machine (device: {runs_on}, figures from "
            "tools/profile_cluster.py) or run where the file's devices are"
        )
    c = model_config_of(cfg)
    return best_plan(
        c,
        cluster,
        workload_from_config(cfg, device=runs_on, model=c),
        pipeline=pipeline_refusal(cfg) is None,  # not even enumerated
        refusal=config_refusal(cfg, runs_on, model=c),
    )
