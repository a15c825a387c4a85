"""The WebUI's chat with a vision-language model: an uploaded image (or video) attaches to the message it is
sent with, and every reply re-renders the whole conversation with its images (as VL-SFT trains
and `erniekit chat --image` asks) and streams from the serving engine, so the page's sampling
options apply as they do to text models."""

from __future__ import annotations

import queue
from collections.abc import Iterator

from erniekit.data.formats import IMAGE_MARKER, VIDEO_MARKER, Conversation
from erniekit.errors import ErniekitError
from erniekit.infer.engine import Engine, Request
from erniekit.infer.sampling import SamplingParams
from erniekit.infer.vl_generate import prompt_with_videos


class ImageConversation:
    def __init__(self, model, tokenizer, stops: list[int]):
        self.model, self.tokenizer = model, tokenizer
        self.engine = Engine(model, tokenizer, max_batch=1, stop_token_ids=stops)
        self.turns: list[tuple[str, str]] = []  # (user text with IMAGE_MARKERs, reply)
        self.images: list[str] = []  # image files in marker order
        self.videos: list = []  # videos, decoded to (frames, times), in marker order

    @property
    def has_images(self) -> bool:
        """Whether the conversation holds a picture (an image or a video)."""
        return bool(self.images or self.videos)

    def reset(self) -> None:
        self.turns, self.images, self.videos = [], [], []

    def reply(self, text: str, image: str | None, params: SamplingParams, video: str | None = None) -> Iterator[str]:
        """The reply so far after each new piece; the turn joins the conversation once complete."""
        from erniekit.models.ernie4_5_vl.video import load_video

        m = self.model
        images = self.images + ([image] if image else [])
        videos = self.videos + ([load_video(video, "the uploaded video", m.video_settings)] if video else [])
        user = (IMAGE_MARKER if image else "") + (VIDEO_MARKER if video else "") + text
        turns = self.turns + [(user, "")]
        conv = Conversation(None, turns, [True] * len(turns), "chat image", images, videos)
        ids, pixels, frames = prompt_with_videos(conv, self.tokenizer, m.config, m.image_settings, m.video_settings)
        pieces: queue.Queue = queue.Queue()
        req = Request(ids, params, lambda delta, finish: pieces.put((delta, finish)), images=pixels, videos=frames)
        self.engine.submit(req)
        finish, so_far = None, ""
        try:
            while finish is None:
                delta, finish = pieces.get()
                so_far += delta
                if delta and finish is None:
                    yield so_far
        finally:
            req.cancelled = finish is None  # the page went away mid-reply: stop generating
        if finish == "error":
            raise ErniekitError(f"generation failed: {req.error}")
        self.turns.append((user, so_far))
        self.images, self.videos = images, videos
        yield so_far

    def close(self) -> None:
        self.engine.close()
