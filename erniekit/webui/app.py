"""`erniekit webui`: fine-tune, chat and export in the browser (gradio), local by default.

Train starts `erniekit train` as a child process (erniekit/webui/runs.py) and polls it every
second: log tail, loss (and reward) plot from the run's VisualDL log directory, progress and ETA.
Chat loads a checkpoint or exported directory and streams replies. Export runs `erniekit
export` and shows the command that serves the result. Every handler turns errors into a message
in the page (never a stack trace). Every path a handler receives (from the page or from gradio's
HTTP API, which calls the same handlers) must lie in the allowed directories (access.PathPolicy).
"""

from __future__ import annotations

import html
import os
import sys
import traceback

import gradio as gr

from erniekit.errors import ErniekitError
from erniekit.export.formats import format_names
from erniekit.webui.access import PathPolicy, banner, exposure_warning
from erniekit.webui.runs import EMBEDDED, RECIPES, Form, Runs, cli_command, config_yaml, yaml_preview

CSS = (
    ".erniekit-error {color: #b00020; font-weight: 600}\n"
    "#exposure_warning {background: #fff3bf; border: 2px solid #e67700; padding: 8px 12px; font-weight: 600}"
)


def _message(e: Exception) -> str:
    """One line for the page: erniekit's own errors as they are, anything else with its type."""
    if isinstance(e, ErniekitError):
        return str(e)
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".strip()


def _error(e: Exception) -> str:
    """The page's one-line error. The console gets the same line for the user's own mistakes
    (ErniekitError) and the full trace for anything else, which is a bug worth reporting."""
    if isinstance(e, ErniekitError):
        print(f"webui: error: {e}", file=sys.stderr, flush=True)
    else:
        traceback.print_exc()
    return f"<span class='erniekit-error'>Error: {_message(e)}</span>"


def _fmt_eta(s: float | None) -> str:
    if s is None:
        return ""
    s = int(s)
    return f", ETA {s // 60}m{s % 60:02d}s" if s >= 60 else f", ETA {s}s"


def export_model(paths: PathPolicy, s: str, d: str, f: str) -> str:
    """The Export tab's work: source and destination must be allowed paths, the destination new or
    empty; returns the page's message (markdown) with the commands that check and serve the result."""
    from erniekit.export.hf import export_hf

    s, d = (s or "").strip(), (d or "").strip()
    if not s:
        raise ErniekitError("the source directory is empty; pick a checkpoint written by a run")
    if not d:
        raise ErniekitError("the export directory is empty")
    paths.check(s, "source directory")
    paths.check(d, "export directory")
    if not os.path.isdir(s):
        raise ErniekitError(f"{s}: no such directory; pick a checkpoint written by a run")
    if os.path.isdir(d) and os.listdir(d):
        raise ErniekitError(f"{d} already exists and is not empty; choose a new directory")
    export_hf(s, d, fmt=f)
    if f in ("paddle", "onnx"):
        serve = (
            f"erniekit export --verify {d}\n# the decoding step runs under "
            f"{'paddle.inference' if f == 'paddle' else 'onnxruntime'}: "
            f"erniekit.export.static.StepRunner('{d}', '{f}', config)"
        )
    else:
        serve = f"erniekit export --verify {d}\nerniekit server {d} --port 8000"
    return f"Exported {s} to {d} ({f}). Check and serve it:\n\n```bash\n{serve}\n```"


