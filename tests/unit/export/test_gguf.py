"""`erniekit export --format gguf`: the file llama.cpp's ERNIE 4.5 loader reads (names, shapes and
metadata as src/models/ernie4-5.cpp asks for them), GGML's q8_0 blocks, the sentencepiece
vocabulary as llama.cpp's converter writes it, the Ollama Modelfile, and --verify.
llama.cpp itself runs the files in tests/e2e/test_gguf_llama_cpp.py."""

import dataclasses
import json
import os
import re
import struct

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from erniekit.errors import CheckpointError, ErniekitError  # noqa: E402
from erniekit.export import gguf_model  # noqa: E402
from erniekit.export.formats.gguf import encode, encoded_nbytes, read_gguf, tensor_type  # noqa: E402
from erniekit.export.gguf_vocab import BYTE, CONTROL, NORMAL, UNKNOWN, UNUSED, USER_DEFINED, sentencepiece_vocab  # noqa: E402
from erniekit.export.ollama import end_of_turn  # noqa: E402
from erniekit.models.ernie4_5.configuration import get_preset  # noqa: E402
from erniekit.models.ernie4_5.tokenizer import default_tokenizer  # noqa: E402

DENSE = dataclasses.replace(
    get_preset("tiny-dense"), hidden_size=64, intermediate_size=96, num_hidden_layers=2, tie_word_embeddings=False
)  # head_dim 32 x 4 heads = 128 != hidden_size: the key length must be written
# (router_aux_loss_coef is a training setting a GGUF does not carry)
MOE = dataclasses.replace(get_preset("tiny-moe"), num_hidden_layers=3, moe_layer_end_index=-1, router_aux_loss_coef=0.0)


def _checkpoint(path, config, seed=0):
    import paddle

    from erniekit.models.ernie4_5 import Ernie4_5ForCausalLM
    from erniekit.models.ernie4_5.checkpoint import save_pretrained

    paddle.seed(seed)
    model = Ernie4_5ForCausalLM(config)
    for m in model.moe_layers():  # a correction bias that is not zero, so that it has to be written
        b = m.gate.e_score_correction_bias
        b.set_value(paddle.randn(b.shape) * 0.05)
    save_pretrained(model, str(path), tokenizer=default_tokenizer())
    return str(path)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    return {"dense": _checkpoint(root / "dense", DENSE), "moe": _checkpoint(root / "moe", MOE)}


@pytest.fixture(scope="module")
def exports(ckpts, tmp_path_factory):
    from erniekit.export.hf import export_hf

    root = tmp_path_factory.mktemp("out")
    return {
        (kind, dtype): export_hf(src, str(root / f"{kind}-{dtype}"), fmt="gguf", dtype=dtype)
        for kind, src in ckpts.items()
        for dtype in (None, "float16", "bfloat16", "q8_0")
    }


# ---------------------------------------------------------------- q8_0


def _naive_q8_0(x: np.ndarray) -> bytes:
    """ggml-quants.c quantize_row_q8_0_ref, one block of 32 at a time, in float32 scalars."""
    out = b""
    for block in x.astype(np.float32).reshape(-1, 32):
        amax = max(abs(float(v)) for v in block)
        d = np.float32(amax) / np.float32(127)
        inv = np.float32(1) / d if d else np.float32(0)
        qs = []
        for v in block:
            y = float(np.float32(v) * inv)
            qs.append(int(np.sign(y) * np.floor(abs(y) + 0.5)))  # roundf: halves away from zero
        out += struct.pack("<e", d) + struct.pack("<32b", *qs)
    return out


def test_q8_0_is_ggml_block_format_bit_for_bit():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 96)).astype(np.float32)
    x[1, 32:64] = 0.0  # an all-zero block: scale 0, codes 0
    x[2, :32] = np.linspace(-127, 127, 32) / 64  # values landing on .5 after scaling
    got = encode(x, "Q8_0")
    assert got.dtype == np.uint8 and got.shape == (3, 3 * 34)  # 3 blocks of (2-byte scale + 32 codes) per row
    assert got.tobytes() == _naive_q8_0(x)
    back = gguf.quants.dequantize(got, gguf.GGMLQuantizationType.Q8_0)
    scale = np.abs(x.reshape(-1, 32)).max(1, keepdims=True) / 127
    assert back.shape == x.shape
    assert np.all(np.abs(back - x).reshape(-1, 32) <= scale * 0.5 + 1e-3 * scale + 1e-12)


