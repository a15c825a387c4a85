#!/usr/bin/env python
"""erniekit against transformers + torch on the same checkpoint, same threads (issue #25).

    python tools/bench_vs_torch.py [--cases all] [--repeats 3] [--threads N] [--out bench_results/vs_torch.json]

Each checkpoint is written once, by transformers (random weights, seed 0), into --workdir. Every
measurement runs in a fresh process of its own (erniekit or torch, OMP_NUM_THREADS and
torch.set_num_threads = --threads), the two frameworks alternating and their order flipped on
each repeat; a measurement reports its figure and the process's peak resident memory. Before
timing, each erniekit process checks that its logits equal transformers' on the checkpoint
(written by the torch process of the same case) so both time the same model.

Cases
  train:<model>   forward + mean token cross-entropy (+ the MoE router loss each framework adds
                  in training) + backward + AdamW step; tokens/s over the timed steps (erniekit
                  takes the head's loss as `erniekit train` does: --fused-head-loss)
  prefill         dense-1024, one no-grad forward of batch 4 x 256; tokens/s
  decode-b{1,8,32} dense-1024, greedy, 32-token prompts, 128 new tokens; new tokens/s (erniekit
                  packs its weights as `erniekit chat` does: --packed-weights)
  decode-moe-b{1,8} the same on moe16-top4 (a MoE model's decode)
  decode-vl-b1    vl-moe16: greedy generation after a prompt of 16 text tokens, one image (8 x 8
                  patches, 16 merged tokens) and 16 more, 128 new tokens (erniekit's `generate_vl`,
                  transformers' `generate`; the vision encoder and prefill inside the time)
  decode-tiny-b{1,8} the same on tiny-moe (the embedded default's model: what `erniekit chat`
                  decodes after the README's first command; its evaluation during training
                  runs the experts in FP8, which the decode step leaves to the layers)
  server-c{16,64} dense-1024: the built-in engine (continuous batching) with 16 / 64 concurrent
                  requests of 32-token prompts and 64 new tokens, against transformers batched
                  `generate` of the same prompts; generated tokens/s over the wall time
Models
  dense-1024   hidden 1024, 4 layers, 16 q / 2 kv heads of 64, MLP 3072, vocab 32000, tied
  0.3b-2l      ERNIE-4.5-0.3B's shapes (hidden 1024, 16 q / 2 kv heads of 128, MLP 3072, vocab
               103424, tied) cut to 2 layers; batch 2 x 256
  tiny-moe     the embedded default's model (its preset and model_overrides, read from
               examples/configs/tiny/sft.yaml); batch 64 x 32
  moe16-top4   hidden 512, 4 layers (MoE from layer 1), 16 experts of 512 top-4 + 1 shared,
               vocab 8192; batch 4 x 256

Devices (--device): on a machine where both Paddle (paddlepaddle-gpu) and torch see a CUDA GPU,
`auto` runs every case there: the training cases in bf16 autocast on both sides (erniekit as
`erniekit train bf16=true` runs it), memory = each framework's peak allocated device memory, and
each training run reports its model TFLOP/s and MFU against the GPU's dense bf16 peak (the
datasheet's, by name, or --peak-tflops) next to the 47% ERNIE 4.5 reports. A GPU only one of the
two frameworks sees is refused (the comparison would be a GPU against a CPU). Model FLOPs per
token are tools/bench_train.py's (6 N_active + 12 L A S) plus the LM head (6 H V).

The JSON has every run, min / median / max per case and framework, and erniekit / torch of the
medians (> 1: erniekit faster; for memory < 1: erniekit smaller). Every run also times its
checkpoint load after the framework's import (load_s: erniekit's load_model, transformers'
from_pretrained, on a GPU with the copy to the device);
load_speedup is torch's median over erniekit's (> 1: erniekit loads faster).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MODELS = {
    "dense-1024": dict(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=4,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=64,
        tie_word_embeddings=True,
    ),
    "0.3b-2l": dict(
        vocab_size=103424,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=2,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=128,
        tie_word_embeddings=True,
    ),
    "tiny-moe": None,  # the embedded default's model: read from its config (embedded_default_model)
    "moe16-top4": dict(
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        tie_word_embeddings=True,
        moe_num_experts=16,
        moe_k=4,
        moe_intermediate_size=512,
        moe_num_shared_experts=1,
        moe_layer_start_index=1,
        router_aux_loss_coef=0.01,
    ),
}
TRAIN_SHAPES = {"dense-1024": (4, 256), "0.3b-2l": (2, 256), "tiny-moe": (64, 32), "moe16-top4": (4, 256)}
CASES = [f"train:{m}" for m in MODELS] + ["prefill", "decode-b1", "decode-b8", "decode-b32", "server-c16", "server-c64"]
CASES += ["decode-moe-b1", "decode-moe-b8", "decode-tiny-b1", "decode-tiny-b8", "decode-vl-b1"]
# ERNIE-4.5-VL's shapes cut down: moe16-top4's text model with modality-isolated experts (16 text
# of 512, 16 vision of 256, top-4, one shared) and a 2-layer vision encoder; transformers' keys
VL_MODEL = "vl-moe16"
VL_IDS = dict(image_start_token_id=500, image_end_token_id=501, image_token_id=502)
_NOT_VL_TEXT = ("tie_word_embeddings", "moe_intermediate_size", "moe_layer_start_index", "router_aux_loss_coef")
VL_CONFIG = dict(
    text_config=dict(
        {k: v for k, v in MODELS["moe16-top4"].items() if k not in _NOT_VL_TEXT},
        moe_intermediate_size=[512, 256],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [14, 14, 4]},
        mlp_layer_types=["dense"] + ["sparse"] * 3,
        initializer_range=0.02,
    ),
    vision_config=dict(
        depth=2,
        hidden_size=64,
        num_heads=2,
        intermediate_size=128,
        rope_parameters={"rope_type": "axial", "rope_theta": 10000.0},
        initializer_range=0.02,
    ),
    video_start_token_id=503,
    video_end_token_id=504,
    video_token_id=505,
    **VL_IDS,
)
# not in `all` (a step of ~10-25 s): where the batch's logits outgrow the model (1 x 4096 tokens x
# 103,424 ids: 1.7 GB of float32 logits), the memory fused_head_loss saves
LONG_CASES = {"train:0.3b-2l-4k": ("0.3b-2l", (1, 4096))}
PROMPT_LEN, DECODE_NEW, SERVER_NEW = 32, 128, 64
PACKED_WEIGHTS = "auto"  # --packed-weights: decode and server cases, as `erniekit chat` / `server` choose
FUSED_HEAD_LOSS = "on"  # --fused-head-loss: training cases, as `erniekit train`'s fused_head_loss
DEVICE, PRECISION = "cpu", "fp32"  # --device (resolved) and --precision of the training cases
LOAD_S = 0.0  # a worker's checkpoint load: erniekit's load_model, transformers' from_pretrained (s)
# dense bf16 tensor-core peaks (TFLOP/s, no sparsity) from the vendors' datasheets; the first entry
# a device's name contains wins, so the longer names come first (H200 before H20, A100 before A10)
GPU_PEAK_BF16_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H100", 989.4),
    ("H200", 989.4),
    ("H800", 989.4),
    ("H20", 148.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.1),
    ("L40", 181.0),
    ("RTX 4090", 165.2),
    ("A10", 125.0),
)
ERNIE45_MFU = 0.47  # the pre-training MFU the ERNIE 4.5 technical report gives


GPU_VARIANTS = ("NVL", "A10G")  # names the table's entries would match with another part's peak


def gpu_peak_tflops(name: str | None) -> float | None:
    """The dense bf16 peak of a GPU by its name (None: not in GPU_PEAK_BF16_TFLOPS, or a variant
    whose peak differs from its family's: pass --peak-tflops)."""
    if not name or any(v in name for v in GPU_VARIANTS):
        return None
    return next((peak for key, peak in GPU_PEAK_BF16_TFLOPS if key in name), None)


def resolve_device(requested: str, paddle_gpu: bool, torch_gpu: bool) -> str:
    """cpu or gpu for every case: both frameworks on the same kind of device, or a one-line refusal."""
    if requested == "cpu":
        return "cpu"
    if paddle_gpu and torch_gpu:
        return "gpu"
    if requested == "gpu" or paddle_gpu != torch_gpu:
        missing = [name for name, seen in (("Paddle", paddle_gpu), ("torch", torch_gpu)) if not seen]
        hint = {
            "Paddle": "install paddlepaddle-gpu from PaddlePaddle's index (README.md, Installing on GPU)",
            "torch": "install a CUDA build of torch",
        }
        raise SystemExit(
            f"--device {requested}: {' and '.join(missing)} {'sees' if len(missing) == 1 else 'see'} no CUDA GPU here; "
            f"{'; '.join(hint[m] for m in missing)}, or pass --device cpu"
        )
    return "cpu"


def train_flops_per_token(model: str, seq: int) -> float:
    """Model FLOPs of one trained token (forward + backward): tools/bench_train.py's count
    (6 N_active + 12 L A S) plus the LM head's 6 H V."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_train import flops_per_token

    f = flops_per_token(model_config(model), seq)
    return f["model"] + f["lm_head"]


def _model_of(case: str) -> str:
    if case in LONG_CASES:
        return LONG_CASES[case][0]
    if case.startswith("decode-moe-"):
        return "moe16-top4"
    if case.startswith("decode-tiny-"):
        return "tiny-moe"
    if case.startswith("decode-vl-"):
        return VL_MODEL
    return case.split(":", 1)[1] if case.startswith("train:") else "dense-1024"


def _train_shape(case: str) -> tuple[int, int]:
    """(batch, sequence length) of a training case."""
    return LONG_CASES[case][1] if case in LONG_CASES else TRAIN_SHAPES[_model_of(case)]


# ---- the checkpoint ---------------------------------------------------------------------------
EMBEDDED_CONFIG = os.path.join(ROOT, "examples", "configs", "tiny", "sft.yaml")


def model_config(model: str):
    """erniekit's config of a benchmark model (its fields are transformers' config.json keys)."""
    sys.path.insert(0, ROOT)
    from erniekit.models.ernie4_5.configuration import Ernie4_5Config, get_preset

    if MODELS[model] is None:  # the embedded default's preset and overrides, so the two cannot drift
        import yaml

        with open(EMBEDDED_CONFIG) as f:
            cfg = yaml.safe_load(f)
        return get_preset(cfg["model_name_or_path"]).replace(**(cfg.get("model_overrides") or {}))
    return Ernie4_5Config(**MODELS[model], max_position_embeddings=4096)


def write_checkpoint(model: str, path: str) -> None:
    """Random weights (seed 0) saved by transformers, from the config.json erniekit writes."""
    import torch
    import transformers

    if os.path.isfile(os.path.join(path, "model.safetensors")):
        return
    if model == VL_MODEL:
        torch.manual_seed(0)
        transformers.Ernie4_5_VLMoeForConditionalGeneration(
            transformers.Ernie4_5_VLMoeConfig(**VL_CONFIG)
        ).save_pretrained(path)
        return
    model_config(model).save_pretrained(path)
    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(path))
    m.save_pretrained(path)


# ---- measurements (one per process) -------------------------------------------------------------
def _peak_rss() -> int:
    """This process's peak resident memory (VmHWM: unlike ru_maxrss it does not start from the
    parent's size at fork)."""
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmHWM:"))


