"""Elastic sub-models (ERNIE 5 style): one set of weights serves several depths, expert counts and
routing sparsities.

A sub-model is named by an `ElasticSpec` (None = as the full model) and is always a *prefix*-style
cut of the full weights, so it can be trained in place (`elastic(model, spec)` only flips routing
and layer-skipping switches, no parameter changes shape) and exported as an ordinary smaller
checkpoint (`extract_submodel`) whose logits equal the in-place ones. Rules (docs/elastic.md):

- depth d keeps `layer_subset(L, d)`: the first and the last layer and d - 2 layers spread evenly
  between them;
- experts n keeps experts 0..n-1 of every MoE layer (router columns and correction bias sliced
  alike); the router's softmax and top-k run over those n only;
- top_k k routes every token to k experts.
"""

from __future__ import annotations

import contextlib
import random
import re
from dataclasses import dataclass, field
from typing import Iterator

from erniekit.errors import CheckpointError, ConfigError, ErniekitError

# paddle is imported inside the functions that need it, so the CLI can parse elastic.* settings first


@dataclass(frozen=True)
class ElasticSpec:
    """One sub-model; None in a field means 'as the full model'."""

    depth: int | None = None
    experts: int | None = None
    top_k: int | None = None

    @property
    def is_full(self) -> bool:
        return self.depth is None and self.experts is None and self.top_k is None

    def resolved(self, config) -> "ElasticSpec":
        """The same sub-model with every None replaced by the full model's value."""
        return ElasticSpec(
            self.depth or config.num_hidden_layers,
            self.experts or num_experts(config) or None,
            self.top_k or (config.moe_k if config.is_moe else None),
        )


@dataclass(frozen=True)
class ElasticChoices:
    """What a training run samples from; empty lists keep that dimension full."""

    depth: list[int] = field(default_factory=list)
    experts: list[int] = field(default_factory=list)
    top_k: list[int] = field(default_factory=list)
    full_prob: float = 0.25
    sandwich: bool = False  # every step: the full model, then one sampled smaller sub-model

    @property
    def enabled(self) -> bool:
        return bool(self.depth or self.experts or self.top_k)


def num_experts(config) -> int:
    """Routed experts an elastic expert count can go up to: per modality, the smallest (0 = dense)."""
    per = getattr(config, "experts_per_modality", None)
    return min(per) if per else config.moe_num_experts


def layer_subset(num_layers: int, depth: int | None) -> list[int]:
    """Indices of the layers a depth-`depth` sub-model keeps, ascending.

    The first and the last layer are always kept and the rest are spread evenly
    (round(i * (L - 1) / (d - 1))): the last layer is the one trained to feed the final norm and
    LM head, and the first reads raw embeddings, so dropping middle layers disturbs the residual
    stream least (a prefix cut would make layer d-1 double as intermediate and output layer).
    depth 1 keeps layer 0 only.
    """
    if depth is None or depth >= num_layers:
        return list(range(num_layers))
    if depth < 1:
        raise ValueError(f"depth={depth} must be >= 1")
    if depth == 1:
        return [0]
    return [int(i * (num_layers - 1) / (depth - 1) + 0.5) for i in range(depth)]


def check_spec(config, spec: ElasticSpec, key: str = "elastic") -> None:
    """One-line ConfigError when `spec` does not fit the model config (names `key`.field)."""
    L, k = config.num_hidden_layers, config.moe_k
    E = num_experts(config)
    if spec.depth is not None and not 1 <= spec.depth <= L:
        raise ConfigError(f"{key}.depth={spec.depth} is invalid: the model has {L} layers; use 1..{L}")
    if (spec.experts is not None or spec.top_k is not None) and not config.is_moe:
        raise ConfigError(f"{key}.experts/top_k: the model is dense (no experts); leave them unset")
    if spec.experts is not None and not 1 <= spec.experts <= E:
        raise ConfigError(f"{key}.experts={spec.experts} is invalid: the model has {E} experts; use 1..{E}")
    n = spec.experts or E
    if spec.top_k is not None and not 1 <= spec.top_k <= n:
        raise ConfigError(f"{key}.top_k={spec.top_k} is invalid: it must be in 1..{n} (the active experts)")
    if spec.top_k is None and config.is_moe and k > n:
        raise ConfigError(f"{key}.experts={n} is below the model's moe_k={k}; also set {key}.top_k <= {n}")


