"""ERNIE-4.5-VL: the ERNIE 4.5 text model (modality-isolated MoE: text and vision experts) reading
image and video features the vision transformer and resampler put in place of placeholder tokens.

It is an `Ernie4_5ForCausalLM` (training, LoRA, FP8 experts, recompute and the parallel layouts
see the same layers) whose forward also takes pixel_values / grid_thw. Text tokens get 1-D
positions, vision tokens 3-D ones (frame, row, column; `rope_index`); MoE routing reads each
token's modality (`moe_modality`: image and video placeholders and their start / end tokens go to
the vision experts, as the reference's processor marks them).
"""

from __future__ import annotations

from itertools import groupby

import numpy as np
import paddle

from erniekit.models.ernie4_5.modeling import CausalLMOutput, Ernie4_5ForCausalLM
from erniekit.models.ernie4_5_vl.configuration import Ernie4_5_VLConfig
from erniekit.models.ernie4_5_vl.processor import ImageSettings, save_image_settings
from erniekit.models.ernie4_5_vl.video import VideoSettings, save_video_settings
from erniekit.models.ernie4_5_vl.vision import Resampler, VisionTransformer
from erniekit.nn.deferred_init import random_init_skipped


def mm_token_types(input_ids: np.ndarray, config: Ernie4_5_VLConfig) -> np.ndarray:
    """0 text, 1 image placeholder, 2 video placeholder (what positions are computed from)."""
    out = np.zeros_like(input_ids)
    out[input_ids == config.image_token_id] = 1
    out[input_ids == config.video_token_id] = 2
    return out


def moe_modality(input_ids: np.ndarray, config: Ernie4_5_VLConfig) -> np.ndarray:
    """The MoE's modality per token: 1 (vision experts) for image / video placeholders and their
    start and end tokens, 0 (text experts) for the rest."""
    vision = [config.image_token_id, config.video_token_id, config.image_start_token_id]
    vision += [config.image_end_token_id, config.video_start_token_id, config.video_end_token_id]
    return np.isin(input_ids, vision).astype(np.int64)


