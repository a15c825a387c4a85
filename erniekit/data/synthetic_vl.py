"""Synthetic picture questions, drawn with Pillow at run time (nothing downloaded): coloured shapes
on a plain background, asked about their colour, their shape, which side they are on, or how
many there are. Deterministic for a (split, n) pair: the training split draws from one random
stream and the held-out split from another, so no held-out picture is a training picture.

Dataset paths name them: `synthetic:shapes/train?n=3000` (erniekit/train/stages/vl_sft.py).
"""

from __future__ import annotations

import base64
import io
import random
from urllib.parse import parse_qs, urlparse

from erniekit.data.formats import IMAGE_MARKER, Conversation
from erniekit.errors import DataError

COLORS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (230, 200, 30)}
SHAPES = ("circle", "square", "triangle")
QUESTIONS = {
    "color": "What color is the shape?",
    "shape": "What shape is it?",
    "side": "Is the shape on the left or the right?",
    "count": "How many shapes are there?",
}
SIZE = 84  # pixels: 6 x 6 patches of 14, 9 image tokens after the 2 x 2 merge
_SPLIT_SEEDS = {"train": 1, "eval": 2}


def _draw(draw, shape: str, box: tuple[int, int, int, int], color) -> None:
    x0, y0, x1, y1 = box
    if shape == "circle":
        draw.ellipse(box, fill=color)
    elif shape == "square":
        draw.rectangle(box, fill=color)
    else:
        draw.polygon([((x0 + x1) // 2, y0), (x1, y1), (x0, y1)], fill=color)


def _picture(rng: random.Random, kind: str) -> tuple[object, str]:
    """(PIL image, answer) for one question kind."""
    from PIL import Image, ImageDraw

    im = Image.new("RGB", (SIZE, SIZE), (245, 245, 240))
    d = ImageDraw.Draw(im)
    if kind == "count":
        n = rng.randint(1, 3)
        color = COLORS[rng.choice(list(COLORS))]
        cells = rng.sample([(cx, cy) for cx in range(3) for cy in range(3)], n)  # one shape per cell of a 3x3 grid
        for cx, cy in cells:
            s = rng.randint(14, 20)
            x0, y0 = cx * 28 + rng.randint(2, 26 - s + 2), cy * 28 + rng.randint(2, 26 - s + 2)
            _draw(d, rng.choice(SHAPES), (x0, y0, x0 + s, y0 + s), color)
        return im, str(n)
    color_name, shape = rng.choice(list(COLORS)), rng.choice(SHAPES)
    s = rng.randint(26, 36)
    left = rng.random() < 0.5
    x0 = rng.randint(2, SIZE // 2 - s - 2) if left else rng.randint(SIZE // 2 + 2, SIZE - s - 2)
    y0 = rng.randint(4, SIZE - s - 4)
    _draw(d, shape, (x0, y0, x0 + s, y0 + s), COLORS[color_name])
    return im, {"color": color_name, "shape": shape, "side": "left" if left else "right"}[kind]


def _data_uri(im) -> str:
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def shape_questions(split: str, n: int) -> list[Conversation]:
    if split not in _SPLIT_SEEDS:
        raise DataError(f"synthetic:shapes/{split}: the splits are {', '.join(_SPLIT_SEEDS)}")
    rng = random.Random(_SPLIT_SEEDS[split])
    out = []
    for i in range(n):
        kind = list(QUESTIONS)[i % len(QUESTIONS)]
        im, answer = _picture(rng, kind)
        out.append(
            Conversation(
                None,
                [(IMAGE_MARKER + QUESTIONS[kind], answer)],
                [True],
                f"synthetic:shapes/{split}#{i}",
                [_data_uri(im)],
            )
        )
    return out


def synthetic_conversations(path: str) -> list[Conversation]:
    """`synthetic:shapes/<split>?n=<count>` -> its conversations."""
    u = urlparse(path)
    name, _, split = u.path.partition("/")
    if name != "shapes":
        raise DataError(
            f"{path}: unknown synthetic dataset {name!r}; use synthetic:shapes/train or synthetic:shapes/eval"
        )
    try:
        n = int(parse_qs(u.query).get("n", ["1000"])[0])
    except ValueError:
        raise DataError(f"{path}: n must be an integer") from None
    if n < 1:
        raise DataError(f"{path}: n must be >= 1")
    return shape_questions(split, n)
