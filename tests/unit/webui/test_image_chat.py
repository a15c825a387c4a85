"""The WebUI chat with a vision-language model (erniekit/webui/image_chat.py and the Chat tab's
image upload): a reply with an uploaded image equals greedy generation on that image, later
text turns keep the image in the conversation, Clear forgets it, and a text model refuses images;
through a live gradio app and its client, as the page calls it."""

from __future__ import annotations

import numpy as np
import paddle
import pytest
from media_files import moving_square, write_mp4
from PIL import Image

pytest.importorskip("gradio")

from erniekit.data.formats import IMAGE_MARKER, VIDEO_MARKER, Conversation
from erniekit.infer.chat import load_chat_model, stop_ids
from erniekit.infer.sampling import SamplingParams
from erniekit.infer.vl_generate import answer
from erniekit.models.ernie4_5.tokenizer import default_tokenizer
from erniekit.models.ernie4_5_vl.modeling import Ernie4_5_VLForConditionalGeneration
from erniekit.models.ernie4_5_vl.processor import ImageSettings
from erniekit.models.ernie4_5_vl.video import VideoSettings, load_video
from erniekit.models.registry import model_config, save_model
from erniekit.webui.image_chat import ImageConversation


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("webui_vl")
    paddle.seed(0)  # initializer_range 0.5: peaked logits, greedy choices not decided by rounding
    model = Ernie4_5_VLForConditionalGeneration(model_config("tiny-vl").replace(initializer_range=0.5))
    model.image_settings = ImageSettings(min_pixels=56 * 56, max_pixels=112 * 112)
    model.video_settings = VideoSettings(min_pixels=56 * 56, max_pixels=56 * 56, min_frames=2, max_frames=4)
    save_model(model, str(root / "ckpt"), tokenizer=default_tokenizer())
    write_mp4(root / "clip.mp4", moving_square(4, 64, 64), 4, codec="libx264")  # playable in a browser
    for seed in (1, 2):
        arr = np.random.default_rng(seed).integers(0, 256, (84, 84, 3), dtype=np.uint8)
        Image.fromarray(arr).save(root / f"p{seed}.png")
    return root


def _text(content) -> str:
    return content if isinstance(content, str) else "".join(p.get("text", "") for p in content)


def _greedy(model, tok, turns, images):
    conv = Conversation(None, turns, [True] * len(turns), "ref", images)
    return answer(model, tok, conv, model.image_settings, 8)


def test_image_conversation_replies_as_greedy_generation_and_keeps_its_image(ckpt):
    model, tok = load_chat_model(str(ckpt / "ckpt"))
    chat = ImageConversation(model, tok, stop_ids(model, tok))
    greedy = SamplingParams(max_new_tokens=8)
    try:
        p1 = str(ckpt / "p1.png")
        first = list(chat.reply("what is it?", p1, greedy))
        assert first[-1] == _greedy(model, tok, [(IMAGE_MARKER + "what is it?", "")], [p1])
        second = list(chat.reply("and now?", None, greedy))[-1]
        turns = [(IMAGE_MARKER + "what is it?", first[-1]), ("and now?", "")]
        assert second == _greedy(model, tok, turns, [p1])
        other = ImageConversation(model, tok, stop_ids(model, tok))
        try:  # the same question about another picture gets another answer: the image is read
            assert list(other.reply("what is it?", str(ckpt / "p2.png"), greedy))[-1] != first[-1]
        finally:
            other.close()
        chat.reset()
        assert not chat.has_images and chat.turns == []
    finally:
        chat.close()


def test_chat_tab_sends_an_uploaded_image_and_a_text_model_refuses_one(ckpt, tmp_path):
    from gradio_client import Client, handle_file
    from launched_jobs import free_port

    from erniekit.models.ernie4_5 import Ernie4_5ForCausalLM, get_preset, save_pretrained
    from erniekit.webui.access import PathPolicy
    from erniekit.webui.app import build_app, prepare_launch

    paddle.seed(0)
    save_pretrained(Ernie4_5ForCausalLM(get_preset("tiny-dense")), str(ckpt / "text"), tokenizer=default_tokenizer())
    port = free_port()
    kw, _ = prepare_launch("127.0.0.1", port)
    app = build_app(paths=PathPolicy(str(ckpt)))
    app.queue().launch(**kw, prevent_thread_lock=True)
    try:
        client = Client(f"http://127.0.0.1:{port}", verbose=False)
        assert "Loaded" in client.predict(str(ckpt / "ckpt"), api_name="/chat_load")
        history, message, _, _, _ = client.predict(
            "what is it?", [], handle_file(str(ckpt / "p1.png")), None, 0.0, 1.0, 8, api_name="/chat_send"
        )
        model, tok = load_chat_model(str(ckpt / "ckpt"))
        assert message == ""
        want = _greedy(model, tok, [(IMAGE_MARKER + "what is it?", "")], [str(ckpt / "p1.png")])
        assert _text(history[-1]["content"]) == want.strip()  # the page shows messages stripped
        assert "[image: p1.png]" in _text(history[-2]["content"])
        history, message, _, _, _ = client.predict(  # a video with the next message
            "and this?",
            history,
            None,
            handle_file(str(ckpt / "clip.mp4")),
            0.0,
            1.0,
            8,
            api_name="/chat_send",
        )
        assert message == "" and "[video: clip.mp4]" in _text(history[-2]["content"])
        frames = load_video(str(ckpt / "clip.mp4"), settings=model.video_settings)
        turns = [(IMAGE_MARKER + "what is it?", want), (VIDEO_MARKER + "and this?", "")]
        conv = Conversation(None, turns, [True, True], "ref", [str(ckpt / "p1.png")], [frames])
        assert _text(history[-1]["content"]) == answer(model, tok, conv, model.image_settings, 8).strip()
        assert "Loaded" in client.predict(str(ckpt / "text"), api_name="/chat_load")
        _, message, _, _, _ = client.predict(
            "what is it?", [], handle_file(str(ckpt / "p1.png")), None, 0.0, 1.0, 8, api_name="/chat_send"
        )
        assert "reads no images" in message
    finally:
        app.close()
