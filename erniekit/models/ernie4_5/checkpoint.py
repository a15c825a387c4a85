"""Hugging Face layout checkpoints: config.json, generation_config.json, *.safetensors (+ index).

Tensor names are those of the public ERNIE-4.5 PT checkpoints (per-expert MoE tensors,
`mlp.moe_statics.e_score_correction_bias`). Only safetensors is read or written: no pickle.
"""

from __future__ import annotations

import math
import os
import re
import warnings
from dataclasses import dataclass

import paddle
from safetensors import SafetensorError

from erniekit.errors import CheckpointError
from erniekit.models.ernie4_5 import paddle_layout
from erniekit.models.ernie4_5.configuration import Ernie4_5Config
from erniekit.models.ernie4_5.modeling import Ernie4_5ForCausalLM
from erniekit.models.generation_config import GENERATION_CONFIG_NAME, generation_config
from erniekit.models.hf_files import INDEX_NAME, STAGING_NAME, WEIGHTS_NAME, publish_model_files, start_staging
from erniekit.nn.deferred_init import skip_random_init
from erniekit.nn.weight_only import SCALE_SUFFIX, dequantize, logical_shape
from erniekit.utils.dtensor import assign_full, is_main_process, to_dense
from erniekit.utils.io import atomic_write_json, open_safetensors, read_json_object, strided_views, write_errors

_IGNORED_UNEXPECTED = re.compile(r"^(mtp|model\.mtp)|rotary_emb\.inv_freq$|_scale$")
# safetensors dtype names a weight may be stored in; int8 / uint8 only beside a weight-only scale
_FLOAT_DTYPES = {"F16", "BF16", "F32", "F64"}
_QUANT_DTYPES = {"I8", "U8"}


@dataclass
class _Spec:
    """How one of our parameters maps to HF tensors: 'copy', 'transpose' (Linear [in,out] vs
    [out,in]), 'experts' (our [E, in, out] stack <-> E tensors of [out, in]) or 'rowN' (our
    [1, n] <-> row N of one [rows, n] tensor several parameters share)."""

    kind: str
    hf_names: list[str]


def _specs(model: Ernie4_5ForCausalLM) -> dict[str, _Spec]:
    """Modality m >= 1 (ERNIE-VL layout): router `mlp.gate.weight_m`, bias
    `mlp.moe_statics.e_score_correction_bias_m`, experts numbered globally after the text experts."""
    specs: dict[str, _Spec] = {}
    per = model.config.experts_per_modality if model.config.is_moe else [0]
    offsets = [sum(per[:m]) for m in range(len(per))]
    for name, p in model.named_parameters():
        m = re.match(r"(.*\.mlp)\.experts(?:_(\d+))?\.(gate_proj|up_proj|down_proj)$", name)
        g = re.match(r"(.*\.mlp)\.gate_(\d+)\.(weight|e_score_correction_bias)$", name)
        if m:
            off = offsets[int(m[2] or 0)]
            specs[name] = _Spec("experts", [f"{m[1]}.experts.{off + e}.{m[3]}.weight" for e in range(p.shape[0])])
        elif g and g[3] == "weight":
            specs[name] = _Spec("transpose", [f"{g[1]}.gate.weight_{g[2]}"])
        elif g:
            specs[name] = _Spec("copy", [f"{g[1]}.moe_statics.e_score_correction_bias_{g[2]}"])
        elif name.endswith(".gate.e_score_correction_bias"):
            specs[name] = _Spec(
                "copy", [name.replace(".gate.e_score_correction_bias", ".moe_statics.e_score_correction_bias")]
            )
        elif name.endswith(".weight") and p.ndim == 2 and not name.endswith("embed_tokens.weight"):
            specs[name] = _Spec("transpose", [name])
        else:
            specs[name] = _Spec("copy", [name])
    for name, spec in specs.items():  # MTP heads (erniekit/nn/mtp.py): ERNIE's names, model.mtp_block.N...
        if name.startswith("mtp."):
            spec.hf_names = ["model." + n[len("mtp.") :] for n in spec.hf_names]
    return specs


