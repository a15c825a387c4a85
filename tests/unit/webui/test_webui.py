"""The WebUI's run logic (erniekit/webui/runs.py) without a browser: the form becomes validated
overrides of the stage's shipped config, errors are one line, the plot points come from the run's
VisualDL log directory (loss and GRPO's reward), and a finished run's status. Its guards
(erniekit/webui/access.py): the warning for a non-loopback host, the login (flag, file or
environment, handed to gradio's auth: checked against a real app on 127.0.0.1), and every path the
handlers and the HTTP API accept confined to the working directory unless widened."""

from __future__ import annotations

import json
import os
import sys
import time

import pytest

pytest.importorskip("gradio")

from erniekit.errors import ErniekitError
from erniekit.webui.access import AUTH_ENV, PathPolicy, is_loopback, resolve_auth
from erniekit.webui.runs import ROOT, Form, Runs, bundled_data, check_form, cli_command, read_points


def test_form_becomes_overrides_of_the_stage_config(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the bundled data is found from anywhere
    f = Form(
        stage="LoRA",
        output_dir=str(tmp_path / "o"),
        max_steps=7,
        learning_rate=1e-3,
        batch_size=4,
        max_seq_len=32,
        lora_rank=4,
    )
    cfg = check_form(f)
    assert (cfg.fine_tuning, cfg.lora_rank, cfg.max_steps, cfg.learning_rate) == ("LoRA", 4, 7, 1e-3)
    assert cfg.model_name_or_path == "tiny-moe" and cfg.logging_steps == 1
    assert cfg.train_dataset_path == os.path.join(ROOT, "examples/data/arithmetic/train.jsonl")
    cmd = cli_command(f)
    assert cmd.startswith("erniekit train ") and "sft_lora.yaml" in cmd and "lora_rank=4" in cmd
    assert set(bundled_data("GRPO")) == {"train_dataset_path", "eval_dataset_path"}


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"model": "/no/such/model"}, "model directory /no/such/model not found"),
        ({"dataset": "/no/such.jsonl"}, "dataset /no/such.jsonl not found"),
        ({"max_steps": 0}, "max steps 0 must be >= 1"),
        ({"learning_rate": -1.0}, "learning_rate"),
        ({"stage": "RLHF"}, "stage 'RLHF': choose one of"),
    ],
)
def test_bad_form_values_are_one_line_errors(tmp_path, kw, match):
    with pytest.raises(ErniekitError, match=match) as e:
        check_form(Form(output_dir=str(tmp_path / "o"), **kw))
    assert "\n" not in str(e.value)


def test_plot_points_read_loss_and_reward(tmp_path):
    (tmp_path / "vdl_log").mkdir()
    rows = [{"step": 1, "train/loss": 2.0, "train/reward": 0.1}, {"step": 2, "train/loss": 1.5, "train/reward": 0.3}]
    (tmp_path / "vdl_log" / "scalars.jsonl").write_text("\n".join(map(json.dumps, rows)) + '\n{"step": 3, "tr')
    pts, step = read_points(str(tmp_path))
    assert step == 2  # the half-written line is skipped
    assert sorted(pts) == [(1, 0.1, "reward"), (1, 2.0, "loss"), (2, 0.3, "reward"), (2, 1.5, "loss")]


def test_a_finished_run_reports_its_steps_and_a_second_start_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    runs = Runs()
    f = Form(stage="pretrain", output_dir=str(tmp_path / "run"), max_steps=3, batch_size=4, max_seq_len=32)
    runs.start(f)
    with pytest.raises(ErniekitError, match="a run is already writing to"):
        runs.start(f)
    deadline = time.time() + 240
    while runs.status(f.output_dir)["state"] == "running" and time.time() < deadline:
        time.sleep(0.2)
    st = runs.status(f.output_dir)
    assert st["state"] == "finished", st["log"][-2000:]
    assert st["step"] == 3 and [p[0] for p in st["points"] if p[2] == "loss"] == [1, 2, 3]
    assert "saved model" in st["log"]


