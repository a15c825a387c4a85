"""`erniekit train`: build tokenizer, model, stage data and run the shared loop."""

from __future__ import annotations

import contextlib
import os
import time

import paddle

from erniekit.config import dump_config
from erniekit.errors import CheckpointError, ConfigError, DataError, ErniekitError
from erniekit.train.loop import Trainer
from erniekit.train.model_checks import check_lora_layout, check_ps_model, check_stop_ids
from erniekit.train.stages import get_stage
from erniekit.utils.device import cuda_visible
from erniekit.utils.dtensor import is_main_process, launched_world
from erniekit.utils.io import atomic_write_json
from erniekit.utils.malloc import release_freed_heap


def select_device() -> str:
    """GPU when this Paddle build has CUDA and a device is visible, else CPU (float32)."""
    if cuda_visible():
        return paddle.set_device("gpu")
    return paddle.set_device("cpu")


def peak_memory_bytes() -> int:
    """This process's peak: allocated device memory on GPU, resident set on CPU (the planner's
    calibration compares it with its prediction)."""
    if cuda_visible():
        return int(paddle.device.cuda.max_memory_allocated())
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def load_tokenizer(cfg):
    """The checkpoint's tokenizer; `chat_template` swaps in a built-in template (saved with the model,
    so chat, the server and exports render what training rendered)."""
    from erniekit.models import registry

    tokenizer = registry.load_tokenizer(cfg.model_name_or_path, cfg.tokenizer_name_or_path)
    if cfg.chat_template == "ernie_thinking":
        tokenizer = tokenizer.with_thinking_template()
    elif cfg.chat_template == "ernie":
        from erniekit.models.ernie4_5.tokenizer import ERNIE_CHAT_TEMPLATE

        tokenizer.chat_template = ERNIE_CHAT_TEMPLATE
    return tokenizer


def load_model(cfg):
    """The model family is picked by the checkpoint's config.json model_type (or the preset)."""
    from erniekit.models import registry

    # a preset starts from scratch, seeded by paddle.seed(cfg.seed)
    model = registry.load_model(cfg.model_name_or_path, cfg.model_overrides or None)
    if cfg.init_layers_from:  # a student started from its teacher's layers (erniekit/models/layer_init.py)
        from erniekit.models.layer_init import init_from_layers

        init_from_layers(model, registry.load_model(cfg.init_layers_from), cfg.init_layer_map)
    if cfg.fp8:
        model.set_fp8(cfg.fp8_block_size, cfg.fp8_grad_format)
    if cfg.recompute:
        model.set_recompute(cfg.recompute_granularity)
    if cfg.fine_tuning == "LoRA":
        from erniekit.nn.lora import LoraConfig, apply_lora

        kw = {"target_modules": cfg.lora_target_modules} if cfg.lora_target_modules else {}
        apply_lora(
            model,
            LoraConfig(
                r=cfg.lora_rank,
                lora_alpha=cfg.lora_alpha,
                lora_dropout=cfg.lora_dropout,
                use_rslora=cfg.rslora,
                use_dora=cfg.use_dora,
                lora_plus_scale=cfg.lora_plus_scale,
                base_dtype=cfg.lora_base_dtype,
                peft_layout=cfg.lora_peft_layout,
                **kw,
            ),
        )
    return model


def check_vocab(model, tokenizer) -> None:
    beyond = [t for t, i in getattr(tokenizer, "added_tokens", {}).items() if i >= model.config.vocab_size]
    if beyond:
        raise ConfigError(
            f"tokenizer tokens {', '.join(beyond[:4])} have ids past the model's vocab_size={model.config.vocab_size} "
            f"(chat_template: ernie_thinking adds its tags where the vocabulary lacks them): set "
            f"model_overrides.vocab_size: {tokenizer.vocab_size} when training a preset from scratch"
        )
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ConfigError(
            f"tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is {model.config.vocab_size}: "
            "use the tokenizer that belongs to model_name_or_path (tokenizer_name_or_path)"
        )


