"""`erniekit export`: a self-contained Hugging Face-layout directory (what FastDeploy and
transformers read): LoRA merged into the base, config, generation config, tokenizer with its chat
template, safetensors sharded above `max_shard_size`. `wint8` / `wint4` write the same layout with
the decoder's matrices weight-only quantized (erniekit/nn/weight_only.py; erniekit loads them
dequantized). Every export records its source in `export_info.json`, which `--verify` reads."""

from __future__ import annotations

import os

from erniekit.errors import CheckpointError

INFO_NAME = "export_info.json"
FORMATS = ("hf", "wint8", "wint4", "paddle", "onnx")
VERIFY_PROMPTS = ("1+2=", "What is 7 plus 5?", "Hello, ERNIE.")  # what --verify compares the logits on


def _load_source(src: str, elastic=None):
    from erniekit.models.ernie4_5.checkpoint import load_model_or_adapter
    from erniekit.models.ernie4_5.tokenizer import ErnieTokenizer

    tokenizer = ErnieTokenizer.from_pretrained(src)
    model = load_model_or_adapter(src)
    if elastic is not None and not elastic.is_full:
        from erniekit.elastic.submodels import extract_submodel

        model = extract_submodel(model, elastic)
    model.eval()
    return model, tokenizer


def check_output(src: str, out: str, force: bool = False) -> None:
    """Before any loading: `out` must not be the source, not a file, and new or empty unless `force`
    (an export over an earlier one would silently mix their files), and must be writable."""
    if os.path.abspath(src) == os.path.abspath(out):
        raise CheckpointError(f"export: --output {out} is the source directory; choose a new directory")
    if os.path.lexists(out) and not os.path.isdir(out):
        raise CheckpointError(f"export: --output {out} is a file, not a directory; choose a new directory")
    if os.path.isdir(out) and os.listdir(out) and not force:
        raise CheckpointError(
            f"export: --output {out} is not empty; choose a new directory, or add --force to "
            "replace the model files in it"
        )
    probe = os.path.abspath(out)
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe) or not os.access(probe, os.W_OK | os.X_OK):
        raise CheckpointError(
            f"export: cannot write {out}: {probe} is not a writable directory; choose another --output"
        )


def export_hf(
    src: str,
    out: str,
    max_shard_size: str = "5GB",
    dtype: str | None = None,
    elastic=None,
    fmt: str = "hf",
    group_size: int = 64,
    force: bool = False,
) -> str:
    """`elastic` (an erniekit.elastic.submodels.ElasticSpec) writes that sub-model as an ordinary smaller checkpoint.
    `force` writes into a non-empty `out` (the weights are replaced atomically: old or new, never mixed)."""
    import paddle

    from erniekit.models.ernie4_5.checkpoint import hf_state_dict, save_pretrained
    from erniekit.utils.io import atomic_write_json, write_errors

    check_output(src, out, force)
    model, tokenizer = _load_source(src, elastic)
    state, info = None, {"source": os.path.abspath(src), "format": fmt}
    if elastic is not None and not elastic.is_full:
        info["elastic"] = {"depth": elastic.depth, "experts": elastic.experts, "top_k": elastic.top_k}
    if fmt in ("paddle", "onnx"):
        from erniekit.export.static import save_onnx, save_static
        from erniekit.models.ernie4_5.checkpoint import STAGING_NAME, publish_model_files, start_staging

        needed = sum(int(p.numel()) * p.element_size() for p in model.parameters())
        with write_errors(f"the {fmt} export", out, needed, partial=os.path.join(out, STAGING_NAME)):
            staging = start_staging(out)  # no half-written file ever sits under its final name
            model.config.save_pretrained(staging)
            tokenizer.save_pretrained(staging)
            save_static(model, staging)
            if fmt == "onnx":
                save_onnx(staging)
            atomic_write_json(os.path.join(staging, INFO_NAME), info)
            publish_model_files(staging, out)
        return out
    if fmt in ("wint8", "wint4"):
        from erniekit.nn.weight_only import quantize_state

        bits = 8 if fmt == "wint8" else 4
        full = {k: v.numpy() for k, v in hf_state_dict(model, "float32").items()}
        try:
            quant, n = quantize_state(full, bits, group_size)
        except ValueError as e:
            raise CheckpointError(f"export --format {fmt}: {e}; choose --group-size accordingly") from None
        state = {k: paddle.to_tensor(v) for k, v in quant.items()}
        info.update(bits=bits, group_size=group_size if bits == 4 else None, quantized_matrices=n)
    save_pretrained(model, out, tokenizer=tokenizer, max_shard_size=max_shard_size, dtype=dtype, state=state)
    atomic_write_json(os.path.join(out, INFO_NAME), info)
    return out