def test_tensor_types_follow_the_converter():
    m = (64, 64)
    assert tensor_type("blk.0.attn_q.weight", m, "Q8_0") == "Q8_0"
    assert tensor_type("blk.0.attn_norm.weight", (64,), "Q8_0") == "F32"
    assert tensor_type("blk.1.ffn_gate_inp.weight", m, "F16") == "F32"  # the router stays float32
    assert tensor_type("blk.1.exp_probs_b.bias", (8,), "F16") == "F32"
    assert tensor_type("blk.0.ffn_down.weight", (64, 48), "Q8_0") == "F16"  # 48 is no multiple of 32
    assert [encoded_nbytes((8, 64, 96), t) for t in ("F32", "F16", "BF16", "Q8_0")] == [
        8 * 64 * 96 * 4,
        8 * 64 * 96 * 2,
        8 * 64 * 96 * 2,
        8 * 64 * 3 * 34,  # 3 blocks of 32 per row, 34 bytes each
    ]
    assert all(encoded_nbytes((5, 64), t) == encode(np.ones((5, 64)), t).nbytes for t in ("F32", "F16", "BF16", "Q8_0"))


# ---------------------------------------------------------------- the file llama.cpp loads


def _shapes(c):
    """{name: ne} as llama.cpp's llama_model_ernie4_5::load_arch_tensors creates them."""
    H, V, q, kv = c.hidden_size, c.vocab_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    want = {"token_embd.weight": [H, V], "output_norm.weight": [H]}
    if not c.tie_word_embeddings:
        want["output.weight"] = [H, V]
    for i in range(c.num_hidden_layers):
        b = f"blk.{i}."
        want.update(
            {
                b + "attn_norm.weight": [H],
                b + "attn_q.weight": [H, q],
                b + "attn_k.weight": [H, kv],
                b + "attn_v.weight": [H, kv],
                b + "attn_output.weight": [q, H],
                b + "ffn_norm.weight": [H],
            }
        )
        if c.is_moe and i >= c.moe_layer_start_index:
            E, f, s = c.moe_num_experts, c.moe_intermediate_size, c.moe_intermediate_size * c.moe_num_shared_experts
            want.update(
                {
                    b + "ffn_gate_inp.weight": [H, E],
                    b + "exp_probs_b.bias": [E],
                    b + "ffn_gate_exps.weight": [H, f, E],
                    b + "ffn_down_exps.weight": [f, H, E],
                    b + "ffn_up_exps.weight": [H, f, E],
                    b + "ffn_gate_shexp.weight": [H, s],
                    b + "ffn_down_shexp.weight": [s, H],
                    b + "ffn_up_shexp.weight": [H, s],
                }
            )
        else:
            F = c.intermediate_size
            want.update({b + "ffn_gate.weight": [H, F], b + "ffn_down.weight": [F, H], b + "ffn_up.weight": [H, F]})
    return want


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_names_shapes_and_metadata_are_llama_cpps(exports, kind):
    c = DENSE if kind == "dense" else MOE
    r = gguf.GGUFReader(f"{exports[(kind, None)]}/model.gguf")
    assert {t.name: [int(n) for n in t.shape] for t in r.tensors} == _shapes(c)
    arch = "ernie4_5" if kind == "dense" else "ernie4_5-moe"
    f = r.fields

    def kv(key):
        return f[key].contents()

    assert kv("general.architecture") == arch and kv("general.file_type") == gguf.LlamaFileType.ALL_F32
    want = {
        "context_length": c.max_position_embeddings,
        "embedding_length": c.hidden_size,
        "block_count": c.num_hidden_layers,
        "feed_forward_length": c.intermediate_size,
        "attention.head_count": c.num_attention_heads,
        "attention.head_count_kv": c.num_key_value_heads,
        "attention.key_length": c.head_dim,
        "attention.value_length": c.head_dim,
    }
    if kind == "moe":
        want.update(
            {
                "expert_count": 8,
                "expert_used_count": 2,
                "expert_shared_count": 1,
                "expert_feed_forward_length": 128,
                "expert_shared_feed_forward_length": 128,
                "leading_dense_block_count": 1,
                "interleave_moe_layer_step": 1,
            }
        )
    assert {k: kv(f"{arch}.{k}") for k in want} == want
    assert kv(f"{arch}.rope.freq_base") == pytest.approx(c.rope_theta)
    assert kv(f"{arch}.attention.layer_norm_rms_epsilon") == pytest.approx(c.rms_norm_eps)
    assert gguf_model.config_from_gguf(r, has_output=kind == "dense").to_dict() == {
        **c.to_dict(),
        "eos_token_id": 2,  # the GGUF's one eos id
    }