def _check_inside(index: str, name: str, file: str) -> None:
    """A weight_map entry names a file of the checkpoint directory: an absolute path or one climbing
    out of it would make a downloaded index read any file. The entry as written is judged, not
    where it resolves: shards that are symlinks into a cache (Hugging Face snapshots) stay loadable."""
    norm = os.path.normpath(file) if file else ""
    if not norm or os.path.isabs(file) or norm == ".." or norm.startswith(".." + os.sep) or "\0" in file:
        raise CheckpointError(
            f"{index}: weight_map[{name!r}] = {file!r} is not a file name inside the checkpoint directory; "
            "fix the index (shard names are relative to it) or re-save the checkpoint"
        )


REMAP_BYTES = 64 << 20  # a shard's pages kept mapped while loading, about (_ShardReader._read)


def _weight_map(path: str) -> dict[str, str] | None:
    """Tensor name -> shard file from the index (each entry checked), None for a single
    model.safetensors; neither is one CheckpointError."""
    index = os.path.join(path, INDEX_NAME)
    if os.path.isfile(index):
        weight_map = read_json_object(index, f"fix {INDEX_NAME}").get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(
                f"{index}: no 'weight_map' object of tensor name -> file name; rewrite the index or re-save the checkpoint"
            )
        for name, file in weight_map.items():
            _check_inside(index, name, file)
        return {k: os.path.join(path, v) for k, v in weight_map.items()}
    if os.path.isfile(os.path.join(path, WEIGHTS_NAME)):
        return None
    found = [f for f in os.listdir(path) if f.endswith((".bin", ".pdparams", ".pt"))]
    hint = f" (found {found[0]}: convert it to safetensors; pickle files are not loaded)" if found else ""
    raise CheckpointError(f"{path}: no {WEIGHTS_NAME} or {INDEX_NAME}{hint}")


def _header_shapes(path: str) -> dict[str, tuple[str, list[int]]]:
    """Tensor name -> (file, stored shape) from the headers of the checkpoint's weight files: each
    file opened once and closed again, no tensor read."""
    # not the module's open_safetensors: these handles only read headers and are closed at once,
    # they are no part of the load's mappings (REMAP_BYTES)
    from erniekit.utils.io import open_safetensors as open_headers

    weight_map = _weight_map(path)
    files = dict.fromkeys(weight_map.values()) if weight_map else [os.path.join(path, WEIGHTS_NAME)]
    out: dict[str, tuple[str, list[int]]] = {}
    for file in files:
        if not os.path.isfile(file):
            raise CheckpointError(f"{file}: shard listed in {INDEX_NAME} is missing")
        with open_headers(file, "numpy") as f:
            for name in f.keys():
                if weight_map is None or weight_map.get(name) == file:
                    out[name] = (file, list(f.get_slice(name).get_shape()))
    if weight_map is not None and len(out) < len(weight_map):
        name = next(n for n in weight_map if n not in out)
        raise CheckpointError(
            f"{weight_map[name]}: has no tensor {name}, which {INDEX_NAME} puts there; the index and the "
            "shards disagree: re-save the checkpoint"
        )
    return out


