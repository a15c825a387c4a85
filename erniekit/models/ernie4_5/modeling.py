"""ERNIE 4.5 text model (dense and MoE) in Paddle, top to bottom.

Module and parameter names follow the Hugging Face layout (`model.layers.N.self_attn.q_proj`...)
so checkpoints map one to one; Linear weights are stored in Paddle's [in, out] orientation and
transposed by `checkpoint.py` on the way in and out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import paddle
import paddle.nn as nn

from erniekit.errors import CheckpointError
from erniekit.models.ernie4_5 import decode_step
from erniekit.models.ernie4_5.configuration import Ernie4_5Config
from erniekit.nn import small_gemm
from erniekit.nn.attention import (
    KVCache,
    additive_mask,
    apply_rope,
    attention,
    build_attention_mask,
    math_attention,
    rope_cos_sin,
    rope_cos_sin_3d,
    use_fused_attention,
)
from erniekit.nn.deferred_init import random_init_skipped
from erniekit.nn.gpas import GPAS
from erniekit.nn.linear import Linear
from erniekit.nn.moe import MoEBlock, router_loss_sum
from erniekit.nn.mtp import MultiTokenPredictor
from erniekit.nn.norm import rms_norm
from erniekit.nn.recompute import GRANULARITIES, checkpoint
from erniekit.nn.swiglu import swiglu


class RMSNorm(nn.Layer):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = self.create_parameter([hidden_size], default_initializer=nn.initializer.Constant(1.0))

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return rms_norm(x, self.weight, self.eps)


class MLP(nn.Layer):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: Ernie4_5Config, intermediate_size: int | None = None):
        super().__init__()
        inter = intermediate_size or config.intermediate_size
        b = config.use_bias
        self.gate_proj = Linear(config.hidden_size, inter, bias_attr=None if b else False)
        self.up_proj = Linear(config.hidden_size, inter, bias_attr=None if b else False)
        self.down_proj = Linear(inter, config.hidden_size, bias_attr=None if b else False)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


class Attention(nn.Layer):
    def __init__(self, config: Ernie4_5Config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        b = None if config.use_bias else False
        h = config.hidden_size
        self.q_proj = Linear(h, self.num_heads * self.head_dim, bias_attr=b)
        self.k_proj = Linear(h, self.num_kv_heads * self.head_dim, bias_attr=b)
        self.v_proj = Linear(h, self.num_kv_heads * self.head_dim, bias_attr=b)
        self.o_proj = Linear(self.num_heads * self.head_dim, h, bias_attr=b)
        self.recompute_core = False  # core_attn recompute (set by Ernie4_5ForCausalLM.set_recompute)

    def forward(self, x, cos, sin, mask, cache: KVCache | None):
        B, S, _ = x.shape
        q = self.q_proj(x).reshape([B, S, self.num_heads, self.head_dim])
        k = self.k_proj(x).reshape([B, S, self.num_kv_heads, self.head_dim])
        v = self.v_proj(x).reshape([B, S, self.num_kv_heads, self.head_dim])
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v)
        if self.recompute_core and _wants_recompute(self, cache):
            out = checkpoint(lambda q, k, v: self.core(q, k, v, mask), q, k, v)
        else:
            out = self.core(q, k, v, mask)
        return self.o_proj(out.reshape([B, S, self.num_heads * self.head_dim]))

    def core(self, q, k, v, mask):
        """softmax(q k^T * scale + mask) v: [B, S, heads, head_dim]."""
        if isinstance(mask, tuple):  # ("bias", additive mask) for the CPU math path
            return math_attention(q, k, v, mask[1], scale=self.head_dim**-0.5)
        return attention(q, k, v, mask, causal=True, scale=self.head_dim**-0.5)


def _wants_recompute(layer: nn.Layer, cache) -> bool:
    """Recompute only pays off in a training forward that will be differentiated."""
    return layer.training and cache is None and paddle.is_grad_enabled()


class DecoderLayer(nn.Layer):
    def __init__(self, config: Ernie4_5Config, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MoEBlock(config, MLP) if config.is_moe_layer(layer_idx) else MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.gpas = GPAS() if config.use_gpas else None
        self.recompute: str | None = None  # full | full_attn | mlp (core_attn lives in Attention)

    def forward(self, x, cos, sin, mask, cache, token_type_ids=None):
        if not (self.recompute and _wants_recompute(self, cache)):
            return self._forward(x, cos, sin, mask, cache, token_type_ids)
        if self.recompute == "full":
            return checkpoint(lambda x: self._forward(x, cos, sin, mask, cache, token_type_ids), x)
        if self.recompute == "full_attn":
            x = x + checkpoint(lambda x: self._attn(x, cos, sin, mask, cache), x)
            return self._finish(x + self._mlp(x, token_type_ids))
        x = x + self._attn(x, cos, sin, mask, cache)  # mlp
        return self._finish(x + checkpoint(lambda x: self._mlp(x, token_type_ids), x))

    def _forward(self, x, cos, sin, mask, cache, token_type_ids=None):
        x = x + self._attn(x, cos, sin, mask, cache)
        return self._finish(x + self._mlp(x, token_type_ids))

    def _attn(self, x, cos, sin, mask, cache):
        return self.self_attn(self.input_layernorm(x), cos, sin, mask, cache)

    def _mlp(self, x, token_type_ids=None):
        h = self.post_attention_layernorm(x)
        # modality ids matter only to the MoE router (modality-isolated routing); dense MLPs ignore them
        return self.mlp(h, token_type_ids) if isinstance(self.mlp, MoEBlock) else self.mlp(h)

    def _finish(self, x):
        return self.gpas(x) if self.gpas is not None else x


class Ernie4_5Model(nn.Layer):
    # the modules decode_step.py reproduces, exactly these types (it cannot import this module)
    decode_step_types = (DecoderLayer, Attention, MLP, RMSNorm, Linear, MoEBlock)

    def __init__(self, config: Ernie4_5Config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.LayerList([DecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mrope_section = getattr(config, "mrope_section", None)  # 3-D rope sections (ERNIE-4.5-VL)
        self.active_layers: list[int] | None = None  # elastic depth (erniekit/elastic/submodels.py); None = all

    def forward(
        self,
        input_ids,
        position_ids=None,
        segment_ids=None,
        attention_mask=None,
        cache=None,
        token_type_ids=None,
        inputs_embeds=None,
    ):
        """token_type_ids [B, S]: modality id per token (0 = text) for modality-isolated MoE routing;
        inputs_embeds [B, S, H]: instead of embedding input_ids (a VL model's text with image
        features in place); position_ids may then be [3, B, S] (3-D rope, `mrope_section`)."""
        if cache is not None and inputs_embeds is None and segment_ids is None and token_type_ids is None:
            # a text decode step on the kernels directly (same bits; a VL model's text tokens too: it
            # passes inputs_embeds only with vision features in them); no walrus here: the static
            # export converts this function, and its AST transformer rejects one
            stepped = decode_step.run(self, input_ids, attention_mask, cache, position_ids)
            if stepped is not None:
                return stepped
        past = cache.length if cache is not None else 0
        cos, sin, mask = self.rope_and_mask(input_ids, position_ids, segment_ids, attention_mask, past)
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        layers = self.layers if self.active_layers is None else [self.layers[i] for i in self.active_layers]
        for layer in layers:
            h = layer(h, cos, sin, mask, cache, token_type_ids)
        if cache is not None:
            cache.length = past + input_ids.shape[1]
        return self.norm(h)

    def rope_and_mask(
        self, input_ids, position_ids=None, segment_ids=None, attention_mask=None, past: int = 0, dtype=None
    ):
        """RoPE cos/sin and attention mask of one forward over `input_ids` after `past` cached tokens;
        the MTP blocks (erniekit/nn/mtp.py) reuse them so they attend exactly as the trunk does.
        dtype: of the additive mask; a pipeline stage without the embedding passes its own."""
        B, S = input_ids.shape[:2]  # ids [B, S] or, from a VL model, its embeddings [B, S, H]
        if position_ids is not None and position_ids.ndim == 3:  # [3, B, S]: temporal, height, width
            cos, sin = rope_cos_sin_3d(position_ids, self.config.head_dim, self.config.rope_theta, self.mrope_section)
        elif position_ids is None:
            if attention_mask is not None:  # left padding: positions count real tokens only
                pos = paddle.cumsum(attention_mask.astype("int64"), axis=-1) - 1
                position_ids = paddle.clip(pos, min=0)[:, past : past + S]
            else:
                position_ids = paddle.arange(past, past + S, dtype="int64").unsqueeze(0).expand([B, S])
        if position_ids.ndim == 2:
            cos, sin = rope_cos_sin(position_ids, self.config.head_dim, self.config.rope_theta)
        mask, sees_all = None, False
        if segment_ids is not None or attention_mask is not None or (past > 0 and S > 1):
            mask = build_attention_mask(S, past + S, segment_ids, attention_mask)
        elif past > 0:  # one new token attends to the whole cache: no mask needed
            mask, sees_all = paddle.ones([1, 1, 1, past + S], dtype="bool"), True
        if not use_fused_attention():
            dtype = dtype or self.embed_tokens.weight.dtype
            # a decode step's bias is all zeros: one op instead of additive_mask's four
            bias = paddle.zeros([1, 1, 1, past + S], dtype) if sees_all else additive_mask(mask, S, past + S, dtype)
            mask = ("bias", bias)
        return cos, sin, mask


class TiedHeadBias(nn.Layer):
    """The LM head's own bias beside tied embeddings (an MoE model with use_bias), named
    `lm_head.bias` as transformers' checkpoints store it."""

    def __init__(self, vocab_size: int):
        super().__init__()
        self.bias = self.create_parameter([vocab_size], is_bias=True)


