"""`erniekit export --format paddle|onnx`: one decoding step as a static graph, run by
`paddle.inference` or onnxruntime.

The step takes the new tokens, their positions, the attention mask over past + new tokens and the
past keys / values of every layer ([layers, B, past, KV heads, head dim]; past = 0 for the
prefill) and returns the last position's logits with the keys / values extended by the new
tokens, so the same graph serves the prefill and every decode step. MoE layers run every expert
and weight them by the gates (`StackedExperts._forward_every_expert`): the token-sorted grouped
GEMM has data-dependent shapes a static graph cannot hold. FP8 expert GEMMs are a training-time
setting and are off in the export.
"""

from __future__ import annotations

import os

import numpy as np
import paddle

from erniekit.errors import CheckpointError

MODEL_PREFIX = "model"  # model.json + model.pdiparams (paddle), model.onnx (onnx)


class _ConcatCache:
    """The KV-cache interface the model calls, as pure tensor functions: past + new, concatenated."""

    def __init__(self, past_k: paddle.Tensor, past_v: paddle.Tensor):
        self.past_k, self.past_v = paddle.unbind(past_k, axis=0), paddle.unbind(past_v, axis=0)
        self.length = paddle.shape(past_k)[2]
        self.k: list[paddle.Tensor] = []
        self.v: list[paddle.Tensor] = []

    def update(self, layer: int, k: paddle.Tensor, v: paddle.Tensor) -> tuple[paddle.Tensor, paddle.Tensor]:
        fk = paddle.concat([self.past_k[layer], k], axis=1)
        fv = paddle.concat([self.past_v[layer], v], axis=1)
        self.k.append(fk)
        self.v.append(fv)
        return fk, fv


class DecodeStep(paddle.nn.Layer):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, position_ids, attention_mask, past_k, past_v):
        cache = _ConcatCache(past_k, past_v)
        h = self.model.model(input_ids, position_ids=position_ids, attention_mask=attention_mask, cache=cache)
        logits = self.model.head(h[:, -1:])[:, -1].astype("float32")
        return logits, paddle.stack(cache.k), paddle.stack(cache.v)


def save_static(model, out: str) -> None:
    """The decoding step of `model` as out/model.json + out/model.pdiparams."""
    from paddle.static import InputSpec

    c = model.config
    model.set_fp8(0)  # a training-time setting; MTP heads are not part of the step either
    model.eval()
    L, KVH, D = c.num_hidden_layers, c.num_key_value_heads, c.head_dim
    dtype = str(model.model.embed_tokens.weight.dtype).replace("paddle.", "")
    spec = [
        InputSpec([None, None], "int64", "input_ids"),
        InputSpec([None, None], "int64", "position_ids"),
        InputSpec([None, None], "int64", "attention_mask"),
        InputSpec([L, None, None, KVH, D], dtype, "past_k"),
        InputSpec([L, None, None, KVH, D], dtype, "past_v"),
    ]
    step = paddle.jit.to_static(DecodeStep(model), input_spec=spec, full_graph=True)
    paddle.jit.save(step, os.path.join(out, MODEL_PREFIX))


def save_onnx(out: str) -> None:
    """out/model.onnx from the static graph in `out` (paddle2onnx)."""
    try:
        import paddle2onnx
    except ImportError:
        raise CheckpointError("export --format onnx needs paddle2onnx (pip install paddle2onnx onnxruntime)") from None
    from paddle2onnx.utils import logging as p2o_log

    model_file, params = (os.path.join(out, MODEL_PREFIX + ext) for ext in (".json", ".pdiparams"))
    level, p2o_log.log_level = p2o_log.log_level, min(p2o_log.log_level, 1)  # warnings and errors only:
    try:  # its INFO line names the staging path, not where the model ends up (the caller says that)
        paddle2onnx.export(
            model_file,
            params,
            os.path.join(out, MODEL_PREFIX + ".onnx"),
            opset_version=17,
            enable_onnx_checker=True,
            optimize_tool="None",
        )
    finally:
        p2o_log.log_level = level
    os.remove(model_file)
    os.remove(params)


class StepRunner:
    """The exported step under paddle.inference (`paddle`) or onnxruntime (`onnx`), with the
    cache bookkeeping: `prefill(ids)` then `decode(token)`, each returning the logits [V]."""

    def __init__(self, out: str, fmt: str, config):
        self.fmt, self.config = fmt, config
        if fmt == "paddle":
            from paddle import inference

            cfg = inference.Config(
                os.path.join(out, MODEL_PREFIX + ".json"), os.path.join(out, MODEL_PREFIX + ".pdiparams")
            )
            cfg.disable_gpu()
            cfg.disable_glog_info()
            self.pred = inference.create_predictor(cfg)
        elif fmt == "onnx":
            try:
                import onnxruntime as ort
            except ImportError:
                raise CheckpointError("running an onnx export needs onnxruntime (pip install onnxruntime)") from None
            options = ort.SessionOptions()
            options.log_severity_level = 3  # errors only: not a warning per unused initializer paddle2onnx left
            self.sess = ort.InferenceSession(
                os.path.join(out, MODEL_PREFIX + ".onnx"), sess_options=options, providers=["CPUExecutionProvider"]
            )
            self.names = [i.name for i in self.sess.get_inputs()]
        else:
            raise ValueError(fmt)

    def run(self, *arrays: np.ndarray) -> list[np.ndarray]:
        if self.fmt == "onnx":
            return self.sess.run(None, dict(zip(self.names, arrays)))
        for name, a in zip(self.pred.get_input_names(), arrays):
            h = self.pred.get_input_handle(name)
            h.reshape(list(a.shape))
            h.copy_from_cpu(np.ascontiguousarray(a))
        self.pred.run()
        return [self.pred.get_output_handle(n).copy_to_cpu() for n in self.pred.get_output_names()]

    def prefill(self, ids: list[int]) -> np.ndarray:
        c = self.config
        self.k = np.zeros((c.num_hidden_layers, 1, 0, c.num_key_value_heads, c.head_dim), np.float32)
        self.v = self.k.copy()
        self.n = 0
        return self._step(np.array([ids], dtype=np.int64))

    def decode(self, token: int) -> np.ndarray:
        return self._step(np.array([[token]], dtype=np.int64))

    def _step(self, ids: np.ndarray) -> np.ndarray:
        S = ids.shape[1]
        pos = np.arange(self.n, self.n + S, dtype=np.int64)[None]
        mask = np.ones((1, self.n + S), dtype=np.int64)
        logits, self.k, self.v = self.run(ids, pos, mask, self.k, self.v)
        self.n += S
        return logits[0]


def reference_logits(model, ids: list[int], steps: int) -> tuple[list[np.ndarray], list[int]]:
    """Eager logits of the prefill's last position and of `steps` greedy decode steps, and the tokens."""
    from erniekit.nn.attention import KVCache

    cache = KVCache(model.config, 1, len(ids) + steps + 1, dtype=model.model.embed_tokens.weight.dtype)
    x, out, toks = paddle.to_tensor([ids], dtype="int64"), [], []
    with paddle.no_grad():
        for _ in range(steps + 1):
            lg = model(x, cache=cache, logits_to_keep=1).logits[0, -1].astype("float32").numpy()
            out.append(lg)
            toks.append(int(lg.argmax()))
            x = paddle.to_tensor([[toks[-1]]], dtype="int64")
    return out, toks