def _ids(vocab: int, b: int, s: int, seed: int = 0):
    import numpy as np

    return np.random.default_rng(seed).integers(3, vocab, size=(b, s), dtype=np.int64)


def _vl_prompt():
    """The VL cases' prompt: ids [1, S] (16 text tokens, the image's start, 16 placeholders, its
    end, 16 text tokens), the image's patches [64, 3 * 14 * 14] and its grid."""
    import numpy as np

    r = np.random.default_rng(0)
    text = [r.integers(3, 400, 16).tolist() for _ in range(2)]
    ids = text[0] + [VL_IDS["image_start_token_id"]] + [VL_IDS["image_token_id"]] * 16 + [VL_IDS["image_end_token_id"]]
    return np.array([ids + text[1]]), r.standard_normal((64, 3 * 14 * 14)).astype(np.float32), [[1, 8, 8]]


def _timed(step, warmup: int, steps: int, sync=None) -> float:
    """Seconds per call of `step`; `sync` waits for the device's queued work (GPU) around the clock."""
    sync = sync or (lambda: None)
    for _ in range(warmup):
        step()
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    return (time.perf_counter() - t0) / steps


def erniekit_case(case: str, ckpt: str, steps: int) -> dict:
    import numpy as np
    import paddle

    from erniekit.models.registry import load_model

    if DEVICE == "gpu":
        paddle.set_device("gpu")
    t0 = time.perf_counter()
    model = load_model(ckpt)
    global LOAD_S
    LOAD_S = time.perf_counter() - t0
    ref = os.path.join(ckpt, "torch_logits.npy")
    if os.path.isfile(ref):  # the same model as the torch process timed
        ids = _ids(model.config.vocab_size, 1, 16)
        model.eval()
        with paddle.no_grad():
            got = model(paddle.to_tensor(ids)).logits.numpy()
        want = np.load(ref)
        tol = 1e-3 if DEVICE == "cpu" else 1e-2  # GPUs may take float32 products in TF32
        if not np.allclose(got, want, rtol=tol, atol=tol * max(1.0, float(np.abs(want).max()))):
            raise SystemExit(f"{ckpt}: erniekit and transformers logits differ by {np.abs(got - want).max():.3g}")
    if case.startswith("train:"):
        return _erniekit_train(model, case, steps)
    if case == "prefill":
        ids = paddle.to_tensor(_ids(model.config.vocab_size, 4, 256))
        model.eval()

        def fwd():
            with paddle.no_grad():
                logits = model(ids).logits
                if DEVICE == "cpu":  # on a GPU the clock waits for the device instead of a host copy
                    logits.numpy()

        return {"tokens_per_s": 4 * 256 / _timed(fwd, 1, steps, _paddle_sync())}
    if case.startswith("decode-vl-"):
        from erniekit.infer.chat import pack_for_chat
        from erniekit.infer.vl_generate import generate_vl

        ids, pixels, grid = _vl_prompt()
        packing = pack_for_chat(model, PACKED_WEIGHTS)
        generate_vl(model, ids[0].tolist(), (pixels, grid), 4, [])
        t0 = time.perf_counter()
        out = generate_vl(model, ids[0].tolist(), (pixels, grid), DECODE_NEW, [])  # no stop ids: fixed length
        dt = time.perf_counter() - t0
        assert len(out) == DECODE_NEW
        return {"tokens_per_s": DECODE_NEW / dt, "packing": packing}
    if case.startswith("decode-"):
        from erniekit.infer.chat import pack_for_chat
        from erniekit.infer.generate import generate
        from erniekit.infer.sampling import SamplingParams

        b = int(case.rsplit("-b", 1)[1])
        prompts = _ids(model.config.vocab_size, b, PROMPT_LEN).tolist()
        params = SamplingParams(max_new_tokens=DECODE_NEW)  # greedy, no stop ids: fixed lengths
        packing = pack_for_chat(model, PACKED_WEIGHTS)  # as `erniekit chat` loads a model
        generate(model, prompts, SamplingParams(max_new_tokens=4))
        t0 = time.perf_counter()
        out = generate(model, prompts, params)
        dt = time.perf_counter() - t0
        assert all(len(o) == DECODE_NEW for o in out)
        return {"tokens_per_s": b * DECODE_NEW / dt, "packing": packing}
    return _erniekit_server(model, int(case.split("-c")[1]))


