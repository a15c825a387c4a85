"""ERNIE 4.5 weights and hyperparameters in GGUF terms: llama.cpp's `ernie4_5` (dense) and
`ernie4_5-moe` architectures, with the tensor names, shapes and metadata keys its converter
(convert_hf_to_gguf.py, Ernie4_5Model / Ernie4_5MoeModel) writes and src/models/ernie4-5*.cpp reads.

- Tensors keep the Hugging Face [out, in] layout (GGUF lists dimensions the other way round,
  {in, out}, which is what llama.cpp asks for). q/k are not permuted: ERNIE rotates interleaved
  pairs, llama.cpp's NORM rope type for both architectures.
- The E experts of a MoE layer are one [E, out, in] tensor per projection (`ffn_*_exps`); the
  correction bias is `exp_probs_b.bias` [E]; shared experts are `ffn_*_shexp`.
- llama.cpp makes every layer from `leading_dense_block_count` on a MoE layer, so a MoE layer
  interval other than 1, or dense layers after the last MoE layer, cannot be written (refused).
- The shared experts' width is written as it is (moe_intermediate_size x shared experts); the
  converter derives it as intermediate_size / num_key_value_heads, which gives the same number for
  the public checkpoints only.
- Multi-token-prediction heads are left out, as the converter does (llama.cpp does not run them).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from erniekit.errors import CheckpointError


def _gguf():
    import gguf

    return gguf


def arch_of(config):
    g = _gguf()
    return g.MODEL_ARCH.ERNIE4_5_MOE if config.is_moe else g.MODEL_ARCH.ERNIE4_5


def check_supported(config) -> None:
    """One CheckpointError naming the first setting llama.cpp's ERNIE 4.5 graph cannot run."""
    where = "export --format gguf"
    if config.model_type not in ("ernie4_5", "ernie4_5_moe") or config.num_modalities != 1:
        raise CheckpointError(
            f"{where}: only ERNIE 4.5 text models (dense or MoE) can be written, not {config.model_type}"
        )
    if config.use_bias:
        raise CheckpointError(f"{where}: use_bias=true: llama.cpp's ERNIE 4.5 has no q/k/v/MLP biases")
    if config.use_gpas:
        raise CheckpointError(f"{where}: use_gpas=true: llama.cpp does not run GPAS scaling")
    if config.is_moe and (config.moe_layer_interval != 1 or config.moe_layer_end_index < config.num_hidden_layers - 1):
        raise CheckpointError(
            f"{where}: moe_layer_interval={config.moe_layer_interval}, moe_layer_end_index="
            f"{config.moe_layer_end_index}: llama.cpp makes every layer from moe_layer_start_index on a MoE "
            "layer (needs interval 1 and the MoE layers running to the last layer)"
        )


def _tables():
    T = _gguf().MODEL_TENSOR
    top = {"model.embed_tokens.weight": T.TOKEN_EMBD, "model.norm.weight": T.OUTPUT_NORM, "lm_head.weight": T.OUTPUT}
    layer = {
        "input_layernorm.weight": T.ATTN_NORM,
        "self_attn.q_proj.weight": T.ATTN_Q,
        "self_attn.k_proj.weight": T.ATTN_K,
        "self_attn.v_proj.weight": T.ATTN_V,
        "self_attn.o_proj.weight": T.ATTN_OUT,
        "post_attention_layernorm.weight": T.FFN_NORM,
        "mlp.gate_proj.weight": T.FFN_GATE,
        "mlp.up_proj.weight": T.FFN_UP,
        "mlp.down_proj.weight": T.FFN_DOWN,
        "mlp.gate.weight": T.FFN_GATE_INP,
        "mlp.moe_statics.e_score_correction_bias": T.FFN_EXP_PROBS_B,
        "mlp.shared_experts.gate_proj.weight": T.FFN_GATE_SHEXP,
        "mlp.shared_experts.up_proj.weight": T.FFN_UP_SHEXP,
        "mlp.shared_experts.down_proj.weight": T.FFN_DOWN_SHEXP,
    }
    experts = {"gate_proj": T.FFN_GATE_EXP, "up_proj": T.FFN_UP_EXP, "down_proj": T.FFN_DOWN_EXP}
    return top, layer, experts


