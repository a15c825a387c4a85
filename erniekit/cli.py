"""`erniekit <verb> ...`: each verb is a plain function that imports its own dependencies.

Lazy imports keep `erniekit help` and `erniekit version` working on a broken install.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
import warnings
from typing import Callable

import erniekit
from erniekit.errors import ErniekitError
from erniekit.utils.paddle_import import import_paddle as _import_paddle

# Import name -> pip package name, for the missing-dependency message.
PIP_NAMES = {"paddle": "paddlepaddle", "yaml": "pyyaml"}
TRAIN_USAGE = "usage: erniekit train CONFIG.yaml [key=value ...]"


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag as one line (error: PROG: what; see PROG --help), like every
    other user error, instead of a usage block followed by the message."""

    def error(self, message: str):
        raise ErniekitError(f"{self.prog}: {message}; see '{self.prog} --help'")


def train(args: list[str]) -> int:
    """Train from a YAML config plus key=value overrides."""
    if args and args[0] in ("-h", "--help"):
        print(_train_help())
        return 0
    if not args:
        raise ErniekitError(f"train needs a config file; {TRAIN_USAGE}")
    flag = next((a for a in args if a.startswith("--")), None)
    if flag:  # `--max-steps 5` is a habit from other tools; say what this one takes
        key = flag.lstrip("-").split("=", 1)[0].replace("-", "_")
        raise ErniekitError(f"train: {flag} is not an option; settings are key=value, e.g. {key}=VALUE; {TRAIN_USAGE}")
    path, overrides = (None, args) if "=" in args[0] else (args[0], args[1:])
    from erniekit.config import load_config

    cfg = load_config(path, overrides)  # before paddle: YAML mistakes are reported in 0.1 s
    user_threads = os.environ.get("OMP_NUM_THREADS")
    _import_paddle()
    cfg = _validated(cfg)  # config errors stop the job before any worker starts
    from erniekit.train.start import start_training

    return start_training(cfg, path, overrides, user_threads)


def _validated(cfg):
    """validate(cfg); a launched rank's (or a cluster process's) refusal is also noted for the parent
    `erniekit train`, which then reports it once instead of restarting the job (a check that passed
    in the parent can differ in a rank, e.g. a path another node cannot see)."""
    from erniekit.config import validate
    from erniekit.distributed.cross_cluster.launch import noted_for_launch_clusters
    from erniekit.distributed.launch import in_launched_worker

    in_cluster = noted_for_launch_clusters(cfg.cross_cluster_id)
    if not in_launched_worker() and not in_cluster:
        return validate(cfg)
    from erniekit.train.run import noting_start_failure

    with noting_start_failure(cfg.output_dir, in_cluster):
        return validate(cfg)


def add_packed_weights_flag(p: argparse.ArgumentParser, where: str) -> None:
    """`--packed-weights auto|on|off` (erniekit/infer/weight_packing.py): server, chat and
    tools/bench_vs_torch.py, which makes their choice."""
    p.add_argument(
        "--packed-weights",
        nargs="?",
        const="on",
        default="auto",
        choices=("auto", "on", "off"),
        help=f"{where}: keep a packed copy of the projections for faster decode steps (docs/deploy.md; costs a "
        "second copy of those weights). auto (default): on x86 CPUs with AVX2 or AVX-512, when the copy takes "
        "at most a quarter of the memory available",
    )