def test_weights_round_trip_and_q8_0_is_q8_0(exports, ckpts):
    from safetensors.numpy import load_file

    src = load_file(f"{ckpts['moe']}/model.safetensors")
    _, f32 = read_gguf(f"{exports[('moe', None)]}/model.gguf")
    assert sorted(f32) == sorted(src)
    assert all(np.array_equal(f32[k], src[k].astype(np.float32)) for k in src)  # float32: exact
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(f"{exports[('moe', 'q8_0')]}/model.gguf").tensors}
    assert types["blk.1.ffn_up_exps.weight"] == types["token_embd.weight"] == "Q8_0"
    assert types["blk.1.ffn_gate_inp.weight"] == types["blk.1.exp_probs_b.bias"] == types["output_norm.weight"] == "F32"
    _, q8 = read_gguf(f"{exports[('moe', 'q8_0')]}/model.gguf")
    w = src["model.layers.1.mlp.experts.3.down_proj.weight"]
    assert 0 < np.abs(q8["model.layers.1.mlp.experts.3.down_proj.weight"] - w).max() <= np.abs(w).max() / 127


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_verify_compares_the_reloaded_file_with_the_source(exports, kind):
    from erniekit.export.hf import verify

    r32, r16, r8 = (verify(exports[(kind, d)]) for d in (None, "float16", "q8_0"))
    assert r32["ok"] and r32["max_abs_diff"] < 1e-5 and r32["same_greedy"] == 1.0
    assert r16["ok"] and 0 < r16["max_abs_diff"] < r8["max_abs_diff"] <= r8["tolerance"] and r8["ok"]
    info = json.load(open(f"{exports[(kind, 'q8_0')]}/export_info.json"))
    assert info["format"] == "gguf" and info["dtype"] == "q8_0" and info["tensor_types"]["Q8_0"] > 0


def test_verify_fails_when_the_file_has_other_weights(exports, tmp_path):
    """The check can fail: a file whose bytes changed is caught."""
    import shutil

    from erniekit.export.hf import verify

    out = tmp_path / "bad"
    shutil.copytree(exports[("dense", None)], out)
    r = gguf.GGUFReader(str(out / "model.gguf"), "r+")
    t = next(t for t in r.tensors if t.name == "blk.1.ffn_down.weight")
    t.data[...] *= 1.5
    r.data.flush()
    rep = verify(str(out))
    assert not rep["ok"] and rep["max_abs_diff"] > rep["tolerance"]


def test_what_llama_cpp_cannot_run_is_refused_before_writing(ckpts, tmp_path):
    cfg = dataclasses.replace(MOE, moe_layer_interval=2)
    with pytest.raises(CheckpointError, match="moe_layer_interval=2.*interval 1"):
        gguf_model.check_supported(cfg)
    with pytest.raises(CheckpointError, match="use_gpas=true"):
        gguf_model.check_supported(dataclasses.replace(DENSE, use_gpas=True))
    from erniekit.export.hf import export_hf

    with pytest.raises(CheckpointError, match="--dtype int4"):
        export_hf(ckpts["dense"], str(tmp_path / "x"), fmt="gguf", dtype="int4")
    assert not (tmp_path / "x").exists()


def test_the_cli_takes_q8_0_for_gguf_only(ckpts, tmp_path):
    from erniekit import cli

    with pytest.raises(ErniekitError, match="--dtype q8_0 is a GGUF type: add --format gguf"):
        cli.export([ckpts["dense"], "-o", str(tmp_path / "x"), "--dtype", "q8_0"])
    assert cli.export([ckpts["dense"], "-o", str(tmp_path / "y"), "--format", "gguf", "--dtype", "q8_0"]) == 0
    assert gguf.GGUFReader(str(tmp_path / "y" / "model.gguf")).fields["general.file_type"].contents() == 7  # Q8_0


# ---------------------------------------------------------------- writing tensor by tensor


