"""`paddle-layout`: the checkpoint layout of the `-Paddle` repositories (fused qkv_proj /
up_gate_proj, [in, out] weights, `ernie.` names; erniekit/models/ernie4_5/paddle_layout.py), with
the config.json FastDeploy reads as a Paddle checkpoint (`dtype`, no `torch_dtype`). erniekit loads
it back like any checkpoint; `--verify` does so and compares logits with the source."""

from __future__ import annotations

import contextlib
import os

from erniekit.errors import CheckpointError
from erniekit.export.formats import (
    INFO_NAME,
    ExportFormat,
    ExportOptions,
    register_export_format,
    relative_tolerance,
)
from erniekit.export.formats.hf import verify_layout

NAME = "paddle-layout"
_TEXT_TYPES = ("ernie4_5", "ernie4_5_moe")


@contextlib.contextmanager
def _written_as_paddle(model, dtype: str):
    """While saving, the model's config writes the FastDeploy flavour of config.json; everything
    else save_pretrained writes (generation config, tokenizer, shards, atomic publish) is shared."""
    from erniekit.models.ernie4_5.paddle_layout import paddle_config

    original = model.config
    model.config = paddle_config(original, dtype)
    try:
        yield
    finally:
        model.config = original


def _write(model, tokenizer, out: str, info: dict, options: ExportOptions) -> None:
    from erniekit.models.ernie4_5.paddle_layout import check_supported, paddle_state_dict
    from erniekit.models.registry import save_model
    from erniekit.utils.io import atomic_write_json

    if model.config.model_type not in _TEXT_TYPES:
        raise CheckpointError(
            f"export --format {NAME}: model_type={model.config.model_type!r} is not an ERNIE 4.5 text model; "
            "use --format hf"
        )
    check_supported(model.config, f"export --format {NAME}")
    dtype = options.dtype or str(model.model.embed_tokens.weight.dtype).replace("paddle.", "")
    state = paddle_state_dict(model, options.dtype)
    info["dtype"] = dtype
    with _written_as_paddle(model, dtype):
        save_model(model, out, tokenizer=tokenizer, max_shard_size=options.max_shard_size, state=state)
    atomic_write_json(os.path.join(out, INFO_NAME), info)


def _verify(out: str, info: dict, ref_model, tokenizer, atol: float | None) -> dict:
    """The export must be in the Paddle layout with FastDeploy's config keys, and reload (as
    erniekit loads any checkpoint) to the source's logits within the relative tolerance of the dtype
    it was written in (bfloat16 rounding alone moved tiny-moe's logits 2.6% and can flip a router's
    choice; a misplaced block moves them by their whole size)."""
    from erniekit.models.ernie4_5.paddle_layout import ARCHITECTURES, checkpoint_tensor_names, is_paddle_layout
    from erniekit.utils.io import read_json_object

    config = read_json_object(os.path.join(out, "config.json"), f"re-run erniekit export --format {NAME}")
    arch = ARCHITECTURES.get(config.get("model_type"))
    if "torch_dtype" in config or "dtype" not in config or config.get("architectures") != [arch]:
        raise CheckpointError(
            f"{os.path.join(out, 'config.json')}: not FastDeploy's Paddle flavour (needs dtype, no torch_dtype, "
            f"architectures [{arch}]); re-run erniekit export --format {NAME}"
        )
    if not is_paddle_layout(checkpoint_tensor_names(out)):
        raise CheckpointError(
            f"{out}: no fused qkv_proj / up_gate_proj tensors; re-run erniekit export --format {NAME}"
        )
    return verify_layout(out, info, ref_model, tokenizer, atol, relative_tolerance(info.get("dtype", "float32"), out))


register_export_format(
    ExportFormat(
        name=NAME,
        help=f"{NAME}: the -Paddle checkpoint layout (fused qkv/up_gate, [in,out]) FastDeploy and PaddleFormers read",
        write=_write,
        verify=_verify,
        dtypes=("float32", "bfloat16", "float16"),
        shards=True,
    )
)