def _paddle_sync():
    import paddle

    return paddle.device.synchronize if DEVICE == "gpu" else None


def _erniekit_train(model, case: str, steps: int) -> dict:
    from types import SimpleNamespace

    import paddle

    from erniekit.train.losses import causal_lm_loss_sum, count_target_tokens, head_fusable, head_loss_sum
    from erniekit.train.optim import build_optimizer
    from erniekit.train.runners.local import amp_context

    b, s = _train_shape(case)
    model.train()
    optim = SimpleNamespace(learning_rate=1e-4, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, weight_decay=0.01)
    opt = build_optimizer(model, optim)
    ids = _ids(model.config.vocab_size, b, s)
    x = paddle.to_tensor(ids)
    n = count_target_tokens({"labels": ids})
    losses = []
    fused = FUSED_HEAD_LOSS == "on" and head_fusable(model)  # as erniekit train's lm_loss decides

    precision = SimpleNamespace(bf16=PRECISION == "bf16", fp16=False)  # as erniekit train's bf16=true

    def step():
        with amp_context(precision):
            out = model(x, skip_head=fused)
            loss_sum = head_loss_sum(model, out.hidden_states, ids)[0] if fused else causal_lm_loss_sum(out.logits, ids)
            loss = loss_sum / n
            if out.aux_loss is not None:
                loss = loss + out.aux_loss
        loss.backward()
        opt.restore_unused_grads()  # as the trainer's step
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))

    dt = _timed(step, 2, steps, _paddle_sync())
    return {"tokens_per_s": b * s / dt, "step_s": dt, "first_loss": losses[0], "fused_head_loss": fused}


