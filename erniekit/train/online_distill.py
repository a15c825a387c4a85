"""Online distillation (ERNIE 3.0 Titan): the model trains on its own objective while students
learn from its current soft labels in the same steps (docs/online_distillation.md).

`OnlineDistill` is mixed into the run's LM stage (pretrain or SFT; `with_students`): data,
evaluation and the teacher's loss are that stage's; the students are extra parameters of the same optimizer
(`extra_named_parameters`), each a `grad_group` clipped by its own norm, so the teacher's update
is the one its solo run makes. The step's loss is

    L = L_LM(teacher) + sum over students s of [ a D(z_teacher(s) || z_s) + (1 - a) L_LM(s) + w_s * H_s ]

where D is `distill_loss_sum` (forward KL, reverse KL or GKD's JSD, temperature T) against the
detached logits of s's teacher (the main model, or a teacher-assistant student earlier in the
chain), a = online_distill_alpha (1: soft labels only), L_LM(s) the student's own loss on the
data's labels and H_s the auxiliary layer's hidden-state loss (online_distill_aux.py). A student
with `hidden_weight` > 0 also adds that weight times the layer-wise hidden-state loss against its
teacher's layers (erniekit/train/hidden_distill.py, as in stage Distill). Students learn in the
steps where step % online_distill_every == 0 and are left as they are in the others.
"""

from __future__ import annotations

import os

import paddle

from erniekit.errors import ConfigError
from erniekit.train.distill_losses import distill_loss_sum
from erniekit.train.hidden_distill import HiddenProjection, layer_loss_sum, layer_outputs
from erniekit.train.losses import causal_lm_loss_sum
from erniekit.train.online_distill_aux import AuxiliaryLayer, hidden_loss_sum
from erniekit.train.online_distill_spec import (
    MAIN_TEACHER,
    StudentSpec,
    hidden_layer_map,
    hidden_layer_map_error,
    parse_students,
    student_base,
    student_config,
    teaching_order,
)
from erniekit.train.stage import LossOutput, Stage, model_inputs
from erniekit.utils.dtensor import scalar

CHECKPOINT_FILE = "online_distill_students.safetensors"  # students and auxiliary layers, for resume
STUDENTS_DIR = "students"  # output_dir/students/<name>: each student in the Hugging Face layout


def build_student(spec: StudentSpec, cfg):
    """The student's model: fresh weights (seeded by `seed`, as a solo run of its shape starts) or
    a checkpoint directory's; FP8 experts and recompute as the run's."""
    from erniekit.models import registry

    base, overrides, loads = student_base(spec, cfg.model_name_or_path, cfg.model_overrides)
    config = student_config(spec, cfg.model_name_or_path, cfg.model_overrides, f"online_distill_students ({spec.name})")
    paddle.seed(cfg.seed)
    if loads:
        model = registry.load_model(base)
    else:
        family = registry.family_of(base)
        prev = paddle.get_default_dtype()
        paddle.set_default_dtype("float32")
        try:
            model = family.build(config)
        finally:
            paddle.set_default_dtype(prev)
    if cfg.fp8 and model.config.is_moe:
        model.set_fp8(cfg.fp8_block_size, cfg.fp8_grad_format)
    if cfg.recompute:
        model.set_recompute(cfg.recompute_granularity)
    model.train()
    return model


def with_students(stage: Stage, cfg) -> Stage:
    """`stage` (a fresh pretrain or SFT stage) with the students of `online_distill_students`: an
    instance of the stage's own class with `OnlineDistill` before it, so everything the students do
    not change is the stage's."""
    cls = type(stage)
    online = type(cls.__name__, (OnlineDistill, cls), {"__module__": cls.__module__})
    out = online.__new__(online)
    out.__dict__.update(stage.__dict__)
    out.setup_students(cfg)
    return out