@pytest.mark.parametrize(
    "host, loopback",
    [
        ("127.0.0.1", True),
        ("127.8.9.10", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("LOCALHOST.", True),
        ("0.0.0.0", False),
        ("::", False),
        ("192.168.1.20", False),
        ("10.0.0.1", False),
        ("", False),
        ("no-such-host.invalid", False),
    ],
)
def test_loopback_hosts(host, loopback):
    assert is_loopback(host) is loopback


def test_a_non_loopback_host_prints_a_loud_warning_and_no_password(capsys):
    from erniekit.webui.app import prepare_launch

    kw, warning = prepare_launch("0.0.0.0", 7860)  # nothing binds: these are launch()'s arguments
    err = capsys.readouterr().err
    assert warning in err and "!" * 78 in err
    assert "WARNING" in err and "--host 0.0.0.0" in err and "NO LOGIN IS SET" in err and AUTH_ENV in err
    assert kw["server_name"] == "0.0.0.0" and kw["auth"] is None
    kw, warning = prepare_launch("192.168.1.20", 7860, auth=[("ann", "s3cret-pw")])
    out = capsys.readouterr()
    assert "--host 192.168.1.20" in out.err and "login is required" in out.err and "NO LOGIN" not in out.err
    assert "s3cret-pw" not in out.err + out.out + warning
    assert kw["auth"] == [("ann", "s3cret-pw")] and kw["auth_message"]
    prepare_launch("127.0.0.1", 7860, share=True)  # a public link is an exposure too
    assert "--share" in capsys.readouterr().err
    for host in ("127.0.0.1", "localhost", "::1"):
        kw, warning = prepare_launch(host, 7860)
        assert warning is None and capsys.readouterr().err == "" and kw["auth"] is None


def test_login_from_flag_file_or_environment(tmp_path):
    assert resolve_auth(None, None, {}) is None
    assert resolve_auth(None, None, {AUTH_ENV: ""}) is None
    assert resolve_auth("ann:pa:ss", None, {}) == [("ann", "pa:ss")]  # the password may hold ':'
    assert resolve_auth(None, None, {AUTH_ENV: "bob:pw"}) == [("bob", "pw")]
    f = tmp_path / "auth"
    f.write_text("# WebUI accounts\nann:one\n\nbob:two\n")
    assert resolve_auth(None, str(f), {AUTH_ENV: "x:y"}) == [("ann", "one"), ("bob", "two")]
    assert resolve_auth("c:d", None, {AUTH_ENV: "x:y"}) == [("c", "d")]  # a flag wins over the environment


@pytest.mark.parametrize(
    "args, env, match",
    [
        (["--auth", "annsecret"], None, "--auth must be USER:PASSWORD"),
        (["--auth", ":secret"], None, "--auth must be USER:PASSWORD"),
        (["--auth", "ann:"], None, "--auth must be USER:PASSWORD"),
        ([], "annsecret", f"the environment variable {AUTH_ENV} must be USER:PASSWORD"),
        (["--auth-file", "FILE"], None, "line 2 must be USER:PASSWORD"),
        (["--auth-file", "/no/such/auth"], None, "--auth-file /no/such/auth: cannot read it"),
        (["--auth", "a:b", "--auth-file", "FILE"], None, "give --auth or --auth-file, not both"),
        (["--allow-path", "/no/such/dir"], None, "--allow-path /no/such/dir: not a directory"),
    ],
)
def test_bad_login_or_path_flags_are_one_line_errors_that_hide_the_password(
    tmp_path, monkeypatch, capsys, args, env, match
):
    from erniekit.cli import main

    (tmp_path / "auth").write_text("ann:one\nannsecret\n")
    args = [str(tmp_path / "auth") if a == "FILE" else a for a in args]
    monkeypatch.delenv(AUTH_ENV, raising=False)
    if env is not None:
        monkeypatch.setenv(AUTH_ENV, env)
    assert main(["webui", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: webui: ") and match in err
    assert "secret" not in err and ":one" not in err


def test_cli_hands_login_and_allowed_paths_to_the_webui(tmp_path, monkeypatch):
    import erniekit.webui.app as webui_app
    from erniekit.cli import main

    got = {}
    monkeypatch.setattr(webui_app, "run_webui", lambda *a: got.update(args=a) or 0)
    monkeypatch.chdir(tmp_path)  # --workdir changes directory; monkeypatch changes it back
    (tmp_path / "work").mkdir()
    (tmp_path / "models").mkdir()
    monkeypatch.setenv(AUTH_ENV, "ann:from-env")
    assert main(["webui", "--port", "7861", "--workdir", "work", "--allow-path", str(tmp_path / "models")]) == 0
    host, port, share, auth, paths = got["args"]
    assert (host, port, share, auth) == ("127.0.0.1", 7861, False, [("ann", "from-env")])
    assert os.getcwd() == str(tmp_path / "work")
    assert paths.roots == [str(tmp_path / "work"), str(tmp_path / "models")]
    assert main(["webui", "--auth", "bob:from-flag"]) == 0 and got["args"][3] == [("bob", "from-flag")]


@pytest.fixture()
def confined(tmp_path, monkeypatch):
    """A working directory `work`, a directory `outside` beside it, and `work/link` -> `outside`."""
    work, outside = tmp_path / "work", tmp_path / "outside"
    work.mkdir()
    outside.mkdir()
    (work / "link").symlink_to(outside)
    (tmp_path / "work-evil").mkdir()  # shares the prefix "work" but is not inside it
    monkeypatch.chdir(work)
    return work, outside


def test_paths_are_confined_to_the_working_directory_unless_widened(confined):
    work, outside = confined
    paths = PathPolicy()
    assert paths.roots == [str(work)]
    for ok in ("output/run", "./a/../b", str(work / "new" / "dir"), str(work)):
        assert paths.check(ok, "output directory") == ok  # inside (existing or not): accepted as given
    for bad in (
        "/etc",
        "/etc/erniekit-export",
        "../outside/x",
        "output/../../outside",
        str(outside),
        "../work-evil",
        "~/x",
    ):
        with pytest.raises(ErniekitError, match="is outside the directories this WebUI may use") as e:
            paths.check(bad, "export directory")
        assert "\n" not in str(e.value) and "--allow-path" in str(e.value)
    with pytest.raises(ErniekitError, match=f"link/export \\(it resolves to {outside}/export\\) is outside"):
        paths.check("link/export", "export directory")  # a symlink out of the working directory
    with pytest.raises(ErniekitError, match="the export directory is empty"):
        paths.check("  ", "export directory")
    wide = PathPolicy(allow=[str(outside)])
    assert wide.check("link/export", "export directory") == "link/export"
    assert wide.check(str(outside / "x"), "export directory") == str(outside / "x")
    with pytest.raises(ErniekitError, match=f"may use \\({work}, {outside}\\)"):
        wide.check("/etc", "export directory")


def test_every_handler_refuses_a_path_outside_and_writes_nothing(confined):
    from erniekit.webui.app import export_model

    work, outside = confined
    paths = PathPolicy()
    for src, dst in (
        ("ckpt", "/etc"),
        ("ckpt", "../../x"),
        ("ckpt", "link/x"),
        ("/etc", "export"),
        ("../outside", "export"),
    ):
        with pytest.raises(ErniekitError, match="is outside the directories"):
            export_model(paths, src, dst, "hf")
    runs = Runs(paths)
    for kw in (
        {"output_dir": "/etc/x"},
        {"output_dir": "../x"},
        {"output_dir": "link/run"},
        {"dataset": "/etc/passwd"},
        {"model": "/etc"},
        {"model": "link"},
        {"output_dir": f"'{outside}/run'"},  # quoted: the run reads it without the quotes
        {"output_dir": f'"{outside}/run"'},
    ):
        with pytest.raises(ErniekitError, match="is outside the directories") as e:
            runs.start(Form(**{"output_dir": "run", **kw}))
        assert "\n" not in str(e.value)
    with pytest.raises(ErniekitError, match="not found"):  # no such directory here, quoted or not
        runs.start(Form(output_dir="run", model=f"'{outside}'"))
    with pytest.raises(ErniekitError, match="output directory /etc is outside"):
        runs.status("/etc")
    assert runs.runs == {} and list(outside.iterdir()) == [] and sorted(os.listdir(work)) == ["link"]
    assert check_form(Form(output_dir="run"), paths).output_dir == "run"  # inside: the form validates
    assert check_form(Form(output_dir="'run'"), paths).output_dir == "run"
    assert check_form(Form(output_dir="link/run"), PathPolicy(allow=[str(outside)])).output_dir == "link/run"


def _http(opener, url, data=None):
    import urllib.error

    try:
        with opener.open(url, data=data, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_gradio_login_guards_every_route_and_the_api_refuses_outside_paths(tmp_path):
    """A real app on 127.0.0.1 with the launch arguments `erniekit webui --auth` gives it."""
    import http.cookiejar
    import urllib.parse
    import urllib.request

    from gradio_client import Client
    from launched_jobs import free_port

    from erniekit.webui.app import build_app, prepare_launch

    port = free_port()
    kw, _ = prepare_launch("127.0.0.1", port, auth=[("ann", "s3cret-pw")])
    app = build_app(paths=PathPolicy(str(tmp_path)), warning="WARNING: reachable (test banner)")
    app.queue().launch(**kw, prevent_thread_lock=True)
    url = f"http://127.0.0.1:{port}"
    try:
        anon = urllib.request.build_opener()
        call = json.dumps({"data": ["ckpt", "/etc", "hf"]}).encode()
        for route, data in (
            ("/config", None),
            ("/gradio_api/info", None),
            ("/gradio_api/call/export", call),
            ("/gradio_api/file=/etc/hostname", None),
        ):
            status, body = _http(anon, url + route, data)
            assert status == 401 and "Not authenticated" in body, route
        with pytest.raises(ValueError, match="Could not login"):
            Client(url, auth=("ann", "wrong"), verbose=False)
        user = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(http.cookiejar.CookieJar()))
        status, _ = _http(
            user, url + "/login", urllib.parse.urlencode({"username": "ann", "password": "s3cret-pw"}).encode()
        )
        assert status == 200
        status, body = _http(user, url + "/config")
        assert status == 200 and "WARNING: reachable (test banner)" in body and "exposure_warning" in body
        assert _http(user, url + "/gradio_api/file=/etc/hostname")[0] == 403  # gradio serves no file outside
        client = Client(url, auth=("ann", "s3cret-pw"), verbose=False)
        for dst in ("/etc", "../../x"):
            assert "is outside the directories this WebUI may use" in client.predict(
                "ckpt", dst, "hf", api_name="/export"
            )
        assert "checkpoint directory /etc is outside" in client.predict("/etc", api_name="/chat_load")
        assert not os.path.exists(tmp_path.parent.parent / "x")
    finally:
        app.close()


@pytest.mark.parametrize(
    "code, stop_sent, state",
    [
        (0, False, "finished"),
        (0, True, "stopped"),
        (143, True, "stopped"),
        (130, False, "stopped"),
        (1, False, "failed (exit code 1)"),
        (2, True, "failed (exit code 2)"),
    ],
)
def test_exit_code_of_a_run_becomes_its_state(tmp_path, code, stop_sent, state):
    """`erniekit train` stopped by SIGTERM / SIGINT exits 128 + N with its checkpoint: the page says stopped."""
    import subprocess

    from erniekit.webui.runs import Run

    proc = subprocess.Popen([sys.executable, "-c", f"raise SystemExit({code})"])
    proc.wait()
    runs = Runs()
    runs.runs[str(tmp_path)] = Run(
        str(tmp_path),
        proc,
        time.time(),
        check_form(Form(output_dir=str(tmp_path))),
        str(tmp_path / "log"),
        stop_sent=stop_sent,
    )
    assert runs.status(str(tmp_path))["state"] == state


def test_sigterm_stops_the_webui_in_one_line_with_143(tmp_path):
    """docker stop / systemd send SIGTERM: the WebUI ends as `erniekit train` stopped by it does, one
    line and exit 128 + 15; paddle's C++ handler used to dump a `FatalError` report and die by signal."""
    import signal

    from launched_jobs import free_port, serve

    port = free_port()
    webui = serve(["webui", "--port", str(port)], f"http://127.0.0.1:{port}/", str(tmp_path), timeout=120)
    proc = next(webui)  # it answers: gradio waits in launch()
    try:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        webui.close()
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert "FatalError" not in out and "Traceback" not in out, out[-3000:]
    assert out.splitlines()[-1] == "erniekit: WebUI stopped on SIGTERM", out[-3000:]


def _child(tmp_path, name: str, on_term: str, then: str = "time.sleep(30)"):
    """A stand-in training run: `on_term` is its SIGTERM handler's body; after it is ready (a file
    appears) it runs `then`."""
    import subprocess

    ready = tmp_path / f"{name}.ready"
    code = (
        "import signal, sys, time, pathlib\n"
        f"def h(s, f):\n    {on_term}\n"
        "signal.signal(signal.SIGTERM, h)\n"
        f"pathlib.Path({str(ready)!r}).touch()\n"
        f"{then}\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code])
    deadline = time.time() + 30
    while not ready.exists():
        assert time.time() < deadline and proc.poll() is None
        time.sleep(0.02)
    return proc


def test_stop_all_signals_each_run_once_and_says_how_each_ended(tmp_path):
    """A stopping WebUI (SIGTERM) stops its runs: each gets one SIGTERM (a run already stopped by the
    button gets none more: a second signal kills an `erniekit train` before its checkpoint) and a
    line says how it ended, or that it is still stopping when the wait runs out."""
    from erniekit.webui.runs import Run

    cfg = check_form(Form(output_dir=str(tmp_path)))
    term = _child(tmp_path, "term", "sys.exit(143)")  # ends as `erniekit train` does on SIGTERM
    # already sent SIGTERM by the stop button: a second one would make it exit 9, not 143 later
    button = _child(tmp_path, "button", "sys.exit(9)", then="time.sleep(0.5); sys.exit(143)")
    stuck = _child(tmp_path, "stuck", "pass")  # takes longer than the wait
    runs = Runs()
    for name, proc, sent in (("a", term, False), ("b", button, True), ("c", stuck, False)):
        runs.runs[str(tmp_path / name)] = Run(str(tmp_path / name), proc, time.time(), cfg, "log", stop_sent=sent)
    try:
        lines = runs.stop_all(wait_s=3.0)
        assert term.returncode == 143 and button.returncode == 143 and stuck.poll() is None
        assert lines == [
            f"training run in {tmp_path / 'a'} stopped with its checkpoint (resume_from_checkpoint=auto goes on)",
            f"training run in {tmp_path / 'b'} stopped with its checkpoint (resume_from_checkpoint=auto goes on)",
            f"training run in {tmp_path / 'c'} still stopping after 3 s (pid {stuck.pid})",
        ]
        assert all(r.stop_sent for r in runs.runs.values())
        assert runs.stop_all(wait_s=0.1) == [
            f"training run in {tmp_path / 'c'} still stopping after 0.1 s (pid {stuck.pid})"
        ]
    finally:
        stuck.kill()
        stuck.wait()


def test_runs_start_their_trainer_to_take_a_repeated_stop_signal_as_one(tmp_path, monkeypatch):
    from erniekit.utils.run_control import STOP_ONCE_ENV, stops_once
    from erniekit.webui import runs as runs_mod

    seen = {}

    class FakePopen:
        def __init__(self, cmd, **kw):
            seen.update(kw["env"])

        def poll(self):
            return None

    monkeypatch.setattr(runs_mod.subprocess, "Popen", FakePopen)
    Runs().start(Form(output_dir=str(tmp_path / "out")))
    assert seen[STOP_ONCE_ENV] == "1"
    assert stops_once(1, seen) and stops_once(2, {}) and not stops_once(1, {})


def test_a_sigterm_to_the_webui_stops_its_runs_before_it_exits(capsys):
    import signal

    from erniekit.webui.app import _serve_until_stopped

    class App:  # gradio's Blocks as _serve_until_stopped uses it; SIGTERM arrives while it serves
        closed = False

        def queue(self):
            return self

        def launch(self, **kw):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)

        def close(self, verbose=True):
            App.closed = True

    class StubRuns:
        asked = 0

        def stop_all(self):
            StubRuns.asked += 1
            os.kill(os.getpid(), signal.SIGTERM)  # repeated while the runs stop: nothing more happens
            time.sleep(0.2)
            return ["training run in /r stopped with its checkpoint (resume_from_checkpoint=auto goes on)"]

    assert _serve_until_stopped(App(), {}, StubRuns()) == 128 + signal.SIGTERM
    assert App.closed and StubRuns.asked == 1
    assert capsys.readouterr().err.splitlines() == [
        "erniekit: training run in /r stopped with its checkpoint (resume_from_checkpoint=auto goes on)",
        "erniekit: WebUI stopped on SIGTERM",
    ]