_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")
_EXPERT_RE = re.compile(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
_SKIPPED_RE = re.compile(r"model\.mtp")  # MTP heads: erniekit/models/ernie4_5/checkpoint.py names them model.mtp_*


def _name(tensor, config, bid: int | None = None) -> str:
    g = _gguf()
    if tensor not in g.MODEL_TENSORS[arch_of(config)]:
        raise CheckpointError(f"export --format gguf: llama.cpp's {arch_of(config).name} has no {tensor.name} tensor")
    suffix = "bias" if tensor == g.MODEL_TENSOR.FFN_EXP_PROBS_B else "weight"
    return g.TENSOR_NAMES[tensor].format(bid=bid) + "." + suffix


def gguf_name(hf: str, config) -> tuple[str, int | None] | None:
    """The GGUF tensor a Hugging Face-named tensor goes into, with its index in the stack for an
    expert (None otherwise); None for a tensor left out (MTP heads)."""
    if _SKIPPED_RE.match(hf):
        return None
    top, layer, experts = _tables()
    m = _LAYER_RE.fullmatch(hf)
    if hf in top:
        return _name(top[hf], config), None
    if m and m[2] in layer:
        return _name(layer[m[2]], config, int(m[1])), None
    if m and (e := _EXPERT_RE.fullmatch(m[2])):
        return _name(experts[e[2]], config, int(m[1])), int(e[1])
    raise CheckpointError(f"export --format gguf: no llama.cpp tensor for {hf}")


@dataclass(frozen=True)
class PlannedTensor:
    """One tensor of the GGUF file before any data is read: its name, its numpy shape (the Hugging
    Face [out, in] layout; GGUF lists the dimensions the other way round) and the one parameter of
    ours it is made from, by `layout`: 'copy', 'transpose' (our Linear [in, out]), 'experts' (our
    [E, in, out] stack -> [E, out, in]) or 'flat' (the [1, E] correction bias -> [E])."""

    name: str
    shape: tuple[int, ...]
    param: str
    layout: str


def plan(model) -> list[PlannedTensor]:
    """The GGUF tensors of `model` in file order (its parameters' order, as `hf_state_dict` gives
    the Hugging Face tensors and llama.cpp's converter writes them), from the parameters' shapes
    only: the file's tensor infos are written before any weight is read."""
    # the Hugging Face names hf_state_dict gives each parameter (the family's own mapping)
    from erniekit.models.registry import checkpoint_names

    config = model.config
    names = checkpoint_names(model)
    out: list[PlannedTensor] = []
    for pname, p in model.named_parameters():
        kind, hf_names = names[pname]
        targets = [gguf_name(hf, config) for hf in hf_names]
        if all(t is None for t in targets):
            continue
        if any(t is None for t in targets):
            raise CheckpointError(f"export --format gguf: {pname} mixes MTP and model tensors: {hf_names[:2]}")
        shape = tuple(int(d) for d in p.shape)
        if kind == "experts":
            name, n = targets[0][0], config.experts_per_modality[0]
            if any(t[0] != name for t in targets) or [t[1] for t in targets] != list(range(n)):
                raise CheckpointError(f"export --format gguf: {name} needs experts 0..{n - 1}, got {len(targets)}")
            out.append(PlannedTensor(name, (shape[0], shape[2], shape[1]), pname, "experts"))
            continue
        if len(targets) != 1 or targets[0][1] is not None or kind not in ("copy", "transpose"):
            raise CheckpointError(f"export --format gguf: no llama.cpp tensor for {hf_names[0]} ({pname})")
        name = targets[0][0]
        if kind == "transpose":
            out.append(PlannedTensor(name, shape[::-1], pname, "transpose"))
        elif "e_score" in hf_names[0]:
            out.append(PlannedTensor(name, (int(np.prod(shape)),), pname, "flat"))
        else:
            out.append(PlannedTensor(name, shape, pname, "copy"))
    return out


def read(param, layout: str) -> np.ndarray:
    """One planned tensor's float32 values (contiguous) from its parameter: the full value of a
    parameter sharded over processes (a collective: every rank calls it in the same order), viewed
    without a copy where it is a float32 CPU tensor, so at most this one tensor is copied."""
    import paddle

    from erniekit.utils.dtensor import host_view, to_dense

    t = to_dense(param.detach())
    if t.dtype != paddle.float32:
        t = t.astype("float32")
    a = host_view(t)
    if a is None:
        a = t.numpy()
    if layout == "experts":
        a = a.transpose(0, 2, 1)
    elif layout == "transpose":
        a = a.T
    elif layout == "flat":
        a = a.reshape(-1)
    return np.ascontiguousarray(a)


def from_gguf(tensors: dict[str, np.ndarray], config) -> dict[str, np.ndarray]:
    """GGUF-named tensors (a file `plan` describes) -> Hugging Face-named ones."""
    top, layer, experts = _tables()
    known = set(_gguf().MODEL_TENSORS[arch_of(config)])
    layer = {hf: t for hf, t in layer.items() if t in known}
    names: dict[str, tuple[str, str]] = {_name(t, config): (hf, "") for hf, t in top.items()}
    for i in range(config.num_hidden_layers):
        names.update({_name(t, config, i): (f"model.layers.{i}.{hf}", "") for hf, t in layer.items()})
        if config.is_moe:
            names.update({_name(t, config, i): (f"model.layers.{i}.mlp.experts", p) for p, t in experts.items()})
    state: dict[str, np.ndarray] = {}
    for name, t in tensors.items():
        if name not in names:
            raise CheckpointError(f"GGUF tensor {name} is not part of an ERNIE 4.5 model")
        hf, proj = names[name]
        if proj:
            state.update({f"{hf}.{e}.{proj}.weight": w for e, w in enumerate(t)})
        else:
            state[hf] = t.reshape(1, -1) if "e_score" in hf else t
    return state


def write_hparams(writer, config) -> None:
    """The `<arch>.*` keys llama.cpp reads for ERNIE 4.5 (a gguf.GGUFWriter before its header)."""
    c = config
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_rope_freq_base(float(c.rope_theta))
    writer.add_layer_norm_rms_eps(float(c.rms_norm_eps))
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    if c.is_moe:
        ff = c.expert_sizes[0]
        writer.add_expert_count(c.experts_per_modality[0])
        writer.add_expert_used_count(c.moe_k)
        writer.add_interleave_moe_layer_step(c.moe_layer_interval)
        writer.add_leading_dense_block_count(c.moe_layer_start_index)
        writer.add_expert_feed_forward_length(ff)
        writer.add_expert_shared_count(c.moe_num_shared_experts)
        if c.moe_num_shared_experts:
            writer.add_expert_shared_feed_forward_length(ff * c.moe_num_shared_experts)


def _f32(value) -> float:
    """A float32 metadata value as the shortest decimal that is it (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(value)))


def config_from_gguf(reader, has_output: bool):
    """An Ernie4_5Config from a GGUF file's metadata (gguf.GGUFReader); has_output: the file has
    its own `output.weight` (untied embeddings)."""
    from erniekit.models.ernie4_5.configuration import Ernie4_5Config

    f = reader.fields
    arch = f["general.architecture"].contents()
    moe = arch == _gguf().MODEL_ARCH_NAMES[_gguf().MODEL_ARCH.ERNIE4_5_MOE]

    def get(key: str, default=None):
        full = f"{arch}.{key}"
        if full not in f:
            if default is None:
                raise CheckpointError(f"GGUF file has no {full}; write it with erniekit export --format gguf")
            return default
        return f[full].contents()

    tokens = len(f["tokenizer.ggml.tokens"].data)
    kw = dict(
        vocab_size=tokens,
        hidden_size=int(get("embedding_length")),
        intermediate_size=int(get("feed_forward_length")),
        num_hidden_layers=int(get("block_count")),
        num_attention_heads=int(get("attention.head_count")),
        num_key_value_heads=int(get("attention.head_count_kv")),
        head_dim=int(get("attention.key_length")),
        max_position_embeddings=int(get("context_length")),
        rms_norm_eps=_f32(get("attention.layer_norm_rms_epsilon")),
        rope_theta=_f32(get("rope.freq_base")),
        tie_word_embeddings=not has_output,
    )
    for role in ("bos", "eos", "pad"):
        if f"tokenizer.ggml.{role}_token_id" in f:
            kw[f"{role}_token_id"] = int(f[f"tokenizer.ggml.{role}_token_id"].contents())
    if moe:
        ff = int(get("expert_feed_forward_length"))
        kw.update(
            moe_num_experts=int(get("expert_count")),
            moe_k=int(get("expert_used_count")),
            moe_intermediate_size=ff,
            moe_num_shared_experts=int(get("expert_shared_feed_forward_length", 0)) // ff,
            moe_layer_start_index=int(get("leading_dense_block_count", 0)),
            moe_layer_interval=int(get("interleave_moe_layer_step")),
        )
    return Ernie4_5Config(**kw)