def verify(out: str, atol: float | None = None) -> dict:
    """Reload an exported directory and compare its logits with its source's on fixed prompts:
    {max_abs_diff, max_logit, same_greedy (argmax agreement), tolerance, ok}."""
    import numpy as np
    import paddle

    from erniekit.elastic.submodels import ElasticSpec
    from erniekit.models.ernie4_5.checkpoint import load_model_or_adapter

    info_file = os.path.join(out, INFO_NAME)
    if not os.path.isfile(info_file):
        raise CheckpointError(f"{out}: no {INFO_NAME}; --verify checks a directory written by erniekit export")
    from erniekit.utils.io import read_json_object

    info = read_json_object(info_file, "re-run erniekit export to rewrite it")
    src = info.get("source")
    if not isinstance(src, str) or info.get("format") not in FORMATS:
        raise CheckpointError(
            f"{info_file}: needs 'source' (a directory) and 'format' (one of {', '.join(FORMATS)}); "
            "re-run erniekit export to rewrite it"
        )
    if not os.path.isdir(src):
        raise CheckpointError(f"{out}: its source {src} is gone; --verify needs the source to compare with")
    el = info.get("elastic")
    ref_model, tokenizer = _load_source(src, ElasticSpec(**el) if el else None)
    if info["format"] in ("paddle", "onnx"):
        return _verify_static(out, info, ref_model, tokenizer, atol)
    got_model = load_model_or_adapter(out)
    got_model.eval()
    ids = [tokenizer.encode(t) for t in VERIFY_PROMPTS]
    L = max(len(i) for i in ids)
    batch = paddle.to_tensor([[0] * (L - len(i)) + i for i in ids], dtype="int64")
    mask = paddle.to_tensor([[0] * (L - len(i)) + [1] * len(i) for i in ids], dtype="int64")
    with paddle.no_grad():
        a = ref_model(batch, attention_mask=mask).logits.astype("float32").numpy()
        b = got_model(batch, attention_mask=mask).logits.astype("float32").numpy()
    real = mask.numpy().astype(bool)
    a, b = a[real], b[real]
    diff = float(np.abs(a - b).max())
    tol = (
        atol
        if atol is not None
        else {"hf": 1e-4, "wint8": 0.05, "wint4": 0.25}.get(info["format"], 1e-4) * max(1.0, float(np.abs(a).max()))
    )
    same = float((a.argmax(-1) == b.argmax(-1)).mean())
    return {
        "format": info["format"],
        "source": src,
        "max_abs_diff": diff,
        "max_logit": float(np.abs(a).max()),
        "same_greedy": same,
        "tolerance": tol,
        "ok": diff <= tol,
    }


def _verify_static(out: str, info: dict, ref_model, tokenizer, atol: float | None) -> dict:
    """The exported step (paddle.inference / onnxruntime) against eager: the prefill's last logits
    and 4 decode steps on the eager greedy tokens, for each fixed prompt."""
    import numpy as np

    from erniekit.export.static import StepRunner, reference_logits

    runner = StepRunner(out, info["format"], ref_model.config)
    diffs, agree, top = [], [], 0.0
    for text in VERIFY_PROMPTS:
        ids = tokenizer.encode(text)
        want, toks = reference_logits(ref_model, ids, 4)
        got = [runner.prefill(ids)] + [runner.decode(t) for t in toks[:-1]]
        for a, b in zip(want, got):
            diffs.append(float(np.abs(a - b).max()))
            agree.append(int(a.argmax()) == int(b.argmax()))
            top = max(top, float(np.abs(a).max()))
    tol = atol if atol is not None else 1e-4 * max(1.0, top)
    diff = max(diffs)
    return {
        "format": info["format"],
        "source": info["source"],
        "max_abs_diff": diff,
        "max_logit": top,
        "same_greedy": float(np.mean(agree)),
        "tolerance": tol,
        "ok": diff <= tol,
    }
