"""`gguf`: one GGUF file for llama.cpp (and what runs on it: Ollama, LM Studio, llama-cpp-python),
with the tokenizer and chat template inside, and an Ollama Modelfile beside it (docs/gguf.md).

--dtype float32 (default) / float16 / bfloat16 / q8_0 sets the matrices' type; as llama.cpp's
converter does, 1-D tensors, norms and the MoE router stay float32, and a q8_0 matrix whose rows
are not a multiple of 32 is written float16. `--verify` reads the file back with gguf's reader,
dequantizes it into an erniekit model and compares its logits with the source's.

The file is written tensor by tensor (`write_tensors`): every tensor's info is known from the
parameters' shapes, so the header goes first and each tensor is then read from the model, encoded,
written and dropped: beyond the loaded model the export holds about one output tensor (the largest
is a MoE layer's stacked experts or the embedding), not a copy of the model.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from erniekit.errors import CheckpointError
from erniekit.export.formats import (
    INFO_NAME,
    RELATIVE_TOLERANCE,
    ExportFormat,
    ExportOptions,
    register_export_format,
)

GGUF_NAME = "model.gguf"
# --dtype -> (GGML type of the matrices, general.file_type, --verify's tolerance relative to the largest logit)
TYPES = {
    None: ("F32", "ALL_F32", RELATIVE_TOLERANCE["float32"]),
    "float32": ("F32", "ALL_F32", RELATIVE_TOLERANCE["float32"]),
    "float16": ("F16", "MOSTLY_F16", RELATIVE_TOLERANCE["float16"]),
    "bfloat16": ("BF16", "MOSTLY_BF16", RELATIVE_TOLERANCE["bfloat16"]),
    "q8_0": ("Q8_0", "MOSTLY_Q8_0", 5e-2),
}


def tensor_type(name: str, shape: Sequence[int], matrix_type: str) -> str:
    """The GGML type one tensor is stored in, by the converter's rules (see the module doc)."""
    import gguf

    if len(shape) <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight"):
        return "F32"
    if name.startswith("blk.") and name.endswith(".ffn_gate_inp.weight"):  # the MoE router
        return "F32"
    if matrix_type == "Q8_0" and shape[-1] % gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_0][0]:
        return "F16"
    return matrix_type


def encoded_nbytes(shape: Sequence[int], type_name: str) -> int:
    """The bytes of a tensor of `shape` in GGML type `type_name`, known before it is encoded."""
    import math

    import gguf

    return math.prod(gguf.quants.quant_shape_to_byte_shape(shape, gguf.GGMLQuantizationType[type_name]))


def encode(array, type_name: str):
    """The bytes (as a numpy array) of `array` in GGML type `type_name` (Q8_0 per GGML's block_q8_0:
    32 values, one float16 scale amax/127, int8 round(x/scale); bit-exact with ggml-quants.c)."""
    import gguf
    import numpy as np

    qtype = gguf.GGMLQuantizationType[type_name]
    return gguf.quants.quantize(np.ascontiguousarray(array, dtype=np.float32), qtype)


def write_tensors(writer, model, planned: list, types: list[str], sizes: list[int]) -> None:
    """Declare every tensor, write the header, metadata and tensor infos, then each tensor's data:
    read from its parameter, encoded, written and dropped before the next one is read, so the
    export holds one output tensor at a time besides the model (a gguf.GGUFWriter whose metadata
    is set and no tensor added)."""
    import gguf
    import numpy as np

    from erniekit.export import gguf_model

    for t, ty, n in zip(planned, types, sizes):
        # the float32 numpy dtype only says `t.shape` is the logical shape (a uint8 one would be bytes)
        writer.add_tensor_info(t.name, t.shape, np.float32, n, raw_dtype=gguf.GGMLQuantizationType[ty])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    params = dict(model.named_parameters())
    for t, ty in zip(planned, types):
        value = gguf_model.read(params[t.param], t.layout)
        if value.shape != t.shape:  # its tensor info is written already: the file would be corrupt
            raise CheckpointError(
                f"export --format gguf: {t.param} gave {t.name} the shape {list(value.shape)}, its tensor info "
                f"says {list(t.shape)}; this is an erniekit bug: report it"
            )
        data = encode(value, ty)
        del value
        writer.write_tensor_data(data)  # checks the byte count against the tensor info
        del data  # before the next tensor is read