def _chat_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="erniekit chat", description="Chat with a checkpoint.")
    p.add_argument("model_dir", help="checkpoint directory (Hugging Face layout) or LoRA adapter directory")
    _add_base_model(p)
    add_packed_weights_flag(p, "on the CPU")
    p.add_argument("--prompt", help="answer this one message and exit (no interactive session)")
    p.add_argument("--system", help="system message")
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=256,
        help="most tokens per reply (capped at what the model's context leaves)",
    )
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    p.add_argument(
        "--speculative",
        action="store_true",
        help="greedy self-speculative decoding with the model's MTP heads: same reply, fewer "
        "forward passes (needs num_nextn_predict_layers >= 1; docs/mtp.md)",
    )
    p.add_argument(
        "--image",
        action="append",
        default=[],
        metavar="PATH",
        help="an image for the first message (repeatable; a vision-language checkpoint, greedy replies)",
    )
    p.add_argument(
        "--video",
        action="append",
        default=[],
        metavar="PATH",
        help="a video file for the first message, after the images (repeatable; needs PyAV: pip install av)",
    )
    p.add_argument(
        "--tools",
        metavar="TOOLS_PY",
        help="a Python file whose functions the model may call; calls run locally and their results go back "
        "to the model (a thinking-format checkpoint; docs/tools.md)",
    )
    p.add_argument(
        "--control",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a control attribute the model was trained to follow, e.g. style=words (repeatable; docs/control.md)",
    )
    p.add_argument(
        "--rerank",
        type=int,
        default=1,
        metavar="N",
        help="sample N answers (--temperature > 0) and return the one the checkpoint's credibility head "
        "scores highest (trained with credibility_loss_weight > 0; docs/control.md)",
    )
    return p


MAX_RERANK = 64  # answers sampled side by side for one reply


def _check_control_flags(ns: argparse.Namespace) -> None:
    """--control and --rerank, checked before paddle loads."""
    from erniekit.data.control import check_model_control, parse_control_args

    ns.control = parse_control_args(ns.control)
    check_model_control(ns.model_dir, ns.control)  # the attributes the model was trained on (docs/control.md)
    if not 1 <= ns.rerank <= MAX_RERANK:
        raise ErniekitError(f"chat: --rerank {ns.rerank} must be in 1..{MAX_RERANK}")
    if ns.rerank > 1:
        if ns.temperature <= 0:
            raise ErniekitError(
                f"chat: --rerank {ns.rerank} samples answers to choose from: set --temperature > 0, e.g. 1.0"
            )
        if ns.speculative or ns.image or ns.video or ns.tools:
            raise ErniekitError(
                "chat: --rerank works on plain text chat: drop --speculative, --image, --video, --tools"
            )


def _add_base_model(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--base-model",
        metavar="DIR",
        help="a LoRA adapter directory: put it on this base checkpoint (default: its adapter_config.json's "
        "base_model_name_or_path; its tokenizer too when the adapter has none)",
    )


def _check_base_model(model_dir: str | None, base: str | None, verb: str) -> None:
    """--base-model names an existing directory and goes with an adapter: checked before paddle loads."""
    if base is None:
        return
    from erniekit.models.registry import is_adapter_dir

    if not os.path.isdir(base):
        raise ErniekitError(f"{verb}: --base-model {base} is not a directory; give the base checkpoint directory")
    if model_dir and os.path.isdir(model_dir) and not is_adapter_dir(model_dir):
        raise ErniekitError(
            f"{verb}: --base-model is for a LoRA adapter directory; {model_dir} has no adapter_config.json: drop the flag"
        )


def _escaped_bytes(s: str) -> bool:
    """Every character is a PEP 383 escape of one undecodable byte (U+DC80..U+DCFF)."""
    return all("\udc80" <= c <= "\udcff" for c in s)


def _check_text(flag: str, text: str | None, verb: str) -> None:
    """An argument that is not UTF-8 arrives with surrogate escapes (PEP 383): refuse it here, in
    one line, rather than in the tokenizer."""
    from erniekit.utils.text import non_text_span

    span = non_text_span(text) if text is not None else None
    if span is not None:
        start, end = span
        bad = text[start:end].encode(
            "utf-8", "surrogateescape" if _escaped_bytes(text[start:end]) else "backslashreplace"
        )
        raise ErniekitError(
            f"{verb}: {flag} is not UTF-8 text ({bad!r} at character {start}); set a UTF-8 locale or pass UTF-8 text"
        )


