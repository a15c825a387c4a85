"""`hf`: the Hugging Face layout (what FastDeploy and transformers read)."""

from __future__ import annotations

import os

from erniekit.export.formats import (
    INFO_NAME,
    VERIFY_PROMPTS,
    ExportFormat,
    ExportOptions,
    register_export_format,
    relative_tolerance,
    verify_report,
)


def write_layout(model, tokenizer, out: str, info: dict, options: ExportOptions, state=None) -> None:
    """config, generation config, tokenizer with its chat template, safetensors (`state` replaces
    the model's own tensors), export_info.json with the weights' dtype (what --verify's tolerance
    depends on)."""
    from erniekit.models.registry import save_model
    from erniekit.utils.io import atomic_write_json

    info.setdefault(
        "dtype", options.dtype or _narrowest_dtype(state.values() if state is not None else model.parameters())
    )
    save_model(model, out, tokenizer=tokenizer, max_shard_size=options.max_shard_size, dtype=options.dtype, state=state)
    atomic_write_json(os.path.join(out, INFO_NAME), info)


def _narrowest_dtype(tensors) -> str:
    """The float dtype with the fewest mantissa bits among `tensors` (float32 when all are wider or
    integer): the one whose rounding bounds the export's error."""
    found = {str(t.dtype).replace("paddle.", "") for t in tensors}
    return next((d for d in ("bfloat16", "float16") if d in found), "float32")


def verify_layout(out: str, info: dict, ref_model, tokenizer, atol: float | None, relative_tolerance: float) -> dict:
    """Reload `out` as erniekit loads any checkpoint and compare its logits with the source's on
    fixed prompts; the tolerance is relative to the largest logit unless `atol` is given."""
    import numpy as np
    import paddle

    from erniekit.models.registry import load_model_or_adapter

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
    theirs = None
    if hasattr(ref_model, "visual_features"):  # a vision-language model: a prompt with a picture too
        from erniekit.export import vl_check

        probe = vl_check.vl_probe(ref_model, tokenizer)
        ref_image = vl_check.our_logits(ref_model, probe)
        a = np.concatenate([a, ref_image])
        b = np.concatenate([b, vl_check.our_logits(got_model, probe)])
        theirs = vl_check.transformers_logits(out, ref_model, probe)
    same = float((a.argmax(-1) == b.argmax(-1)).mean())
    report = verify_report(info, float(np.abs(a - b).max()), float(np.abs(a).max()), same, atol, relative_tolerance)
    if theirs is not None:  # transformers read the export: its logits against the source's
        diff = float(np.abs(theirs - ref_image).max())
        report["transformers_max_abs_diff"] = diff
        report["ok"] = report["ok"] and diff <= report["tolerance"]
    elif hasattr(ref_model, "visual_features"):
        report["transformers_max_abs_diff"] = None  # transformers with ernie4_5_vl_moe is not installed
    return report


def _verify(out: str, info: dict, ref_model, tokenizer, atol: float | None) -> dict:
    """Within the tolerance of the dtype the export recorded; an export written before erniekit
    recorded it: of the narrowest float dtype its safetensors headers declare."""
    from erniekit.models.hf_files import stored_float_dtype

    dtype = info.get("dtype") or stored_float_dtype(out)
    return verify_layout(out, info, ref_model, tokenizer, atol, relative_tolerance(dtype, out))


register_export_format(
    ExportFormat(
        name="hf",
        help="hf: Hugging Face layout (FastDeploy, transformers)",
        write=write_layout,
        verify=_verify,
        dtypes=("float32", "bfloat16", "float16"),
        shards=True,
    )
)
