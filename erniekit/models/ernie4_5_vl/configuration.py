"""ERNIE-4.5-VL config: transformers' `ernie4_5_vl_moe` config.json (text_config, vision_config,
the image / video token ids), read into one object.

The text fields are flattened into an `Ernie4_5Config` subclass, so everything that reads a text
model's config (training, MoE, FP8, the planner) reads this one unchanged: the text and vision
experts are modality 0 and 1 of the modality-isolated MoE (`moe_num_experts` and
`moe_intermediate_size` as per-modality lists).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from erniekit.errors import CheckpointError
from erniekit.models.ernie4_5.configuration import MAX_SIZE, Ernie4_5Config, _check_rope

MODEL_TYPE = "ernie4_5_vl_moe"
_TEXT_PASSTHROUGH = {
    "model_type",
    "rope_parameters",
    "rope_scaling",
    "mlp_layer_types",
    "output_router_logits",
    "use_cache",
    "dtype",
}


@dataclass
class VisionConfig:
    """The vision transformer (transformers' `Ernie4_5_VLMoeVisionConfig` names)."""

    depth: int = 32
    hidden_size: int = 1280
    num_heads: int = 16
    intermediate_size: int = 5120
    hidden_act: str = "quick_gelu"
    in_channels: int = 3
    patch_size: int = 14
    spatial_merge_size: int = 2
    temporal_merge_size: int = 2
    rms_norm_eps: float = 1e-6  # of its LayerNorms (the reference's name)
    rope_theta: float = 10000.0
    initializer_range: float = 0.02

    def __post_init__(self) -> None:
        for key in (
            "depth",
            "hidden_size",
            "num_heads",
            "intermediate_size",
            "in_channels",
            "patch_size",
            "spatial_merge_size",
        ):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_SIZE:
                raise CheckpointError(f"vision_config.{key}={v!r} must be an integer in [1, {MAX_SIZE}]")
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 4:
            raise CheckpointError(
                f"vision_config: hidden_size {self.hidden_size} / num_heads {self.num_heads} must be a "
                "multiple of 4 (2-D rope splits each head over height and width)"
            )
        if self.temporal_merge_size != 2:
            raise CheckpointError(
                f"vision_config.temporal_merge_size={self.temporal_merge_size}: ERNIE-4.5-VL's resampler merges "
                "frame pairs (2)"
            )
        if self.hidden_act not in ("quick_gelu", "gelu"):
            raise CheckpointError(f"vision_config.hidden_act={self.hidden_act!r}: 'quick_gelu' or 'gelu'")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def num_parameters_estimate(self, text_hidden_size: int) -> int:
        """Parameters of the vision transformer and the resampler (norms and biases approximately)."""
        hs, spatial = self.hidden_size, self.hidden_size * self.spatial_merge_size**2
        blocks = self.depth * (4 * hs * hs + 2 * hs * self.intermediate_size + 9 * hs)
        resampler = (2 + 2 * self.temporal_merge_size) * spatial * spatial + spatial * text_hidden_size
        return self.in_channels * self.patch_size**2 * hs + blocks + resampler

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> VisionConfig:
        d = dict(d)
        rope = d.get("rope_parameters") or {}
        if isinstance(rope, dict) and "rope_theta" in rope:
            d.setdefault("rope_theta", rope["rope_theta"])
        if "num_attention_heads" in d:  # transformers' attribute_map spelling
            d.setdefault("num_heads", d["num_attention_heads"])
        if "num_hidden_layers" in d:
            d.setdefault("depth", d["num_hidden_layers"])
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        theta = d.pop("rope_theta")
        return {
            "model_type": MODEL_TYPE + "_vision",
            **d,
            "rope_parameters": {"rope_type": "axial", "rope_theta": theta},
        }


@dataclass
class Ernie4_5_VLConfig(Ernie4_5Config):
    _READS = (MODEL_TYPE,)
    _READS_WHAT = repr(MODEL_TYPE)
    vision: VisionConfig = field(default_factory=VisionConfig)
    mrope_section: list[int] = field(default_factory=lambda: [22, 22, 20])  # h, w, t pairs of the text rope
    image_start_token_id: int = 101304
    image_end_token_id: int = 101305
    image_token_id: int = 100295
    video_start_token_id: int = 101306
    video_end_token_id: int = 101307
    video_token_id: int = 103367

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.is_moe or len(self.experts_per_modality) != 2:
            raise CheckpointError(
                f"moe_num_experts={self.moe_num_experts}: ERNIE-4.5-VL has text and vision experts (2 modalities)"
            )
        s = list(self.mrope_section)
        if len(s) != 3 or s[0] != s[1] or sum(s) != self.head_dim // 2:
            raise CheckpointError(
                f"mrope_section={s}: needs [h, w, t] with h == w and h + w + t = head_dim / 2 = {self.head_dim // 2}"
            )

    @property
    def model_type(self) -> str:
        return MODEL_TYPE

    def num_parameters_estimate(self, mtp: bool = True) -> int:
        return super().num_parameters_estimate(mtp) + self.vision.num_parameters_estimate(self.hidden_size)

    def replace(self, **changes: Any) -> Ernie4_5_VLConfig:
        """As the text config's; `vision` may be a dict of vision fields to change
        (model_overrides.vision.hidden_size=128)."""
        v = changes.get("vision")
        if isinstance(v, dict):
            unknown = set(v) - {f.name for f in dataclasses.fields(VisionConfig)}
            if unknown:
                raise CheckpointError(f"model_overrides.vision: unknown field(s) {sorted(unknown)}")
            changes["vision"] = dataclasses.replace(self.vision, **v)
        return super().replace(**changes)

    def mlp_layer_types(self) -> list[str]:
        return ["sparse" if self.is_moe_layer(i) else "dense" for i in range(self.num_hidden_layers)]

    def vision_token_ids(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in _TOKEN_KEYS}

    # ---- config.json io ------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Ernie4_5_VLConfig:
        # transformers writes null special ids in text_config: ours keep their defaults
        text = {k: v for k, v in (d.get("text_config") or {}).items() if not (k.endswith("token_id") and v is None)}
        if not text:
            raise CheckpointError("config.json of an ERNIE-4.5-VL model needs text_config")
        for key in ("rope_parameters", "rope_scaling"):  # the text rope; the vision one is axial by design
            _check_rope(f"text_config.{key}", text.get(key))
        _check_rope("rope_scaling", d.get("rope_scaling"))
        rope = text.get("rope_parameters") or {}
        n, types = text.get("num_hidden_layers", 28), text.get("mlp_layer_types")
        if types:
            text.update(_moe_layers(types))
        elif isinstance(n, int) and n >= 2:  # transformers' default: the first layer dense, the rest sparse
            text.update(moe_layer_start_index=1, moe_layer_end_index=n - 1, moe_layer_interval=1)
        elif n == 1:
            text.update(_moe_layers(["dense"]))  # refused: no sparse layer
        # (any other num_hidden_layers is refused by the text config's checks)
        e = text.get("moe_num_experts", 64)
        text["moe_num_experts"] = [e, e] if isinstance(e, int) else list(e)
        text.setdefault("moe_intermediate_size", [1536, 512])
        base = Ernie4_5Config.from_dict(
            {k: v for k, v in text.items() if k not in _TEXT_PASSTHROUGH}
            | {"model_type": "ernie4_5_moe", "rope_parameters": rope}
        )
        kw = {f.name: getattr(base, f.name) for f in dataclasses.fields(Ernie4_5Config)}
        kw["moe_num_experts"] = text["moe_num_experts"]
        kw["tie_word_embeddings"] = bool(d.get("tie_word_embeddings", text.get("tie_word_embeddings", True)))
        kw["vision"] = VisionConfig.from_dict(d.get("vision_config") or {})
        kw["mrope_section"] = list(rope.get("mrope_section", [22, 22, 20]))
        for k in _TOKEN_KEYS:
            if k in d:
                kw[k] = d[k]
        return cls(**kw)

    def to_dict(self) -> dict[str, Any]:
        text = Ernie4_5Config.to_dict(self)
        for k in ("architectures", "torch_dtype", "moe_layer_start_index", "moe_layer_end_index", "moe_layer_interval"):
            text.pop(k, None)
        for k in ("vision", "mrope_section", *_TOKEN_KEYS):
            text.pop(k, None)
        text["model_type"] = MODEL_TYPE + "_text"
        text["moe_num_experts"] = self.experts_per_modality[0]
        text["mlp_layer_types"] = self.mlp_layer_types()
        text["rope_parameters"] = {
            "rope_type": "default",
            "rope_theta": self.rope_theta,
            "mrope_section": list(self.mrope_section),
        }
        return {
            "architectures": ["Ernie4_5_VLMoeForConditionalGeneration"],
            "model_type": MODEL_TYPE,
            "text_config": text,
            "vision_config": self.vision.to_dict(),
            **self.vision_token_ids(),
            "tie_word_embeddings": self.tie_word_embeddings,
            "dtype": "float32",
        }


_TOKEN_KEYS = (
    "image_start_token_id",
    "image_end_token_id",
    "image_token_id",
    "video_start_token_id",
    "video_end_token_id",
    "video_token_id",
)


def _moe_layers(types: list[str]) -> dict[str, int]:
    """transformers' per-layer `mlp_layer_types` as ERNIE's start / end / interval (what the
    decoder layers read); a pattern they cannot express is refused."""
    sparse = [i for i, t in enumerate(types) if t == "sparse"]
    bad = [t for t in types if t not in ("dense", "sparse")]
    if bad or not sparse:
        raise CheckpointError(
            f"text_config.mlp_layer_types={types}: needs 'dense' / 'sparse' entries, at least one sparse"
        )
    start, end = sparse[0], sparse[-1]
    # every n-th layer: consecutive sparse layers are `interval` apart, so one candidate is tried
    # (a long hostile list is not searched quadratically)
    interval = sparse[1] - sparse[0] if len(sparse) > 1 else 1
    want = [i for i in range(start, end + 1) if (i + 1) % interval == 0]
    if want == sparse:
        return {"moe_layer_start_index": start, "moe_layer_end_index": end, "moe_layer_interval": interval}
    raise CheckpointError(
        f"text_config.mlp_layer_types={types}: sparse layers must be every n-th layer of one range "
        "(ERNIE's moe_layer_start_index / end / interval)"
    )


# Presets: the public shapes (for the planner's memory and time estimates) and a tiny one for tests.
PRESETS: dict[str, Ernie4_5_VLConfig] = {
    "ERNIE-4.5-VL-28B-A3B": Ernie4_5_VLConfig(
        vocab_size=103424,
        hidden_size=2560,
        intermediate_size=12288,
        num_hidden_layers=28,
        num_attention_heads=20,
        num_key_value_heads=4,
        head_dim=128,
        tie_word_embeddings=True,
        moe_num_experts=[64, 64],
        moe_k=6,
        moe_intermediate_size=[1536, 512],
        moe_num_shared_experts=2,
        moe_layer_start_index=1,
        vision=VisionConfig(),
    ),
    # the text model of ERNIE-4.5-300B-A47B (64 text experts of 3584) plus 64 vision experts of 1536:
    # 424B parameters, 47B active per token
    "ERNIE-4.5-VL-424B-A47B": Ernie4_5_VLConfig(
        vocab_size=103424,
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=54,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
        moe_num_experts=[64, 64],
        moe_k=8,
        moe_intermediate_size=[3584, 1536],
        moe_num_shared_experts=0,
        moe_layer_start_index=3,
        vision=VisionConfig(),
    ),
    # the bundled 1024-piece tokenizer's vocabulary plus the six vision tokens (ids 1024-1029), so
    # no text ever tokenizes to a placeholder
    "tiny-vl": Ernie4_5_VLConfig(
        vocab_size=1032,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        moe_num_experts=[8, 8],
        moe_k=2,
        moe_intermediate_size=[128, 64],
        moe_num_shared_experts=1,
        moe_layer_start_index=1,
        router_aux_loss_coef=0.01,
        mrope_section=[4, 4, 8],
        vision=VisionConfig(depth=2, hidden_size=64, num_heads=4, intermediate_size=128),
        image_start_token_id=1024,
        image_end_token_id=1025,
        image_token_id=1026,
        video_start_token_id=1027,
        video_end_token_id=1028,
        video_token_id=1029,
    ),
}
