"""What `erniekit export --verify` adds for a vision-language export: logits of a prompt with a
picture from the reloaded export against the source, and, where transformers (with
`ernie4_5_vl_moe`) is installed, from transformers loading the export: the layout is then known
to be what the hub's readers take, not only what erniekit reads back."""

from __future__ import annotations

import numpy as np


def vl_probe(model, tokenizer) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A fixed prompt around a fixed picture (a colour gradient, 112 x 84): ids [1, S], patches, grid."""
    from PIL import Image

    from erniekit.models.ernie4_5_vl.processor import image_tokens, preprocess_image

    yy, xx = np.mgrid[0:84, 0:112]
    rgb = np.stack([xx * 255 // 111, yy * 255 // 83, (xx + yy) * 255 // 194], axis=-1).astype(np.uint8)
    patches, grid = preprocess_image(Image.fromarray(rgb), model.image_settings)
    ids = (
        tokenizer.encode("Look at this picture:") + image_tokens(grid, model.config) + tokenizer.encode(" What is it?")
    )
    return np.asarray([ids], dtype=np.int64), patches, grid


def our_logits(model, probe) -> np.ndarray:
    import paddle

    ids, patches, grid = probe
    with paddle.no_grad():
        out = model(paddle.to_tensor(ids), pixel_values=paddle.to_tensor(patches), image_grid_thw=grid)
    return out.logits.astype("float32").numpy()[0]


def transformers_logits(path: str, model, probe) -> np.ndarray | None:
    """Logits of transformers' Ernie4_5_VLMoeForConditionalGeneration loading `path` (float32);
    None when transformers or its ernie4_5_vl_moe is not installed."""
    try:
        import torch
        import transformers
    except ImportError:
        return None
    cls = getattr(transformers, "Ernie4_5_VLMoeForConditionalGeneration", None)
    if cls is None:
        return None
    from erniekit.models.ernie4_5_vl.modeling import mm_token_types, moe_modality

    ids, patches, grid = probe
    theirs = cls.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = theirs(
            input_ids=torch.from_numpy(ids),
            mm_token_type_ids=torch.from_numpy(mm_token_types(ids, model.config)),
            moe_mm_token_type_ids=torch.from_numpy(moe_modality(ids, model.config)),
            pixel_values=torch.from_numpy(patches),
            image_grid_thw=torch.from_numpy(grid),
        )
    return out.logits.float().numpy()[0]