def build_app(runs: Runs | None = None, paths: PathPolicy | None = None, warning: str | None = None) -> gr.Blocks:
    """The page. `paths` confines every path a handler accepts (default: the current directory);
    `warning` (the exposure warning, if any) is shown at the top of every tab."""
    paths = paths or (runs.paths if runs is not None and runs.paths is not None else PathPolicy())
    runs = runs or Runs(paths)
    chat_state: dict = {}

    with gr.Blocks(title="erniekit") as app:
        gr.Markdown("# erniekit\nFine-tune, chat with and export ERNIE 4.5 models.")
        if warning:
            gr.HTML(f"<div id='exposure_warning'>{html.escape(warning)}</div>")
        gr.Markdown(
            f"Files: inside `{'`, `'.join(paths.roots)}` (widen with `--allow-path DIR`).", elem_id="allowed_paths"
        )
        with gr.Tab("Train"):
            with gr.Row():
                stage = gr.Dropdown(list(RECIPES), value="SFT", label="Stage", elem_id="stage")
                model = gr.Textbox(EMBEDDED, label="Model directory (or the embedded tiny model)", elem_id="model")
                dataset = gr.Textbox("", label="Dataset path (empty: the stage's bundled data)", elem_id="dataset")
            with gr.Row():
                output_dir = gr.Textbox("output/webui-run", label="Output directory", elem_id="output_dir")
                max_steps = gr.Number(200, precision=0, label="Max steps", elem_id="max_steps")
                lr = gr.Number(3e-3, label="Learning rate", elem_id="learning_rate")
                batch = gr.Number(32, precision=0, label="Batch size", elem_id="batch_size")
                seq = gr.Number(32, precision=0, label="Max sequence length", elem_id="max_seq_len")
                rank = gr.Number(8, precision=0, label="LoRA rank", elem_id="lora_rank")
            with gr.Row():
                preview_btn = gr.Button("Show config", elem_id="preview")
                start_btn = gr.Button("Start", variant="primary", elem_id="start")
                stop_btn = gr.Button("Stop", variant="stop", elem_id="stop")
                resume_btn = gr.Button("Resume", elem_id="resume")
            message = gr.HTML("", elem_id="train_message")
            with gr.Row():
                yaml_box = gr.Code(
                    "", language="yaml", label="Config (YAML) the run uses", elem_id="yaml", max_lines=16
                )
                cli_box = gr.Textbox("", label="Equivalent command", elem_id="cli", lines=3)
            progress = gr.Markdown("", elem_id="progress")
            plot = gr.LinePlot(
                None,
                x="step",
                y="value",
                color="series",
                label="Loss (and reward)",
                elem_id="loss_plot",
                height=300,
                color_map={"loss": "#e8590c", "reward": "#2b8a3e", "eval loss": "#5f3dc4"},
            )
            points = gr.Markdown("", elem_id="points")
            log = gr.Textbox("", label="Log (last lines)", lines=12, max_lines=12, elem_id="log", autoscroll=True)
            timer = gr.Timer(1.0, active=False)

            inputs = [stage, model, dataset, output_dir, max_steps, lr, batch, seq, rank]

            def form_of(*vals) -> Form:
                st, mo, ds, out, steps, rate, bs, sl, rk = vals
                for name, v in (
                    ("max steps", steps),
                    ("learning rate", rate),
                    ("batch size", bs),
                    ("max sequence length", sl),
                    ("LoRA rank", rk),
                ):
                    if v is None:
                        raise ErniekitError(f"{name} is empty")
                return Form(
                    stage=st,
                    model=(mo or EMBEDDED).strip(),
                    dataset=(ds or "").strip(),
                    output_dir=(out or "").strip(),
                    max_steps=int(steps),
                    learning_rate=float(rate),
                    batch_size=int(bs),
                    max_seq_len=int(sl),
                    lora_rank=int(rk),
                )

            def preview(*vals):
                try:
                    f = form_of(*vals)
                    return yaml_preview(f, paths), cli_command(f), ""
                except Exception as e:  # noqa: BLE001 - shown in the page
                    return "", "", _error(e)

            def start(resume: bool, *vals):
                try:
                    f = form_of(*vals)
                    run = runs.start(f, resume=resume)
                    what = "resumed" if resume else "started"
                    return config_yaml(run.cfg), cli_command(f), f"Run {what}: {f.output_dir}", gr.Timer(active=True)
                except Exception as e:  # noqa: BLE001 - shown in the page
                    return gr.update(), gr.update(), _error(e), gr.Timer()

            def stop(out):
                try:
                    return runs.stop(out or "")
                except Exception as e:  # noqa: BLE001 - shown in the page
                    return _error(e)

            def poll(out):
                try:
                    st = runs.status(out or "")
                except ErniekitError as e:  # the output directory box now names a refused path
                    return (
                        gr.skip(),
                        "",
                        f"<span class='erniekit-error'>Error: {e}</span>",
                        "",
                        gr.Timer(active=False),
                    )
                pts = st["points"]
                # no frame until there are points: a first, empty frame left the lines without a color
                df = _points_frame(pts) if pts else gr.skip()
                total = st["total"]
                prog = f"**{st['state']}**"
                if st["step"]:
                    prog += f": step {st['step']}" + (f" / {total} ({100 * st['step'] // total}%)" if total else "")
                prog += _fmt_eta(st["eta_s"])
                if st["error"]:
                    prog += f" &mdash; <span class='erniekit-error'>Error: {st['error']}</span>"
                n = sum(1 for p in pts if p[2] == "loss")
                keep = gr.Timer(active=st["state"] in ("running", "stopping"))
                return df, f"loss points: {n}", prog, st["log"], keep

            preview_btn.click(preview, inputs, [yaml_box, cli_box, message])
            start_btn.click(lambda *v: start(False, *v), inputs, [yaml_box, cli_box, message, timer])
            resume_btn.click(lambda *v: start(True, *v), inputs, [yaml_box, cli_box, message, timer])
            stop_btn.click(stop, [output_dir], [message])
            timer.tick(poll, [output_dir], [plot, points, progress, log, timer])

        with gr.Tab("Chat"):
            with gr.Row():
                chat_dir = gr.Textbox("output/webui-run", label="Checkpoint or exported directory", elem_id="chat_dir")
                load_btn = gr.Button("Load", elem_id="chat_load")
            chat_message = gr.HTML("", elem_id="chat_message")
            with gr.Row():
                temperature = gr.Slider(
                    0.0, 2.0, 0.0, step=0.05, label="Temperature (0 = greedy)", elem_id="temperature"
                )
                top_p = gr.Slider(0.05, 1.0, 1.0, step=0.05, label="Top-p", elem_id="top_p")
                max_new = gr.Slider(1, 1024, 64, step=1, label="Max new tokens", elem_id="max_new_tokens")
            chatbot = gr.Chatbot(label="Conversation", elem_id="chatbot", height=320)
            with gr.Row():
                user = gr.Textbox("", label="Message", elem_id="chat_input", scale=4)
                image = gr.Image(
                    None,
                    type="filepath",
                    sources=["upload"],
                    label="Image (ERNIE-4.5-VL models)",
                    elem_id="chat_image",
                    height=120,
                    scale=1,
                )
                video = gr.Video(
                    None, sources=["upload"], label="Video (ERNIE-4.5-VL models)", elem_id="chat_video", height=120
                )
                send_btn = gr.Button("Send", variant="primary", elem_id="chat_send")
                clear_btn = gr.Button("Clear", elem_id="chat_clear")

            def load(path):
                try:
                    from erniekit.infer.chat import load_chat_model, stop_ids

                    path = paths.check(path, "checkpoint directory")
                    model_, tok = load_chat_model(path)
                    if "images" in chat_state:
                        chat_state.pop("images").close()
                    chat_state.update(model=model_, tokenizer=tok, stops=stop_ids(model_, tok), path=path)
                    if hasattr(model_, "visual_features"):  # a vision-language model: images go with messages
                        from erniekit.webui.image_chat import ImageConversation

                        chat_state["images"] = ImageConversation(model_, tok, chat_state["stops"])
                    return f"Loaded {path} ({sum(int(p.numel()) for p in model_.parameters()) / 1e6:.2f}M parameters)"
                except Exception as e:  # noqa: BLE001 - shown in the page
                    return _error(e)

            def reply(text, history, picture, clip, temp, tp, mx):
                history = list(history or [])
                if "model" not in chat_state:
                    yield history, _error(ErniekitError("load a checkpoint first (Load)")), text, picture, clip
                    return
                if not (text or "").strip():
                    yield history, "", "", picture, clip
                    return
                vl = chat_state.get("images")
                if (picture or clip) and vl is None:
                    no = ErniekitError("this model reads no images or videos; load an ERNIE-4.5-VL checkpoint")
                    yield history, _error(no), text, picture, clip
                    return
                if vl is not None and (picture or clip or vl.has_images):
                    yield from _image_reply(vl, text, history, picture, clip, temp, tp, mx)
                    return
                try:
                    from erniekit.infer.sampling import SamplingParams
                    from erniekit.webui.text_chat import text_reply

                    params = SamplingParams(
                        max_new_tokens=int(mx),
                        temperature=float(temp),
                        top_p=float(tp),
                        stop_token_ids=chat_state["stops"],
                    )
                    for shown in text_reply(chat_state["model"], chat_state["tokenizer"], history, text, params):
                        yield shown, "", "", None, None
                except Exception as e:  # noqa: BLE001 - shown in the page
                    yield history, _error(e), text, picture, clip

            def _image_reply(vl, text, history, picture, clip, temp, tp, mx):
                shown = text + "".join(
                    f"\n[{kind}: {os.path.basename(f)}]" for kind, f in (("image", picture), ("video", clip)) if f
                )
                history = history + [{"role": "user", "content": shown}, {"role": "assistant", "content": ""}]
                try:
                    from erniekit.infer.sampling import SamplingParams

                    params = SamplingParams(max_new_tokens=int(mx), temperature=float(temp), top_p=float(tp))
                    for so_far in vl.reply(text, picture, params, video=clip):
                        history[-1]["content"] = so_far
                        yield history, "", "", None, None
                except Exception as e:  # noqa: BLE001 - shown in the page
                    yield history[:-2], _error(e), text, picture, clip

            def clear():
                if "images" in chat_state:
                    chat_state["images"].reset()
                return [], "", None, None

            ins = [user, chatbot, image, video, temperature, top_p, max_new]
            outs = [chatbot, chat_message, user, image, video]
            load_btn.click(load, [chat_dir], [chat_message], api_name="chat_load")
            send_btn.click(reply, ins, outs, api_name="chat_send")
            user.submit(reply, ins, outs)
            clear_btn.click(clear, None, [chatbot, chat_message, image, video], api_name="chat_clear")

        with gr.Tab("Export"):
            with gr.Row():
                src = gr.Textbox("output/webui-run", label="Checkpoint or LoRA adapter directory", elem_id="export_src")
                dst = gr.Textbox("output/webui-export", label="Export to", elem_id="export_dst")
                fmt = gr.Dropdown(format_names(), value="hf", label="Format", elem_id="export_format")
            export_btn = gr.Button("Export", variant="primary", elem_id="export")
            export_out = gr.Markdown("", elem_id="export_result")

            def do_export(s, d, f):
                try:
                    return export_model(paths, s, d, f)
                except Exception as e:  # noqa: BLE001 - shown in the page
                    return _error(e)

            export_btn.click(do_export, [src, dst, fmt], [export_out], api_name="export")
    return app


