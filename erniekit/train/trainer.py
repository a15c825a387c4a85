"""The training loop shared by every stage.

A stage supplies data rows, a loss and an evaluation; this module owns the rest: optimizer,
LR schedule, gradient accumulation and clipping, AMP on GPU, periodic eval, atomic
checkpoints, resume, VisualDL scalars and the progress bar.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time

import paddle

from erniekit.errors import ErniekitError
from erniekit.nn.elastic import ElasticSpec, ElasticTraining, apply_elastic
from erniekit.train.batching import MicroBatches
from erniekit.train.checkpointing import EMA_NAME, load_checkpoint, resolve_resume, rotate_checkpoints, save_checkpoint
from erniekit.train.losses import distill_loss_sum
from erniekit.train.routing_monitor import RoutingMonitor
from erniekit.train.optim import build_optimizer, clip_grad_norm_, reduced_grads
from erniekit.train.schedules import lr_at
from erniekit.train.stage import Stage
from erniekit.utils.dtensor import is_main_process, scalar


class ScalarLogger:
    """VisualDL scalars plus a JSON-lines copy (easy to read in tests and tools).

    The VisualDL writer opens on first use, so that a resumed run can first drop what the
    interrupted run logged past its checkpoint (`drop_after`): those steps are trained again."""

    def __init__(self, logdir: str, enabled: bool = True):
        self.enabled = enabled
        self.logdir = logdir
        self._writer = None
        self.jsonl = None
        if enabled:
            os.makedirs(logdir, exist_ok=True)
            self.jsonl = open(os.path.join(logdir, JSONL_NAME), "a", encoding="utf-8")

    @property
    def writer(self):
        if self._writer is None and self.enabled:
            from visualdl import LogWriter

            self._writer = LogWriter(logdir=self.logdir)
        return self._writer

    def log(self, step: int, values: dict[str, float]) -> None:
        if not self.enabled:
            return
        for k, v in values.items():
            self.writer.add_scalar(tag=k, value=float(v), step=step)
        self.jsonl.write(json.dumps({"step": step, **{k: float(v) for k, v in values.items()}}) + "\n")
        self.jsonl.flush()

    def drop_after(self, step: int) -> int:
        """Remove every record past `step` from the VisualDL files and scalars.jsonl (a resumed
        run logs those steps again); returns how many records went. Each file is rewritten beside
        itself and renamed over the old one, so a crash here keeps the old file whole."""
        if not self.enabled:
            return 0
        if self._writer is not None:
            raise RuntimeError("drop_after must run before the first record of this run is written")
        self.jsonl.close()
        dropped = drop_jsonl_after(os.path.join(self.logdir, JSONL_NAME), step)
        self.jsonl = open(os.path.join(self.logdir, JSONL_NAME), "a", encoding="utf-8")
        for name in sorted(os.listdir(self.logdir)):
            if "vdlrecords" in name and not name.endswith(".tmp"):
                dropped += drop_vdl_after(os.path.join(self.logdir, name), step)
        return dropped

    def flush(self) -> None:
        """The VisualDL writer keeps records in memory up to 120 s; a checkpoint flushes them."""
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        if self.jsonl is not None:
            self.jsonl.close()


JSONL_NAME = "scalars.jsonl"


def drop_jsonl_after(path: str, step: int) -> int:
    """Keep the lines of a scalars.jsonl at or before `step` (a torn last line goes too)."""
    if not os.path.isfile(path):
        return 0
    kept, dropped = [], 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                row_step = int(json.loads(line)["step"])
            except (ValueError, KeyError, TypeError):
                dropped += 1
                continue
            if row_step <= step:
                kept.append(line if line.endswith("\n") else line + "\n")
            else:
                dropped += 1
    if dropped:
        _replace_file(path, "".join(kept).encode("utf-8"))
    return dropped


def drop_vdl_after(path: str, step: int) -> int:
    """Keep the values of a VisualDL record file (uint64 length + a `Record` protobuf, repeated)
    whose step (`id`) is at or before `step`; a torn last record goes too."""
    import struct

    from visualdl.proto import record_pb2

    data = open(path, "rb").read()
    out, pos, dropped = bytearray(), 0, 0
    while pos + 8 <= len(data):
        (n,) = struct.unpack("<Q", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + n]
        pos += 8 + n
        if len(body) < n:
            dropped += 1
            break
        rec = record_pb2.Record()
        rec.ParseFromString(body)
        keep = [v for v in rec.values if v.id <= step]
        dropped += len(rec.values) - len(keep)
        if len(keep) == len(rec.values):
            out += data[pos - 8 - n:pos]
        elif keep:
            new = record_pb2.Record()
            new.values.extend(keep)
            b = new.SerializeToString()
            out += struct.pack("<Q", len(b)) + b
    if pos < len(data):
        dropped += 1  # a torn header
    if dropped:
        _replace_file(path, bytes(out))
    return dropped


def _replace_file(path: str, content: bytes) -> None:
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(content)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def amp_context(cfg):
    """bf16/fp16 autocast on GPU; float32 elsewhere (config validation rejects AMP on CPU)."""
    if not (cfg.bf16 or cfg.fp16):
        return contextlib.nullcontext()
    return paddle.amp.auto_cast(enable=True, dtype="bfloat16" if cfg.bf16 else "float16", level="O1")


class Trainer:
    def __init__(self, cfg, model, tokenizer, stage: Stage, train_rows, eval_data=None, log=print):
        self.cfg, self.model, self.tokenizer, self.stage = cfg, model, tokenizer, stage
        self.eval_data = eval_data
        self.log = log
        from erniekit.distributed.runtime import active

        # every rank builds the same global batch and keeps its rows (erniekit/distributed/runtime.py)
        ctx = active()
        from erniekit.train.ps_worker import active_worker

        self.ps = active_worker()  # distributed_mode ps: the servers hold the embedding / head rows
        self.data_ranks = ctx.data_ranks if ctx is not None else (self.ps.data_ranks if self.ps else 1)
        self.batches = MicroBatches(train_rows, cfg.per_device_train_batch_size * self.data_ranks, cfg.seed,
                                    tokenizer.pad_token_id, collate_fn=stage.collate)
        accum = cfg.gradient_accumulation_steps
        if cfg.max_steps > 0:
            self.total_steps = cfg.max_steps
        else:
            self.total_steps = max(1, math.ceil(cfg.num_train_epochs * self.batches.per_epoch / accum))
        warmup = cfg.warmup_steps or int(round(cfg.warmup_ratio * self.total_steps))
        self.warmup = min(warmup, self.total_steps)
        extra = stage.extra_named_parameters()  # e.g. a PPO value head
        self.optimizer = build_optimizer(model, cfg, extra)
        self.params = [p for p in model.parameters() if not p.stop_gradient] + [p for _, p in extra]
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
        self.elastic = ElasticTraining.from_config(cfg, model)  # None unless elastic_* choices are set
        self.pipe = None  # pipeline-parallel runs: this stage's share of each step (1F1B)
        if ctx is not None and ctx.pipeline is not None:
            from erniekit.train.pipeline_schedule import PipelineStep

            self.pipe = PipelineStep(ctx.pipeline, model, stage.token_balance)
            self.named_params = [(n, p) for n, p in model.named_parameters() if not p.stop_gradient]
        if self.ps is not None:
            self.ps.token_balance = stage.token_balance
            self.named_params = [(n, p) for n, p in model.named_parameters() if not p.stop_gradient]

    # ---- state -----------------------------------------------------------------------------
    def state(self) -> dict:
        return {"global_step": self.step, "consumed_micro_batches": self.consumed, "total_steps": self.total_steps,
                "seed": self.cfg.seed, "rng": "paddle.seed(seed + global_step) before every step"}

    def maybe_resume(self) -> None:
        path = resolve_resume(self.cfg.resume_from_checkpoint, self.cfg.output_dir)
        if path is None:
            return
        st = load_checkpoint(path, self.model, self.optimizer)
        self.step, self.consumed = st["global_step"], st["consumed_micro_batches"]
        self.stage.load_checkpoint_tensors(path)
        ema_file = os.path.join(path, EMA_NAME)
        if self.ema is not None and os.path.isfile(ema_file):
            from safetensors.paddle import load_file

            self.ema.load_state_dict(load_file(ema_file), ema_file)
        elif self.ema is not None:
            self.log(f"{path} has no {EMA_NAME}: the weight EMA restarts from the resumed weights")
            self.ema = type(self.ema)(list(self.ema.params.items()), self.ema.decay)
        if is_main_process():  # the interrupted run may have logged steps past its checkpoint
            self.logger.drop_after(self.step)
        self.log(f"resumed from {path} at step {self.step}")

    def save(self) -> str:
        path = os.path.join(self.cfg.output_dir, f"checkpoint-{self.step}")
        self.logger.flush()  # every step up to this checkpoint on disk: a kill leaves no hole before it
        extra = dict(self.stage.checkpoint_tensors())
        if self.ema is not None:
            extra[EMA_NAME] = self.ema.state_dict()
        save_checkpoint(path, self.model, self.tokenizer, self.optimizer, self.state(), self.cfg.model_name_or_path,
                        extra_tensors=extra)
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
        lr = lr_at(self.step, self.total_steps, cfg.learning_rate, cfg.lr_scheduler_type, self.warmup,
                   cfg.min_lr, cfg.decay_ratio)
        self.optimizer.set_lr(lr)
        loss_sum, aux_sum = 0.0, 0.0
        extra: dict[str, float] = {}
        sub = {"train/elastic_loss": 0.0, "train/elastic_kl": 0.0}  # sandwich: the smaller sub-model's pass
        if self.pipe is not None:
            loss_sum, aux_sum = self.pipe.run(micro, n_units, self.loss_scale if cfg.fp16 else 1.0,
                                              amp=lambda: amp_context(cfg),
                                              on_forward=lambda b: self.routing.after_forward(b["segment_ids"] > 0))
            self.pipe.topo.reduce_grads(self.named_params)
            micro_loop = []
        elif self.ps is not None:
            loss_sum, aux_sum = self.ps.run(micro, n_units,
                                            on_forward=lambda b: self.routing.after_forward(b["segment_ids"] > 0),
                                            normalizer=self.stage.normalizer)
            self.ps.reduce_grads(self.named_params)
            micro_loop = []
        else:
            micro_loop = micro
        for b in micro_loop:
            teacher = None
            for j, spec in enumerate(specs):
                if len(specs) > 1:
                    apply_elastic(self.model, spec)
                with amp_context(cfg):
                    out = self.stage.loss(self.model, b)
                self.routing.after_forward(b["segment_ids"] > 0)
                lm = out.loss_sum
                if teacher is not None:  # in-place distillation from the full model of this step
                    kd = distill_loss_sum(out.logits, teacher, b["labels"], b.get("segment_ids"),
                                          self.stage.token_balance)
                    w = cfg.elastic_distill_weight
                    lm = (1.0 - w) * lm + w * kd if w > 0 else lm
                    sub["train/elastic_kl"] += scalar(kd) / max(n_units, 1)
                loss = lm / max(n_units, 1)
                if out.aux_loss is not None:  # router losses, already weighted by their coefficients
                    loss = loss + out.aux_loss / len(micro)
                    aux_sum += scalar(out.aux_loss) / len(micro)
                (loss * self.loss_scale if cfg.fp16 else loss).backward()
                if j > 0:
                    sub["train/elastic_loss"] += scalar(out.loss_sum) / max(n_units, 1)
                    continue
                loss_sum += scalar(out.loss_sum)
                for k, v in out.metrics.items():
                    extra[k] = extra.get(k, 0.0) + v / max(n_units, 1)
                if len(specs) > 1:
                    teacher = out.logits.detach()
            if len(specs) > 1:  # the full model again: the bias update and evaluation see it
                apply_elastic(self.model, ElasticSpec())
        if cfg.fp16:
            with paddle.no_grad():
                for p in self.params:
                    if p.grad is not None:
                        p.grad.scale_(1.0 / self.loss_scale)
        grads = None  # multi-process: each gradient reduced once, for the clip and the update
        if self.pipe is not None:
            grad_norm = self.pipe.clip_grad_norm_(self.named_params, cfg.max_grad_norm)
        elif self.ps is not None:  # the servers update their rows with the same norm and rate
            grad_norm = self.ps.finish_step(self.named_params, cfg.max_grad_norm, lr)
        else:
            grads = reduced_grads(self.params)
            grad_norm = clip_grad_norm_(self.params, cfg.max_grad_norm, grads)
        if math.isfinite(grad_norm):
            self.optimizer.step(grads)
            if self.ema is not None:
                self.ema.update()
            self.good_steps += 1
            if cfg.fp16 and self.good_steps % 1000 == 0:
                self.loss_scale *= 2.0
        elif cfg.fp16:  # overflow: skip this update and halve the scale
            self.loss_scale /= 2.0
            self.good_steps = 0
        else:
            raise ErniekitError(f"step {self.step + 1}: gradient norm is {grad_norm}; lower learning_rate "
                                "or check the data (the last checkpoint is intact)")
        self.optimizer.clear_grad()
        self.after_update()
        if self.ps is not None:
            self.ps.after_step(self.step + 1, final=self.step + 1 == self.total_steps)
        if self.elastic is not None:  # back to the full model before anything else sees it
            apply_elastic(self.model, ElasticSpec())
        self.step += 1
        self.consumed += len(micro)
        tokens = int(sum((b["segment_ids"] > 0).sum() for b in micro))  # real (non-padding) tokens
        metrics = {"train/loss": loss_sum / max(n_units, 1), "train/lr": lr, "train/grad_norm": grad_norm,
                   "train/tokens": tokens, **{f"train/{k}": v for k, v in extra.items()}}
        if aux_sum:
            metrics["train/router_loss"] = aux_sum
        if self.elastic is not None:
            metrics.update(self.elastic.scalars(self.model, specs[-1]))
            if len(specs) > 1:
                metrics.update(sub)
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
        """Unweighted router losses of the last micro-batch, averaged over MoE layers."""
        layers = self._moe_layers()
        out: dict[str, float] = {}
        for m in layers:
            for k, v in m.loss_parts.items():
                out[f"train/moe_{k}_loss"] = out.get(f"train/moe_{k}_loss", 0.0) + scalar(v) / len(layers)
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

            bar = tqdm(total=self.total_steps, initial=self.step, desc="train", dynamic_ncols=True,
                       file=sys.stdout, mininterval=0.5)
        window_tokens, window_steps, window_start = 0, 0, time.perf_counter()
        last: dict[str, float] = {}
        while self.step < self.total_steps:
            m = self.train_step()
            self.stopped_by = self.agree_stop()  # every rank: the same answer after the same step
            window_tokens += m.pop("train/tokens")
            window_steps += 1
            if self.step % cfg.logging_steps == 0 or self.step == self.total_steps or self.stopped_by:
                dt = time.perf_counter() - window_start
                m["train/tokens_per_sec"] = window_tokens / max(dt, 1e-9)
                m["train/step_time_s"] = dt / window_steps
                m.update(self.routing.scalars())
                m.update(self.moe_metrics())  # router-loss parts of the last micro-batch (only when logged)
                self.logger.log(self.step, m)
                window_tokens, window_steps, window_start = 0, 0, time.perf_counter()
                last = m
                if bar is not None:
                    bar.set_postfix(loss=f"{m['train/loss']:.4f}", lr=f"{m['train/lr']:.2e}",
                                    tok_s=f"{m['train/tokens_per_sec']:.0f}", **self._progress_extra(m))
                else:
                    extra = "".join(f" {k} {v}" for k, v in self._progress_extra(m).items())
                    self.log(f"step {self.step}/{self.total_steps} loss {m['train/loss']:.4f} "
                             f"lr {m['train/lr']:.2e} grad_norm {m['train/grad_norm']:.3f} "
                             f"tokens/s {m['train/tokens_per_sec']:.0f}{extra}")
            if is_main_process():
                self.routing.maybe_write_pictures(self.step, self.logger.writer)
            if bar is not None:
                bar.update(1)
            if cfg.do_eval and self.eval_data is not None and cfg.eval_steps > 0 and self.step % cfg.eval_steps == 0 \
                    and self.step < self.total_steps:
                self.evaluate()
            if self.stopped_by:  # a stop request (SIGTERM/SIGINT) on any rank: all end here with a checkpoint
                import signal

                msg = (f"stopping at step {self.step}/{self.total_steps} on {signal.Signals(self.stopped_by).name}: "
                       f"writing checkpoint-{self.step}; continue with resume_from_checkpoint=auto")
                self.log(msg)
                if not is_main_process():  # each rank's own log (launch_logs/workerlog.N) shows where it stopped
                    print(msg, flush=True)
                if self.ps is not None and self.ps.k_steps and self.step % self.ps.k_steps:
                    self.ps.after_step(self.step, final=True)  # async: one block replica to save
                break
            if cfg.save_steps > 0 and self.step % cfg.save_steps == 0 and self.step < self.total_steps:
                self.save()
        if bar is not None:
            bar.close()
        if is_main_process():
            self.routing.maybe_write_pictures(self.step, self.logger.writer, final=True)
        self.save()
        return last

    def request_stop(self, signum: int = 15) -> None:
        """End training after the current step, with a checkpoint (the WebUI's stop button, Ctrl-C)."""
        from erniekit.train.run_control import request_stop

        request_stop(signum)

    @property
    def stop_requested(self) -> bool:
        """The run ended early on a stop request (every rank agreed on it)."""
        return bool(self.stopped_by)

    def agree_stop(self) -> int:
        """The stop signal of any process of the job (0: go on), the same on every rank.

        A signal may reach one rank only (a scheduler preempting one process, a kill by hand) or
        reach the ranks in different steps; an all-reduce MAX of each rank's request after every
        step makes them all stop after the same one, so checkpoint-N is written by all. PS
        workers also carry a server's request (it answers their step's norm request with it);
        servers stop when the workers send STOP."""
        from erniekit.train.run_control import stop_signal

        local = stop_signal()
        if self.ps is not None:
            return self.ps.agree_stop(local)
        from erniekit.distributed.runtime import active

        if active() is None:
            return local
        import paddle.distributed as dist

        flag = paddle.to_tensor([local], dtype="int64")
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.numpy()[0])

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
        if self.pipe is not None:  # held-out loss through the stages (config checks refuse generation)
            rows = self.eval_data["rows"] if isinstance(self.eval_data, dict) else self.eval_data
            results = self.pipe.eval_loss(rows, self.cfg.per_device_eval_batch_size, self.tokenizer.pad_token_id)
        else:
            results = self.stage.evaluate(self.model, self.tokenizer, self.eval_data, self.cfg)
        self.logger.log(self.step, {f"{prefix}/{k}": v for k, v in results.items()})
        self.log(f"{prefix} " + " ".join(f"{k}={v:.4f}" for k, v in results.items()))
        self.model.train()
        return results