def _exact_match_line(ev: dict, start: dict | None) -> str:
    line = f"held-out exact match: {ev['exact_match']:.3f}"
    if "ema_exact_match" in ev:
        line += f", EMA weights {ev['ema_exact_match']:.3f}"
    if start is not None and "exact_match" in start:
        line += f" (start {start['exact_match']:.3f}, gain {ev['exact_match'] - start['exact_match']:+.3f})"
    elif ev.get("baseline_exact_match") is not None:
        line += f" (majority-answer baseline {ev['baseline_exact_match']:.3f})"
    return line


def _quiet(*args, **kwargs) -> None:
    pass


def _param_note(model, partial: bool) -> str:
    """The banner's parameter counts; a pipeline stage or PS worker holds part of the model, and says so."""
    n_params = sum(int(p.numel()) for p in model.parameters())
    n_train = sum(int(p.numel()) for p in model.parameters() if not p.stop_gradient)
    where = " on this rank (its part of the model)" if partial else ""
    return f"{n_params / 1e6:.2f}M params, {n_train / 1e6:.2f}M trainable{where}"


def _parallel_note(ctx) -> str:
    return "" if ctx is None else f" processes={ctx.layout.world} ({ctx.layout.describe()})"


def run_train(cfg, log=print) -> dict:
    """One training run; rank 0 (or the only process) holds output_dir against a second run.
    SIGTERM / SIGINT to any process of the run end it after a step every rank agrees on, with
    checkpoint-N (docs/training.md "Stopping and preemption")."""
    from erniekit.distributed.cross_cluster.launch import noted_for_launch_clusters
    from erniekit.utils.run_control import output_dir_lock, stop_on_signal, stops_once

    with (
        stop_on_signal(launched=stops_once(launched_world())),
        noting_start_failure(cfg.output_dir, noted_for_launch_clusters(cfg.cross_cluster_id)) as start,
    ):
        if os.environ.get("PADDLE_TRAINER_ID", "0") != "0":
            return _run_train(cfg, log, start)
        with output_dir_lock(cfg.output_dir):
            return _run_train(cfg, log, start)


class StoppedBeforeFirstStep(ErniekitError):
    """A stop signal ended the run while it was starting (e.g. in the wait for the other clusters):
    a stop, not a failure; `erniekit train` exits 128 + signum, as after a stop at a step."""

    def __init__(self, signum: int):
        import signal

        super().__init__(f"stopped on {signal.Signals(signum).name} before the first step; nothing was saved")
        self.signum = signum


@contextlib.contextmanager
def _starting():
    """An error raised while a stop request is pending during start-up is that stop (a wait that
    polls the request ended on it), not a failure to report as one."""
    from erniekit.utils.run_control import stop_signal

    try:
        yield
    except ErniekitError as e:
        if not stop_signal():
            raise
        raise StoppedBeforeFirstStep(stop_signal()) from e


class _StartUp:
    """Where a run is: starting (no step yet) until `done`."""

    def __init__(self):
        self.over = False

    def done(self) -> None:
        self.over = True


@contextlib.contextmanager
def noting_start_failure(output_dir: str, in_cluster: bool = False):
    """A launched rank's (or a one-machine cross-cluster job's cluster process's: `in_cluster`) configuration,
    data or checkpoint error before its first step is left in launch_logs for the `erniekit train`
    that started it, which reports it once and does not restart the job (a restart would meet it
    again; distributed/launch.py failure_before_first_step). Not during a stop: that is reported
    as one."""
    from erniekit.distributed.launch import in_launched_worker, note_failure_before_first_step
    from erniekit.utils.run_control import stop_signal

    start = _StartUp()
    try:
        yield start
    except (ConfigError, DataError, CheckpointError) as e:
        if not start.over and (in_launched_worker() or in_cluster) and not stop_signal():
            with contextlib.suppress(OSError):  # output_dir itself may be the error: the rank still says it
                note_failure_before_first_step(output_dir, str(e))
        raise