def _reference_gguf(src: str, path: str, dtype: str | None) -> None:
    """The export as it was written before it streamed: the whole float32 state as numpy, the
    experts stacked, every tensor encoded, then gguf's all-at-once add_tensor / write_tensors_to_file."""
    from erniekit.export.formats.gguf import TYPES
    from erniekit.export.gguf_vocab import write_vocab
    from erniekit.export.hf import _load_source
    from erniekit.models.registry import model_state

    model, tokenizer = _load_source(src)
    config = model.config
    state = {k: v.numpy() for k, v in model_state(model, "float32").items()}
    top, layer, experts = gguf_model._tables()
    tensors, stacks = {}, {}
    for hf, t in state.items():
        if gguf_model._SKIPPED_RE.match(hf):
            continue
        m = gguf_model._LAYER_RE.fullmatch(hf)
        if hf in top:
            tensors[gguf_model._name(top[hf], config)] = t
        elif m and m[2] in layer:
            tensors[gguf_model._name(layer[m[2]], config, int(m[1]))] = t.reshape(-1) if "e_score" in hf else t
        else:
            e = gguf_model._EXPERT_RE.fullmatch(m[2])
            name = gguf_model._name(experts[e[2]], config, int(m[1]))
            tensors.setdefault(name, None)
            stacks.setdefault(name, {})[int(e[1])] = t
    for name, parts in stacks.items():
        tensors[name] = np.stack([parts[e] for e in range(len(parts))])
    matrix_type, file_type, _ = TYPES[dtype]
    w = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[gguf_model.arch_of(config)])
    w.add_name(os.path.basename(os.path.normpath(src)))
    w.add_file_type(gguf.LlamaFileType[file_type])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    gguf_model.write_hparams(w, config)
    tokenizer.save_pretrained(os.path.dirname(path))
    write_vocab(w, sentencepiece_vocab(os.path.dirname(path), config.vocab_size, end_of_turn=end_of_turn(tokenizer)))
    for name, t in tensors.items():
        ty = tensor_type(name, t.shape, matrix_type)
        w.add_tensor(name, encode(t, ty), raw_dtype=gguf.GGMLQuantizationType[ty])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("dtype", [None, "float16", "bfloat16", "q8_0"])
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_streamed_file_is_the_all_at_once_file_byte_for_byte(exports, ckpts, kind, dtype, tmp_path):
    ref = tmp_path / "ref.gguf"
    _reference_gguf(ckpts[kind], str(ref), dtype)
    got = open(f"{exports[(kind, dtype)]}/model.gguf", "rb").read()
    assert len(got) == ref.stat().st_size and got == ref.read_bytes()