def parse_settings(tokens: list[str]) -> ElasticSpec:
    """`elastic.depth=2 elastic.experts=4 elastic.top_k=1` (command-line spelling) -> ElasticSpec."""
    values: dict[str, int] = {}
    for tok in tokens:
        key, sep, raw = tok.partition("=")
        name = key.strip().lower().removeprefix("elastic.").replace("-", "_")
        shown = tok if len(tok) <= 60 else tok[:57] + "..."  # a pasted blob stays a one-line error
        if not sep or not key.strip().lower().startswith("elastic.") or name not in ("depth", "experts", "top_k"):
            raise ErniekitError(
                f"'{shown}' is not an elastic setting; write elastic.depth=N, elastic.experts=N or elastic.top_k=N"
            )
        if name in values:  # last-one-wins would silently export a sub-model the user did not read back
            raise ErniekitError(f"'{shown}': elastic.{name} is given twice ({values[name]} before); keep one")
        try:
            values[name] = int(raw)
        except ValueError:
            raise ErniekitError(f"'{shown}': the value is not an integer; write e.g. elastic.{name}=2") from None
        if values[name] < 1:
            raise ErniekitError(f"'{shown}': elastic.{name} must be >= 1")
    return ElasticSpec(**values)


# ---- elastic mode on the full model ----------------------------------------------------------
def _routers(layer) -> list:
    """The TopKRouters of a decoder layer's MoE block (one per modality), [] for a dense layer."""
    mlp = layer.mlp
    if not hasattr(mlp, "gate"):
        return []
    n = getattr(mlp, "num_modalities", 1)
    return [mlp.router(m) for m in range(n)] if hasattr(mlp, "router") else [mlp.gate]


def apply_elastic(model, spec: ElasticSpec) -> None:
    """Switch `model` (Ernie4_5ForCausalLM) to the sub-model `spec` in place; the full spec resets.

    Skipped MoE layers forget their last router loss and routing, so neither the loss sum nor the
    routing monitor sees stale values from an earlier step.
    """
    inner = model.model
    L = len(inner.layers)
    keep = layer_subset(L, spec.depth)
    inner.active_layers = None if len(keep) == L else keep
    kept = set(keep)
    for i, layer in enumerate(inner.layers):
        routers = _routers(layer)
        for gate in routers:  # with modality-isolated experts: the first n of every modality
            gate.active_experts = spec.experts if spec.experts and spec.experts < gate.num_experts else None
            gate.active_k = spec.top_k
        if routers and i not in kept:
            m = layer.mlp
            m.router_loss, m.loss_parts, m.last_topk_idx, m.last_probs = None, {}, None, None
            m.pending_stats = None


@contextlib.contextmanager
def elastic(model, spec: ElasticSpec) -> Iterator[None]:
    """Run the block with `model` switched to `spec`, then back to the full model."""
    apply_elastic(model, spec)
    try:
        yield
    finally:
        apply_elastic(model, ElasticSpec())


def sample_spec(rng: random.Random, choices: ElasticChoices) -> ElasticSpec:
    """The full model with probability full_prob, else each dimension uniformly from its list."""
    if rng.random() < choices.full_prob:
        return ElasticSpec()

    def pick(xs):
        return rng.choice(xs) if xs else None

    return ElasticSpec(pick(choices.depth), pick(choices.experts), pick(choices.top_k))