def _run_train(cfg, log, start: _StartUp) -> dict:
    device = select_device()
    from erniekit.distributed.collective.runtime import placing_batches
    from erniekit.distributed.join import join

    with _starting():
        topology = join(cfg)
    with placing_batches(topology.collective):  # a collective job's batches split over its data ranks
        return _run_joined(cfg, topology, device, log, start)


def _build_data(stage, cfg, tokenizer) -> tuple[list, dict | None]:
    """The stage's training rows and evaluation data, read and checked (one-line DataErrors); a stop
    while a large corpus is tokenized or its token store awaited ends the start-up as that stop."""
    with _starting():
        stage.starting_control_record(cfg)  # a damaged control_attributes.json stops here, before the model loads
        train_rows = stage.build_train_rows(cfg, tokenizer) if cfg.do_train else []
        return train_rows, stage.build_eval_data(cfg, tokenizer) if cfg.do_eval else None


def _stage_of(cfg):
    stage = get_stage(cfg.stage)
    if cfg.online_distill_students:  # students trained beside the model (docs/online_distillation.md)
        from erniekit.train.online_distill import with_students

        stage = with_students(stage, cfg)
    return stage


def _checked_model(cfg, tokenizer):
    """The run's model, its fresh weights those of the seed whatever ran before (reading the data
    draws nothing from paddle), checked against the tokenizer and the stop ids."""
    paddle.seed(cfg.seed)
    model = load_model(cfg)
    check_vocab(model, tokenizer)
    check_stop_ids(cfg.stop_token_ids, model.config.vocab_size)
    check_lora_layout(model, cfg.fine_tuning, cfg.lora_peft_layout, cfg.use_dora)
    return model


def _run_joined(cfg, topology, device: str, log, start: _StartUp) -> dict:
    ctx, ps = topology.collective, topology.ps
    main = is_main_process()
    if not main:
        log = _quiet  # rank 0 reports; every rank's output is in launch_logs/
    if main:
        os.makedirs(cfg.output_dir, exist_ok=True)
        dump_config(cfg, os.path.join(cfg.output_dir, "run_config.yaml"))
    tokenizer, stage = load_tokenizer(cfg), _stage_of(cfg)
    # the data is read and checked before the model loads (a real checkpoint takes minutes, and a
    # mistake in the data is then said at once); a PS job's roles need the model first (servers read none)
    t0 = time.perf_counter()
    train_rows, eval_data = _build_data(stage, cfg, tokenizer) if ps is None else ([], None)
    data_prep = time.perf_counter() - t0
    model = _checked_model(cfg, tokenizer)
    runner = None
    if ps is not None:
        ps = _ps_role(cfg, model, ps)
        if ps.is_server:
            from erniekit.train.runners.ps import serve_tables

            start.done()  # a server serves until the workers finish: its errors come later
            return serve_tables(cfg, model, ps, log)
        runner = _ps_runner(cfg, model, ps, stage, log)
    if ctx is not None:
        _place_model(cfg, ctx, model, stage, log)
    t0 = time.perf_counter()
    if ps is not None:
        train_rows, eval_data = _build_data(stage, cfg, tokenizer)
    stage.prepare(model, train_rows, eval_data, cfg, tokenizer)  # before any resume: model = reference
    data_prep += time.perf_counter() - t0
    release_freed_heap()  # what loading, casting and placing the model freed (utils/malloc.py)
    partial = ps is not None or (ctx is not None and ctx.pipeline is not None)
    log(
        f"erniekit: stage={cfg.stage} model={cfg.model_name_or_path} ({_param_note(model, partial)}, "
        f"{model.config.model_type}) device={device}{_parallel_note(ctx)} threads={os.environ.get('OMP_NUM_THREADS', '1')} "
        f"train_rows={len(train_rows)} data_prep={data_prep:.1f}s"
    )
    if runner is None:
        from erniekit.train.runners import collective_runner

        runner = collective_runner(ctx, model, stage, cfg.precision, cfg.elastic_distill_weight)
    if cfg.cross_cluster_id >= 0:  # this cluster's runner, joined to the others over the link
        from erniekit.train.runners.cross_cluster import CrossClusterRunner

        runner = CrossClusterRunner(runner, cfg, ctx)
    with _starting():  # the runner joins the other clusters here (CrossClusterRunner.bind)
        trainer = Trainer(cfg, model, tokenizer, stage, train_rows, eval_data, log=log, runner=runner)
    start.done()
    results = _train_and_evaluate(cfg, trainer, eval_data, ctx is not None, log)
    return _wrap_up(cfg, trainer, results, main, log)


