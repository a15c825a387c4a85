"""Multi-token prediction (MTP) heads: ERNIE's next-group-of-tokens prediction (docs/mtp.md).

Sequential heads in the ERNIE / DeepSeek-V3 layout. With h_0 the trunk's final hidden state
*after* the final norm (the tensor the LM head reads), depth j = 1..D at position i computes

    u_j[i]      = W_j [ RMSNorm^e_j(Emb(t[i+j])) ; RMSNorm^h_j(h_{j-1}[i]) ]    (W_j: 2H -> H, no bias)
    h_j[i]      = Block_j(u_j[i])                 (one dense decoder layer, causal attention over i)
    logits_j[i] = Head(FinalNorm(h_j[i]))         predicts t[i+j+1]

Emb, FinalNorm and Head are the trunk's own (shared). Each depth keeps the whole sequence, so
training runs every depth over all positions in one pass. Parameter names are ERNIE's
(`model.mtp_block.{j}`, `model.mtp_emb_norm.{j}`, `model.mtp_hidden_norm.{j}`,
`model.mtp_linear_proj.{j}` in the checkpoint), so public ERNIE checkpoints with MTP tensors load.
"""

from __future__ import annotations

import paddle
import paddle.nn as nn

from erniekit.nn.linear import Linear


def mtp_block_config(config):
    """Config of one MTP block: a dense (never MoE), single-layer decoder without GPAS, so a
    `KVCache` built from it holds exactly one layer."""
    return config.replace(moe_num_experts=0, use_gpas=False, num_nextn_predict_layers=0, num_hidden_layers=1)


def shift_left(input_ids: paddle.Tensor, k: int, pad_id: int) -> paddle.Tensor:
    """t[i+k] at position i ([B, S]); positions past the end hold `pad_id` (their targets are never trained)."""
    B, S = input_ids.shape
    if k >= S:
        return paddle.full([B, S], pad_id, dtype=input_ids.dtype)
    return paddle.concat([input_ids[:, k:], paddle.full([B, k], pad_id, dtype=input_ids.dtype)], axis=1)


class MultiTokenPredictor(nn.Layer):
    """The D MTP depths; the trunk (`Ernie4_5ForCausalLM`) is passed in, never owned, so embedding,
    final norm and head stay shared. The model family hands in its own decoder layer and norm
    classes (`decoder_layer(config, layer_idx)`, `norm(hidden_size, eps)`), so nn/ needs no model."""

    def __init__(self, config, decoder_layer, norm):
        super().__init__()
        d, hs, eps = config.num_nextn_predict_layers, config.hidden_size, config.rms_norm_eps
        block = mtp_block_config(config)
        self.mtp_emb_norm = nn.LayerList([norm(hs, eps) for _ in range(d)])
        self.mtp_hidden_norm = nn.LayerList([norm(hs, eps) for _ in range(d)])
        self.mtp_linear_proj = nn.LayerList([Linear(2 * hs, hs, bias_attr=False) for _ in range(d)])
        self.mtp_block = nn.LayerList([decoder_layer(block, 0) for _ in range(d)])

    @property
    def depth(self) -> int:
        return len(self.mtp_block)

    def step(self, j: int, h_prev: paddle.Tensor, emb: paddle.Tensor, cos, sin, mask, cache=None) -> paddle.Tensor:
        """h_j from h_{j-1} and Emb(t[i+j]) (j is 0-based here); `cache` is this depth's own KV cache."""
        u = paddle.concat([self.mtp_emb_norm[j](emb), self.mtp_hidden_norm[j](h_prev)], axis=-1)
        return self.mtp_block[j](self.mtp_linear_proj[j](u), cos, sin, mask, cache)

    def hidden_states(
        self,
        model,
        h0: paddle.Tensor,
        input_ids: paddle.Tensor,
        position_ids=None,
        segment_ids=None,
        attention_mask=None,
    ) -> list[paddle.Tensor]:
        """[h_1, ..., h_D] over the whole sequence, with the trunk's RoPE positions and mask."""
        cos, sin, mask = model.model.rope_and_mask(input_ids, position_ids, segment_ids, attention_mask)
        pad = model.config.pad_token_id or 0
        out, h = [], h0
        for j in range(self.depth):
            h = self.step(j, h, model.model.embed_tokens(shift_left(input_ids, j + 1, pad)), cos, sin, mask)
            out.append(h)
        return out

    def logits(
        self,
        model,
        h0: paddle.Tensor,
        input_ids: paddle.Tensor,
        position_ids=None,
        segment_ids=None,
        attention_mask=None,
    ) -> list[paddle.Tensor]:
        """logits_j [B, S, V] for j = 1..D; logits_j[:, i] predicts t[i+j+1]."""
        hs = self.hidden_states(model, h0, input_ids, position_ids, segment_ids, attention_mask)
        return [model.head(model.model.norm(h)) for h in hs]