def _write(model, tokenizer, out: str, info: dict, options: ExportOptions) -> None:
    import tempfile

    import gguf

    from erniekit.export import gguf_model, ollama
    from erniekit.export.gguf_vocab import sentencepiece_vocab, write_vocab
    from erniekit.models.generation_config import generation_config
    from erniekit.utils.io import atomic_write_json, atomic_write_text, write_errors

    if options.dtype not in TYPES:
        raise CheckpointError(
            f"export --format gguf: --dtype {options.dtype} is not one of float32, float16, bfloat16, q8_0"
        )
    config = model.config
    gguf_model.check_supported(config)
    matrix_type, file_type, _ = TYPES[options.dtype]
    planned = gguf_model.plan(model)
    types = [tensor_type(t.name, t.shape, matrix_type) for t in planned]
    sizes = [encoded_nbytes(t.shape, ty) for t, ty in zip(planned, types)]
    eot = ollama.end_of_turn(tokenizer)
    with tempfile.TemporaryDirectory() as tok_dir:
        tokenizer.save_pretrained(tok_dir)
        vocab = sentencepiece_vocab(tok_dir, config.vocab_size, end_of_turn=eot)
    os.makedirs(out, exist_ok=True)
    partial = os.path.join(out, f".{GGUF_NAME}.tmp")
    with write_errors("the GGUF file", out, sum(sizes), partial=partial):
        w = gguf.GGUFWriter(partial, gguf.MODEL_ARCH_NAMES[gguf_model.arch_of(config)])
        try:
            w.add_name(os.path.basename(os.path.normpath(info["source"])))
            w.add_file_type(gguf.LlamaFileType[file_type])
            w.add_quantization_version(gguf.GGML_QUANT_VERSION)
            gguf_model.write_hparams(w, config)
            write_vocab(w, vocab)
            write_tensors(w, model, planned, types, sizes)
        finally:
            w.close()
        os.replace(partial, os.path.join(out, GGUF_NAME))
    # the decoding defaults and turn-end ids the HF export writes (the source's, greedy without one)
    generation = generation_config(model, tokenizer)
    eos = generation.get("eos_token_id", [])
    eos = [*config.eos_token_ids, *(eos if isinstance(eos, list) else [eos])]
    stops = ([eot] if eot else []) + [
        tokenizer.convert_ids_to_tokens(i) for i in eos if isinstance(i, int) and 0 <= i < config.vocab_size
    ]
    text = ollama.modelfile(GGUF_NAME, ollama.go_template(tokenizer), stops, ollama.sampling(generation))
    atomic_write_text(os.path.join(out, ollama.MODELFILE_NAME), text)
    counts: dict[str, int] = {}
    for ty in types:
        counts[ty] = counts.get(ty, 0) + 1
    info.update(
        file=GGUF_NAME,
        architecture=gguf.MODEL_ARCH_NAMES[gguf_model.arch_of(config)],
        dtype=options.dtype or "float32",
        tensor_types=counts,
        end_of_turn=eot,
        mtp_heads_left_out=bool(config.num_nextn_predict_layers),
    )
    atomic_write_json(os.path.join(out, INFO_NAME), info)


def read_gguf(path: str):
    """(config, Hugging Face-named float32 state) of a GGUF file written by `_write`."""
    import gguf
    import numpy as np

    from erniekit.export import gguf_model

    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: no GGUF file; re-run erniekit export --format gguf")
    reader = gguf.GGUFReader(path)
    tensors = {t.name: np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type)) for t in reader.tensors}
    config = gguf_model.config_from_gguf(reader, has_output="output.weight" in tensors)
    return config, gguf_model.from_gguf(tensors, config)


def _verify(out: str, info: dict, ref_model, tokenizer, atol: float | None) -> dict:
    """The GGUF file read back into an erniekit model (a temporary HF-layout checkpoint) against
    the source, on the fixed prompts of every format's --verify."""
    import tempfile

    from safetensors.numpy import save_file

    from erniekit.export.formats.hf import verify_layout
    from erniekit.models.hf_files import WEIGHTS_NAME

    config, state = read_gguf(os.path.join(out, info.get("file", GGUF_NAME)))
    with tempfile.TemporaryDirectory() as tmp:
        config.save_pretrained(tmp)
        save_file(state, os.path.join(tmp, WEIGHTS_NAME), metadata={"format": "pt"})
        return verify_layout(tmp, info, ref_model, tokenizer, atol, TYPES[info.get("dtype", "float32")][2])


register_export_format(
    ExportFormat(
        name="gguf",
        help="gguf: one GGUF file for llama.cpp / Ollama (--dtype float32|float16|bfloat16|q8_0), with a Modelfile",
        write=_write,
        verify=_verify,
        dtypes=tuple(d for d in TYPES if d is not None),
    )
)
