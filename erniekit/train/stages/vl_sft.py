"""stage: VL-SFT (ERNIEKit's name) — supervised fine-tuning of an ERNIE-4.5-VL model on conversations
with images: the loss on the assistant replies, the images' patches through the vision encoder and
resampler into their placeholders, MoE routing by modality (vision tokens to the vision experts).

Data: OpenAI messages with image_url parts, or ERNIEKit's image_info / text_info records
(erniekit/data/formats.py). `freeze_vision_encoder` / `freeze_resampler` keep those parts fixed.
Evaluation: held-out loss, and exact match of greedy answers generated from each prompt with its
images (erniekit/infer/vl_generate.py), against the most common training answer as a baseline.
"""

from __future__ import annotations

import functools
import os

import numpy as np
import paddle

from erniekit.data.encode import IGNORE_INDEX
from erniekit.data.formats import load_sft_examples
from erniekit.data.vl import collate_images, encode_vl_conversation
from erniekit.errors import ConfigError, DataError
from erniekit.train.evaluation import baseline_exact_match, majority_reply
from erniekit.train.losses import batch_tensor, causal_lm_loss_sum, token_balanced_loss_sum
from erniekit.train.stage import LossOutput, Stage, Supports, eval_loss, next_token_loss_sum, takes_fused_head
from erniekit.train.stages import register_stage


def _settings(cfg):
    """The image sizes the config asks for; a budget no image fits is refused before any is read
    (a 0 would divide by zero in the first resize)."""
    from erniekit.models.ernie4_5_vl.processor import ImageSettings

    lo, hi = cfg.image_min_pixels, cfg.image_max_pixels
    if not 0 < lo <= hi:
        raise ConfigError(
            f"image_min_pixels={lo!r}, image_max_pixels={hi!r} are invalid: they must satisfy "
            "0 < image_min_pixels <= image_max_pixels; change them"
        )
    return ImageSettings(min_pixels=lo, max_pixels=hi)


def _video_settings(cfg):
    """The checkpoint's video settings (frames, sizes, time stamps), as the model is served with
    them (it saves them again); the hub processor's defaults for a preset."""
    from erniekit.models.ernie4_5_vl.video import VideoSettings, load_video_settings

    path = cfg.model_name_or_path
    return load_video_settings(path) if os.path.isdir(path) else VideoSettings()


def vl_loss(model, batch: dict[str, np.ndarray], token_balance: bool = False, fused_head: bool = False) -> LossOutput:
    """The summed next-token loss of a picture batch; fused_head: the head and its loss chunk by
    chunk without the batch's logits (as `lm_loss`; `LossOutput.logits` is then None)."""
    fused = takes_fused_head(model, fused_head, token_balance)
    pixels, grids = collate_images(batch["images"])
    vpixels, vgrids = collate_images(batch["videos"]) if "videos" in batch else (None, None)
    out = model(
        batch_tensor(batch["input_ids"]),
        pixel_values=None if pixels is None else paddle.to_tensor(pixels),
        image_grid_thw=grids,
        pixel_values_videos=None if vpixels is None else paddle.to_tensor(vpixels),
        video_grid_thw=vgrids,
        **({"skip_head": True} if fused else {}),
    )
    loss_fn = token_balanced_loss_sum if token_balance else causal_lm_loss_sum
    loss_sum, logits = next_token_loss_sum(model, out, batch, loss_fn, fused)
    return LossOutput(loss_sum, out.aux_loss, logits=logits)