def chat(args: list[str]) -> int:
    """Interactive or one-shot chat with a checkpoint."""
    ns = _chat_parser().parse_args(args)
    _check_base_model(ns.model_dir, ns.base_model, "chat")
    from erniekit.infer.sampling import SamplingParams

    try:  # the same checks generation applies, before paddle's slow import
        SamplingParams(max_new_tokens=ns.max_new_tokens, temperature=ns.temperature, top_p=ns.top_p, seed=ns.seed)
    except ValueError as e:
        raise ErniekitError(f"chat: {e}") from None
    for flag, text in (("--prompt", ns.prompt), ("--system", ns.system)):
        _check_text(flag, text, "chat")
    if (ns.image or ns.video) and (ns.temperature > 0 or ns.speculative):
        raise ErniekitError(
            "chat: --image / --video replies are greedy in this version: drop --temperature / --speculative"
        )
    if ns.speculative and ns.temperature > 0:
        raise ErniekitError(
            f"chat: --speculative supports greedy decoding only: use --temperature 0 (got {ns.temperature})"
        )
    _check_control_flags(ns)
    _import_paddle()
    from erniekit.infer.chat import run_chat
    from erniekit.models.registry import adapter_base_override

    with adapter_base_override(ns.base_model):
        result = run_chat(ns)
    return result if isinstance(result, int) and not isinstance(result, bool) else 0


def _server_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="erniekit server",
        description="OpenAI-compatible HTTP server (/v1/chat/completions, /v1/completions, /v1/models, /health).",
    )
    p.add_argument(
        "model_dir", help="checkpoint or exported directory (Hugging Face layout), or LoRA adapter directory"
    )
    _add_base_model(p)
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key",
        help="require 'Authorization: Bearer KEY'; the environment variable ERNIEKIT_API_KEY "
        "does the same without showing the key in `ps` (--api-key wins when both are set)",
    )
    p.add_argument("--served-model-name", help="the model id clients send (default: the directory's name)")
    p.add_argument("--max-batch", type=int, default=8, help="requests decoded together; more wait in a queue")
    p.add_argument(
        "--max-queued-requests",
        type=int,
        default=256,
        help="requests queued or running at once (each holds its prompt and images until it ends); more get a 429",
    )
    p.add_argument(
        "--max-queued-per-client",
        type=int,
        default=None,
        help="of those, what one client (peer address, or X-Forwarded-For from a trusted proxy) may hold; "
        "more get a 429 (default: half of --max-queued-requests; 0: no limit, e.g. behind an untrusted remote proxy)",
    )
    add_packed_weights_flag(p, "built-in engine on the CPU")
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="context per request, prompt + completion (default: min(model's, 4096))",
    )
    p.add_argument(
        "--backend",
        choices=("builtin", "fastdeploy"),
        default="builtin",
        help="fastdeploy: start FastDeploy's OpenAI server on the directory (GPU, FastDeploy installed)",
    )
    p.add_argument(
        "--quantization",
        choices=("wint8", "wint4"),
        default=None,
        help="--backend fastdeploy: FastDeploy quantizes the (hf export's) weights as it loads them",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=1 << 20,
        help="larger request bodies get 413 before they are read (default 1 MiB)",
    )
    p.add_argument(
        "--allowed-local-media-path",
        default=None,
        help="a vision-language model: image_url parts may also name files under this directory "
        "(default: data: URIs only; nothing is ever fetched from the network)",
    )
    p.add_argument("--log-level", default="warning", help="uvicorn's log level")
    return p


def server(args: list[str]) -> int:
    """Serve a checkpoint over an OpenAI-compatible API."""
    ns = _server_parser().parse_args(args)
    if not 1 <= ns.port <= 65535:
        raise ErniekitError(f"server: --port {ns.port} must be in 1..65535")
    if ns.max_batch < 1 or (ns.max_model_len is not None and ns.max_model_len < 2) or ns.max_queued_requests < 1:
        raise ErniekitError("server: --max-batch and --max-queued-requests must be >= 1 and --max-model-len >= 2")
    if ns.max_queued_per_client is not None and ns.max_queued_per_client < 0:
        raise ErniekitError(f"server: --max-queued-per-client {ns.max_queued_per_client} must be >= 0 (0: no limit)")
    if ns.max_body_bytes < 1024:
        raise ErniekitError(f"server: --max-body-bytes {ns.max_body_bytes} must be >= 1024 (a request needs room)")
    _check_base_model(ns.model_dir, ns.base_model, "server")
    if ns.base_model and ns.backend == "fastdeploy":
        raise ErniekitError(
            "server: --base-model is for the builtin backend; for FastDeploy, erniekit export the adapter first"
        )
    _import_paddle()
    from erniekit.infer.server import run_server
    from erniekit.models.registry import adapter_base_override

    with adapter_base_override(ns.base_model):
        return run_server(ns)