def smaller_specs(config, choices: ElasticChoices) -> list[ElasticSpec]:
    """Every depth x experts x top-k combination of the choices except those equal to the full
    model: what a sandwich step draws its sub-model from (uniformly)."""
    full = ElasticSpec().resolved(config)
    combos = [
        ElasticSpec(d, e, k)
        for d in (choices.depth or [None])
        for e in (choices.experts or [None])
        for k in (choices.top_k or [None])
    ]
    return [s for s in combos if s.resolved(config) != full]


# ---- export ---------------------------------------------------------------------------------
def _moe_range(flags: list[bool], interval: int) -> dict | None:
    """moe_layer_start/end/interval reproducing `flags` over the kept layers, or None."""
    on = [j for j, f in enumerate(flags) if f]
    if not on:
        return {"moe_layer_start_index": len(flags), "moe_layer_end_index": -1, "moe_layer_interval": 1}
    for step in dict.fromkeys((interval, 1)):
        want = [on[0] <= j <= on[-1] and (j + 1) % step == 0 for j in range(len(flags))]
        if want == flags:
            return {"moe_layer_start_index": on[0], "moe_layer_end_index": on[-1], "moe_layer_interval": step}
    return None


def submodel_config(config, spec: ElasticSpec):
    """The Ernie4_5Config of the sub-model (fewer layers / experts, new top-k)."""
    check_spec(config, spec)
    keep = layer_subset(config.num_hidden_layers, spec.depth)
    changes: dict = {"num_hidden_layers": len(keep)}
    if config.is_moe:
        moe = _moe_range([config.is_moe_layer(i) for i in keep], config.moe_layer_interval)
        if moe is None:
            raise CheckpointError(
                f"elastic.depth={spec.depth} keeps layers {keep}, whose dense/MoE pattern no "
                "moe_layer_start_index/end_index/interval can express; choose another depth"
            )
        experts = config.moe_num_experts
        if spec.experts:  # modality-isolated (a list): the first n experts of every modality
            experts = [spec.experts] * len(experts) if isinstance(experts, list) else spec.experts
        changes.update(moe, moe_num_experts=experts, moe_k=spec.top_k or config.moe_k)
    return config.replace(**changes)


_LAYER = re.compile(r"model\.layers\.(\d+)\.(.*)")


def _source(name: str, keep: list[int]) -> str:
    m = _LAYER.fullmatch(name)
    return f"model.layers.{keep[int(m[1])]}.{m[2]}" if m else name


def extract_submodel(model, spec: ElasticSpec):
    """A standalone Ernie4_5ForCausalLM holding sub-model `spec` of `model` (weights copied):
    layers renumbered 0..d-1, expert stacks, router columns and correction bias cut to the first
    n experts. Its logits equal those of `model` under `elastic(model, spec)`."""
    import paddle

    from erniekit.models.registry import family_of_model
    from erniekit.nn.deferred_init import skip_random_init

    sub_cfg = submodel_config(model.config, spec)
    keep = layer_subset(model.config.num_hidden_layers, spec.depth)
    n = spec.experts  # None: no expert slicing
    src = dict(model.named_parameters())
    prev = paddle.get_default_dtype()
    paddle.set_default_dtype(str(model.model.embed_tokens.weight.dtype).replace("paddle.", ""))
    try:
        with skip_random_init():  # every parameter is copied from the parent below, or refused
            sub = family_of_model(model).build(sub_cfg)
    finally:
        paddle.set_default_dtype(prev)
    with paddle.no_grad():
        for name, p in sub.named_parameters():
            sname = _source(name, keep)
            if sname not in src:
                raise CheckpointError(f"elastic export: the source model has no parameter {sname}")
            t = src[sname]
            if n and re.search(r"\.mlp\.experts(_\d+)?\.(gate|up|down)_proj$", name):
                t = t[:n]
            elif n and re.search(r"\.mlp\.gate(_\d+)?\.(weight|e_score_correction_bias)$", name):
                t = t[:, :n]
            if list(t.shape) != list(p.shape):
                raise CheckpointError(
                    f"elastic export: {sname} has shape {list(t.shape)}, the sub-model needs {list(p.shape)}"
                )
            p.set_value(t.astype(p.dtype))
    sub.eval()
    return sub