class OnlineDistill:
    """Mixed in before a LM stage's class (`with_students`); each method adds the students to the
    stage's own through super()."""

    def setup_students(self, cfg) -> None:
        self.specs = teaching_order(parse_students(cfg.online_distill_students))
        self.every = cfg.online_distill_every
        self.kind, self.beta = cfg.online_distill_loss, cfg.online_distill_beta
        self.temperature = cfg.online_distill_temperature
        self.alpha = cfg.online_distill_alpha
        self.start = cfg.online_distill_start
        self.distilling = True  # the current step is past online_distill_start: soft labels count
        self.students: dict[str, paddle.nn.Layer] = {}
        self.aux: dict[str, AuxiliaryLayer] = {}
        self.hidden_maps: dict[str, list[int]] = {}  # student -> its teacher's layer per layer (hidden_weight > 0)
        self.hidden_proj: dict[str, HiddenProjection] = {}  # a narrower student's map to its teacher's width
        self.captured: dict[str, list[int]] = {}  # model -> the layers whose outputs a hidden-state loss reads
        self.active = True  # the students learn in the current step

    def prepare(self, model, train_rows, eval_data, cfg, tokenizer) -> None:
        super().prepare(model, train_rows, eval_data, cfg, tokenizer)
        widths = {MAIN_TEACHER: model.config.hidden_size}
        for spec in self.specs:
            student = build_student(spec, cfg)
            if student.config.vocab_size != model.config.vocab_size:
                raise ConfigError(
                    f"online_distill_students ({spec.name}): vocab_size {student.config.vocab_size} differs from "
                    f"the model's {model.config.vocab_size}; a student shares the teacher's tokenizer"
                )
            if getattr(student.config, "moe_bias_update_rate", 0.0) > 0:
                raise ConfigError(
                    f"online_distill_students ({spec.name}): moe_bias_update_rate > 0 is not applied to students "
                    "in this version; set moe_bias_update_rate: 0 in the student's entry"
                )
            _share_data_sum(model, student)
            self.students[spec.name] = student
            widths[spec.name] = student.config.hidden_size
            if spec.auxiliary_layer:
                self.aux[spec.name] = AuxiliaryLayer(student, widths[spec.teacher])
        self._prepare_hidden(model)
        paddle.seed(cfg.seed)  # the RNG as the solo run leaves it (the loop reseeds every step anyway)

    def _prepare_hidden(self, model) -> None:
        """Each hidden-state loss's layer map (and W_h for a narrower student), and which layers of
        which model the losses read."""
        configs = {MAIN_TEACHER: model.config, **{n: s.config for n, s in self.students.items()}}
        for spec in self.specs:
            if not spec.hidden_weight:
                continue
            mine, theirs = configs[spec.name], configs[spec.teacher]
            hidden_layer_map_error(spec, mine, theirs, f"online_distill_students ({spec.name})")
            self.hidden_maps[spec.name] = hidden_layer_map(spec, mine, theirs)
            self.captured.setdefault(spec.name, []).extend(range(mine.num_hidden_layers))
            self.captured.setdefault(spec.teacher, []).extend(self.hidden_maps[spec.name])
            if mine.hidden_size != theirs.hidden_size:
                proj = HiddenProjection(mine.hidden_size, theirs.hidden_size, mine.initializer_range)
                self.hidden_proj[spec.name] = proj

    # ---- the loss ---------------------------------------------------------------------------------
    def step_batches(self, model, micro, step: int):
        self.active = step % self.every == 0
        self.distilling = step >= self.start
        return super().step_batches(model, micro, step)

    def loss(self, model, batch) -> LossOutput:
        with layer_outputs(model, self.captured.get(MAIN_TEACHER, [])) as main_layers:
            res = super().loss(model, batch)
        if res.logits is None:
            raise ConfigError(f"stage {self.name} gives no logits to distill; online distillation needs an LM stage")
        res.metrics["teacher_loss"] = scalar(res.loss_sum)
        if not self.active:
            return res
        inputs = model_inputs(batch)
        logits, hidden = {MAIN_TEACHER: res.logits.detach()}, {MAIN_TEACHER: res.hidden}
        layers = {MAIN_TEACHER: main_layers}
        total, aux_losses = res.loss_sum, [res.aux_loss] if res.aux_loss is not None else []
        for spec in self.specs:
            with layer_outputs(self.students[spec.name], self.captured.get(spec.name, [])) as layers[spec.name]:
                out = self.students[spec.name](**inputs)
            alpha = self.alpha if self.distilling else 0.0  # before online_distill_start: labels only
            kd = None
            if alpha > 0.0:
                kd = distill_loss_sum(
                    out.logits,
                    batch["labels"],
                    logits[spec.teacher],
                    self.kind,
                    self.beta,
                    self.temperature,
                    batch["segment_ids"],
                )
                res.metrics[f"{spec.name}_distill"] = scalar(kd)
            if alpha < 1.0:  # the data's own labels beside the soft ones
                ce = causal_lm_loss_sum(out.logits, batch["labels"], batch["segment_ids"])
                kd = ce if kd is None else alpha * kd + (1.0 - alpha) * ce
                res.metrics[f"{spec.name}_lm"] = scalar(ce)
            total = total + kd
            if spec.name in self.aux:
                h = self.aux[spec.name](self.students[spec.name], out.hidden_states, inputs)
                hl = hidden_loss_sum(h, hidden[spec.teacher], batch["labels"], batch["segment_ids"])
                total = total + spec.auxiliary_weight * hl
                res.metrics[f"{spec.name}_aux"] = scalar(hl)
            if spec.name in self.hidden_maps:
                hl = self._layer_loss(spec, layers, batch)
                total = total + spec.hidden_weight * hl
                res.metrics[f"{spec.name}_hidden"] = scalar(hl)  # logged per trained token, as the loss
            if out.aux_loss is not None:
                aux_losses.append(out.aux_loss)
            logits[spec.name], hidden[spec.name] = out.logits.detach(), out.hidden_states.detach()
        res.loss_sum = total
        res.aux_loss = paddle.add_n(aux_losses) if aux_losses else None
        return res

    def _layer_loss(self, spec: StudentSpec, layers: dict[str, dict], batch) -> paddle.Tensor:
        """The student's layer-wise hidden-state loss (a sum over real tokens) against its teacher's
        layers, both caught in this step's forwards."""
        layer_map = self.hidden_maps[spec.name]
        mine, theirs = layers[spec.name], layers[spec.teacher]
        return layer_loss_sum(
            [mine[i] for i in range(len(layer_map))],
            [theirs[j] for j in layer_map],
            batch["segment_ids"],
            self.hidden_proj.get(spec.name),
        )

    # ---- the students as parameters of the run ----------------------------------------------------
    def _named(self, name: str) -> list[tuple[str, paddle.Tensor]]:
        named = [(f"{STUDENTS_DIR}.{name}.{n}", p) for n, p in self.students[name].named_parameters()]
        for sub, layer in self._side_layers(name):  # students.<name>.auxiliary.*, .hidden_projection.*
            named += [(f"{STUDENTS_DIR}.{name}.{sub.rstrip('/')}.{n}", p) for n, p in layer.named_parameters()]
        return [(n, p) for n, p in named if not p.stop_gradient]

    def extra_named_parameters(self):
        return list(super().extra_named_parameters()) + [x for s in self.specs for x in self._named(s.name)]

    def lr_ratios(self, cfg) -> dict[str, float]:
        """A student's `lr_ratio` over its parameters (auxiliary layer included): a teacher that
        already knows its task may go on at a small learning rate while its students learn fast."""
        own = {f"{STUDENTS_DIR}.{s.name}.": s.lr_ratio for s in self.specs if s.lr_ratio != 1.0}
        return {**super().lr_ratios(cfg), **own}

    def grad_groups(self) -> dict[str, list[paddle.Tensor]]:
        return {**super().grad_groups(), **{s.name: [p for _, p in self._named(s.name)] for s in self.specs}}

    def idle_groups(self, step: int) -> set[str]:
        own = set() if step % self.every == 0 else {s.name for s in self.specs}
        return own | super().idle_groups(step)

    def checkpoint_tensors(self) -> dict[str, dict[str, paddle.Tensor]]:
        tensors = {}
        for spec in self.specs:
            tensors.update({f"{spec.name}/{k}": v for k, v in self.students[spec.name].state_dict().items()})
            for sub, layer in self._side_layers(spec.name):
                tensors.update({f"{spec.name}/{sub}{k}": v for k, v in layer.state_dict().items()})
        return {**super().checkpoint_tensors(), CHECKPOINT_FILE: tensors}

    def load_checkpoint_tensors(self, path: str) -> None:
        super().load_checkpoint_tensors(path)
        file = os.path.join(path, CHECKPOINT_FILE)
        if not os.path.isfile(file):
            raise ConfigError(
                f"resume_from_checkpoint={path}: no {CHECKPOINT_FILE}, so the students cannot resume; resume from a "
                "checkpoint of this online-distillation run or start a fresh output_dir"
            )
        from erniekit.utils.io import load_safetensors

        saved = load_safetensors(file)
        for spec in self.specs:
            for sub, layer in [("", self.students[spec.name]), *self._side_layers(spec.name)]:
                prefix = f"{spec.name}/{sub}"
                own = {k[len(prefix) :]: v for k, v in saved.items() if k.startswith(prefix)}
                own = {k: v for k, v in own.items() if "/" not in k}
                missing = sorted(set(layer.state_dict()) - set(own))
                if missing:
                    raise ConfigError(
                        f"{file}: no {prefix}{missing[0]}; the students of this config differ from the "
                        "checkpoint's (online_distill_students changed?)"
                    )
                layer.set_state_dict(own)

    def _side_layers(self, name: str) -> list[tuple[str, paddle.nn.Layer]]:
        """(checkpoint prefix, layer) of what trains beside a student and is never saved in it."""
        out = [("auxiliary/", self.aux[name])] if name in self.aux else []
        return out + ([("hidden_projection/", self.hidden_proj[name])] if name in self.hidden_proj else [])

    # ---- evaluation and the end of the run ----------------------------------------------------------
    def evaluate(self, model, tokenizer, eval_data, cfg) -> dict[str, float]:
        res = dict(super().evaluate(model, tokenizer, eval_data, cfg))
        for spec in self.specs:
            student = self.students[spec.name]
            for k, v in super().evaluate(student, tokenizer, eval_data, cfg).items():
                res[f"{spec.name}/{k}"] = v
            student.train()  # as the loop leaves the model: MoE router losses are training-mode only
        return res

    def save_final(self, output_dir: str, tokenizer) -> None:
        """Each student alone (no auxiliary layer) in output_dir/students/<name>, Hugging Face layout."""
        from erniekit.data.control import write_control_record
        from erniekit.models.registry import save_model
        from erniekit.utils.dtensor import is_main_process

        super().save_final(output_dir, tokenizer)
        for spec in self.specs:
            where = os.path.join(output_dir, STUDENTS_DIR, spec.name)
            save_model(self.students[spec.name], where, tokenizer=tokenizer)
            if is_main_process():  # the students learnt the same control prefixes (docs/control.md)
                write_control_record(where, self.control_record)

    def report_lines(self, results: dict[str, float], start: dict[str, float] | None) -> list[str]:
        lines = list(super().report_lines(results, start))
        for spec in self.specs:
            c = self.students[spec.name].config
            who = (
                f"student {spec.name} ({c.num_hidden_layers} layers, hidden {c.hidden_size}, "
                f"taught by {spec.teacher}{', auxiliary layer' if spec.name in self.aux else ''})"
            )
            key = "exact_match" if f"{spec.name}/exact_match" in results else "loss"
            if f"{spec.name}/{key}" not in results:
                continue
            line = f"held-out {key.replace('_', ' ')}, {who}: {results[f'{spec.name}/{key}']:.3f}"
            if start is not None and f"{spec.name}/{key}" in start:
                line += f" (start {start[f'{spec.name}/{key}']:.3f})"
            lines.append(line + f"; saved in {os.path.join(STUDENTS_DIR, spec.name)}")
        return lines


def _share_data_sum(teacher, student) -> None:
    """A MoE student's router statistics over the whole global batch, as the teacher's: data-parallel
    replicas give the teacher's MoE layers their sum over the data ranks (DataReplicas.attach)."""
    layers = teacher.moe_layers() if hasattr(teacher, "moe_layers") else []
    source = next((m for m in layers if getattr(m, "data_sum", None) is not None), None)
    for m in student.moe_layers() if hasattr(student, "moe_layers") else []:
        if source is not None:
            m.data_sum, m.data_ranks = source.data_sum, source.data_ranks
