"""`erniekit chat DIR --image PATH [--image PATH2]`: the pictures go before the first message, in
order, and the reply is the one the VL generation gives that conversation; a bad picture or a text
checkpoint is one line before any reply."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    import paddle

    from erniekit.models.ernie4_5.tokenizer import default_tokenizer
    from erniekit.models.ernie4_5_vl.modeling import Ernie4_5_VLForConditionalGeneration
    from erniekit.models.ernie4_5_vl.processor import ImageSettings
    from erniekit.models.registry import model_config, save_model

    paddle.seed(0)
    model = Ernie4_5_VLForConditionalGeneration(model_config("tiny-vl").replace(initializer_range=0.5))
    model.image_settings = ImageSettings(min_pixels=56 * 56, max_pixels=56 * 84)
    root = tmp_path_factory.mktemp("chat-image")
    save_model(model, str(root / "m"), tokenizer=default_tokenizer())
    rng = np.random.default_rng(3)
    for name, shape in (("a.png", (56, 84, 3)), ("b.png", (40, 40, 3))):
        Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8)).save(root / name)
    return root


def _chat(root, *images: str, capsys) -> tuple[int, str, str]:
    from erniekit.cli import main

    argv = ["chat", str(root / "m"), "--prompt", "what is there?", "--max-new-tokens", "6"]
    for name in images:
        argv += ["--image", str(root / name)]
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out.strip(), out.err.strip()


def test_chat_answers_about_its_images_in_order(vl_dir, capsys):
    from erniekit.data.formats import IMAGE_MARKER, Conversation
    from erniekit.infer.vl_generate import answer
    from erniekit.models.ernie4_5.tokenizer import default_tokenizer
    from erniekit.models.ernie4_5_vl.processor import load_image
    from erniekit.models.registry import load_model

    code, ab, _ = _chat(vl_dir, "a.png", "b.png", capsys=capsys)
    assert code == 0 and ab
    model = load_model(str(vl_dir / "m"))
    images = [load_image(str(vl_dir / n)) for n in ("a.png", "b.png")]
    conv = Conversation(None, [(IMAGE_MARKER * 2 + "what is there?", "")], [True], "ref", images)
    assert ab == answer(model, default_tokenizer(), conv, model.image_settings, 6).strip()
    code, ba, _ = _chat(vl_dir, "b.png", "a.png", capsys=capsys)
    assert code == 0 and ba != ab  # the pictures' order is read
    code, alone, _ = _chat(vl_dir, "a.png", capsys=capsys)
    assert code == 0 and alone not in (ab, ba)


def test_a_bad_picture_is_one_line_naming_it(vl_dir, capsys):
    (vl_dir / "bad.png").write_text("not a picture")
    code, out, err = _chat(vl_dir, "a.png", "bad.png", capsys=capsys)
    assert code != 0 and out == ""
    assert "--image 2" in err and "not a readable image" in err and len(err.splitlines()) == 1
    code, out, err = _chat(vl_dir, "missing.png", capsys=capsys)
    assert code != 0 and "--image 1" in err and "not found" in err and len(err.splitlines()) == 1


def test_a_text_checkpoint_refuses_images(tmp_path, vl_dir, capsys):
    from erniekit.cli import main
    from erniekit.models.ernie4_5.modeling import Ernie4_5ForCausalLM
    from erniekit.models.ernie4_5.tokenizer import default_tokenizer
    from erniekit.models.registry import model_config, save_model

    save_model(Ernie4_5ForCausalLM(model_config("tiny-dense")), str(tmp_path / "t"), tokenizer=default_tokenizer())
    code = main(["chat", str(tmp_path / "t"), "--image", str(vl_dir / "a.png"), "--prompt", "hi"])
    err = capsys.readouterr().err.strip()
    assert code != 0 and "vision-language" in err and len(err.splitlines()) == 1
