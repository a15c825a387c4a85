"""`paddle` / `onnx`: the decoding step as a static graph for paddle.inference / onnxruntime
(erniekit/export/static.py)."""

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


def _write(model, tokenizer, out: str, info: dict, options: ExportOptions) -> None:
    from erniekit.export.static import MODEL_PREFIX, save_onnx, save_static
    from erniekit.models.hf_files import STAGING_NAME, publish_model_files, start_staging
    from erniekit.utils.io import atomic_write_json, write_errors

    fmt = info["format"]
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
    if fmt == "onnx":  # in place of paddle2onnx's line, which named the staging directory
        print(f"ONNX model saved in {os.path.join(out, MODEL_PREFIX + '.onnx')}", flush=True)


def _verify(out: str, info: dict, ref_model, tokenizer, atol: float | None) -> dict:
    """The exported step against eager: the prefill's last logits and 4 decode steps on the eager
    greedy tokens, for each fixed prompt."""
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
    return verify_report(info, max(diffs), top, float(np.mean(agree)), atol, 1e-4)


register_export_format(
    ExportFormat(
        name="paddle",
        help="paddle: the decoding step as a static graph for paddle.inference",
        write=_write,
        verify=_verify,
    )
)
register_export_format(
    ExportFormat(name="onnx", help="onnx: the same for onnxruntime (needs paddle2onnx)", write=_write, verify=_verify)
)