class _ShardReader:
    """Opens each shard once; tensors are read lazily by name."""

    def __init__(self, path: str):
        weight_map = _weight_map(path)
        self._files: dict[str, object] = {}
        self._read_bytes: dict[str, int] = {}  # read through each shard's current mapping
        if weight_map is None:
            single = os.path.join(path, WEIGHTS_NAME)
            h = self._open(single)
            self.where = {k: single for k in h.keys()}
        else:
            self.where = weight_map

    def _open(self, file: str):
        if file not in self._files:
            if not os.path.isfile(file):
                raise CheckpointError(f"{file}: shard listed in {INDEX_NAME} is missing")
            self._files[file] = open_safetensors(file)
        return self._files[file]

    def _slice(self, name: str):
        """The lazy view of one tensor; an index naming a tensor its shard lacks is a CheckpointError."""
        file = self.where[name]
        try:
            return self._open(file).get_slice(name)
        except SafetensorError as e:
            raise CheckpointError(
                f"{file}: cannot read tensor {name} ({e}); the index and the shard disagree or "
                "the file is damaged: re-save the checkpoint"
            ) from None

    def shape(self, name: str) -> list[int]:
        """Logical shape; also refuses a dtype no weight is stored in (an int tensor under a weight's name)."""
        view = self._slice(name)
        stored, dtype = list(view.get_shape()), view.get_dtype()
        scale = name + SCALE_SUFFIX
        allowed = _FLOAT_DTYPES | (_QUANT_DTYPES if scale in self.where else set())
        if dtype not in allowed:
            raise CheckpointError(
                f"{self.where[name]}: tensor {name} is stored as {dtype}, not a floating-point "
                "type; the file was not written from a model: re-save or re-download it"
            )
        if scale in self.where:  # a weight-only quantized matrix (erniekit/nn/weight_only.py)
            return logical_shape(stored, list(self._slice(scale).get_shape()))
        return stored

    def _read(self, name: str) -> paddle.Tensor:
        """One tensor's values. A shard is memory-mapped, and the pages read stay in the process's
        resident set while the mapping lives: kept open, the whole file would sit beside the loaded
        weights (305 MiB more at dense-1024's peak). So a shard's mapping is dropped, and opened
        again on the next read, once REMAP_BYTES have been read through it. The tensor returned
        can be a view of the map (no copy for a float32 weight): safetensors keeps a map alive while
        a tensor read through it lives, so the caller copying it into the parameter and dropping it
        is what lets the pages go (tests/unit/models/test_model.py reads every tensor after a drop)."""
        file = self.where[name]
        return self._counted(file, self._open(file).get_tensor(name))

    def columns(self, name: str, a: int, b: int) -> paddle.Tensor:
        """Columns a:b of a 2-D tensor (elements a:b of a 1-D one), copied out of the file: a fused
        tensor's block (paddle_layout.py), read without holding the whole; counted as `_read`."""
        view = self._slice(name)
        try:
            with strided_views():  # safetensors returns the block as a dtype view of its bytes
                t = (view[:, a:b] if len(view.get_shape()) == 2 else view[a:b]).contiguous()
        except SafetensorError as e:
            raise CheckpointError(
                f"{self.where[name]}: cannot read columns {a}:{b} of tensor {name} ({e}); the file is "
                "damaged or truncated: re-download or re-save the checkpoint"
            ) from None
        return self._counted(self.where[name], t)

    def _counted(self, file: str, t: paddle.Tensor) -> paddle.Tensor:
        """t, read through `file`'s mapping, which is dropped once REMAP_BYTES went through it."""
        self._read_bytes[file] = self._read_bytes.get(file, 0) + int(t.numel()) * t.element_size()
        if self._read_bytes[file] >= REMAP_BYTES:
            self._files.pop(file).__exit__(None, None, None)
            self._read_bytes[file] = 0
        return t

    def get(self, name: str) -> paddle.Tensor:
        try:
            t = self._read(name)
            scale = name + SCALE_SUFFIX
            if scale in self.where:  # dequantized on load: the engine computes with what the export kept
                t = paddle.to_tensor(dequantize(t.numpy(), self._read(scale).numpy()))
        except SafetensorError as e:
            raise CheckpointError(
                f"{self.where[name]}: cannot read tensor {name} ({e}); the file is damaged: re-save the checkpoint"
            ) from None
        return t