def webui(args: list[str]) -> int:
    """Fine-tune, chat and export in the browser."""
    p = _Parser(prog="erniekit webui", description=webui.__doc__)
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=7860)
    p.add_argument("--share", action="store_true", help="also open a public gradio.live link (off by default)")
    p.add_argument(
        "--auth",
        metavar="USER:PASSWORD",
        help="require this login (visible in `ps`: prefer --auth-file or ERNIEKIT_WEBUI_AUTH)",
    )
    p.add_argument("--auth-file", metavar="FILE", help="require a login from FILE: one USER:PASSWORD per line")
    p.add_argument(
        "--workdir",
        metavar="DIR",
        help="serve from DIR (default: the current directory): relative paths start there and every "
        "path the page accepts must lie inside it or an --allow-path DIR",
    )
    p.add_argument(
        "--allow-path",
        metavar="DIR",
        action="append",
        default=[],
        help="also let the page read and write under DIR (repeatable)",
    )
    ns = p.parse_args(args)
    if not 1 <= ns.port <= 65535:
        raise ErniekitError(f"webui: --port {ns.port} must be in 1..65535")
    # the checks that need no gradio come first: a typo is reported at once
    from erniekit.webui.access import PathPolicy, resolve_auth

    auth = resolve_auth(ns.auth, ns.auth_file)  # ERNIEKIT_WEBUI_AUTH when neither flag is given
    if ns.workdir:
        if not os.path.isdir(ns.workdir):
            raise ErniekitError(f"webui: --workdir {ns.workdir}: not a directory; give an existing directory")
        os.chdir(ns.workdir)  # relative paths in the page, and the training runs it starts, begin here
    paths = PathPolicy(os.getcwd(), ns.allow_path)
    try:
        import gradio  # noqa: F401
    except ImportError:
        raise ErniekitError("webui needs gradio: pip install 'erniekit[webui]' (gradio>=6,<7)") from None
    _import_paddle()
    from erniekit.webui.app import run_webui

    return run_webui(ns.host, ns.port, ns.share, auth, paths)


def export(args: list[str]) -> int:
    """Merge LoRA (if any) and write a deployable directory (docs/deploy.md)."""
    from erniekit.export.formats import export_format, format_names

    p = _Parser(
        prog="erniekit export",
        description=export.__doc__,
        usage=f"erniekit export SRC -o OUT [--format {'|'.join(format_names())}] [--force] | "
        "erniekit export --verify OUT",
    )
    p.add_argument("src", nargs="?", help="checkpoint or LoRA adapter directory (output of erniekit train)")
    p.add_argument("--output", "-o", help="directory to write (new or empty, unless --force)")
    p.add_argument(
        "--force",
        action="store_true",
        help="write into a non-empty --output holding an earlier export of the same format: its model files "
        "are replaced (atomically), others kept",
    )
    p.add_argument(
        "--format",
        choices=format_names(),
        default="hf",
        help="; ".join(export_format(n).help for n in format_names()),
    )
    p.add_argument("--group-size", type=int, default=None, help="wint4: inputs per scale (default 64)")
    p.add_argument(
        "--max-shard-size",
        default=None,
        help="split weights into files of at most this size (default 5GB; the formats that shard)",
    )
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16", "q8_0"],
        default=None,
        help="weight dtype in the files (default: float32, as erniekit loads a checkpoint); q8_0: --format gguf only",
    )
    p.add_argument("--verify", metavar="DIR", help="reload an exported DIR and compare its logits with its source")
    _add_base_model(p)
    p.add_argument(
        "elastic",
        nargs="*",
        metavar="elastic.KEY=N",
        help="write an elastic sub-model: elastic.depth=N elastic.experts=N elastic.top_k=N (docs/elastic.md)",
    )
    ns = p.parse_intermixed_args(args)
    if ns.dtype == "q8_0" and ns.format != "gguf":
        p.error(
            f"--dtype q8_0 is a GGUF type: add --format gguf, or choose float32, bfloat16 or float16 for {ns.format}"
        )
    from erniekit.export import command
    from erniekit.models.registry import adapter_base_override

    _check_base_model(ns.src, ns.base_model, "export")
    with adapter_base_override(ns.base_model):
        if ns.verify:
            return command.verify_export(ns.verify)
        return command.export(
            ns.src, ns.output, ns.format, ns.force, ns.max_shard_size, ns.dtype, ns.group_size, ns.elastic
        )


