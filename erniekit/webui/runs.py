"""The WebUI's training runs, free of gradio: a form -> a validated config (the shipped tiny
config of the stage plus key=value overrides), the equivalent CLI command, a child `erniekit
train` process per output_dir, its log tail, its loss / reward points read from the run's
VisualDL log directory (vdl_log/scalars.jsonl, the JSON-lines copy of the VisualDL scalars),
progress and ETA, a clean stop (SIGTERM: the run ends after its step with a checkpoint) and resume.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from erniekit.errors import ErniekitError
from erniekit.utils.run_control import STOP_ONCE_ENV
from erniekit.webui.access import AUTH_ENV, PathPolicy

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# the page's recipe menu: each entry starts from a shipped tiny config (bundled data, tested
# settings); "LoRA" is the SFT stage with fine_tuning: LoRA. Stage names themselves come from the
# stage registry (erniekit/train/stages).
RECIPES = {
    "pretrain": "pretrain.yaml",
    "SFT": "sft.yaml",
    "LoRA": "sft_lora.yaml",
    "DPO": "dpo.yaml",
    "GRPO": "grpo.yaml",
    "PPO": "ppo.yaml",
}
EMBEDDED = "tiny-moe (embedded, random init)"
LOG_NAME = "webui_train.log"
SERIES = {"train/loss": "loss", "train/reward": "reward", "eval/loss": "eval loss"}
# a run stopped by SIGTERM / SIGINT exits 128 + N after writing its checkpoint (not 0: it did not finish)
STOPPED_CODES = (128 + signal.SIGTERM, 128 + signal.SIGINT)
STOP_ALL_WAIT_S = 60.0  # how long a stopping WebUI waits for its runs' checkpoints (systemd's default grace is 90 s)


def base_config(stage: str) -> str:
    if stage not in RECIPES:
        raise ErniekitError(f"stage {stage!r}: choose one of {', '.join(RECIPES)}")
    return os.path.join(ROOT, "examples", "configs", "tiny", RECIPES[stage])


@dataclass
class Form:
    stage: str = "SFT"
    model: str = EMBEDDED
    dataset: str = ""  # "" = the stage's bundled dataset
    output_dir: str = "output/webui-run"
    max_steps: int = 200
    learning_rate: float = 3e-3
    batch_size: int = 32
    max_seq_len: int = 32
    lora_rank: int = 8
    extra: list[str] = field(default_factory=list)  # more key=value overrides

    def overrides(self) -> list[str]:
        out = [
            f"output_dir={self.output_dir}",
            f"max_steps={int(self.max_steps)}",
            f"learning_rate={float(self.learning_rate)}",
            f"per_device_train_batch_size={int(self.batch_size)}",
            f"max_seq_len={int(self.max_seq_len)}",
            "logging_steps=1",
            "disable_tqdm=true",
        ]
        out.append(f"model_name_or_path={self.model if self.model and self.model != EMBEDDED else 'tiny-moe'}")
        if self.dataset:
            out.append(f"train_dataset_path={self.dataset}")
        else:  # the bundled data, wherever the WebUI was started
            out += [f"{k}={v}" for k, v in bundled_data(self.stage).items()]
        if self.stage == "LoRA":
            out.append(f"lora_rank={int(self.lora_rank)}")
        return out + list(self.extra)


def bundled_data(stage: str) -> dict[str, str]:
    """The stage config's dataset paths, made absolute (they are relative to the source tree)."""
    import yaml

    with open(base_config(stage), encoding="utf-8") as f:
        raw = yaml.safe_load(f) or {}
    return {
        k: os.path.join(ROOT, raw[k])
        for k in ("train_dataset_path", "eval_dataset_path")
        if isinstance(raw.get(k), str) and not os.path.isabs(raw[k])
    }


def check_form(form: Form, paths: PathPolicy | None = None):
    """The config the form describes, validated like `erniekit train` does; one-line errors. With
    `paths`, the model, dataset and output directory must lie in the WebUI's allowed directories
    (checked first: a refused path is not even probed for existence)."""
    from erniekit.config import load_config, validate

    if paths is not None:
        if form.model and form.model != EMBEDDED:
            paths.check(form.model, "model directory")
        if form.dataset:
            paths.check(form.dataset, "dataset")
        paths.check(str(form.output_dir), "output directory")
    if form.model and form.model != EMBEDDED and not os.path.isdir(form.model):
        raise ErniekitError(
            f"model directory {form.model} not found; pick a checkpoint directory or the embedded tiny model"
        )
    if form.dataset and not os.path.isfile(form.dataset):
        raise ErniekitError(f"dataset {form.dataset} not found; leave it empty for the bundled data")
    if int(form.max_steps) < 1:
        raise ErniekitError(f"max steps {form.max_steps} must be >= 1")
    if not str(form.output_dir).strip():
        raise ErniekitError("output directory is empty")
    cfg = load_config(base_config(form.stage), form.overrides())
    if paths is not None:  # the values as the run reads them: quotes a box held are gone by now
        paths.check(cfg.output_dir, "output directory")
        if form.model and form.model != EMBEDDED:
            paths.check(cfg.model_name_or_path, "model directory")
        if form.dataset:
            paths.check(cfg.train_dataset_path, "dataset")
    return validate(cfg)


def yaml_preview(form: Form, paths: PathPolicy | None = None) -> str:
    """The merged config the run uses, as YAML."""
    return config_yaml(check_form(form, paths))


def config_yaml(cfg) -> str:
    import tempfile

    from erniekit.config import dump_config

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "run.yaml")
        dump_config(cfg, path)
        return open(path, encoding="utf-8").read()


def cli_command(form: Form) -> str:
    base = os.path.relpath(base_config(form.stage), os.getcwd())
    return "erniekit train " + " ".join(shlex.quote(a) for a in [base, *form.overrides()])