def check_config_against_weights(config: Ernie4_5Config, path: str, overridden: bool = False) -> None:
    """Compare the config (config.json, with model_overrides when `overridden`) with the shapes in
    the weight files' headers, before a model is built from it: a config that disagrees with its
    weights (vocab_size 1e10, a million layers) would otherwise allocate gigabytes, or die in
    Paddle, before load_state_into compares a shape. The weights may hold more than the config
    takes (an override that cuts layers or drops the MTP heads), never less. Reads headers only.
    Either layout (`model.` or the Paddle layout's `ernie.` names)."""
    paddle_layout.refuse_pickle_only(path)
    shapes = _header_shapes(path)
    cfg = os.path.join(path, "config.json") + (" with model_overrides" if overridden else "")
    prefix = "ernie" if "ernie.embed_tokens.weight" in shapes else "model"
    hint = "use the config.json the weights were saved with" + (
        "; model_overrides that change the model's shape do not apply to a checkpoint: leave them out "
        "(e.g. 'model_overrides={}' on the command line)"
        if overridden
        else ""
    )

    embed = f"{prefix}.embed_tokens.weight"
    if embed not in shapes:
        raise CheckpointError(
            f"{path}: tensor {embed} is missing from the checkpoint; the weights are incomplete or belong to "
            "another model: re-save them"
        )
    (file, got), want = shapes[embed], [config.vocab_size, config.hidden_size]
    if got != want:
        raise CheckpointError(
            f"{cfg}: vocab_size={config.vocab_size}, hidden_size={config.hidden_size} but tensor {embed} in "
            f"{file} has shape {got}; {hint}"
        )

    def numbered(pattern: str, count: int, what: str, key: str, value) -> None:
        """The indices N in the names matching `pattern` must include 0..count-1 (a range built
        only once count is known to be no more than the indices found: it may be absurd)."""
        rx = re.compile(rf"{re.escape(prefix)}\.{pattern}")
        found = {int(m[1]) for n in shapes if (m := rx.match(n))}
        if count > len(found) or any(i not in found for i in range(count)):
            held = f"{len(found)} {what}" + (f" (numbered {min(found)}-{max(found)})" if found else "")
            raise CheckpointError(f"{cfg}: {key}={value} but the weights hold {held}; {hint}")

    numbered(
        r"layers\.(\d+)\.", config.num_hidden_layers, "decoder layers", "num_hidden_layers", config.num_hidden_layers
    )
    if config.num_moe_layers():
        numbered(
            r"layers\.\d+\.mlp\.experts\.(\d+)\.",
            config.total_experts,
            "routed experts",
            "moe_num_experts",
            config.moe_num_experts,
        )
    if not config.tie_word_embeddings and "lm_head.weight" not in shapes:
        raise CheckpointError(
            f"{cfg}: tie_word_embeddings=false but the weights hold no lm_head.weight (their output head is "
            f"the embedding); {hint}"
        )
    depth = config.num_nextn_predict_layers
    if depth:
        blocks = {int(m[1]) for n in shapes if (m := re.match(rf"{re.escape(prefix)}\.mtp_block\.(\d+)\.", n))}
        if len(blocks) < depth or any(j not in blocks for j in range(depth)):
            raise CheckpointError(
                f"{cfg}: num_nextn_predict_layers={depth} but the weights hold {len(blocks)} MTP blocks "
                f"({prefix}.mtp_block.N.*); set it to {len(blocks)} (0 loads without MTP heads)"
            )
    # every other size (intermediate_size, head_dim, the experts' widths...): the parameters the
    # config describes against the values the headers hold, with room for the estimate and for
    # storage (packed quantized weights); an absurd size is off by orders of magnitude
    held = sum(math.prod(shape) for _, shape in shapes.values())
    described = config.num_parameters_estimate(mtp=False)
    if described > 4 * held + (1 << 20):
        raise CheckpointError(
            f"{cfg}: the config describes about {described:.3g} parameters but the weights hold "
            f"{held:.3g} values; {hint}"
        )