class _WrappedTokenizer:
    """The bundled tokenizer (1024 pieces) streaming the text of a 32000-id model: each id decodes as
    the piece id % 1024, so the engine pays a real sentencepiece decode per token. Its length is the
    model's vocabulary: the engine samples among the ids a tokenizer decodes (infer/stops.py)."""

    def __init__(self, inner, vocab: int):
        self.inner, self.vocab = inner, vocab

    def __len__(self) -> int:
        return self.vocab

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.inner.decode([i % self.inner.vocab_size for i in ids], skip_special_tokens)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _erniekit_server(model, concurrent: int) -> dict:
    import threading

    from erniekit.infer.engine import Engine, Request
    from erniekit.infer.sampling import SamplingParams
    from erniekit.infer.weight_packing import packing_choice
    from erniekit.models.ernie4_5.tokenizer import default_tokenizer

    pack, packing = packing_choice(model, PACKED_WEIGHTS)  # the server's own choice
    engine = Engine(
        model,
        _WrappedTokenizer(default_tokenizer(), model.config.vocab_size),
        max_batch=concurrent,
        max_model_len=PROMPT_LEN + SERVER_NEW + 8,
        pack_weights=pack,
    )
    prompts = _ids(model.config.vocab_size, concurrent, PROMPT_LEN).tolist()

    def run(ps):
        left, done, lock, reqs = [len(ps)], threading.Event(), threading.Lock(), []

        def emit(_delta, finish):
            if finish is not None:
                with lock:
                    left[0] -= 1
                    if not left[0]:
                        done.set()

        t0 = time.perf_counter()
        for p in ps:
            r = Request(p, SamplingParams(max_new_tokens=SERVER_NEW), emit)
            reqs.append(r)
            engine.submit(r)
        done.wait(1200)
        wall = time.perf_counter() - t0
        bad = [r.error for r in reqs if r.error or len(r.completion) != SERVER_NEW]
        if bad:
            raise SystemExit(f"server case: {len(bad)} requests did not generate {SERVER_NEW} tokens: {bad[0]}")
        return sum(len(r.completion) for r in reqs), wall

    try:
        run(prompts[:2])
        tokens, wall = run(prompts)
    finally:
        engine.close()
    return {"tokens_per_s": tokens / wall, "packed_weights": pack, "packing": packing}


