"""The training loop, the only one: batches -> runner.step -> optimizer -> logging / eval /
checkpoint / stop signals.

A stage supplies data rows, a loss and an evaluation; a step runner (erniekit/train/runners/)
runs a step's forward and backward on this process's topology (one process, pipeline
segments, parameter-server worker); this module owns the rest: optimizer, LR schedule,
gradient accumulation and clipping, fp16 loss scaling, EMA, periodic eval, atomic checkpoints,
resume, VisualDL scalars and the progress bar.
"""

from __future__ import annotations

import math
import os
import sys
import time

import paddle

from erniekit.data.control import CONTROL_RECORD_NAME
from erniekit.elastic.submodels import ElasticSpec, ElasticTraining, apply_elastic
from erniekit.errors import ErniekitError
from erniekit.routing.monitor import RoutingMonitor
from erniekit.train.batching import MicroBatches
from erniekit.train.checkpointing import (
    EMA_NAME,
    check_same_run,
    load_checkpoint,
    read_trainer_state,
    resolve_resume,
    rotate_checkpoints,
    run_identity,
    save_checkpoint,
)
from erniekit.train.optim import build_optimizer, clip_grad_norm_
from erniekit.train.runners import StepRunner, StepSums
from erniekit.train.runners.local import LocalRunner
from erniekit.train.scalar_log import ScalarLogger
from erniekit.train.schedules import lr_at
from erniekit.train.stage import Stage
from erniekit.utils.dtensor import is_main_process, scalar