@dataclass
class Run:
    output_dir: str
    proc: subprocess.Popen
    started: float
    cfg: object  # the validated TrainConfig it runs
    log_path: str
    stop_sent: bool = False


class Runs:
    """Child training processes, one per output_dir; with `paths`, only inside the allowed directories."""

    def __init__(self, paths: PathPolicy | None = None):
        self.runs: dict[str, Run] = {}
        self.paths = paths

    def active(self, output_dir: str) -> Run | None:
        r = self.runs.get(os.path.realpath(output_dir))  # a symlink to a run's directory is that run
        return r if r is not None and r.proc.poll() is None else None

    def start(self, form: Form, resume: bool = False) -> Run:
        cfg = check_form(form, self.paths)
        out = os.path.realpath(cfg.output_dir)
        if self.active(out) is not None:
            raise ErniekitError(
                f"a run is already writing to {cfg.output_dir}; stop it first or choose another output directory"
            )
        if not resume:  # said on the page now, not in the child's log
            from erniekit.train.start import refuse_earlier_run

            refuse_earlier_run(cfg)
        args = [base_config(form.stage), *form.overrides()] + (["resume_from_checkpoint=auto"] if resume else [])
        os.makedirs(out, exist_ok=True)
        log_path = os.path.join(out, LOG_NAME)
        log = open(log_path, "a" if resume else "w", encoding="utf-8")
        env = dict(os.environ, PYTHONUNBUFFERED="1", **{STOP_ONCE_ENV: "1"})  # stop_all may repeat a SIGTERM
        env.pop(AUTH_ENV, None)  # the WebUI's password has no business in the trainer's environment
        proc = subprocess.Popen(
            [sys.executable, "-m", "erniekit", "train", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=os.getcwd(),
            env=env,
        )
        log.close()
        run = Run(out, proc, time.time(), cfg, log_path)
        self.runs[out] = run
        return run

    def stop(self, output_dir: str) -> str:
        r = self.active(output_dir)
        if r is None:
            return "no run is going on in that output directory"
        r.proc.send_signal(signal.SIGTERM)  # the trainer ends after its step, with a checkpoint
        r.stop_sent = True
        return "stopping: the run ends after its current step and writes a checkpoint"

    def stop_all(self, wait_s: float = STOP_ALL_WAIT_S) -> list[str]:
        """SIGTERM every run still going (the stop button's stop; none twice) and wait up to `wait_s`
        in all for them to end; a line for each. Where the WebUI alone gets SIGTERM (docker stop,
        kill) its runs would otherwise train on unwatched, or be killed with the container without
        a checkpoint."""
        going = [r for r in self.runs.values() if r.proc.poll() is None]
        for r in going:
            if not r.stop_sent:
                r.proc.send_signal(signal.SIGTERM)
                r.stop_sent = True
        deadline = time.monotonic() + wait_s
        lines = []
        for r in going:
            try:
                rc = r.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                lines.append(f"training run in {r.output_dir} still stopping after {wait_s:g} s (pid {r.proc.pid})")
                continue
            if rc == 0:
                lines.append(f"training run in {r.output_dir} finished")
            elif rc in STOPPED_CODES:
                lines.append(
                    f"training run in {r.output_dir} stopped with its checkpoint (resume_from_checkpoint=auto goes on)"
                )
            else:
                lines.append(f"training run in {r.output_dir} ended with exit code {rc} (its log: {r.log_path})")
        return lines

    def status(self, output_dir: str) -> dict:
        """{state, step, total, eta_s, points [(step, value, series)], log} of the run in output_dir
        (it reads files there, so the directory must be an allowed one)."""
        if self.paths is not None:
            self.paths.check(output_dir, "output directory")
        out = os.path.realpath(output_dir)
        r = self.runs.get(out)
        points, step = read_points(out)
        total = r.cfg.max_steps if r is not None else None
        log = tail(os.path.join(out, LOG_NAME))
        if r is None:
            state = "idle"
        elif r.proc.poll() is None:
            state = "stopping" if r.stop_sent else "running"
        else:
            rc = r.proc.returncode
            if rc == 0:
                state = "stopped" if r.stop_sent else "finished"
            elif rc in STOPPED_CODES:  # `erniekit train` stopped by a signal, with its checkpoint
                state = "stopped"
            else:
                state = f"failed (exit code {rc})"
        eta = None
        if r is not None and state == "running" and step and total:
            first = min(p[0] for p in points) - 1 if points else 0  # a resumed run starts past 0
            per = (time.time() - r.started) / max(step - first, 1)
            eta = max(total - step, 0) * per
        return {
            "state": state,
            "step": step,
            "total": total,
            "eta_s": eta,
            "points": points,
            "log": log,
            "error": last_error(log) if state.startswith("failed") else None,
        }


def read_points(out: str) -> tuple[list[tuple[int, float, str]], int]:
    path = os.path.join(out, "vdl_log", "scalars.jsonl")
    points, step = [], 0
    if not os.path.isfile(path):
        return points, step
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line being written
            step = max(step, int(row.get("step", 0)))
            for key, name in SERIES.items():
                if key in row:
                    points.append((int(row["step"]), float(row[key]), name))
    return points, step


def tail(path: str, lines: int = 40) -> str:
    if not os.path.isfile(path):
        return ""
    with open(path, encoding="utf-8", errors="replace") as f:
        return "".join(f.readlines()[-lines:])


def last_error(log: str) -> str | None:
    """The one-line error a failed run printed (erniekit's `error: ...`), if any."""
    errs = [line for line in log.splitlines() if line.startswith("error: ")]
    return errs[-1][len("error: ") :] if errs else None