_MEMORY_SCRIPT = """
import dataclasses, json, sys
import paddle
from erniekit.export.formats import ExportOptions, export_format
from erniekit.models.ernie4_5 import Ernie4_5ForCausalLM
from erniekit.models.ernie4_5.configuration import get_preset
from erniekit.models.ernie4_5.tokenizer import default_tokenizer

def status(key):
    return int(next(line for line in open("/proc/self/status") if line.startswith(key + ":")).split()[1]) * 1024

config = dataclasses.replace(
    get_preset("tiny-moe"), hidden_size=512, intermediate_size=1024, num_hidden_layers=3, num_attention_heads=8,
    num_key_value_heads=4, head_dim=64, moe_num_experts=16, moe_intermediate_size=512, moe_layer_end_index=-1,
    router_aux_loss_coef=0.0,
)
paddle.seed(0)
model = Ernie4_5ForCausalLM(config)
model.eval()
tokenizer = default_tokenizer()
report = {"state": sum(p.numel().item() * 4 for p in model.parameters()),
          "largest": max(p.numel().item() * 4 for p in model.parameters())}
for dtype in (None, "q8_0"):
    open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS: the peak from here on
    base = status("VmRSS")
    out = f"{sys.argv[1]}/{dtype}"
    export_format("gguf").write(model, tokenizer, out, {"source": out}, ExportOptions(dtype=dtype))
    report[str(dtype)] = status("VmHWM") - base
print(json.dumps(report))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's /proc/self/clear_refs")
def test_export_holds_about_one_tensor_not_a_copy_of_the_model(tmp_path):
    """A 119 MB (float32) MoE model exported in a fresh process: the peak resident memory rises by
    about its largest tensor (one layer's stacked experts, 16 MB), not by copies of the model.
    Measured: 20 MB (float32) and 24 MB (q8_0); the export that held the float32 state, the stacked
    experts and every encoded tensor before writing rose by 285 MB and 287 MB."""
    import subprocess
    import sys

    run = subprocess.run(
        [sys.executable, "-c", _MEMORY_SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-2000:]
    r = json.loads(run.stdout.strip().splitlines()[-1])
    assert 110 * 2**20 < r["state"] < 130 * 2**20 and r["largest"] == 16 * 2**20
    assert r["None"] < 0.4 * r["state"] and r["q8_0"] < 0.4 * r["state"], r
    assert gguf.GGUFReader(str(tmp_path / "q8_0" / "model.gguf")).tensors[-1].name == "output_norm.weight"


# ---------------------------------------------------------------- vocabulary


def test_vocabulary_is_the_sentencepiece_model_as_the_converter_writes_it(exports):
    from sentencepiece import sentencepiece_model_pb2

    tok = default_tokenizer()
    r = gguf.GGUFReader(f"{exports[('dense', None)]}/model.gguf")
    f = r.fields
    tokens = [bytes(f["tokenizer.ggml.tokens"].parts[i]).decode() for i in f["tokenizer.ggml.tokens"].data]
    types = list(f["tokenizer.ggml.token_type"].contents())
    scores = list(f["tokenizer.ggml.scores"].contents())
    m = sentencepiece_model_pb2.ModelProto()
    m.ParseFromString(tok.sp.serialized_model_proto())
    assert f["tokenizer.ggml.model"].contents() == "llama" and len(tokens) == 1024
    assert tokens == [p.piece for p in m.pieces]
    assert scores[:14] == [-1000.0] * 14  # the added_tokens_decoder's tokens, as the converter scores them
    assert scores[14:] == pytest.approx([p.score for p in m.pieces[14:]])
    # <unk> <s> </s> <|begin_of_sentence|> ... <mask:7>: special in added_tokens_decoder, so CONTROL as the converter
    # makes them (sentencepiece calls <unk> UNKNOWN; llama.cpp takes the unk id from unknown_token_id)
    assert types[:14] == [CONTROL] * 14 and m.pieces[0].type == UNKNOWN
    assert set(types[14:270]) == {BYTE} and set(types[270:]) == {NORMAL}
    ids = {k: f[f"tokenizer.ggml.{k}"].contents() for k in ("bos_token_id", "eos_token_id", "unknown_token_id")}
    assert ids == {"bos_token_id": 1, "eos_token_id": 2, "unknown_token_id": 0}
    assert (
        f["tokenizer.ggml.padding_token_id"].contents() == 0 and f["tokenizer.ggml.seperator_token_id"].contents() == 4
    )
    assert f["tokenizer.ggml.eot_token_id"].contents() == tok.sep_token_id  # <|end_of_sentence|> ends a turn
    assert (
        f["tokenizer.ggml.add_bos_token"].contents() is False
        and f["tokenizer.ggml.add_space_prefix"].contents() is False
    )
    assert f["tokenizer.chat_template"].contents() == tok.chat_template


def test_added_tokens_past_the_model_and_padding(tmp_path):
    tok = default_tokenizer().with_thinking_template()  # 8 tags added at ids 1024..1031
    tok.save_pretrained(str(tmp_path))
    assert end_of_turn(tok) == "<|im_end|>"
    v = sentencepiece_vocab(str(tmp_path), 1040, end_of_turn=end_of_turn(tok))
    assert [t.decode() for t in v.tokens[1024:1026]] == ["<|im_start|>", "<|im_end|>"]
    assert v.types[1024:1026] == [CONTROL, CONTROL]
    assert v.types[tok.convert_tokens_to_ids("<think>")] == USER_DEFINED  # a text tag: kept whole, shown as text
    assert v.tokens[1039] == b"[PAD1039]" and set(v.types[1032:]) == {UNUSED}
    assert v.special_ids["eot"] == 1025 and v.chat_template == tok.chat_template
    with pytest.raises(CheckpointError, match="token id 1031 but the model's vocab_size is 1024"):
        sentencepiece_vocab(str(tmp_path), 1024)


# ---------------------------------------------------------------- Ollama Modelfile


def _go_render(template: str, messages: list[dict]) -> str:
    """The part of Go's text/template the Modelfile's TEMPLATE uses: range .Messages, if / else if
    eq .Role "x", end, .Role / .Content (no trim markers)."""
    parts = re.split(r"\{\{\s*(.*?)\s*\}\}", template)

    def parse(i):
        nodes = []
        while i < len(parts):
            if i % 2 == 0:
                nodes.append(("text", parts[i]))
                i += 1
                continue
            a, i = parts[i], i + 1
            if a == "end" or a.startswith("else"):
                return nodes, i, a
            if a == "range .Messages":
                body, i, stop = parse(i)
                assert stop == "end"
                nodes.append(("range", body))
            elif a.startswith("if "):
                branches, cond = [], a[3:]
                while True:
                    body, i, stop = parse(i)
                    branches.append((cond, body))
                    if stop == "end":
                        break
                    cond = stop[len("else if ") :] if stop.startswith("else if ") else "true"
                nodes.append(("if", branches))
            else:
                assert a in (".Role", ".Content"), a
                nodes.append(("var", a[1:].lower()))
        return nodes, i, None

    def run(nodes, m):
        out = ""
        for node in nodes:
            if node[0] == "text":
                out += node[1]
            elif node[0] == "var":
                out += m[node[1]]
            elif node[0] == "range":
                out += "".join(run(node[1], msg) for msg in messages)
            else:
                for cond, body in node[1]:
                    eq = re.fullmatch(r'eq \.Role "(\w+)"', cond)
                    if cond == "true" or (eq and m["role"] == eq[1]):
                        out += run(body, m)
                        break
        return out

    return run(parse(0)[0], {})


def _modelfile(path: str) -> dict:
    text = open(path).read()
    template = re.search(r'^TEMPLATE """(.*?)"""$', text, re.S | re.M)
    lines = [line for line in re.sub(r'TEMPLATE """.*?"""', "", text, flags=re.S).splitlines() if line.strip()]
    params: dict[str, list[str]] = {}
    for line in lines:
        key, _, value = line.partition(" ")
        if key == "PARAMETER":
            name, _, value = value.partition(" ")
            params.setdefault(name, []).append(value)
        elif not key.startswith("#"):
            params.setdefault(key, []).append(value)
    return {"template": template[1] if template else None, **params}


def test_modelfile_points_at_the_file_stops_at_turn_ends_and_renders_our_template(exports):
    out = exports[("moe", "q8_0")]
    mf = _modelfile(f"{out}/Modelfile")
    assert mf["FROM"] == ["./model.gguf"]
    assert mf["stop"] == ['"<|end_of_sentence|>"', '"</s>"']  # generation_config eos ids 2 and 4
    assert mf["temperature"] == ["0"]  # the checkpoint's generation_config does not sample
    tok = default_tokenizer()
    for messages in (
        [{"role": "user", "content": "1+2="}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "What is 7 plus 5?"},
        ],
    ):
        assert _go_render(mf["template"], messages) == tok.apply_chat_template(messages, add_generation_prompt=True)


def test_modelfile_of_another_template_has_no_guessed_template(ckpts, tmp_path):
    import shutil

    from erniekit.export.hf import export_hf

    thinking = default_tokenizer().with_thinking_template()  # its tags take ids 1024..1031
    small = tmp_path / "small"
    shutil.copytree(ckpts["dense"], small)
    thinking.save_pretrained(str(small))
    with pytest.raises(CheckpointError, match="vocab_size is 1024"):
        export_hf(str(small), str(tmp_path / "x"), fmt="gguf")
    src = _checkpoint(tmp_path / "thinking", dataclasses.replace(DENSE, vocab_size=1032))
    thinking.save_pretrained(src)
    out = export_hf(src, str(tmp_path / "y"), fmt="gguf")
    mf = _modelfile(f"{out}/Modelfile")
    assert mf["template"] is None and "# no TEMPLATE" in open(f"{out}/Modelfile").read()
    assert mf["stop"][0] == '"<|im_end|>"'


def test_modelfile_takes_the_exports_generation_defaults_even_without_a_source_file(ckpts, tmp_path):
    """A source with no generation_config.json exports greedy (as the HF export writes it); one that
    samples keeps its temperature and top_p."""
    import shutil

    from erniekit.export.hf import export_hf

    bare = tmp_path / "bare"
    shutil.copytree(ckpts["dense"], bare)
    os.remove(bare / "generation_config.json")
    mf = _modelfile(f"{export_hf(str(bare), str(tmp_path / 'o1'), fmt='gguf')}/Modelfile")
    assert mf["temperature"] == ["0"]
    (bare / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 0.7, "top_p": 0.9}))
    mf = _modelfile(f"{export_hf(str(bare), str(tmp_path / 'o2'), fmt='gguf')}/Modelfile")
    assert mf["temperature"] == ["0.7"] and mf["top_p"] == ["0.9"]
