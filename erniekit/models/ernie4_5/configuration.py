"""ERNIE 4.5 model config: field names and defaults of the public ERNIE-4.5 `config.json` files.

One dataclass covers the dense (`model_type: ernie4_5`) and MoE (`ernie4_5_moe`) models;
`moe_num_experts == 0` means dense. Presets live next to it so tests, the embedded default
and users share the same shapes.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

from erniekit.errors import CheckpointError

# Keys of config.json that we understand but do not need for the computation.
_PASSTHROUGH_KEYS = {
    "architectures",
    "torch_dtype",
    "dtype",
    "transformers_version",
    "use_cache",
    "model_type",
    "rope_scaling",
    "rope_parameters",
    "_name_or_path",
    "output_router_logits",
    "initializer_range",
}

# Upper bounds of config.json sizes, checked before anything is built from them. Paddle passes
# shapes and indices as int32 in places (head_dim=1e9 dies in an op attribute with IndexError), so
# every dimension, count and token id must fit one.
MAX_SIZE = 2**31 - 1
# About 4.4e12 parameters: ten times the largest ERNIE 4.5 (ERNIE-4.5-VL-424B-A47B). A config past
# it is a typo or a hostile file, and building it would exhaust memory before any weight is compared.
MAX_PARAMETERS = 2**42


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_rope(key: str, rope: Any) -> None:
    """`rope_parameters` (transformers 5) or the legacy `rope_scaling` (4.x, type or rope_type):
    only the default rope is computed, so a scaled one is refused, not silently dropped."""
    if rope is None:
        return
    if not isinstance(rope, dict):
        raise CheckpointError(f"{key}={rope!r} is invalid: it must be an object or null")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise CheckpointError(f"{key}: rope_type={kind!r} is not supported (only 'default')")


@dataclass
class Ernie4_5Config:
    # config.json model_type values this class reads (None: our own early untyped files), and what
    # a mismatch is told it is not
    _READS = (None, "ernie4_5", "ernie4_5_moe")
    _READS_WHAT = "an ERNIE 4.5 text model"

    vocab_size: int = 103424
    hidden_size: int = 1024
    intermediate_size: int = 3072
    num_hidden_layers: int = 18
    num_attention_heads: int = 16
    num_key_value_heads: int = 2
    head_dim: int | None = None  # None -> hidden_size // num_attention_heads
    hidden_act: str = "silu"
    max_position_embeddings: int = 131072
    rms_norm_eps: float = 1e-5
    use_bias: bool = False
    tie_word_embeddings: bool = True
    rope_theta: float = 500000.0
    pad_token_id: int = 0
    bos_token_id: int = 1
    eos_token_id: int | list[int] = 2
    initializer_range: float = 0.02
    # MoE (ERNIE-4.5-21B-A3B names); moe_num_experts == 0 -> dense model. A list (ERNIE-4.5-VL)
    # gives one entry per modality (index = modality id, 0 = text): modality-isolated routing.
    moe_num_experts: int | list[int] = 0
    moe_k: int = 6
    moe_intermediate_size: int | list[int] = 1536
    moe_num_shared_experts: int = 0
    moe_layer_start_index: int = 1
    moe_layer_end_index: int = -1
    moe_layer_interval: int = 1
    moe_norm_min: float = 1e-12
    router_aux_loss_coef: float = 0.0
    # ERNIE training techniques (docs/moe.md, docs/fp8.md, docs/gpas.md); all off by default
    router_z_loss_coef: float = 0.0
    router_orthogonal_loss_coef: float = 0.0
    moe_capacity_factor: float = 0.0  # 0: no capacity limit (no token dropping)
    moe_bias_update_rate: float = 0.0  # aux-loss-free balancing: step of e_score_correction_bias per update
    use_gpas: bool = False  # gradient-preserving activation scaling of the residual stream
    # multi-token prediction (docs/mtp.md; ERNIE's config.json names): D sequential heads, depth j
    # predicting token t+j+1; their mean loss is added with weight multi_token_pred_lambda
    num_nextn_predict_layers: int = 0
    multi_token_pred_lambda: float = 0.3
    extra: dict[str, Any] = field(default_factory=dict)  # unknown config.json keys, written back as read

    def __post_init__(self) -> None:
        self._check_types()
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.moe_layer_end_index == -1:
            self.moe_layer_end_index = self.num_hidden_layers - 1
        if self.num_attention_heads % self.num_key_value_heads:
            raise CheckpointError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}: fix config.json"
            )
        self._check_modalities()
        if self.is_moe and not 0 < self.moe_k <= min(self.experts_per_modality):
            raise CheckpointError(
                f"moe_k={self.moe_k} must be in [1, moe_num_experts={self.moe_num_experts}] "
                "(at most the experts of every modality)"
            )
        if self.moe_capacity_factor < 0:
            raise CheckpointError(f"moe_capacity_factor={self.moe_capacity_factor} must be >= 0 (0 = no limit)")
        self._check_mtp()
        self._check_products()

    def _check_types(self) -> None:
        """A config.json (or model_overrides) value of the wrong type or range is one CheckpointError here,
        not a ZeroDivisionError or a Paddle shape error while the layers are built."""

        def bad(key: str, rule: str) -> CheckpointError:
            return CheckpointError(f"{key}={getattr(self, key)!r} is invalid: it must be {rule}")

        for key in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "max_position_embeddings",
            "moe_k",
            "moe_layer_interval",
        ):
            v = getattr(self, key)
            if not _is_int(v) or not 1 <= v <= MAX_SIZE:
                raise bad(key, f"an integer in [1, {MAX_SIZE}]")
        if self.head_dim is not None and (not _is_int(self.head_dim) or not 1 <= self.head_dim <= MAX_SIZE):
            raise bad("head_dim", f"an integer in [1, {MAX_SIZE}] or null")
        if not _is_int(self.moe_num_shared_experts) or not 0 <= self.moe_num_shared_experts <= MAX_SIZE:
            raise bad("moe_num_shared_experts", f"an integer in [0, {MAX_SIZE}]")
        for key in ("moe_num_experts", "moe_intermediate_size"):  # lists: _check_modalities
            v = getattr(self, key)
            if not all(_is_int(n) and 0 <= n <= MAX_SIZE for n in (v if isinstance(v, (list, tuple)) else [v])):
                raise bad(key, f"an integer in [0, {MAX_SIZE}] or a list of them (one per modality)")
        self._check_token_ids(bad)
        for key in ("rms_norm_eps", "rope_theta"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf"):
                raise bad(key, "a positive number")
        for key in ("use_bias", "tie_word_embeddings", "use_gpas"):
            if not isinstance(getattr(self, key), bool):
                raise bad(key, "true or false")
        if self.hidden_act != "silu":
            raise bad("hidden_act", "'silu' (the only activation of ERNIE 4.5)")

    def _check_token_ids(self, bad) -> None:
        """eos / bos / pad ids are written into generation_config.json and compared with sampled
        tokens: a string here would pass the load and fail at the first save."""
        eos = self.eos_token_id
        ids = list(eos) if isinstance(eos, (list, tuple)) else [eos]
        if not ids or not all(_is_int(i) and 0 <= i <= MAX_SIZE for i in ids):
            raise bad("eos_token_id", "a token id (an integer >= 0) or a non-empty list of them")
        for key in ("bos_token_id", "pad_token_id"):
            v = getattr(self, key)
            if v is not None and not (_is_int(v) and 0 <= v <= MAX_SIZE):
                raise bad(key, "a token id (an integer >= 0) or null")

    def _check_products(self) -> None:
        """Sizes that are each in range can still multiply past what can be built: the projection
        widths must fit int32 and the whole model MAX_PARAMETERS."""
        for heads in ("num_attention_heads", "num_key_value_heads"):
            width = getattr(self, heads) * self.head_dim
            if width > MAX_SIZE:
                raise CheckpointError(
                    f"{heads}={getattr(self, heads)} x head_dim={self.head_dim} = {width} exceeds {MAX_SIZE}"
                )
        shared = self.expert_sizes[0] * self.moe_num_shared_experts if self.is_moe else 0
        if shared > MAX_SIZE:
            raise CheckpointError(
                f"moe_intermediate_size={self.expert_sizes[0]} x moe_num_shared_experts={self.moe_num_shared_experts} "
                f"exceeds {MAX_SIZE}"
            )
        n = self.num_parameters_estimate()
        if n > MAX_PARAMETERS:
            raise CheckpointError(
                f"the config describes about {n:.3g} parameters, more than the {MAX_PARAMETERS:.3g} erniekit builds "
                "(ten times the largest ERNIE 4.5): lower the sizes"
            )

    def num_moe_layers(self) -> int:
        """Decoder layers with routed experts (is_moe_layer counted without visiting every layer)."""
        if not self.is_moe:
            return 0
        lo, hi, k = (
            max(self.moe_layer_start_index, 0),
            min(self.moe_layer_end_index, self.num_hidden_layers - 1),
            self.moe_layer_interval,
        )
        return max(0, (hi + 1) // k - lo // k) if hi >= lo else 0

    def num_parameters_estimate(self, mtp: bool = True) -> int:
        """Parameters the model built from this config holds (biases and norms approximately):
        what the size limits and the comparison with a checkpoint's headers are measured in."""
        h, hd = self.hidden_size, self.head_dim
        attn = h * hd * 2 * (self.num_attention_heads + self.num_key_value_heads) + 2 * h
        dense = attn + 3 * h * self.intermediate_size
        n_moe = self.num_moe_layers()
        moe = (
            attn
            + h * self.total_experts
            + 3 * h * sum(e * i for e, i in zip(self.experts_per_modality, self.expert_sizes))
        )
        if self.is_moe:
            moe += 3 * h * self.expert_sizes[0] * self.moe_num_shared_experts
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        depth = self.num_nextn_predict_layers if mtp and _is_int(self.num_nextn_predict_layers) else 0
        mtp_params = depth * (dense + 2 * h * h + 2 * h)
        return embed + h + n_moe * moe + (self.num_hidden_layers - n_moe) * dense + mtp_params

    def _check_mtp(self) -> None:
        n = self.num_nextn_predict_layers
        if not _is_int(n) or not 0 <= n <= MAX_SIZE:
            raise CheckpointError(
                f"num_nextn_predict_layers={n!r} must be an integer in [0, {MAX_SIZE}] (0 = no MTP heads)"
            )
        lam = self.multi_token_pred_lambda
        if isinstance(lam, bool) or not isinstance(lam, (int, float)) or not math.isfinite(lam) or lam < 0:
            raise CheckpointError(
                f"multi_token_pred_lambda={lam!r} must be a finite number >= 0 (the weight of the MTP loss)"
            )

    def _check_modalities(self) -> None:
        """Per-modality lists must be positive ints of one length (an int applies to every modality)."""
        lens = set()
        for key in ("moe_num_experts", "moe_intermediate_size"):
            v = getattr(self, key)
            if isinstance(v, tuple):
                v = list(v)
                setattr(self, key, v)
            if isinstance(v, list):
                if not v or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in v):
                    raise CheckpointError(
                        f"{key}={v}: a per-modality list needs positive integers (index = modality id)"
                    )
                lens.add(len(v))
        if len(lens) > 1:
            raise CheckpointError(
                f"moe_num_experts={self.moe_num_experts} and moe_intermediate_size="
                f"{self.moe_intermediate_size} list different modality counts: give both one entry per modality"
            )

    @property
    def num_modalities(self) -> int:
        """Modalities with their own routed experts (1 unless a MoE key is a list)."""
        lists = [v for v in (self.moe_num_experts, self.moe_intermediate_size) if isinstance(v, list)]
        return len(lists[0]) if lists else 1

    def _per_modality(self, v: int | list[int]) -> list[int]:
        return list(v) if isinstance(v, list) else [v] * self.num_modalities

    @property
    def experts_per_modality(self) -> list[int]:
        """Routed experts of each modality (index = modality id, 0 = text)."""
        return self._per_modality(self.moe_num_experts)

    @property
    def expert_sizes(self) -> list[int]:
        """Intermediate size of one routed expert of each modality."""
        return self._per_modality(self.moe_intermediate_size)

    @property
    def total_experts(self) -> int:
        """Routed experts of all modalities (global expert ids run 0..total_experts-1)."""
        return sum(self.experts_per_modality)

    @property
    def is_moe(self) -> bool:
        return self.total_experts > 0

    @property
    def model_type(self) -> str:
        return "ernie4_5_moe" if self.is_moe else "ernie4_5"

    @property
    def lm_head_bias(self) -> bool:
        """Whether the LM head adds a bias: transformers' Ernie4_5_MoeForCausalLM builds lm_head with
        bias=use_bias (tied or not: only its weight is tied); the dense and VL models never do."""
        return self.model_type == "ernie4_5_moe" and self.use_bias

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Same rule as the reference implementation (transformers' Ernie4_5_MoeDecoderLayer)."""
        return (
            self.is_moe
            and (layer_idx + 1) % self.moe_layer_interval == 0
            and self.moe_layer_start_index <= layer_idx <= self.moe_layer_end_index
        )

    @property
    def eos_token_ids(self) -> list[int]:
        return list(self.eos_token_id) if isinstance(self.eos_token_id, (list, tuple)) else [self.eos_token_id]

    # ---- config.json io -------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Ernie4_5Config":
        d = dict(d)
        for key in ("rope_parameters", "rope_scaling"):
            _check_rope(key, d.get(key))
        rope = d.get("rope_parameters") or {}
        if "rope_theta" not in d and "rope_theta" in rope:
            d["rope_theta"] = rope["rope_theta"]  # transformers 5 writes it nested
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        known = {k: v for k, v in d.items() if k in names}
        extra = {k: v for k, v in d.items() if k not in names and k not in _PASSTHROUGH_KEYS}
        if d.get("model_type") == "ernie4_5" or "moe_num_experts" not in d:
            known["moe_num_experts"] = 0
        cfg = cls(**known)
        cfg.extra = extra
        return cfg

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        if not self.is_moe:
            for k in list(d):
                if k.startswith(("moe_", "router_")):
                    d.pop(k)
        if not self.num_nextn_predict_layers:  # no MTP heads: config.json stays as without the feature
            d.pop("num_nextn_predict_layers")
            d.pop("multi_token_pred_lambda")
        d.update(self.extra)
        arch = "Ernie4_5_MoeForCausalLM" if self.is_moe else "Ernie4_5ForCausalLM"
        # both rope spellings, so transformers 4.x/5.x and PaddleFormers all read it
        d["rope_parameters"] = {"rope_theta": self.rope_theta, "rope_type": "default"}
        return {"architectures": [arch], "model_type": self.model_type, **d, "torch_dtype": "float32"}

    @classmethod
    def from_pretrained(cls, path: str) -> "Ernie4_5Config":
        file = os.path.join(path, "config.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise CheckpointError(
                f"{file}: config.json not found; not a checkpoint directory: give the one holding config.json and the weights"
            )
        from erniekit.utils.io import read_json_object

        d = read_json_object(file, "fix config.json")
        if d.get("model_type") not in cls._READS:
            raise CheckpointError(f"{file}: model_type={d.get('model_type')!r} is not {cls._READS_WHAT}")
        try:
            return cls.from_dict(d)
        except TypeError as e:
            raise CheckpointError(f"{file}: bad config value ({e}); fix config.json") from None
        except CheckpointError as e:
            raise CheckpointError(f"{file}: {e}" + ("" if "config.json" in str(e) else "; fix config.json")) from None

    def save_pretrained(self, path: str) -> None:
        from erniekit.utils.io import atomic_write_text

        os.makedirs(path, exist_ok=True)
        atomic_write_text(os.path.join(path, "config.json"), json.dumps(self.to_dict(), indent=2) + "\n")

    def replace(self, **changes: Any) -> "Ernie4_5Config":
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise CheckpointError(f"model_overrides: unknown model config field(s) {sorted(unknown)}")
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if "num_hidden_layers" in changes and self.moe_layer_end_index == self.num_hidden_layers - 1:
            d["moe_layer_end_index"] = -1
        d.update(changes)
        try:
            return type(self)(**d)
        except (CheckpointError, TypeError) as e:
            raise CheckpointError(f"model_overrides: {e}; fix the override") from None


# Presets: public shapes, plus the tiny models of the embedded default and the tests.
PRESETS: dict[str, Ernie4_5Config] = {
    "ERNIE-4.5-0.3B": Ernie4_5Config(
        vocab_size=103424,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=18,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=128,
        max_position_embeddings=131072,
        tie_word_embeddings=True,
    ),
    "ERNIE-4.5-21B-A3B": Ernie4_5Config(
        vocab_size=103424,
        hidden_size=2560,
        intermediate_size=12288,
        num_hidden_layers=28,
        num_attention_heads=20,
        num_key_value_heads=4,
        head_dim=128,
        tie_word_embeddings=True,
        moe_num_experts=64,
        moe_k=6,
        moe_intermediate_size=1536,
        moe_num_shared_experts=2,
        moe_layer_start_index=1,
        moe_layer_interval=1,
    ),
    # Embedded default: ERNIE 4.5 MoE architecture at laptop size; vocab matches the shipped tokenizer.
    "tiny-moe": Ernie4_5Config(
        vocab_size=1024,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        moe_num_experts=8,
        moe_k=2,
        moe_intermediate_size=128,
        moe_num_shared_experts=1,
        moe_layer_start_index=1,
        moe_layer_interval=1,
        router_aux_loss_coef=0.01,
    ),
    "tiny-dense": Ernie4_5Config(
        vocab_size=1024,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        rope_theta=10000.0,
    ),
}


def get_preset(name: str) -> Ernie4_5Config:
    if name not in PRESETS:
        raise CheckpointError(
            f"unknown model preset {name!r}; choose one of {sorted(PRESETS)} or a checkpoint directory"
        )
    return dataclasses.replace(PRESETS[name], extra={})