def plan(args: list[str]) -> int:
    """Rank parallel layouts of a training config on a described cluster (docs/planner.md). Exit
    status 1 when no layout both fits and is one `erniekit train` runs (sites=: when none meets the target)."""
    p = _Parser(
        prog="erniekit plan",
        description=plan.__doc__,
        usage="erniekit plan CONFIG.yaml cluster=CLUSTER.yaml | sites=SITES.yaml [key=value ...] [--top N]",
    )
    p.add_argument("items", nargs="*", help="CONFIG.yaml, then key=value overrides (cluster=FILE is required)")
    p.add_argument("--top", type=int, default=15, help="rows to print")
    p.add_argument(
        "--all",
        action="store_true",
        help="also the layouts `erniekit train` refuses for this config, each marked with its reason",
    )
    p.add_argument("--json", metavar="PATH", help="write every prediction as JSON")
    p.add_argument(
        "--mode",
        choices=("collective", "ps"),
        default="collective",
        help="ps: place the model's parts on a heterogeneous cluster (docs/ps.md)",
    )
    p.add_argument(
        "--target",
        type=float,
        help="--mode ps: throughput target, tokens/s (default: half the fastest single-type placement); "
        "with sites: a tokens/s target for the recommendation (default: cross_cluster_max_sync_fraction)",
    )
    p.add_argument(
        "--sites", metavar="FILE", help="sites joined by a slow link (or sites=FILE): the cross-cluster sync plan"
    )
    p.add_argument(
        "--measured-step-s", type=float, help="with sites: a measured step time of one site in place of the predicted"
    )
    ns = p.parse_intermixed_args(args)
    _import_paddle()  # quietly: the stages' workloads (stage_supports) import it
    from erniekit.distributed import plan_report

    if ns.mode == "ps":
        return plan_report.ps_plan(ns.items, ns.top, ns.target, ns.json)
    items = ns.items
    path, overrides = (None, items) if not items or "=" in items[0] else (items[0], items[1:])
    if ns.sites or any(o.startswith("sites=") for o in overrides):
        return plan_report.cross_cluster_plan(path, overrides, ns.sites, ns.target, ns.measured_step_s, ns.json)
    return plan_report.collective_plan(path, overrides, ns.top, ns.all, ns.json)


