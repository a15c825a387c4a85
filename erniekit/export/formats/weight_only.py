"""`wint8` / `wint4`: the Hugging Face layout with the decoder's matrices weight-only quantized
(int8 per channel / int4 per group; erniekit/nn/weight_only.py), for erniekit's engine."""

from __future__ import annotations

from erniekit.errors import CheckpointError
from erniekit.export.formats import ExportFormat, ExportOptions, register_export_format
from erniekit.export.formats.hf import verify_layout, write_layout


def _writer(bits: int):
    def write(model, tokenizer, out: str, info: dict, options: ExportOptions) -> None:
        import paddle

        from erniekit.models.registry import model_state
        from erniekit.nn.weight_only import quantize_state

        full = {k: v.numpy() for k, v in model_state(model, "float32").items()}
        try:
            quant, n = quantize_state(full, bits, options.group_size)
        except ValueError as e:
            raise CheckpointError(f"export --format {info['format']}: {e}; choose --group-size accordingly") from None
        info.update(bits=bits, group_size=options.group_size if bits == 4 else None, quantized_matrices=n)
        write_layout(model, tokenizer, out, info, options, state={k: paddle.to_tensor(v) for k, v in quant.items()})

    return write


register_export_format(
    ExportFormat(
        name="wint8",
        help="wint8: hf with the decoder's matrices int8 per channel (erniekit's engine)",
        write=_writer(8),
        verify=lambda out, info, ref, tok, atol: verify_layout(out, info, ref, tok, atol, 0.05),
        shards=True,
    )
)
register_export_format(
    ExportFormat(
        name="wint4",
        help="wint4: the same, int4 per group of --group-size inputs",
        write=_writer(4),
        verify=lambda out, info, ref, tok, atol: verify_layout(out, info, ref, tok, atol, 0.25),
        shards=True,
    )
)
