"""`hf`: the Hugging Face layout (what FastDeploy and transformers read)."""

from __future__ import annotations

import os

from erniekit.export.formats import (
    INFO_NAME,
    VERIFY_PROMPTS,
    ExportFormat,
    ExportOptions,
    register_export_format,
    verify_report,
)


def write_layout(model, tokenizer, out: str, info: dict, options: ExportOptions, state=None) -> None:
    """config, generation config, tokenizer with its chat template, safetensors (`state` replaces
    the model's own tensors), export_info.json."""
    from erniekit.models.registry import save_model
    from erniekit.utils.io import atomic_write_json

    save_model(model, out, tokenizer=tokenizer, max_shard_size=options.max_shard_size, dtype=options.dtype, state=state)
    atomic_write_json(os.path.join(out, INFO_NAME), info)


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
    same = float((a.argmax(-1) == b.argmax(-1)).mean())
    return verify_report(info, float(np.abs(a - b).max()), float(np.abs(a).max()), same, atol, relative_tolerance)


register_export_format(
    ExportFormat(
        name="hf",
        help="hf: Hugging Face layout (FastDeploy, transformers)",
        write=write_layout,
        verify=lambda out, info, ref, tok, atol: verify_layout(out, info, ref, tok, atol, 1e-4),
    )
)