def _eval_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="erniekit eval", description="Analyse a checkpoint on a dataset.")
    p.add_argument("model_dir", help="checkpoint directory (Hugging Face layout, or a LoRA adapter)")
    kind = p.add_mutually_exclusive_group(required=True)  # one report per run; add report kinds here
    kind.add_argument(
        "--routing",
        dest="report",
        action="store_const",
        const="routing",
        help="MoE routing: per-layer entropy, load imbalance, load and modality heatmaps",
    )
    kind.add_argument(
        "--elastic",
        dest="report",
        action="store_const",
        const="elastic",
        help="elastic sub-models: parameters, held-out exact match and decode tokens/s of each",
    )
    kind.add_argument(
        "--lm-eval",
        metavar="TASK,TASK",
        type=lambda v: [t for t in v.split(",") if t],
        help="lm-evaluation-harness tasks, run against the checkpoint served by the built-in server "
        "(bundled offline task: erniekit_arith; needs pip install 'lm-eval[api]')",
    )
    kind.add_argument(
        "--credibility",
        dest="report",
        action="store_const",
        const="credibility",
        help="credibility head (docs/control.md): scores of real vs sampled replies and their ROC AUC",
    )
    p.add_argument("--include-path", metavar="DIR", help="--lm-eval: a directory of your own task YAML files")
    p.add_argument("--limit", type=int, metavar="N", help="--lm-eval: at most N examples per task")
    p.add_argument(
        "--data",
        metavar="PATH",
        help="jsonl/json/txt dataset, SFT or pretraining format "
        "(default: the bundled examples/data/arithmetic/eval.jsonl)",
    )
    p.add_argument(
        "--out",
        metavar="DIR",
        help="directory for pictures and JSON (default: MODEL_DIR/routing; --elastic, --lm-eval: MODEL_DIR)",
    )
    p.add_argument("--batch-size", type=int, metavar="N", default=16, help="sequences per forward pass")
    p.add_argument("--max-seq-len", type=int, metavar="N", default=1024, help="longer sequences are cut into pieces")
    for flag, what in (("--depths", "depths"), ("--experts", "expert counts"), ("--top-k", "top-k values")):
        p.add_argument(
            flag,
            type=_int_csv,
            metavar="N,N",
            default=[],
            help=f"--elastic: {what} to tabulate (default: the run's elastic_* choices)",
        )
    p.add_argument(
        "--max-samples",
        type=int,
        metavar="N",
        default=500,
        help="--routing, --elastic, --credibility: the first N examples of the data are used",
    )
    p.add_argument("--max-new-tokens", type=int, metavar="N", default=32, help="--credibility: longest sampled reply")
    p.add_argument(
        "--temperature", type=float, default=1.0, help="--credibility: sampling temperature of the replies (> 0)"
    )
    p.add_argument("--seed", type=int, default=0, help="--credibility: seed of the sampled replies")
    return p


def _int_csv(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers, e.g. 2,4") from None


def _default_eval_data() -> str | None:
    """The bundled arithmetic eval set, when running from a source checkout."""
    path = os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(erniekit.__file__))),
        "examples",
        "data",
        "arithmetic",
        "eval.jsonl",
    )
    return path if os.path.isfile(path) else None


def _eval_routing(ns: argparse.Namespace) -> int:
    data = ns.data or _default_eval_data()
    if data is None:
        raise ErniekitError("eval --routing needs --data PATH (the bundled examples/data is not next to this install)")
    if min(ns.batch_size, ns.max_seq_len, ns.max_samples) < 1:
        raise ErniekitError(
            f"eval --routing: --batch-size {ns.batch_size}, --max-seq-len {ns.max_seq_len} and "
            f"--max-samples {ns.max_samples} must all be >= 1"
        )
    _import_paddle()
    from erniekit.routing.report import format_routing_table, routing_report

    stats = routing_report(
        ns.model_dir, data, ns.out, batch_size=ns.batch_size, max_seq_len=ns.max_seq_len, max_samples=ns.max_samples
    )
    print(format_routing_table(stats))
    for what, path in stats["pictures"].items():
        print(f"{what} picture: {path}")
    print(f"stats: {stats['stats_path']}")
    return 0


def _eval_elastic(ns: argparse.Namespace) -> int:
    data = ns.data or _default_eval_data()
    if data is None:
        raise ErniekitError("eval --elastic needs --data PATH (the bundled examples/data is not next to this install)")
    _import_paddle()
    from erniekit.elastic.report import elastic_report, format_elastic_table

    table = elastic_report(
        ns.model_dir,
        data,
        ns.depths,
        ns.experts,
        ns.top_k,
        max_samples=ns.max_samples,
        batch_size=ns.batch_size,
        out_dir=ns.out,
    )
    print(format_elastic_table(table))
    print(f"table: {table['path']}")
    return 0