def load_state_into(model: Ernie4_5ForCausalLM, path: str, specs: dict[str, _Spec] | None = None) -> None:
    """Fill `model` from the checkpoint at `path`; errors name the tensor that is missing or misshaped.
    specs: another family's name mapping (ERNIE-4.5-VL's); default this model's. A checkpoint in the
    Paddle layout (fused qkv_proj / up_gate_proj: the -Paddle repositories) is read by paddle_layout.py."""
    paddle_layout.refuse_pickle_only(path)
    reader = _ShardReader(path)
    if specs is None and paddle_layout.is_paddle_layout(reader.where):
        return paddle_layout.load_paddle_layout(model, path, reader)
    specs = _specs_cache(model) if specs is None else specs
    used: set[str] = set()
    for name, p in model.named_parameters():
        spec = specs[name]
        missing = [n for n in spec.hf_names if n not in reader.where]
        if missing:
            hint = (
                "; set num_nextn_predict_layers to 0 in config.json to load without MTP heads"
                if name.startswith("mtp.")
                else ""
            )
            raise CheckpointError(
                f"{path}: tensor {missing[0]} is missing from the checkpoint (needed for {name}){hint or '; the weights are incomplete or belong to another model: re-save them'}"
            )
        expected = list(p.shape)
        if spec.kind == "experts":
            want = [expected[2], expected[1]]
            for n in spec.hf_names:
                _check_shape(path, n, reader.shape(n), want)
            value = paddle.stack([reader.get(n).astype(p.dtype).T for n in spec.hf_names])
        elif spec.kind.startswith("row"):
            n, row = spec.hf_names[0], int(spec.kind[3:])
            shape = reader.shape(n)
            if len(shape) != 2 or shape[1] != expected[1] or shape[0] <= row:
                raise CheckpointError(
                    f"{path}: tensor {n} has shape {shape}, the model config expects rows of {expected[1]} "
                    f"with row {row} among them: "
                    "config.json and weights disagree: use the config.json the weights were saved with"
                )
            value = reader.get(n).astype(p.dtype)[row : row + 1]
        else:
            n = spec.hf_names[0]
            want = expected[::-1] if spec.kind == "transpose" else expected
            _check_shape(path, n, reader.shape(n), want)
            value = reader.get(n).astype(p.dtype)
            if spec.kind == "transpose":
                value = value.T
        if ".gpas." in name and not bool(paddle.isfinite(value).all()):  # a scalar per layer: costs nothing
            raise CheckpointError(
                f"{path}: tensor {spec.hf_names[0]} (a GPAS gate) is NaN or infinite, which makes every logit "
                "NaN; the weights are corrupt: re-save them from a healthy run"
            )
        assign_full(p, value)
        used.update(spec.hf_names)
    extra = [n for n in reader.where if n not in used and not _IGNORED_UNEXPECTED.search(n)]
    if model.config.tie_word_embeddings:
        extra = [n for n in extra if n != "lm_head.weight"]
    if extra:
        warnings.warn(f"{path}: {len(extra)} checkpoint tensors were not used, e.g. {extra[:3]}", stacklevel=2)


_SPEC_ATTR = "_erniekit_hf_specs"


def _specs_cache(model: Ernie4_5ForCausalLM) -> dict[str, _Spec]:
    specs = model.__dict__.get(_SPEC_ATTR)
    if specs is None:
        specs = _specs(model)
        object.__setattr__(model, _SPEC_ATTR, specs)
    return specs


def _check_shape(path: str, name: str, got: list[int], want: list[int]) -> None:
    if list(got) != list(want):
        raise CheckpointError(
            f"{path}: tensor {name} has shape {list(got)}, the model config expects {list(want)}: "
            "config.json and weights disagree: use the config.json the weights were saved with"
        )