def torch_case(case: str, ckpt: str, steps: int, threads: int) -> dict:
    import numpy as np
    import torch
    import transformers

    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    vl = _model_of(case) == VL_MODEL
    auto = transformers.Ernie4_5_VLMoeForConditionalGeneration if vl else transformers.AutoModelForCausalLM
    model = auto.from_pretrained(ckpt, dtype=torch.float32)
    global LOAD_S
    LOAD_S = time.perf_counter() - t0
    vocab = model.config.text_config.vocab_size if vl else model.config.vocab_size
    ref = os.path.join(ckpt, "torch_logits.npy")
    if not os.path.isfile(ref):  # the reference is always the CPU's float32 logits
        model.eval()
        with torch.no_grad():
            np.save(ref, model(torch.from_numpy(_ids(vocab, 1, 16))).logits.numpy())
    dev = "cuda" if DEVICE == "gpu" else "cpu"
    t0 = time.perf_counter()
    model.to(dev)
    if DEVICE == "gpu":  # erniekit loads straight onto the device: the copy counts for both
        torch.cuda.synchronize()
        LOAD_S += time.perf_counter() - t0
    sync = torch.cuda.synchronize if DEVICE == "gpu" else None
    if DEVICE == "gpu":  # float32 products in TF32, as Paddle's cuBLAS allows them by default
        torch.backends.cuda.matmul.allow_tf32 = True

    def tensor(a):
        return torch.from_numpy(a).to(dev)

    if case.startswith("train:"):
        b, s = _train_shape(case)
        model.train()
        if hasattr(model.config, "output_router_logits"):
            model.config.output_router_logits = True  # the router loss, as erniekit adds it
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
        x = tensor(_ids(vocab, b, s))
        losses = []
        autocast = torch.autocast(dev, dtype=torch.bfloat16, enabled=PRECISION == "bf16")

        def step():
            with autocast:
                loss = model(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(loss))

        dt = _timed(step, 2, steps, sync)
        return {"tokens_per_s": b * s / dt, "step_s": dt, "first_loss": losses[0]}
    model.eval()
    if case == "prefill":
        x = tensor(_ids(vocab, 4, 256))

        def fwd():
            with torch.no_grad():
                logits = model(x, logits_to_keep=0).logits
                if DEVICE == "cpu":
                    logits.numpy()

        return {"tokens_per_s": 4 * 256 / _timed(fwd, 1, steps, sync)}
    if vl:
        return _torch_vl_decode(model, tensor, sync)
    n_new = DECODE_NEW if case.startswith("decode-") else SERVER_NEW
    b = int(case.rsplit("-b", 1)[1]) if case.startswith("decode-") else int(case.split("-c")[1])
    x = tensor(_ids(vocab, b, PROMPT_LEN))

    def gen(n):
        with torch.no_grad():
            return model.generate(
                input_ids=x,
                attention_mask=torch.ones_like(x),
                do_sample=False,
                max_new_tokens=n,
                min_new_tokens=n,
                pad_token_id=0,
                eos_token_id=None,
            )

    out, dt = _generate_timed(gen, n_new, sync)
    assert out.shape[1] == PROMPT_LEN + n_new
    return {"tokens_per_s": b * n_new / dt}