def _points_frame(points):
    """(step, value, series) rows as a frame with numeric columns (untyped ones made the plot
    treat the values as categories)."""
    import pandas as pd

    return pd.DataFrame(
        {
            "step": pd.Series([p[0] for p in points], dtype="int64"),
            "value": pd.Series([p[1] for p in points], dtype="float64"),
            "series": pd.Series([p[2] for p in points], dtype=object),
        }
    )


def prepare_launch(
    host: str = "127.0.0.1",
    port: int = 7860,
    share: bool = False,
    auth: list[tuple[str, str]] | None = None,
    stderr=None,
) -> tuple[dict, str | None]:
    """gradio's launch() arguments, and the exposure warning (printed to stderr, framed, before
    anything binds) when the WebUI will be reachable beyond this machine. The accounts go to
    gradio's own login (it compares passwords in constant time); nothing here prints them."""
    warning = exposure_warning(host, share, bool(auth))
    if warning:
        print(banner(warning), file=stderr or sys.stderr, flush=True)
    kwargs = dict(
        server_name=host,
        server_port=port,
        share=share,
        show_error=False,
        quiet=True,
        css=CSS,
        footer_links=[],
        auth=list(auth) if auth else None,
        auth_message="erniekit WebUI: log in with the account given by --auth, --auth-file or ERNIEKIT_WEBUI_AUTH"
        if auth
        else None,
    )
    return kwargs, warning