def _eval_lm_eval(ns: argparse.Namespace) -> int:
    _import_paddle()
    from erniekit.infer.harness import run_lm_eval

    results = run_lm_eval(
        ns.model_dir, ns.lm_eval, ns.include_path, ns.limit, ns.batch_size, out=ns.out or ns.model_dir
    )
    from lm_eval.utils import make_table  # installed: run_lm_eval checked

    print(make_table(results))
    print(f"results: {os.path.join(ns.out or ns.model_dir, 'lm_eval_results.json')}")
    return 0


def _eval_credibility(ns: argparse.Namespace) -> int:
    data = ns.data or _default_eval_data()
    if data is None:
        raise ErniekitError(
            "eval --credibility needs --data PATH (the bundled examples/data is not next to this install)"
        )
    if min(ns.batch_size, ns.max_samples, ns.max_new_tokens) < 1 or not 0 < ns.temperature <= 2:
        raise ErniekitError(
            "eval --credibility: --batch-size, --max-samples and --max-new-tokens must be >= 1 and "
            f"--temperature in (0, 2] (got {ns.temperature})"
        )
    _import_paddle()
    from erniekit.infer.credibility_report import format_credibility, run_credibility_report

    rep = run_credibility_report(
        ns.model_dir,
        data,
        ns.out or ns.model_dir,
        ns.max_samples,
        ns.batch_size,
        ns.max_new_tokens,
        ns.temperature,
        ns.seed,
    )
    print(format_credibility(rep))
    print(f"results: {rep['path']}")
    return 0


EVAL_REPORTS: dict[str, Callable[[argparse.Namespace], int]] = {
    "routing": _eval_routing,
    "elastic": _eval_elastic,
    "credibility": _eval_credibility,
    "lm_eval": _eval_lm_eval,
}


def eval_(args: list[str]) -> int:
    """Reports on a checkpoint over a dataset (forward passes only, no training)."""
    ns = _eval_parser().parse_args(args)
    if ns.out is not None:  # found out now, not after the forward passes
        from erniekit.config.checks import check_writable_dir

        check_writable_dir("--out", ns.out)
    if ns.report is None:  # --lm-eval
        if not ns.lm_eval:
            raise ErniekitError(
                "eval --lm-eval: no task named; give TASK[,TASK] (bundled offline task: erniekit_arith)"
            )
        if ns.limit is not None and ns.limit < 1:
            raise ErniekitError(f"eval --lm-eval: --limit {ns.limit} must be >= 1 (examples per task)")
    return EVAL_REPORTS[ns.report or "lm_eval"](ns)


def version(args: list[str]) -> int:
    """Print erniekit and paddlepaddle versions."""
    if args:
        raise ErniekitError(f"erniekit version takes no arguments (got {' '.join(args)!r})")
    try:
        import paddle  # main() dropped its ccache warning

        paddle_version = f"paddlepaddle {paddle.__version__}"
    except (ImportError, OSError):
        paddle_version = "paddlepaddle not installed"
    print(f"erniekit {erniekit.__version__}, {paddle_version}")
    return 0


def show_help(args: list[str]) -> int:
    """Show the verbs, or one verb's usage."""
    if not args:
        lines = ["usage: erniekit <command> [args]", "", "commands:"]
        lines += [f"  {name:<9} {summary}" for name, (_, summary) in VERBS.items()]
        lines += ["", "run 'erniekit help <command>' for details, e.g. the config keys of train"]
        print("\n".join(lines))
        return 0
    topic = args[0]
    if topic not in VERBS:
        raise ErniekitError(_unknown_verb(topic))
    if topic == "train":
        print(_train_help())
    elif topic == "version":
        print(f"usage: erniekit {topic}\n\n{VERBS[topic][1]}")
    else:  # the verb's own --help: argparse prints it and exits 0 before the verb does anything
        try:
            VERBS[topic][0](["--help"])
        except SystemExit as e:
            return e.code if isinstance(e.code, int) else 0
    return 0


def _train_help() -> str:
    from erniekit.config.schema import field_types, fields, format_value

    types = field_types()
    lines = [TRAIN_USAGE, "", "Keys (YAML or key=value; dict keys take dotted sub-keys):"]
    for f in fields():
        default = f.default_factory() if callable(f.default_factory) else f.default
        tp = getattr(types[f.name], "__name__", str(types[f.name]))
        values = _choice_list(f.metadata.get("choices"))
        lines.append(f"  {f.name}={format_value(default)}  [{tp}]\n      {f.metadata['help']}{values}")
    return "\n".join(lines)