def _generate_timed(gen, n: int, sync) -> tuple:
    """(gen(n)'s output, its seconds) after a 4-token warm-up; `sync` waits for a GPU's queued work."""
    gen(4)
    t0 = time.perf_counter()
    out = gen(n)
    if sync:
        sync()
    return out, time.perf_counter() - t0


def _torch_vl_decode(model, tensor, sync) -> dict:
    """transformers' greedy `generate` of DECODE_NEW tokens after `_vl_prompt` (its token types as
    its processor marks them: the placeholders vision, the image's start and end vision experts')."""
    import numpy as np
    import torch

    ids, pixels, grid = _vl_prompt()
    mm = (ids == VL_IDS["image_token_id"]).astype(np.int64)
    moe = mm | np.isin(ids, [VL_IDS["image_start_token_id"], VL_IDS["image_end_token_id"]])
    x = tensor(ids)
    kw = dict(
        input_ids=x,
        attention_mask=torch.ones_like(x),
        mm_token_type_ids=tensor(mm),
        moe_mm_token_type_ids=tensor(moe.astype(np.int64)),
        pixel_values=tensor(pixels),
        image_grid_thw=tensor(np.array(grid)),
    )

    def gen(n):
        with torch.no_grad():
            return model.generate(
                **kw, do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=0, eos_token_id=None
            )

    out, dt = _generate_timed(gen, DECODE_NEW, sync)
    assert out.shape[1] == ids.shape[1] + DECODE_NEW
    return {"tokens_per_s": DECODE_NEW / dt}


def probe(framework: str) -> dict:
    """Whether this framework sees a CUDA GPU here, and the GPU's name."""
    if framework == "torch":
        import torch

        gpu = torch.cuda.is_available() and torch.cuda.device_count() > 0
        return {"gpu": gpu, "name": torch.cuda.get_device_name(0) if gpu else None}
    sys.path.insert(0, ROOT)
    from erniekit.utils.paddle_import import import_paddle

    import_paddle()
    import paddle

    gpu = paddle.device.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0
    return {"gpu": gpu, "name": paddle.device.cuda.get_device_name(0) if gpu else None}


