"""`erniekit chat --tools tools.py`: the public functions of a Python file become tools the model
may call; their calls run here and the results go back to the model (an agent round trip).

A function's schema comes from its signature: parameters annotated int / float / bool / str /
list / dict (or Optional / list[...] / dict[...] of them) map to JSON types, the first docstring
line is the description. The tools file is the user's code and runs as it is; what the model
writes is not trusted: a call to an unknown tool, arguments that are not the declared ones, a tool
that raises, exits, runs too long or returns something huge all come back as a short tool result
the model sees, and the chat goes on.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import json
import os
import signal
import sys
import threading
import traceback
import types
import typing
from collections.abc import Callable, Iterator
from typing import Any

from erniekit.errors import ConfigError

_JSON_TYPES = {int: "integer", float: "number", bool: "boolean", str: "string", list: "array", dict: "object"}
MODULE_NAME = "erniekit_user_tools"
TOOL_TIMEOUT_S = 60.0  # a call still running after this is stopped and reported to the model
MAX_RESULT_CHARS = 16_000  # a longer result is cut: the model's context is the bound, not the tool's output


def _json_type(annotation: object) -> str | None:
    """The JSON type of a parameter annotation (Optional[X] and X | None as X, list[str] as list);
    None when it names none."""
    if annotation in _JSON_TYPES:
        return _JSON_TYPES[annotation]  # type: ignore[index]
    origin = typing.get_origin(annotation)
    if origin in _JSON_TYPES:
        return _JSON_TYPES[origin]
    if origin is typing.Union or (hasattr(types, "UnionType") and origin is types.UnionType):
        kinds = {_json_type(a) for a in typing.get_args(annotation) if a is not type(None)}
        return kinds.pop() if len(kinds) == 1 else None
    return None


def _signature(fn: Callable) -> inspect.Signature:
    """The signature with string annotations (`from __future__ import annotations`) evaluated."""
    try:
        return inspect.signature(fn, eval_str=True)
    except Exception:  # noqa: BLE001 - an annotation that does not evaluate: keep it as text
        return inspect.signature(fn)


def tool_schema(name: str, fn: Callable) -> dict:
    """The OpenAI tool entry of a Python function."""
    props, required = {}, []
    for p in _signature(fn).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        props[p.name] = {"type": _json_type(p.annotation) or "string"}
        if p.default is p.empty:
            required.append(p.name)
    fn_entry: dict[str, Any] = {"name": name}
    doc = inspect.getdoc(fn)
    if doc:
        fn_entry["description"] = doc.splitlines()[0]
    fn_entry["parameters"] = {"type": "object", "properties": props, "required": required}
    return {"type": "function", "function": fn_entry}


def _failed_line(path: str, e: BaseException) -> str:
    """`path:LINE` of the failing line of the user's file (where a traceback would point)."""
    if isinstance(e, SyntaxError) and e.lineno:
        return f"{path}:{e.lineno}"
    real = os.path.realpath(path)
    lines = [f.lineno for f in traceback.extract_tb(e.__traceback__) if os.path.realpath(f.filename) == real]
    return f"{path}:{lines[-1]}" if lines else path


