"""The credibility head (ERNIE 3.0 Titan's self-supervised adversarial loss): a linear score on the
model's final hidden state at the end of a reply, trained to say "real reply" (1) or "a reply the
model sampled itself" (0).

The score is read at the reply's end-of-turn token (the sep token the chat template writes after
every reply), where the whole prompt and reply have been seen; a sampled reply gets the same token
appended, so both are scored at the same kind of position and no vocabulary entry is added. The head
lives beside the weights as `credibility_head.safetensors` (weight [hidden, 1], bias [1]), outside
model.safetensors, so the checkpoint stays the ecosystem's layout and tools that do not know the head
load the model unchanged.
"""

from __future__ import annotations

import os

import numpy as np
import paddle
import paddle.nn as nn

from erniekit.errors import CheckpointError

CREDIBILITY_HEAD_NAME = "credibility_head.safetensors"


class CredibilityHead(nn.Layer):
    """logit = h . w + b (float32); zero-initialised, so every reply starts at probability 0.5."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.weight = self.create_parameter(
            [hidden_size, 1], dtype="float32", default_initializer=nn.initializer.Constant(0.0)
        )
        self.bias = self.create_parameter([1], dtype="float32", default_initializer=nn.initializer.Constant(0.0))

    def forward(self, h: paddle.Tensor) -> paddle.Tensor:
        """h [..., hidden] -> logits [...]."""
        return (paddle.matmul(h.astype("float32"), self.weight) + self.bias).squeeze(-1)


def sequence_logits(model, head: CredibilityHead, sequences: list[list[int]], pad_id: int) -> paddle.Tensor:
    """Credibility logits [N] of whole sequences (prompt + reply + end-of-turn token), each read at its
    last token. Sequences are right-padded: causal attention keeps padding out of the real tokens."""
    if not sequences or min(len(s) for s in sequences) < 1:
        raise ValueError("sequence_logits: needs non-empty sequences")
    lens = np.array([len(s) for s in sequences])
    ids = np.full((len(sequences), int(lens.max())), pad_id, dtype=np.int64)
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = s
    h = model(paddle.to_tensor(ids)).hidden_states  # [N, L, H]
    last = paddle.to_tensor(lens - 1, dtype="int64")
    picked = paddle.take_along_axis(h, last.reshape([-1, 1, 1]).expand([-1, 1, h.shape[-1]]), axis=1).squeeze(1)
    return head(picked)


def load_credibility_head(model_dir: str, hidden_size: int) -> CredibilityHead | None:
    """The head saved next to a checkpoint's weights, or None when the directory has none."""
    path = os.path.join(model_dir, CREDIBILITY_HEAD_NAME)
    if not os.path.isfile(path):
        return None
    from erniekit.utils.io import load_safetensors

    tensors = load_safetensors(path)
    w, b = tensors.get("weight"), tensors.get("bias")
    if w is None or list(w.shape) != [hidden_size, 1] or b is None or list(b.shape) != [1]:
        shapes = [None if t is None else list(t.shape) for t in (w, b)]
        raise CheckpointError(
            f"{path}: expected tensors weight [{hidden_size}, 1] and bias [1], got weight {shapes[0]} and bias "
            f"{shapes[1]}; it belongs to another model: retrain with credibility_loss_weight > 0"
        )
    head = CredibilityHead(hidden_size)
    head.set_state_dict({"weight": w, "bias": tensors["bias"]})
    head.eval()
    return head
