"""The WebUI Chat tab with a thinking-format checkpoint (erniekit/webui/text_chat.py): the
reasoning is shown as a "Thinking" message apart from the answer, streamed pieces never show a tag
or half of one, and the next prompt gives the reasoning back as the template renders it. The
model's tokens are scripted (generation itself is tested elsewhere)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from erniekit.infer.chat import chat_prompt_ids
from erniekit.infer.sampling import SamplingParams
from erniekit.models.ernie4_5.tokenizer import default_tokenizer
from erniekit.webui import text_chat

REASONING = "47*86: use the calculator."
REPLY = f"{REASONING}\n</think>\n\n<response>\n4042\n</response>\n"
# a model whose vocabulary is padded past the tokenizer: generation is cut to the tokenizer's ids
PADDED = SimpleNamespace(config=SimpleNamespace(vocab_size=len(default_tokenizer()) + 8))


@pytest.fixture
def scripted(monkeypatch):
    """generate_stream replaced by one that yields the ids of `reply` token by token (then a stop),
    recording the prompt ids it was given."""
    seen: list[list[int]] = []

    def install(tok, reply: str, stop: int):
        def fake(model, batch, params, pad_id=0, vocab=None):
            assert vocab == len(tok)  # replies hold only ids the tokenizer writes
            seen.append(list(batch[0]))
            for t in tok.encode(reply) + [stop]:
                yield [t]

        monkeypatch.setattr(text_chat, "generate_stream", fake)
        return seen

    return install


def test_the_reasoning_is_a_thought_and_goes_back_into_the_next_prompt(scripted):
    tok = default_tokenizer().with_thinking_template()
    stop = tok.convert_tokens_to_ids("<|im_end|>")
    seen = scripted(tok, REPLY, stop)
    params = SamplingParams(max_new_tokens=64, stop_token_ids=[stop])
    states = list(text_chat.text_reply(PADDED, tok, [], "47*86=?", params))
    final = states[-1]
    assert final == [
        {"role": "user", "content": "47*86=?"},
        {"role": "assistant", "content": REASONING, "metadata": {"title": "Thinking"}},
        {"role": "assistant", "content": "4042"},
    ]
    assert seen[0] == chat_prompt_ids(tok, [{"role": "user", "content": "47*86=?"}])
    for state in states:  # as streamed: growing text, never a tag or a piece of one
        for m in state[1:]:
            assert "<" not in m["content"] and not m["content"].endswith("\n</"), state
            assert REASONING.startswith(m["content"]) or "4042".startswith(m["content"]), state
    gr = pytest.importorskip("gradio")
    page = gr.Chatbot()
    history = page.preprocess(page.postprocess(final))  # as the page hands the history back: parts, metadata
    list(text_chat.text_reply(PADDED, tok, history, "and 2+2?", params))
    want = [
        {"role": "user", "content": "47*86=?"},
        {"role": "assistant", "content": "4042", "reasoning_content": REASONING},
        {"role": "user", "content": "and 2+2?"},
    ]
    assert seen[1] == chat_prompt_ids(tok, want)
    assert REASONING in tok.decode(seen[1])  # the reasoning is in the prompt, not an empty think block


def test_a_model_without_the_thinking_format_shows_its_text_as_it_is(scripted):
    tok = default_tokenizer()
    stop = tok.eos_token_id
    scripted(tok, "12</think>", stop)
    params = SamplingParams(max_new_tokens=64, stop_token_ids=[stop])
    final = list(text_chat.text_reply(PADDED, tok, [], "hi", params))[-1]
    assert final == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": tok.decode(tok.encode("12</think>"))},
    ]


def test_gradio_message_contents_are_read_as_text():
    assert text_chat.message_text([{"type": "text", "text": "a"}, {"text": "b"}]) == "ab"
    assert text_chat.message_text({"text": "c"}) == "c" and text_chat.message_text("d") == "d"