def _choice_list(choices) -> str:
    """ "; one of: ..." for a key with fixed values; the stage registry is read live, and its
    modules import paddle: without paddle the stages are not listed (the help line names them)."""
    if choices is None:
        return ""
    try:
        values = [v for v in dict.fromkeys(choices.values()) if v]
    except ModuleNotFoundError:
        return ""
    return f"; one of: {', '.join(values)}"


def _unknown_verb(verb: str) -> str:
    close = difflib.get_close_matches(verb, list(VERBS), n=1)
    hint = f"did you mean '{close[0]}'?" if close else "run 'erniekit help' to list commands"
    return f"unknown command '{verb}'; {hint}"


# One line per verb: name -> (function taking the remaining argv, one-line summary).
VERBS: dict[str, tuple[Callable[[list[str]], int], str]] = {
    "train": (train, "train a model: erniekit train CONFIG.yaml [key=value ...]"),
    "chat": (chat, "chat with a checkpoint: erniekit chat MODEL_DIR [--prompt TEXT]"),
    "server": (server, "OpenAI-compatible API: erniekit server MODEL_DIR [--host 127.0.0.1] [--port 8000]"),
    "webui": (webui, "fine-tune, chat and export in the browser: erniekit webui [--host 127.0.0.1] [--port 7860]"),
    "export": (export, "merge LoRA and write a Hugging Face-layout directory: erniekit export SRC -o OUT"),
    "plan": (plan, "rank parallel layouts on a cluster: erniekit plan CONFIG.yaml cluster=CLUSTER.yaml"),
    "eval": (
        eval_,
        "report on a checkpoint: erniekit eval MODEL_DIR --routing|--elastic|--credibility|--lm-eval TASKS [--data PATH]",
    ),
    "version": (version, "print erniekit and paddlepaddle versions"),
    "help": (show_help, "show this help, or 'erniekit help <command>'"),
}


_python_formatwarning = warnings.formatwarning


def drop_paddle_ccache_warning() -> None:
    """Hide the UserWarning paddle gives on every import when ccache is not installed: it concerns
    compiling C++ extensions, which erniekit never does. Only that message from that module: every
    other warning still shows. Call before paddle is imported."""
    warnings.filterwarnings(
        "ignore", message=r"No ccache found\.", category=UserWarning, module=r"paddle\.utils\.cpp_extension\."
    )


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    """erniekit's own warnings (data notes: truncated conversations, ignored fields, a rebuilt token
    store) as one `WARNING: ...` line, like the config's; not `file:line: UserWarning:` plus the
    source line that raised it. Other packages' warnings keep Python's format."""
    if issubclass(category, UserWarning) and f"{os.sep}erniekit{os.sep}" in str(filename):
        return f"WARNING: {message}\n"
    return _python_formatwarning(message, category, filename, lineno, line)


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit code (2 for user errors, printed as one line)."""
    warnings.formatwarning = _one_line_warning
    drop_paddle_ccache_warning()
    args = list(sys.argv[1:] if argv is None else argv)
    verb = args.pop(0) if args else "help"
    verb = {"-h": "help", "--help": "help", "-V": "version", "--version": "version"}.get(verb, verb)
    try:
        if verb not in VERBS:
            raise ErniekitError(_unknown_verb(verb))
        return VERBS[verb][0](args)
    except ErniekitError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:
        if not e.name or e.name.split(".")[0] == "erniekit":
            raise
        top = e.name.split(".")[0]
        print(
            f"error: 'erniekit {verb}' needs the Python package '{PIP_NAMES.get(top, top)}', "
            f"which is not installed; install it (pip install -r requirements.txt)",
            file=sys.stderr,
        )
        return 2
    except SystemExit as e:  # argparse exits on --help and on bad arguments
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `erniekit help train | head`: the reader left, not an error
        sys.stdout = open(os.devnull, "w")
        return 0