@register_stage
class VLSFTStage(Stage):
    name = "VL-SFT"
    aliases = ("vl_sft", "VLSFT")
    supports = Supports(token_balance=True, row_losses=True, images=True, fused_head=True)

    def _rows(self, path: str, fmt: str, cfg, tokenizer) -> tuple[list, list]:
        model_cfg = self._model_config(cfg)
        if path.startswith("synthetic:"):
            from erniekit.data.synthetic_vl import synthetic_conversations

            convs = synthetic_conversations(path)
        else:
            convs = load_sft_examples(path, fmt)
        settings, video = _settings(cfg), _video_settings(cfg)
        rows = [encode_vl_conversation(c, tokenizer, model_cfg, settings, cfg.max_seq_len, video) for c in convs]
        if not any((r["labels"] != IGNORE_INDEX).any() for r in rows):  # the loop would fail at the first batch
            raise DataError(
                f"{path}: none of the {len(rows)} examples has a trained token (every label 0); check the labels"
            )
        return convs, rows

    @staticmethod
    def _model_config(cfg):
        from erniekit.models.ernie4_5_vl.configuration import Ernie4_5_VLConfig
        from erniekit.models.registry import model_config

        c = model_config(cfg.model_name_or_path, cfg.model_overrides)
        if not isinstance(c, Ernie4_5_VLConfig):
            raise ConfigError(
                f"stage VL-SFT needs a vision-language model (ERNIE-4.5-VL); model_name_or_path="
                f"{cfg.model_name_or_path} is {c.model_type}: use a VL checkpoint or the tiny-vl preset"
            )
        return c

    def build_train_rows(self, cfg, tokenizer):
        convs, rows = self._rows(cfg.train_dataset_path, cfg.train_dataset_type, cfg, tokenizer)
        self.majority_reply = majority_reply(convs)
        return rows

    def build_eval_data(self, cfg, tokenizer):
        if not cfg.eval_dataset_path:
            return None
        convs, rows = self._rows(cfg.eval_dataset_path, cfg.eval_dataset_type, cfg, tokenizer)
        return {"convs": convs, "rows": rows}

    def prepare(self, model, train_rows, eval_data, cfg, tokenizer) -> None:
        super().prepare(model, train_rows, eval_data, cfg, tokenizer)
        for part, freeze in (("vision_model", cfg.freeze_vision_encoder), ("resampler_model", cfg.freeze_resampler)):
            if freeze:
                for p in getattr(model, part).parameters():
                    p.stop_gradient = True
        self.settings = _settings(cfg)
        model.image_settings = self.settings  # saved with the model (preprocessor_config.json)

    def lr_ratios(self, cfg) -> dict[str, float]:
        # A vision side learning as fast as the text model flattens its features toward a constant
        # before the text model reads them (seeds stuck on the answer priors): docs/multimodal.md.
        return {"vision_model.": cfg.vit_lr_ratio, "resampler_model.": cfg.vit_lr_ratio}

    def collate(self, rows, pad_id):
        from erniekit.train.batching import collate

        batch = collate([{k: r[k] for k in ("input_ids", "labels")} for r in rows], pad_id)
        for key in ("images", "videos"):  # per row, so data-parallel row slices keep theirs
            column = np.empty(len(rows), dtype=object)
            column[:] = [r.get(key) for r in rows]
            batch[key] = column
        return batch

    def loss(self, model, batch):
        return vl_loss(model, batch, self.token_balance, self.fused_head)

    @paddle.no_grad()
    def evaluate(self, model, tokenizer, eval_data, cfg):
        from erniekit.infer.vl_generate import answer

        res = eval_loss(
            model,
            eval_data["rows"],
            cfg.per_device_eval_batch_size,
            tokenizer.pad_token_id,
            self.collate,
            functools.partial(vl_loss, fused_head=self.eval_fused_head(cfg)),
        )
        if cfg.eval_generation:
            convs = eval_data["convs"][: cfg.eval_max_samples]
            hits = 0
            for conv in convs:
                got = answer(model, tokenizer, conv, self.settings, cfg.eval_max_new_tokens)
                hits += got.strip() == conv.turns[-1][1].strip()
            res["exact_match"] = hits / max(len(convs), 1)
            majority = getattr(self, "majority_reply", None)
            if majority is not None:
                res["baseline_exact_match"] = baseline_exact_match(convs, majority)
        return res