def count_params(model) -> tuple[int, int]:
    """(total, active per token) parameter counts of a standalone model: active leaves out the
    routed experts a token does not use (E - k of every MoE layer)."""
    total = sum(int(p.numel()) for p in model.parameters())
    unused = 0
    for m in model.moe_layers():
        sets = [m.expert_set(i) for i in range(m.num_modalities)] if hasattr(m, "expert_set") else [m.experts]
        for ex in sets:  # a token uses k experts of its own modality only; count the text modality's
            one = sum(int(getattr(ex, p)[0].numel()) for p in ("gate_proj", "up_proj", "down_proj"))
            unused += one * (ex.num_experts - model.config.moe_k) if ex is sets[0] else one * ex.num_experts
    return total, total - unused


# ---- training hook --------------------------------------------------------------------------
class ElasticTraining:
    """Which sub-models optimizer step s trains, drawn from random.Random(seed + s) so a resumed
    run replays them: one sampled spec (full model with probability full_prob), or with
    `sandwich` the full model and then one of `smaller_specs` on the same micro-batches."""

    def __init__(self, choices: ElasticChoices, seed: int, smaller: list[ElasticSpec]):
        self.choices, self.seed, self.smaller = choices, seed, smaller

    @classmethod
    def from_config(cls, cfg, model, seed: int) -> "ElasticTraining | None":
        """cfg: the run config's `elastic` section; seed: the run's. None when the run has no
        elastic_* choices; ConfigError when a choice does not fit the model."""
        choices = ElasticChoices(
            *(list(getattr(cfg, f"elastic_{k}", [])) for k in ("depth", "experts", "top_k")),
            getattr(cfg, "elastic_full_prob", 0.25),
            bool(getattr(cfg, "elastic_sandwich", False)),
        )
        if not choices.enabled:
            return None
        c = model.config
        for d in choices.depth:
            if not 1 <= d <= c.num_hidden_layers:
                raise ConfigError(
                    f"elastic_depth={choices.depth} is invalid: the model has {c.num_hidden_layers} "
                    f"layers; use values in 1..{c.num_hidden_layers}"
                )
        if (choices.experts or choices.top_k) and not c.is_moe:
            raise ConfigError("elastic_experts / elastic_top_k: the model is dense; set them to []")
        E = num_experts(c)
        for e in choices.experts:
            if not 1 <= e <= E:
                raise ConfigError(
                    f"elastic_experts={choices.experts} is invalid: the model has {E} experts; use values in 1..{E}"
                )
        ks = choices.top_k or ([c.moe_k] if c.is_moe else [])
        ns = choices.experts or [E]
        if ks and max(ks) > min(ns):
            raise ConfigError(
                f"elastic_top_k={ks} exceeds the smallest expert count {min(ns)}; "
                f"keep every elastic_top_k <= min(elastic_experts)"
            )
        smaller = smaller_specs(c, choices)
        if choices.sandwich and not smaller:
            raise ConfigError(
                "elastic_sandwich: every elastic_depth / elastic_experts / elastic_top_k choice is the "
                "full model; add a smaller value"
            )
        return cls(choices, seed, smaller)

    def specs(self, step: int) -> list[ElasticSpec]:
        """The sub-models step `step` trains, in order (sandwich: [full, smaller])."""
        rng = random.Random(self.seed + step)
        if self.choices.sandwich:
            return [ElasticSpec(), rng.choice(self.smaller)]
        return [sample_spec(rng, self.choices)]

    @staticmethod
    def scalars(model, spec: ElasticSpec) -> dict[str, float]:
        """The trained (smaller) sub-model as scalars, full values where unset."""
        r = spec.resolved(model.config)
        out = {"train/elastic_depth": float(r.depth)}
        if r.experts is not None:
            out.update({"train/elastic_experts": float(r.experts), "train/elastic_top_k": float(r.top_k)})
        return out
