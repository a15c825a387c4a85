"""generation_config.json of a saved / exported checkpoint: transformers' `generate` with no
arguments but a length stops where `erniekit chat` stops, and the source's own fields are kept."""

import json

import numpy as np
import paddle
import pytest

from erniekit.export.hf import export_hf
from erniekit.infer import generate as generate_module
from erniekit.infer.chat import ChatSession, load_chat_model
from erniekit.infer.sampling import SamplingParams
from erniekit.infer.stops import stop_ids, turn_end_ids
from erniekit.models.ernie4_5.tokenizer import default_tokenizer
from erniekit.models.registry import load_model, save_model

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

QUESTION = "What is 2+3?"
ANSWER = "5, and that is all"
MAX_NEW = 24


def _trained_source(path, keep_generation_config: bool):
    """A tiny transformers ERNIE 4.5 trained on one chat turn, so its greedy reply to QUESTION is
    ANSWER followed by the turn's end token (<|end_of_sentence|>, id 4, not eos 2)."""
    tok = default_tokenizer()
    session = ChatSession(None, tok, SamplingParams())
    session.messages.append({"role": "user", "content": QUESTION})
    prompt = session.prompt_ids()
    end = tok.sep_token_id
    seq = prompt + tok.encode(ANSWER) + [end]
    torch.manual_seed(0)
    cfg = transformers.Ernie4_5Config(
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    hf = transformers.Ernie4_5ForCausalLM(cfg)
    opt = torch.optim.Adam(hf.parameters(), lr=1e-2)
    x = torch.tensor([seq])
    labels = torch.full_like(x, -100)
    labels[0, len(prompt) :] = x[0, len(prompt) :]
    for _ in range(60):
        opt.zero_grad()
        hf(input_ids=x, labels=labels).loss.backward()
        opt.step()
    hf.eval()
    hf.save_pretrained(path)
    tok.save_pretrained(str(path))
    gen_file = path / "generation_config.json"
    if keep_generation_config:
        gen_file.write_text(
            json.dumps({"do_sample": True, "temperature": 0.7, "top_p": 0.9, "eos_token_id": 2, "note": "ours"})
        )
    elif gen_file.exists():
        gen_file.unlink()
    return prompt, end


def _chat_tokens(model_dir, monkeypatch) -> list[int]:
    """What `erniekit chat --prompt QUESTION` generates, with the stop token it ended on."""
    model, tok = load_chat_model(str(model_dir))
    seen: list[int] = []
    real = generate_module.generate_stream

    def recording(*args, **kwargs):
        for step in real(*args, **kwargs):
            seen.append(int(step[0]))
            yield step

    monkeypatch.setattr(generate_module, "generate_stream", recording)
    params = SamplingParams(max_new_tokens=MAX_NEW, stop_token_ids=stop_ids(model, tok))
    text = ChatSession(model, tok, params).reply(QUESTION)
    assert text == ANSWER  # the tiny model learned its one answer
    return seen


def _transformers_tokens(export_dir, prompt, **kwargs) -> list[int]:
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(export_dir))
    hf.eval()
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, **kwargs)
    return out[0, len(prompt) :].tolist()


def test_transformers_generate_stops_where_chat_stops(tmp_path, monkeypatch):
    src = tmp_path / "src"
    prompt, end = _trained_source(src, keep_generation_config=False)
    out = tmp_path / "export"
    export_hf(str(src), str(out))
    chat = _chat_tokens(out, monkeypatch)
    assert chat[-1] == end and len(chat) < MAX_NEW  # chat stopped on the turn's end token
    theirs = _transformers_tokens(out, prompt)  # greedy and stopping come from the file alone
    assert theirs == chat
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["do_sample"] is False
    assert end in gen["eos_token_id"] and 2 in gen["eos_token_id"]
    assert (gen["bos_token_id"], gen["pad_token_id"]) == (1, 0)


def test_source_generation_config_kept_with_turn_ends(tmp_path, monkeypatch):
    src = tmp_path / "src"
    prompt, end = _trained_source(src, keep_generation_config=True)
    out = tmp_path / "export"
    export_hf(str(src), str(out))
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["do_sample"] is True and gen["temperature"] == 0.7 and gen["top_p"] == 0.9
    assert gen["note"] == "ours"  # fields transformers does not know survive too
    assert gen["eos_token_id"] == [2, end]
    chat = _chat_tokens(out, monkeypatch)
    assert _transformers_tokens(out, prompt, do_sample=False) == chat


def test_preset_saves_greedy_with_every_turn_end(tmp_path):
    paddle.seed(0)
    model = load_model("tiny-dense")
    tok = default_tokenizer()
    save_model(model, str(tmp_path / "ckpt"), tokenizer=tok)
    gen = json.loads((tmp_path / "ckpt" / "generation_config.json").read_text())
    assert gen["do_sample"] is False and "temperature" not in gen
    assert set(gen["eos_token_id"]) == set(stop_ids(model, tok)) == set(turn_end_ids(tok)) | {2}
    # a checkpoint saved from it keeps these fields on its next save
    again = load_model(str(tmp_path / "ckpt"))
    save_model(again, str(tmp_path / "again"), tokenizer=tok)
    assert json.loads((tmp_path / "again" / "generation_config.json").read_text()) == gen
    assert np.array_equal(np.sort(gen["eos_token_id"]), sorted(stop_ids(again, tok)))