@dataclass
class CausalLMOutput:
    logits: paddle.Tensor | None  # None with skip_head=True (the caller applies the head itself)
    aux_loss: paddle.Tensor | None = None  # sum over MoE layers of the weighted router losses (training only)
    mtp_logits: list[paddle.Tensor] | None = None  # depth j predicts token t+j+1 (return_mtp=True; erniekit/nn/mtp.py)
    hidden_states: paddle.Tensor | None = None  # final normed hidden states at the logits' positions (value heads)


_FEW_ROWS = 64  # up to this many positions the tied head multiplies W by h^T (decode steps)


class Ernie4_5ForCausalLM(nn.Layer):
    """`Ernie4_5ForCausalLM` / `Ernie4_5_MoeForCausalLM` of the HF layout, one class for both."""

    def __init__(self, config: Ernie4_5Config):
        super().__init__()
        self.config = config
        self.model = Ernie4_5Model(config)
        if not config.tie_word_embeddings:
            self.lm_head = Linear(
                config.hidden_size, config.vocab_size, bias_attr=None if config.lm_head_bias else False
            )
        elif config.lm_head_bias:  # transformers ties only lm_head.weight: the bias stays lm_head.bias
            self.lm_head = TiedHeadBias(config.vocab_size)
        # multi-token prediction heads (off by default): sharing embedding, final norm and head with the trunk
        self.mtp = MultiTokenPredictor(config, DecoderLayer, RMSNorm) if config.num_nextn_predict_layers > 0 else None
        self.init_weights()

    def init_weights(self) -> None:
        """Normal(0, initializer_range) for matrices, as the reference's `_init_weights`; nothing when
        a checkpoint's weights are about to replace them (erniekit/nn/deferred_init.py)."""
        if random_init_skipped():
            return
        std = self.config.initializer_range
        init = nn.initializer.Normal(0.0, std)
        for name, p in self.named_parameters():
            if p.ndim >= 2 and "e_score_correction_bias" not in name:
                init(p)
            elif name.endswith(".bias"):
                nn.initializer.Constant(0.0)(p)

    def moe_layers(self) -> list[MoEBlock]:
        # getattr: a pipeline stage holds placeholders for the other stages' layers
        return [l.mlp for l in self.model.layers if isinstance(getattr(l, "mlp", None), MoEBlock)]

    def set_fp8(self, block_size: int, grad_format: str = "e4m3") -> None:
        """Run every routed-expert GEMM in block-scaled FP8 (0 turns it off). A training-time
        setting: it is not written to config.json, so exported checkpoints load in full precision."""
        c = self.config
        if block_size and not c.is_moe:
            raise CheckpointError("fp8: FP8 applies to MoE expert GEMMs and this model is dense; set fp8: false")
        sizes = [("hidden_size", c.hidden_size)] + [("moe_intermediate_size", s) for s in c.expert_sizes]
        for name, size in sizes:
            if block_size and (block_size < 0 or size % block_size):
                raise CheckpointError(
                    f"fp8_block_size={block_size} does not divide {name}={size}: set "
                    "fp8_block_size to a divisor of both hidden_size and moe_intermediate_size"
                )
        for m in self.moe_layers():
            for i in range(m.num_modalities):
                m.expert_set(i).fp8_block = block_size
                m.expert_set(i).fp8_grad_format = grad_format

    def set_recompute(self, granularity: str | None) -> None:
        """Recompute activations of every decoder layer in the backward (None turns it off); a
        training-time setting like FP8, not written to config.json (erniekit/nn/recompute.py)."""
        if granularity is not None and granularity not in GRANULARITIES:
            raise CheckpointError(f"recompute_granularity={granularity!r} is not one of {', '.join(GRANULARITIES)}")
        for layer in self.model.layers:
            layer.recompute = granularity if granularity in ("full", "full_attn", "mlp") else None
            layer.self_attn.recompute_core = granularity == "core_attn"

    def forward(
        self,
        input_ids,
        position_ids=None,
        segment_ids=None,
        attention_mask=None,
        cache=None,
        logits_to_keep: int = 0,
        token_type_ids=None,
        return_mtp: bool = False,
        skip_head: bool = False,
    ) -> CausalLMOutput:
        """return_mtp: also the logits of the MTP heads (training); plain inference never pays for them.
        skip_head: no logits, only the final hidden states, for a loss that multiplies them by
        `head_weight()` itself (erniekit/nn/linear_cross_entropy.py)."""
        h = self.model(input_ids, position_ids, segment_ids, attention_mask, cache, token_type_ids=token_type_ids)
        mtp_logits = None
        if return_mtp:
            if self.mtp is None:
                raise CheckpointError(
                    "return_mtp=True needs MTP heads: set num_nextn_predict_layers >= 1 in the config"
                )
            mtp_logits = self.mtp.logits(self, h, input_ids, position_ids, segment_ids, attention_mask)
        return self.output(h, logits_to_keep, mtp_logits, skip_head)

    def output(
        self, h: paddle.Tensor, logits_to_keep: int = 0, mtp_logits=None, skip_head: bool = False
    ) -> CausalLMOutput:
        """The final hidden states -> logits of the kept positions, with the router losses of the
        forward just run (training)."""
        if logits_to_keep:
            h = h[:, -logits_to_keep:]
        logits = None if skip_head else self.head(h)
        aux = None
        if self.training and self.config.is_moe:
            aux = router_loss_sum(self.moe_layers())
        return CausalLMOutput(logits=logits, aux_loss=aux, mtp_logits=mtp_logits, hidden_states=h)

    def head_weight(self) -> tuple[paddle.Tensor, bool] | None:
        """(W, vocab_first) when the head is the plain product h W^T (tied, W [V, H]) or h W (an
        unadapted Linear without bias, W [H, V]); None when it is more (an adapter, a quantized
        layer, a bias: the chunked loss then goes through `head`)."""
        if self.config.tie_word_embeddings:
            return None if self.config.lm_head_bias else (self.model.embed_tokens.weight, True)
        head = self.lm_head
        if type(head) is Linear and head.bias is None:
            return head.weight, False
        return None

    def head(self, h: paddle.Tensor) -> paddle.Tensor:
        """Final hidden states (after the final norm) -> vocabulary logits, tied or not."""
        if not self.config.tie_word_embeddings:
            return self.lm_head(h)
        logits = self._tied_product(h)
        return logits + self.lm_head.bias if self.config.lm_head_bias else logits

    def _tied_product(self, h: paddle.Tensor) -> paddle.Tensor:
        """h E^T with the embedding E [V, H]."""
        w = self.model.embed_tokens.weight  # [V, H]
        if small_gemm.takes_nk(h, w):  # decode steps on the CPU: the kernel streams W as stored
            return small_gemm.matmul_nk(h, w)
        rows = math.prod(h.shape[:-1])
        if rows <= _FEW_ROWS:
            # decoding: (W h^T)^T runs the GEMM on W as stored; h W^T makes the CPU GEMM read W
            # transposed, 1.5-1.9x slower at 8-64 rows (tools/bench_vs_torch.py's decode cases)
            flat = h.reshape([rows, h.shape[-1]])
            return paddle.matmul(w, flat, transpose_y=True).T.reshape([*h.shape[:-1], w.shape[0]])
        return paddle.matmul(h, w, transpose_y=True)