def rope_index(
    input_ids: np.ndarray,
    config: Ernie4_5_VLConfig,
    image_grid_thw: np.ndarray | None = None,
    video_grid_thw: np.ndarray | None = None,
    attention_mask: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """3-D positions [3, B, S] (frame, row, column) and each row's delta (max position + 1 -
    length: what decode steps add to their 1-D position). Text runs count up by one on all three
    axes; an image or video of t x h x w merged tokens starts at the running position p: frame
    p + (frame index, counted per temporal merge for video), row p + i, column p + j; after it the
    text goes on at p + max(h, w)."""
    merge, tmerge = config.vision.spatial_merge_size, config.vision.temporal_merge_size
    B, S = input_ids.shape
    pos = np.zeros((3, B, S), dtype=np.int64)
    deltas = np.zeros(B, dtype=np.int64)
    grids = {
        1: iter(np.asarray(image_grid_thw).reshape(-1, 3) if image_grid_thw is not None else []),
        2: iter(np.asarray(video_grid_thw).reshape(-1, 3) if video_grid_thw is not None else []),
    }
    types = mm_token_types(input_ids, config)
    for b in range(B):
        keep = np.ones(S, dtype=bool) if attention_mask is None else attention_mask[b].astype(bool)
        kinds = types[b][keep]
        parts, cur = [], 0
        for kind, run in groupby(kinds.tolist()):
            n = len(list(run))
            if kind == 0:
                parts.append(np.broadcast_to(np.arange(cur, cur + n), (3, n)))
                cur += n
                continue
            grid = next(grids[kind], None)
            if grid is None:
                raise ValueError(f"row {b}: more {'image' if kind == 1 else 'video'} placeholders than grids")
            t = int(grid[0]) // (tmerge if kind == 2 else 1)
            h, w = int(grid[1]) // merge, int(grid[2]) // merge
            if t * h * w != n:
                raise ValueError(f"row {b}: {n} placeholder tokens, the grid {grid.tolist()} gives {t * h * w}")
            tt, hh, ww = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
            parts.append(np.stack([tt.reshape(-1) + cur, hh.reshape(-1) + cur, ww.reshape(-1) + cur]))
            cur += max(h, w)
        row = np.concatenate(parts, axis=1) if parts else np.zeros((3, 0), dtype=np.int64)
        pos[:, b, keep] = row
        deltas[b] = (row.max() + 1 if row.size else 0) - int(keep.sum())
    return pos, deltas


class Ernie4_5_VLForConditionalGeneration(Ernie4_5ForCausalLM):
    config: Ernie4_5_VLConfig
    moe_modality_names = ("text", "vision")  # the MoE's modality ids 0 and 1 (`moe_modality`), for routing pictures

    def __init__(self, config: Ernie4_5_VLConfig):
        super().__init__(config)
        self.vision_model = VisionTransformer(config.vision)
        self.resampler_model = Resampler(config)
        self._init_vision()
        # the image sizes it reads (preprocessor_config.json; VL-SFT sets its image_*_pixels)
        self.image_settings = ImageSettings()
        self.video_settings = VideoSettings()

    def _init_vision(self) -> None:
        if random_init_skipped():  # a checkpoint's weights replace them (erniekit/nn/deferred_init.py)
            return
        std = self.config.vision.initializer_range
        for p in self.vision_model.parameters() + self.resampler_model.parameters():
            if p.ndim >= 2:
                paddle.nn.initializer.TruncatedNormal(0.0, std)(p)

    def save_extra_files(self, path: str) -> None:
        save_image_settings(path, self.image_settings)
        save_video_settings(path, self.video_settings)

    def visual_features(self, pixel_values: paddle.Tensor, grid_thw: np.ndarray) -> paddle.Tensor:
        """Merged vision tokens [tokens, hidden] of images or videos, in placeholder order."""
        return self.resampler_model(self.vision_model(pixel_values, grid_thw), grid_thw)

    def forward(
        self,
        input_ids,
        position_ids=None,
        segment_ids=None,
        attention_mask=None,
        cache=None,
        logits_to_keep: int = 0,
        token_type_ids=None,
        return_mtp: bool = False,
        pixel_values=None,
        image_grid_thw=None,
        pixel_values_videos=None,
        video_grid_thw=None,
        skip_head: bool = False,
    ) -> CausalLMOutput:
        """As the text model's forward (skip_head too); pixel_values / pixel_values_videos [patches, C*p*p] with
        grid_thw [n, 3] fill the image / video placeholders. token_type_ids: the MoE modality per
        token (default: `moe_modality` of input_ids); position_ids: [3, B, S] (default:
        `rope_index` when there are images or videos, else the text model's own)."""
        c = self.config
        ids = input_ids.numpy() if isinstance(input_ids, paddle.Tensor) else np.asarray(input_ids)
        # without vision features the text model embeds the ids itself (and a decode step of text
        # tokens can then take the kernels' step, models/ernie4_5/decode_step.py)
        x = embedded = None
        for pixels, grid, token in (
            (pixel_values, image_grid_thw, c.image_token_id),
            (pixel_values_videos, video_grid_thw, c.video_token_id),
        ):
            if pixels is None:
                continue
            if x is None:
                x = embedded = self.model.embed_tokens(input_ids)  # its layout over the ranks is the tokens'
            feats = self.visual_features(pixels, np.asarray(grid))
            where = np.nonzero(ids.reshape(-1) == token)[0]
            if len(where) != feats.shape[0]:
                raise ValueError(f"{len(where)} placeholder tokens {token} but {feats.shape[0]} vision features")
            flat = x.reshape([-1, x.shape[-1]])
            flat = paddle.scatter(flat, paddle.to_tensor(where), feats.astype(flat.dtype))
            x = flat.reshape(x.shape)
        if x is not None and embedded.is_dist() and list(x.placements) != list(embedded.placements):
            # a collective job: the features came in whole; keep the tokens split over the ranks as
            # the embedding laid them out (replicated tokens would reach each expert once per rank)
            import paddle.distributed as dist

            x = dist.reshard(x, embedded.process_mesh, list(embedded.placements))
        vision = image_grid_thw is not None or video_grid_thw is not None
        if position_ids is None and vision:
            am = (
                None
                if attention_mask is None
                else np.asarray(attention_mask.numpy() if isinstance(attention_mask, paddle.Tensor) else attention_mask)
            )
            pos, _ = rope_index(ids, c, image_grid_thw, video_grid_thw, am)
            position_ids = paddle.to_tensor(pos)
        if token_type_ids is None and (
            vision or bool(np.isin(ids, [c.image_start_token_id, c.video_start_token_id]).any())
        ):
            token_type_ids = paddle.to_tensor(moe_modality(ids, c))
        h = self.model(
            input_ids, position_ids, segment_ids, attention_mask, cache, token_type_ids=token_type_ids, inputs_embeds=x
        )
        return self.output(h, logits_to_keep, skip_head=skip_head)