def _wrap_up(cfg, trainer, results: dict, main: bool, log) -> dict:
    """The final model and the run's results in output_dir."""
    _save_final(cfg, trainer)
    results.update(trainer.runner.finish())
    if main:
        atomic_write_json(os.path.join(cfg.output_dir, "train_results.json"), {"global_step": trainer.step, **results})
    trainer.logger.close()
    what = "LoRA adapter (PEFT layout)" if cfg.fine_tuning == "LoRA" else "model (Hugging Face layout)"
    if trainer.stop_requested:  # stopped early (a signal): not the finished run's model
        what += f" of step {trainer.step} of {trainer.total_steps} (stopped early; resume_from_checkpoint=auto goes on)"
    log(f"saved {what} to {cfg.output_dir}; VisualDL logs in {trainer.logger_dir}")
    return results


def _ps_role(cfg, model, ps):
    """This process's PS role with its pipeline segment (distributed_mode: ps)."""
    check_ps_model(model.config)
    from erniekit.distributed.ps.topology import with_pipeline

    return with_pipeline(ps, cfg.pipeline_parallel_degree, model.config.num_hidden_layers, cfg.pipeline_stage_layers)


def _ps_runner(cfg, model, ps, stage, log):
    """A PS worker's step runner: its blocks here, the tables' rows on the servers."""
    from erniekit.distributed.ps.worker import PSWorker
    from erniekit.train.runners.ps import PSRunner, stage_device

    if cfg.ps_stage_devices:
        segment = ps.pipe.segment if ps.pipe is not None else 0
        log(f"workers of pipeline stage {segment + 1} on {stage_device(cfg.ps_stage_devices[segment], model)}")
    worker = PSWorker(
        ps,
        model,
        compress=cfg.ps_compress,
        topk_ratio=cfg.ps_topk_ratio,
        k_steps=cfg.ps_k_steps if cfg.ps_sync_mode == "async" else 0,
    )
    log(
        f"parameter-server mode: {ps.workers} workers, {ps.servers} server(s) holding the embedding"
        f"{'' if model.config.tie_word_embeddings else ' and LM head'} rows"
        + (
            f"; workers in {ps.pipe.pp} pipeline stages of layers "
            + ", ".join(f"{a}-{b - 1}" for a, b in ps.pipe.bounds)
            if ps.pipe is not None
            else ""
        )
    )
    return PSRunner(worker, stage.token_balance)


def _place_model(cfg, ctx, model, stage, log) -> None:
    """A collective job: this rank's share of the model over the mesh (and its pipeline segment);
    a causal-LM stage that only splits the batch runs on whole-model replicas."""
    from erniekit.distributed.collective.layout import check_model_fits
    from erniekit.distributed.collective.replicas import host_floats

    check_model_fits(ctx.layout, model.config, cfg.pipeline_stage_layers, cfg.expert_fp8_block)
    if stage.supports.row_losses and ctx.use_replicas():  # its losses split by rows
        how = ctx.replicas.choose_transport(host_floats(model.parameters()))
        log(f"data parallelism: {ctx.layout.world} whole-model replicas, gradients summed by one all-reduce ({how})")
    ctx.init_pipeline(model.config.num_hidden_layers, cfg.pipeline_stage_layers)
    ctx.shard_model(model)
    if ctx.pipeline is not None:
        log(ctx.pipeline.describe())
    if is_main_process():  # where every parameter went: placements over the mesh and rank 0's shard
        atomic_write_json(os.path.join(cfg.output_dir, "parallel_plan.json"), ctx.plan(model))