def run_webui(
    host: str = "127.0.0.1",
    port: int = 7860,
    share: bool = False,
    auth: list[tuple[str, str]] | None = None,
    paths: PathPolicy | None = None,
) -> int:
    kwargs, warning = prepare_launch(host, port, share, auth)
    paths = paths or PathPolicy()
    runs = Runs(paths)
    app = build_app(runs, paths, warning)
    login = f", login required ({len(auth)} account{'s' if len(auth) > 1 else ''})" if auth else ""
    print(
        f"erniekit: WebUI at http://{host}:{port}{login}; files inside {', '.join(paths.roots)} (Ctrl-C to quit)",
        flush=True,
    )
    return _serve_until_stopped(app, kwargs, runs)


class _Terminated(BaseException):
    """SIGTERM arrived; a BaseException, like KeyboardInterrupt, so no `except Exception` on its way
    out of gradio's launch() swallows it."""


def _serve_until_stopped(app, kwargs: dict, runs: Runs) -> int:
    """Serve until Ctrl-C (KeyboardInterrupt: the CLI prints "interrupted", exit 130) or SIGTERM
    (docker stop, systemd): then close the server, stop the training runs it started (each ends
    after its step with a checkpoint; Ctrl-C reaches them from the terminal itself), say so in a line
    each and exit 128 + 15, as a stopped `erniekit train` does. Without this handler paddle's C++
    one took SIGTERM and dumped a `FatalError` report."""
    import signal

    from erniekit.utils.run_control import STOPPED_EXIT_BASE

    def on_sigterm(signum, frame):
        raise _Terminated

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        app.queue().launch(**kwargs)
    except _Terminated:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a repeat while the runs stop (up to 60 s) changes nothing
        app.close(verbose=False)
        for line in runs.stop_all():
            print(f"erniekit: {line}", file=sys.stderr, flush=True)
        print("erniekit: WebUI stopped on SIGTERM", file=sys.stderr, flush=True)
        return STOPPED_EXIT_BASE + signal.SIGTERM
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0