def hf_state_dict(
    model: Ernie4_5ForCausalLM, dtype: str | None = None, specs: dict[str, _Spec] | None = None
) -> dict[str, paddle.Tensor]:
    """Our parameters renamed and reshaped to the HF layout (contiguous, ready for safetensors)."""
    specs = _specs_cache(model) if specs is None else specs
    out: dict[str, paddle.Tensor] = {}
    rows: dict[str, dict[int, paddle.Tensor]] = {}
    for name, p in model.named_parameters():
        spec = specs[name]
        t = to_dense(p.detach())  # the full value, also of a parameter sharded over processes
        if dtype and "e_score_correction_bias" not in name and not re.search(r"\.mlp\.gate(_\d+)?\.weight$", name):
            t = t.astype(dtype)
        if spec.kind == "experts":
            for e, n in enumerate(spec.hf_names):
                out[n] = t[e].T.contiguous()
        elif spec.kind.startswith("row"):
            rows.setdefault(spec.hf_names[0], {})[int(spec.kind[3:])] = t.reshape([-1])
        elif spec.kind == "transpose":
            out[spec.hf_names[0]] = t.T.contiguous()
        else:
            out[spec.hf_names[0]] = t.contiguous()
    for n, parts in rows.items():
        out[n] = paddle.stack([parts[i] for i in sorted(parts)]).contiguous()
    return out


def _parse_size(size: int | str) -> int:
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?B)\s*", size.upper())
    if not m:
        raise CheckpointError(f"max_shard_size={size!r}: use bytes or a size like '5GB'")
    return int(float(m[1]) * {"B": 1, "KB": 2**10, "MB": 2**20, "GB": 2**30}[m[2]])


def save_pretrained(
    model: Ernie4_5ForCausalLM,
    path: str,
    tokenizer=None,
    max_shard_size: int | str = "5GB",
    dtype: str | None = None,
    state: dict[str, paddle.Tensor] | None = None,
) -> None:
    """Write config, generation config, weights (sharded above `max_shard_size`) and tokenizer.
    state: the HF-layout tensors when the caller assembled them (a pipeline run's stages).

    Atomic: everything is written into a staging directory inside `path` and then published by
    renames (publish_model_files), so a crash at any moment leaves `path` loadable with either the
    old weights or the new ones, never without weights. A full disk is one CheckpointError saying how
    much was to be written, and the old files stay."""
    from safetensors.paddle import save_file

    if state is None:
        state = hf_state_dict(model, dtype)  # a collective in multi-process runs: every rank gathers
    if not is_main_process():
        return
    limit = _parse_size(max_shard_size)
    shards: list[dict[str, paddle.Tensor]] = [{}]
    size = total = 0
    for n, t in state.items():
        nbytes = t.numel().item() * t.element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][n] = t
        size += nbytes
        total += nbytes
    with write_errors("the model weights", path, total, partial=os.path.join(path, STAGING_NAME)):
        staging = start_staging(path)
        model.config.save_pretrained(staging)
        if hasattr(model, "save_extra_files"):  # a model's own files beside the config (VL: its image processor)
            model.save_extra_files(staging)
        # the source's decoding defaults with every turn-end id as eos (greedy when there was no source)
        atomic_write_json(os.path.join(staging, GENERATION_CONFIG_NAME), generation_config(model, tokenizer))
        meta = {"format": "pt"}
        if len(shards) == 1:
            save_file(shards[0], os.path.join(staging, WEIGHTS_NAME), metadata=meta)
        else:
            weight_map = {}
            for i, shard in enumerate(shards):
                fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, os.path.join(staging, fname), metadata=meta)
                weight_map.update(dict.fromkeys(shard, fname))
            atomic_write_json(
                os.path.join(staging, INDEX_NAME), {"metadata": {"total_size": total}, "weight_map": weight_map}
            )
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        publish_model_files(staging, path)


def from_pretrained(path: str, dtype: str = "float32", config_overrides: dict | None = None) -> Ernie4_5ForCausalLM:
    """Build the model from `path`/config.json and load its weights."""
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: checkpoint directory not found")
    config = Ernie4_5Config.from_pretrained(path)
    if config_overrides:
        config = config.replace(**config_overrides)
    check_config_against_weights(config, path, bool(config_overrides))  # before anything is allocated
    prev = paddle.get_default_dtype()
    paddle.set_default_dtype(dtype)
    try:
        with skip_random_init():  # load_state_into assigns every parameter or refuses
            model = Ernie4_5ForCausalLM(config)
    finally:
        paddle.set_default_dtype(prev)
    load_state_into(model, path)
    return model