def _train_and_evaluate(cfg, trainer, eval_data, collective: bool, log) -> dict:
    """Score the start (a fine-tuning run reports its gain), train, score the end."""
    from erniekit.train.checkpointing import resolve_resume

    results: dict = {}
    fresh = resolve_resume(cfg.resume_from_checkpoint, cfg.output_dir) is None
    if cfg.do_train and cfg.do_eval and eval_data is not None and os.path.isdir(cfg.model_name_or_path) and fresh:
        results["eval_start"] = trainer.evaluate()  # the starting point, so the run can report its gain
    if cfg.do_train:
        t1 = time.perf_counter()
        results["train"] = trainer.train()
        if trainer.stopped_by:  # SIGTERM / Ctrl-C: ended after this step with a checkpoint
            results["stopped_at_step"] = trainer.step
            results["stop_signal"] = trainer.stopped_by
        results["train_runtime_s"] = time.perf_counter() - t1
        results["peak_memory_bytes"] = peak_memory_bytes()
        if collective:
            local, total = trainer.optimizer.state_numel()
            where = " (of its part of the model)" if trainer.runner.partial else ""
            log(f"optimizer state on rank 0{where}: {local} of {total} values ({100 * local / max(total, 1):.0f}%)")
    if cfg.do_eval and eval_data is not None and not trainer.stop_requested:
        results["eval"] = trainer.evaluate()
        if "exact_match" in results["eval"]:
            log(_exact_match_line(results["eval"], results.get("eval_start")))
        if "tool_call_match" in results["eval"]:
            ev = results["eval"]
            log(f"held-out tool-call exact match: {ev['tool_call_match']:.3f}")
            log(f"held-out final-answer accuracy: {ev['final_answer_accuracy']:.3f}")
        from erniekit.train.control_eval import held_out_lines

        for line in held_out_lines(results["eval"]):  # control following, credibility AUC (docs/control.md)
            log(line)
        for line in trainer.stage.report_lines(results["eval"], results.get("eval_start")):
            log(line)
    return results


def _save_final(cfg, trainer) -> None:
    """The model in output_dir: the EMA weights when the run keeps an EMA and save_ema is set."""
    from erniekit.train.checkpointing import save_model_or_adapter

    model, runner = trainer.model, trainer.runner
    if trainer.ema is not None and cfg.save_ema:
        with trainer.ema.applied():
            save_model_or_adapter(model, cfg.output_dir, trainer.tokenizer, cfg.model_name_or_path, runner)
        trainer.log(
            f"output_dir holds the EMA weights (ema_decay {cfg.ema_decay}); the raw weights are in the last checkpoint"
        )
    else:
        save_model_or_adapter(model, cfg.output_dir, trainer.tokenizer, cfg.model_name_or_path, runner)
    trainer.stage.save_final(cfg.output_dir, trainer.tokenizer)  # online-distillation students
    if is_main_process():  # what a stage keeps beside the weights (a credibility head, the control record)
        from safetensors.paddle import save_file

        from erniekit.data.control import write_control_record
        from erniekit.utils.io import atomic_write

        write_control_record(cfg.output_dir, trainer.stage.control_record)  # none: a stale one is removed

        for name, tensors in trainer.stage.model_tensors().items():
            state = {k: v.contiguous() for k, v in tensors.items()}
            atomic_write(os.path.join(cfg.output_dir, name), lambda tmp, state=state: save_file(state, tmp))