def load_tools(path: str) -> tuple[list[dict], dict[str, Callable]]:
    """(tool schemas, name -> function) of the public functions defined in the file at `path`."""
    if not os.path.isfile(path):
        raise ConfigError(f"--tools {path}: file not found; pass a Python file defining the tool functions")
    spec = importlib.util.spec_from_file_location(MODULE_NAME, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[MODULE_NAME] = module  # as an import does: dataclasses and pickle look the module up
    folder = os.path.dirname(os.path.abspath(path))
    if folder not in sys.path:  # its imports of files beside it work, as under `python tools.py`
        sys.path.append(folder)  # last: its names never shadow a module erniekit imports later
    try:
        spec.loader.exec_module(module)  # the user's own file, run as `python tools.py` would
    except (Exception, SystemExit) as e:  # noqa: BLE001 - any error in user code is reported in one line
        sys.modules.pop(MODULE_NAME, None)
        msg = " ".join(f"{type(e).__name__}: {e}".split())[:300]
        raise ConfigError(
            f"--tools {_failed_line(path, e)}: importing it failed ({msg}); fix the file so `python {path}` runs"
        ) from None
    funcs = {
        n: f
        for n, f in vars(module).items()
        if inspect.isfunction(f) and f.__module__ == module.__name__ and not n.startswith("_")
    }
    if not funcs:
        raise ConfigError(f"--tools {path}: defines no public functions; each top-level def becomes a tool")
    from erniekit.data.tool_messages import NAME, check_tools

    for n, f in funcs.items():
        if not NAME.fullmatch(n):
            raise ConfigError(
                f"--tools {path}:{f.__code__.co_firstlineno}: function {n!r} cannot be a tool: tool names are 1-64 "
                "ASCII letters, digits, '_', '.' or '-' (the OpenAI tools API's rule); rename it, or start it with '_' "
                "to keep it out of the tools"
            )
    # in the normal form the data readers and the server give a tool list: the prompt is the one
    # training rendered, key for key (a model copies what it saw: the description before the parameters)
    return check_tools([tool_schema(n, f) for n, f in funcs.items()], f"--tools {path}"), funcs


def _type_ok(kind: str, value: object) -> bool:
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, {"boolean": bool, "string": str, "array": list, "object": dict}[kind])


def _argument_problem(name: str, fn: Callable, args: dict) -> str | None:
    """What is wrong with the model's arguments for `fn` (missing, unknown, of the wrong JSON type)."""
    sig = _signature(fn)
    try:
        sig.bind(**args)
    except TypeError as e:
        return f"{name}: {e}"
    for key, value in args.items():
        p = sig.parameters.get(key)
        kind = None if p is None else _json_type(p.annotation)
        if kind and not _type_ok(kind, value) and not (value is None and p.default is None):
            return f"{name}: argument {key!r} must be a JSON {kind}, got {json.dumps(value)[:60]}"
    return None


class ToolTimeout(BaseException):
    """Raised inside a tool that ran past its time (a BaseException: the tool's `except Exception` keeps it)."""


@contextlib.contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    """Stop the block with ToolTimeout after `seconds` (SIGALRM: the main thread of a POSIX process;
    elsewhere no limit)."""
    if seconds <= 0 or not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        raise ToolTimeout

    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _clip(text: str) -> str:
    if len(text) <= MAX_RESULT_CHARS:
        return text
    return text[:MAX_RESULT_CHARS] + f"... [cut: {len(text)} characters in all]"


def call_tool(funcs: dict[str, Callable], name: str, arguments: str | dict, timeout: float = TOOL_TIMEOUT_S) -> str:
    """Run one call; what goes back to the model is the result as text, or the error (as a tool
    reports a failure to an agent), at most MAX_RESULT_CHARS long."""
    if name not in funcs:
        return f"error: no tool named {name!r}; the tools are {', '.join(sorted(funcs))}"[:MAX_RESULT_CHARS]
    try:
        args = json.loads(arguments) if isinstance(arguments, str) else arguments
    except (ValueError, RecursionError):
        return f"error: the arguments of {name} are not JSON; write them as a JSON object"
    if not isinstance(args, dict):
        return f"error: the arguments of {name} must be a JSON object, got {type(args).__name__}"
    problem = _argument_problem(name, funcs[name], args)
    if problem:
        return _clip(f"error: {problem}")
    try:
        with _time_limit(timeout):
            result = funcs[name](**args)
        text = result if isinstance(result, str) else json.dumps(result, ensure_ascii=False, default=str)
    except ToolTimeout:
        return f"error: {name} did not return within {timeout:g} s and was stopped"
    except (Exception, SystemExit) as e:  # noqa: BLE001 - the model sees the tool's failure, the session goes on
        text = f"error: {type(e).__name__}: {e}"
    return _clip(text)