def worker(args: argparse.Namespace) -> None:
    global PACKED_WEIGHTS, FUSED_HEAD_LOSS, DEVICE, PRECISION
    if args.probe:
        print("RESULT " + json.dumps(probe(args.framework)), flush=True)
        return
    PACKED_WEIGHTS, FUSED_HEAD_LOSS = args.packed_weights, args.fused_head_loss
    DEVICE, PRECISION = args.device, args.precision
    ckpt = os.path.join(args.workdir, _model_of(args.case))
    if args.framework == "torch":
        res = torch_case(args.case, ckpt, args.steps, args.threads)
        if DEVICE == "gpu":
            import torch

            res["peak_device_bytes"] = int(torch.cuda.max_memory_allocated())
    else:
        sys.path.insert(0, ROOT)
        from erniekit.utils.paddle_import import import_paddle

        import_paddle()
        res = erniekit_case(args.case, ckpt, args.steps)
        if DEVICE == "gpu":
            import paddle

            res["peak_device_bytes"] = int(paddle.device.cuda.max_memory_allocated())
    res["peak_rss_bytes"] = _peak_rss()
    res["load_s"] = LOAD_S
    print("RESULT " + json.dumps(res), flush=True)


# ---- orchestration ------------------------------------------------------------------------------
def _run_one(framework: str, case: str, args: argparse.Namespace, extra: tuple[str, ...] = ()) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--framework", framework, "--case", case]
    cmd += ["--workdir", args.workdir, "--threads", str(args.threads), "--steps", str(args.steps)]
    cmd += ["--packed-weights", args.packed_weights, "--fused-head-loss", args.fused_head_loss]
    cmd += ["--device", args.device, "--precision", args.precision, *extra]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if p.returncode or line is None:
        raise SystemExit(f"{framework} {case} failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
    return json.loads(line[len("RESULT ") :])


def _summary(vals: list[float]) -> dict:
    return {"min": min(vals), "median": statistics.median(vals), "max": max(vals)}


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--cases",
        default="all",
        help=f"comma-separated subset of {', '.join(CASES)}, or {', '.join(LONG_CASES)} (default: all but that)",
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=5, help="timed steps of a training or prefill case")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--workdir", default=os.path.join(ROOT, "output", "bench_vs_torch"))
    p.add_argument("--out", default=os.path.join(ROOT, "bench_results", "vs_torch.json"))
    sys.path.insert(0, ROOT)
    from erniekit.cli import add_packed_weights_flag  # paddle-free: the flag as chat and the server take it

    add_packed_weights_flag(p, "decode and server cases, as `erniekit chat` / `server`")
    p.add_argument(
        "--fused-head-loss",
        choices=("on", "off"),
        default="on",
        help="training cases: the head and its loss chunk by chunk without the batch's logits, as "
        "erniekit train does by default (fused_head_loss)",
    )
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "gpu"),
        default="auto",
        help="auto (default): the GPU when Paddle and torch both see one, else the CPU",
    )
    p.add_argument(
        "--precision",
        choices=("auto", "fp32", "bf16"),
        default="auto",
        help="training cases: bf16 autocast (GPU only) or float32; auto: bf16 on a GPU, fp32 on the CPU",
    )
    p.add_argument(
        "--peak-tflops",
        type=float,
        help="the device's peak for MFU (default: a GPU's datasheet dense bf16 peak by name; none on CPU)",
    )
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--framework", choices=("erniekit", "torch"), help=argparse.SUPPRESS)
    p.add_argument("--case", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    cases = CASES if args.cases == "all" else args.cases.split(",")
    unknown = [c for c in cases if c not in CASES and c not in LONG_CASES]
    if unknown:
        raise SystemExit(f"--cases: unknown {unknown}; choose from {', '.join([*CASES, *LONG_CASES])}")
    if args.peak_tflops is not None and args.peak_tflops <= 0:
        raise SystemExit(f"--peak-tflops {args.peak_tflops}: give the device's peak in TFLOP/s (> 0)")
    seen = {"erniekit": {"gpu": False, "name": None}, "torch": {"gpu": False, "name": None}}
    if args.device != "cpu":
        seen = {fw: _run_one(fw, "probe", args, ("--probe",)) for fw in seen}
    args.device = resolve_device(args.device, seen["erniekit"]["gpu"], seen["torch"]["gpu"])
    if args.precision == "auto":
        args.precision = "bf16" if args.device == "gpu" else "fp32"
    if args.precision == "bf16" and args.device == "cpu":
        raise SystemExit("--precision bf16 needs a GPU (erniekit trains in float32 on the CPU); pass fp32 or auto")
    gpu_name = seen["torch"]["name"] if args.device == "gpu" else None
    peak = args.peak_tflops or (gpu_peak_tflops(gpu_name) if args.precision == "bf16" else None)
    if args.device == "gpu" and peak is None:
        print(f"no known peak for {gpu_name} in {args.precision}: pass --peak-tflops for MFU", flush=True)
    for m in sorted({_model_of(c) for c in cases}):
        write_checkpoint(m, os.path.join(args.workdir, m))
    runs: dict[str, dict[str, list[dict]]] = {c: {"erniekit": [], "torch": []} for c in cases}
    for r in range(args.repeats):
        for c in cases:
            order = ("torch", "erniekit") if r % 2 == 0 else ("erniekit", "torch")  # torch writes the reference first
            for fw in order:
                res = _run_one(fw, c, args)
                runs[c][fw].append(res)
                print(f"repeat {r + 1} {c:14s} {fw:8s} {res['tokens_per_s']:9.1f} tokens/s", flush=True)
    out = {
        "cpu": _cpu(),
        "device": args.device,
        "gpu": gpu_name,
        "precision": args.precision,
        "peak_tflops": peak,
        "reference_mfu": ERNIE45_MFU,
        "threads": args.threads,
        "repeats": args.repeats,
        "steps": args.steps,
        "packed_weights": args.packed_weights,
        "fused_head_loss": args.fused_head_loss,
        "malloc_mmap_mb": os.environ.get("ERNIEKIT_MALLOC_MMAP_MB") or None,  # erniekit/utils/malloc.py
        "versions": _versions(),
        "cases": {},
    }
    memory = "peak_device_bytes" if args.device == "gpu" else "peak_rss_bytes"  # what the ratio compares
    for c in cases:
        e = _summary([x["tokens_per_s"] for x in runs[c]["erniekit"]])
        t = _summary([x["tokens_per_s"] for x in runs[c]["torch"]])
        row = {
            "erniekit_tokens_per_s": e,
            "torch_tokens_per_s": t,
            "ratio_erniekit_over_torch": e["median"] / t["median"],
        }
        for key in ("peak_rss_bytes", memory):
            for fw in ("erniekit", "torch"):
                row[f"{fw}_{key}"] = _summary([x[key] for x in runs[c][fw]])
        row["memory_ratio"] = row[f"erniekit_{memory}"]["median"] / row[f"torch_{memory}"]["median"]
        if all("load_s" in x for fw in ("erniekit", "torch") for x in runs[c][fw]):  # older records lack it
            for fw in ("erniekit", "torch"):
                row[f"{fw}_load_s"] = _summary([x["load_s"] for x in runs[c][fw]])
            row["load_speedup"] = row["torch_load_s"]["median"] / row["erniekit_load_s"]["median"]
        line = f"{c:14s} erniekit/torch {row['ratio_erniekit_over_torch']:.2f}x  memory {row['memory_ratio']:.2f}x"
        if "load_speedup" in row:
            line += f"  load {row['load_speedup']:.2f}x faster"
        if c.startswith("train:"):
            row["model_flops_per_token"] = flops = train_flops_per_token(_model_of(c), _train_shape(c)[1])
            for fw in ("erniekit", "torch"):
                for r in runs[c][fw]:
                    r["model_tflops"] = r["tokens_per_s"] * flops / 1e12
                    if peak:
                        r["mfu"] = r["model_tflops"] / peak
                if peak:
                    row[f"{fw}_mfu"] = _summary([r["mfu"] for r in runs[c][fw]])
            if peak:
                line += f"  MFU {row['erniekit_mfu']['median']:.1%} / {row['torch_mfu']['median']:.1%}"
        row["runs"] = runs[c]
        out["cases"][c] = row
        print(line)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.out}")


def _versions() -> dict:
    out = {}
    for mod in ("paddle", "torch", "transformers"):
        r = subprocess.run(
            [sys.executable, "-c", f"import {mod}; print({mod}.__version__)"], capture_output=True, text=True
        )
        out[mod] = r.stdout.strip() or None
    return out


if __name__ == "__main__":
    main()