class Trainer:
    def __init__(
        self,
        cfg,
        model,
        tokenizer,
        stage: Stage,
        train_rows,
        eval_data=None,
        log=print,
        runner: StepRunner | None = None,
    ):
        self.cfg, self.model, self.tokenizer, self.stage = cfg, model, tokenizer, stage
        self.eval_data = eval_data
        self.eval_batch_size = cfg.per_device_eval_batch_size
        self.log = log
        # a single process unless the run passes the runner of the topology it joined
        self.runner = runner if runner is not None else LocalRunner(None, cfg.precision, cfg.elastic_distill_weight)
        # every data rank builds the same global batch and keeps its rows
        self.batches = MicroBatches(
            train_rows,
            cfg.per_device_train_batch_size * self.runner.data_ranks,
            cfg.seed,
            tokenizer.pad_token_id,
            collate_fn=stage.collate,
        )
        accum = cfg.gradient_accumulation_steps
        if cfg.max_steps > 0:
            self.total_steps = cfg.max_steps
        else:
            self.total_steps = max(1, math.ceil(cfg.num_train_epochs * self.batches.per_epoch / accum))
        warmup = cfg.warmup_steps or int(round(cfg.warmup_ratio * self.total_steps))
        self.warmup = min(warmup, self.total_steps)
        extra = stage.extra_named_parameters()  # e.g. a PPO value head
        self.optimizer = build_optimizer(
            model,
            cfg.optim,
            extra,
            cfg.lora_plus_scale if cfg.fine_tuning == "LoRA" else 1.0,
            self.runner.optimizer_state_placements,
            stage.lr_ratios(cfg),
        )
        self.params = [p for p in model.parameters() if not p.stop_gradient] + [p for _, p in extra]
        self._group_params(stage)
        self.ema = None
        if cfg.ema_decay > 0:
            from erniekit.train.ema import WeightEMA

            self.ema = WeightEMA([(n, p) for n, p in model.named_parameters() if not p.stop_gradient], cfg.ema_decay)
        self.loss_scale = 2.0**15 if cfg.fp16 else 1.0  # dynamic loss scaling for fp16 only
        self.good_steps = 0
        self.stopped_by = 0  # the stop signal every rank agreed on after a step (0: none); see agree_stop
        self.step = 0
        self.consumed = 0  # micro-batches consumed: the data position
        self.logger_dir = cfg.logging_dir or os.path.join(cfg.output_dir, "vdl_log")
        self.logger = ScalarLogger(self.logger_dir, enabled=is_main_process())
        self.routing = RoutingMonitor(model, cfg.output_dir, every_steps=cfg.routing_plot_steps)
        self.elastic = ElasticTraining.from_config(
            cfg.elastic, model, cfg.seed
        )  # None unless elastic_* choices are set
        self.runner.bind(self)

    def _group_params(self, stage) -> None:
        """The stage's other models of the step (online-distillation students) are clipped by their
        own norms; the rest of `params` together (train/grad_norm)."""
        self.groups = stage.grad_groups()
        grouped = {id(p) for group in self.groups.values() for p in group}
        self.clip_params = [p for p in self.params if id(p) not in grouped]
        self.group_norms: dict[str, float] = {}

    # ---- state -----------------------------------------------------------------------------
    def state(self) -> dict:
        return {
            "global_step": self.step,
            "consumed_micro_batches": self.consumed,
            "total_steps": self.total_steps,
            "seed": self.cfg.seed,
            "rng": "paddle.seed(seed + global_step) before every step",
            "run": run_identity(self.cfg, self.batches.batch_size, len(self.batches.rows)),
        }

    def maybe_resume(self) -> None:
        path = resolve_resume(self.cfg.resume_from_checkpoint, self.cfg.output_dir)
        path = self.runner.agree_resume(path)  # clusters over a slow link: a checkpoint all of them hold
        if path is None:
            return
        st = read_trainer_state(path)
        for line in check_same_run(
            path, st, self.cfg, self.batches.batch_size, len(self.batches.rows), self.total_steps
        ):
            self.log(line)
        st = load_checkpoint(path, self.model, self.optimizer, partial=self.runner.partial)
        self.runner.load_state(path)
        self.step, self.consumed = st["global_step"], st["consumed_micro_batches"]
        self.stage.load_checkpoint_tensors(path)
        ema_file = os.path.join(path, EMA_NAME)
        if self.ema is not None and os.path.isfile(ema_file):
            from erniekit.utils.io import load_safetensors

            self.ema.load_state_dict(load_safetensors(ema_file), ema_file)
        elif self.ema is not None:
            self.log(f"{path} has no {EMA_NAME}: the weight EMA restarts from the resumed weights")
            self.ema = type(self.ema)(list(self.ema.params.items()), self.ema.decay)
        if is_main_process():  # the interrupted run may have logged steps past its checkpoint
            self.logger.drop_after(self.step)
        self.log(f"resumed from {path} at step {self.step}")

    def save(self) -> str:
        path = os.path.join(self.cfg.output_dir, f"checkpoint-{self.step}")
        self.runner.save_state(path)  # this process's own state beside the checkpoint (cross-cluster sync)
        self.logger.flush()  # every step up to this checkpoint on disk: a kill leaves no hole before it
        extra = dict(self.stage.checkpoint_tensors())
        if self.stage.control_record:  # a `.json` name: written as a JSON document (docs/control.md)
            extra[CONTROL_RECORD_NAME] = self.stage.control_record
        if self.ema is not None:
            extra[EMA_NAME] = self.ema.state_dict()
        save_checkpoint(
            path,
            self.model,
            self.tokenizer,
            self.optimizer,
            self.state(),
            self.cfg.model_name_or_path,
            extra_tensors=extra,
            runner=self.runner,
        )
        rotate_checkpoints(self.cfg.output_dir, self.cfg.save_total_limit)
        return path

    # ---- one optimizer step ----------------------------------------------------------------
    def train_step(self) -> dict[str, float]:
        cfg = self.cfg
        paddle.seed(cfg.seed + self.step)
        # elastic runs: the sub-model(s) of this step; sandwich = [full, smaller] on every micro-batch
        specs = self.elastic.specs(self.step) if self.elastic is not None else [None]
        if len(specs) == 1 and specs[0] is not None:
            apply_elastic(self.model, specs[0])
        micro = [self.batches.get(self.consumed + i) for i in range(cfg.gradient_accumulation_steps)]
        micro = self.stage.step_batches(self.model, micro, self.step)  # RL: rollouts from the current policy
        n_units = sum(self.stage.normalizer(b) for b in micro)  # trained tokens (LM) or pairs (DPO)
        micro, n_units = self.runner.cluster_share(micro, n_units, self.stage.normalizer)  # across clusters
        lr = lr_at(
            self.step,
            self.total_steps,
            cfg.learning_rate,
            cfg.lr_scheduler_type,
            self.warmup,
            cfg.min_lr,
            cfg.decay_ratio,
        )
        self.optimizer.set_lr(lr)
        sums = self.runner.forward_backward(self, micro, n_units, specs)
        self.optimizer.restore_unused_grads()
        if cfg.fp16:
            self._unscale()
        grad_norm, grads = self.runner.clip(self, cfg.max_grad_norm, lr)
        self._clip_groups(grads)
        self._update(grad_norm, grads)
        self.optimizer.clear_grad()
        self.after_update()
        self.runner.after_update(self.step + 1, final=self.step + 1 == self.total_steps)
        if self.elastic is not None:  # back to the full model before anything else sees it
            apply_elastic(self.model, ElasticSpec())
        self.step += 1
        self.consumed += len(micro)
        return self._step_metrics(sums, micro, n_units, lr, grad_norm, specs)

    @paddle.no_grad()
    def _unscale(self) -> None:
        for p in self.params:
            if p.grad is not None:
                p.grad.scale_(1.0 / self.loss_scale)

    def _clip_groups(self, grads: dict | None) -> None:
        """The stage's other models (`Stage.grad_groups`): each one's gradients clipped by its own
        norm; an idle one's gradients dropped, so the optimizer leaves it as it is (data-parallel
        replicas fill missing gradients with zeros, and AdamW would step on zeros)."""
        idle = self.stage.idle_groups(self.step) if self.groups else set()
        self.group_norms = {}
        for name, params in self.groups.items():
            if name in idle:
                for p in params:
                    p.grad = None
                    if grads is not None:
                        grads.pop(id(p), None)
                continue
            norm = clip_grad_norm_(params, self.cfg.max_grad_norm, grads)
            if not math.isfinite(norm):
                raise ErniekitError(
                    f"step {self.step + 1}: gradient norm of {name} is {norm}; lower learning_rate "
                    "or check the data (the last checkpoint is intact)"
                )
            self.group_norms[f"train/{name}/grad_norm"] = norm

    def _update(self, grad_norm: float, grads: dict | None) -> None:
        """The optimizer step, or with fp16 an overflow's skip; a non-finite norm otherwise stops the run."""
        if math.isfinite(grad_norm):
            self.optimizer.step(grads)
            if self.ema is not None:
                self.ema.update()
            self.good_steps += 1
            if self.cfg.fp16 and self.good_steps % 1000 == 0:
                self.loss_scale *= 2.0
        elif self.cfg.fp16:  # overflow: skip this update and halve the scale
            self.loss_scale /= 2.0
            self.good_steps = 0
        else:
            raise ErniekitError(
                f"step {self.step + 1}: gradient norm is {grad_norm}; lower learning_rate "
                "or check the data (the last checkpoint is intact)"
            )

    def _step_metrics(
        self, sums: StepSums, micro: list[dict], n_units: int, lr: float, grad_norm: float, specs: list
    ) -> dict[str, float]:
        units = max(n_units, 1)
        tokens = int(sum((b["segment_ids"] > 0).sum() for b in micro))  # real (non-padding) tokens
        metrics = {
            "train/loss": sums.loss_sum / units,
            "train/lr": lr,
            "train/grad_norm": grad_norm,
            "train/tokens": tokens,
            **{f"train/{k}": v for k, v in sums.metrics.items()},
        }
        if sums.aux_sum:
            metrics["train/router_loss"] = sums.aux_sum
        if self.elastic is not None:
            metrics.update(self.elastic.scalars(self.model, specs[-1]))
            if len(specs) > 1:
                metrics.update(sums.elastic)
        metrics.update(self.group_norms)
        metrics.update(self.stage.step_metrics())
        return metrics

    def after_update(self) -> None:
        """Work that follows each optimizer update: aux-loss-free router bias correction."""
        rate = getattr(self.model.config, "moe_bias_update_rate", 0.0)
        if rate > 0:
            for m in self._moe_layers():
                m.update_correction_bias(rate)

    def _moe_layers(self) -> list:
        return self.model.moe_layers() if hasattr(self.model, "moe_layers") else []

    def moe_metrics(self) -> dict[str, float]:
        """Unweighted router losses of the last micro-batch, averaged over MoE layers. Beside data ranks
        (MoEBlock.data_sum: every rank calls this at the same logged step) each rank's parts are its
        tokens' share of the batch's losses, so they are summed over the ranks to be the batch's."""
        layers = self._moe_layers()
        out: dict[str, float] = {}
        for m in layers:
            for k, v in m.loss_parts.items():
                out[f"train/moe_{k}_loss"] = out.get(f"train/moe_{k}_loss", 0.0) + scalar(v) / len(layers)
        data_sum = next((m.data_sum for m in layers if m.data_sum is not None), None)
        if out and data_sum is not None:
            keys = sorted(out)
            summed = data_sum(paddle.to_tensor([out[k] for k in keys], dtype="float64")).numpy().tolist()
            out.update(zip(keys, summed))
        if layers and layers[0].capacity_factor > 0:
            out["train/moe_dropped_fraction"] = sum(m.last_dropped for m in layers) / len(layers)
        return out

    # ---- the loop --------------------------------------------------------------------------
    def train(self) -> dict[str, float]:
        cfg = self.cfg
        self.maybe_resume()
        self.model.train()
        bar = None
        if not cfg.disable_tqdm and is_main_process():
            from tqdm import tqdm

            bar = tqdm(
                total=self.total_steps,
                initial=self.step,
                desc="train",
                dynamic_ncols=True,
                file=sys.stdout,
                mininterval=0.5,
            )
        window = [0, 0, time.perf_counter()]  # tokens, steps, start of the logging window
        last: dict[str, float] = {}
        while self.step < self.total_steps:
            m = self.train_step()
            self.stopped_by = self.agree_stop()  # every rank: the same answer after the same step
            window[0] += m.pop("train/tokens")
            window[1] += 1
            if self.step % cfg.logging_steps == 0 or self.step == self.total_steps or self.stopped_by:
                last = self._log_window(m, window, bar)
                window = [0, 0, time.perf_counter()]
            if is_main_process():
                self.routing.maybe_write_pictures(self.step, self.logger.writer)
            if bar is not None:
                bar.update(1)
            if (
                cfg.do_eval
                and self.eval_data is not None
                and cfg.eval_steps > 0
                and self.step % cfg.eval_steps == 0
                and self.step < self.total_steps
            ):
                self.evaluate()
            if self.stopped_by:  # a stop request (SIGTERM/SIGINT) on any rank: all end here with a checkpoint
                self._announce_stop()
                break
            if cfg.save_steps > 0 and self.step % cfg.save_steps == 0 and self.step < self.total_steps:
                self.save()
        if bar is not None:
            bar.close()
        if is_main_process():
            self.routing.maybe_write_pictures(self.step, self.logger.writer, final=True)
        self.save()
        return last

    def _log_window(self, m: dict[str, float], window: list, bar) -> dict[str, float]:
        dt = time.perf_counter() - window[2]
        m["train/tokens_per_sec"] = window[0] / max(dt, 1e-9)
        m["train/step_time_s"] = dt / window[1]
        m.update(self.routing.scalars())
        m.update(self.moe_metrics())  # router-loss parts of the last micro-batch (only when logged)
        self.logger.log(self.step, m)
        if bar is not None:
            bar.set_postfix(
                loss=f"{m['train/loss']:.4f}",
                lr=f"{m['train/lr']:.2e}",
                tok_s=f"{m['train/tokens_per_sec']:.0f}",
                **self._progress_extra(m),
            )
        else:
            extra = "".join(f" {k} {v}" for k, v in self._progress_extra(m).items())
            self.log(
                f"step {self.step}/{self.total_steps} loss {m['train/loss']:.4f} "
                f"lr {m['train/lr']:.2e} grad_norm {m['train/grad_norm']:.3f} "
                f"tokens/s {m['train/tokens_per_sec']:.0f}{extra}"
            )
        return m

    def _announce_stop(self) -> None:
        import signal

        msg = (
            f"stopping at step {self.step}/{self.total_steps} on {signal.Signals(self.stopped_by).name}: "
            f"writing checkpoint-{self.step}; continue with resume_from_checkpoint=auto"
        )
        self.log(msg)
        if not is_main_process():  # each rank's own log (launch_logs/workerlog.N) shows where it stopped
            print(msg, flush=True)
        self.runner.before_stop(self.step)

    def request_stop(self, signum: int = 15) -> None:
        """End training after the current step, with a checkpoint (the WebUI's stop button, Ctrl-C)."""
        from erniekit.utils.run_control import request_stop

        request_stop(signum)

    @property
    def stop_requested(self) -> bool:
        """The run ended early on a stop request (every rank agreed on it)."""
        return bool(self.stopped_by)

    def agree_stop(self) -> int:
        """The stop signal of any process of the job (0: go on), the same on every rank.

        A signal may reach one rank only (a scheduler preempting one process, a kill by hand) or
        reach the ranks in different steps; the runner combines every rank's request after each
        step, so they all stop after the same one and checkpoint-N is written by all."""
        from erniekit.utils.run_control import stop_signal

        return self.runner.agree_stop(stop_signal())

    def _progress_extra(self, m: dict[str, float]) -> dict[str, str]:
        return {short: f"{m[key]:.3f}" for short, key in self.stage.progress_keys.items() if key in m}

    def evaluate(self) -> dict[str, float]:
        """Scores of the current weights; with an EMA also of the EMA weights (eval_ema/*)."""
        results = self._evaluate("eval")
        if self.ema is not None:
            with self.ema.applied():
                ema = self._evaluate("eval_ema")
            results.update({f"ema_{k}": v for k, v in ema.items()})
        return results

    def _evaluate(self, prefix: str) -> dict[str, float]:
        results = self.runner.eval_loss(self)
        if results is None:
            results = self.stage.evaluate(self.model, self.tokenizer, self.eval_data, self.cfg)
        self.logger.log(self.step, {f"{prefix}/{k}": v for k, v in results.items()})
        self.log(f"{prefix} " + " ".join(f"{k}={v:.4f}" for k, v in results.items()))
        self.model.train()
        return results
