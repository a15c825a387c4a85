"""`erniekit eval MODEL --lm-eval TASKS`: lm-evaluation-harness against the built-in server.

The server runs in this process (engine + uvicorn on a free local port, in threads) and lm-eval's
`local-completions` model talks to it over HTTP as it would to any OpenAI-compatible server:
loglikelihood tasks through echo + logprobs, generation tasks through plain completions, with
the server's own tokenizer (/tokenize, /tokenizer_info). So what is measured is exactly what
`erniekit server` serves, and the same numbers come out of `lm_eval --model local-completions`
pointed at a running `erniekit server`.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from contextlib import contextmanager
from typing import Iterator

from erniekit.errors import ErniekitError
from erniekit.infer.server import MAX_PROMPTS

BUNDLED_TASKS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "examples", "lm_eval")
SERVED_NAME = "erniekit-eval"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def local_server(model_dir: str, max_batch: int, max_model_len: int | None) -> Iterator[tuple[str, int]]:
    """The checkpoint served at http://127.0.0.1:PORT until the block ends; yields that base URL
    and the served context length."""
    import uvicorn

    from erniekit.infer.chat import load_chat_model, stop_ids
    from erniekit.infer.engine import Engine
    from erniekit.infer.server import OpenAIServer, build_app

    model, tokenizer = load_chat_model(model_dir)
    engine = Engine(
        model, tokenizer, max_batch=max_batch, max_model_len=max_model_len, stop_token_ids=stop_ids(model, tokenizer)
    )
    port = _free_port()
    server = uvicorn.Server(
        uvicorn.Config(
            build_app(OpenAIServer(engine, tokenizer, SERVED_NAME)), host="127.0.0.1", port=port, log_level="warning"
        )
    )
    thread = threading.Thread(target=server.run, name="erniekit-eval-server", daemon=True)
    thread.start()
    try:
        deadline = time.time() + 60
        while not server.started:
            if not thread.is_alive() or time.time() > deadline:
                raise ErniekitError(f"eval: the local server did not start on 127.0.0.1:{port}")
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}", engine.max_model_len
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        engine.close()


def run_lm_eval(
    model_dir: str,
    tasks: list[str],
    include_path: str | None = None,
    limit: int | None = None,
    batch_size: int = 8,
    max_model_len: int | None = None,
    out: str | None = None,
) -> dict:
    """Run lm-eval `tasks` on the checkpoint; returns lm-eval's results dict (samples left out)
    and writes it to `out`/lm_eval_results.json when `out` is given."""
    try:
        from lm_eval import simple_evaluate
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise ErniekitError("eval --lm-eval needs lm-evaluation-harness: pip install 'lm-eval[api]>=0.4.9'") from None
    if include_path and not os.path.isdir(include_path):
        raise ErniekitError(f"eval: --include-path {include_path} is not a directory of task YAML files")
    paths = [p for p in (BUNDLED_TASKS, include_path) if p and os.path.isdir(p)]
    manager = TaskManager(include_path=paths or None)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise ErniekitError(
            f"eval: lm-eval has no task {', '.join(unknown)}; bundled: erniekit_arith; add your own YAML "
            "directory with --include-path (tasks that download data need the network)"
        )
    with local_server(model_dir, batch_size, max_model_len) as (base, context):
        results = simple_evaluate(
            model="local-completions",
            model_args={
                "base_url": f"{base}/v1/completions",
                "model": SERVED_NAME,
                "tokenizer_backend": "remote",
                "batch_size": min(batch_size, MAX_PROMPTS),  # prompts per request: the server takes 64 at most
                "max_retries": 1,
                "max_length": context - 1,  # room for the one token a loglikelihood request generates
            },
            tasks=tasks,
            task_manager=manager,
            limit=limit,
        )
    if results is None:
        raise ErniekitError("eval: lm-eval returned no results")
    if out:
        os.makedirs(out, exist_ok=True)
        from erniekit.utils.io import atomic_write_json

        keep = {k: results[k] for k in ("results", "versions", "n-shot", "configs") if k in results}
        atomic_write_json(os.path.join(out, "lm_eval_results.json"), json.loads(json.dumps(keep, default=str)))
    return results
