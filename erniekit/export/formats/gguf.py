"""`gguf`: one GGUF file for llama.cpp (and what runs on it: Ollama, LM Studio, llama-cpp-python),
with the tokenizer and chat template inside, and an Ollama Modelfile beside it (docs/gguf.md).

--dtype float32 (default) / float16 / bfloat16 / q8_0 sets the matrices' type; as llama.cpp's
converter does, 1-D tensors, norms and the MoE router stay float32, and a q8_0 matrix whose rows
are not a multiple of 32 is written float16. `--verify` reads the file back with gguf's reader,
dequantizes it into an erniekit model and compares its logits with the source's.
"""

from __future__ import annotations

import os

from erniekit.errors import CheckpointError
from erniekit.export.formats import INFO_NAME, ExportFormat, ExportOptions, register_export_format

GGUF_NAME = "model.gguf"
# --dtype -> (GGML type of the matrices, general.file_type, --verify's tolerance relative to the largest logit)
TYPES = {
    None: ("F32", "ALL_F32", 1e-4),
    "float32": ("F32", "ALL_F32", 1e-4),
    "float16": ("F16", "MOSTLY_F16", 1e-2),
    "bfloat16": ("BF16", "MOSTLY_BF16", 5e-2),
    "q8_0": ("Q8_0", "MOSTLY_Q8_0", 5e-2),
}


def tensor_type(name: str, array, matrix_type: str) -> str:
    """The GGML type one tensor is stored in, by the converter's rules (see the module doc)."""
    import gguf

    if array.ndim <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight"):
        return "F32"
    if name.startswith("blk.") and name.endswith(".ffn_gate_inp.weight"):  # the MoE router
        return "F32"
    if matrix_type == "Q8_0" and array.shape[-1] % gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_0][0]:
        return "F16"
    return matrix_type


def encode(array, type_name: str):
    """The bytes (as a numpy array) of `array` in GGML type `type_name` (Q8_0 per GGML's block_q8_0:
    32 values, one float16 scale amax/127, int8 round(x/scale); bit-exact with ggml-quants.c)."""
    import gguf
    import numpy as np

    qtype = gguf.GGMLQuantizationType[type_name]
    return gguf.quants.quantize(np.ascontiguousarray(array, dtype=np.float32), qtype)


def _write(model, tokenizer, out: str, info: dict, options: ExportOptions) -> None:
    import tempfile

    import gguf

    from erniekit.export import gguf_model, ollama
    from erniekit.export.gguf_vocab import sentencepiece_vocab, write_vocab
    from erniekit.models.generation_config import generation_config
    from erniekit.models.registry import model_state
    from erniekit.utils.io import atomic_write_json, atomic_write_text, write_errors

    if options.dtype not in TYPES:
        raise CheckpointError(
            f"export --format gguf: --dtype {options.dtype} is not one of float32, float16, bfloat16, q8_0"
        )
    config = model.config
    gguf_model.check_supported(config)
    matrix_type, file_type, _ = TYPES[options.dtype]
    state = {k: v.numpy() for k, v in model_state(model, "float32").items()}
    tensors = gguf_model.to_gguf(state, config)
    eot = ollama.end_of_turn(tokenizer)
    with tempfile.TemporaryDirectory() as tok_dir:
        tokenizer.save_pretrained(tok_dir)
        vocab = sentencepiece_vocab(tok_dir, config.vocab_size, end_of_turn=eot)
    encoded = {n: (tensor_type(n, t, matrix_type), t) for n, t in tensors.items()}
    encoded = {n: (ty, encode(t, ty)) for n, (ty, t) in encoded.items()}
    os.makedirs(out, exist_ok=True)
    partial = os.path.join(out, f".{GGUF_NAME}.tmp")
    with write_errors("the GGUF file", out, sum(d.nbytes for _, d in encoded.values()), partial=partial):
        w = gguf.GGUFWriter(partial, gguf.MODEL_ARCH_NAMES[gguf_model.arch_of(config)])
        w.add_name(os.path.basename(os.path.normpath(info["source"])))
        w.add_file_type(gguf.LlamaFileType[file_type])
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        gguf_model.write_hparams(w, config)
        write_vocab(w, vocab)
        for name, (ty, data) in encoded.items():
            w.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType[ty])
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
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
    types: dict[str, int] = {}
    for ty, _ in encoded.values():
        types[ty] = types.get(ty, 0) + 1
    info.update(
        file=GGUF_NAME,
        architecture=gguf.MODEL_ARCH_NAMES[gguf_model.arch_of(config)],
        dtype=options.dtype or "float32",
        tensor_types=types,
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
    )
)
