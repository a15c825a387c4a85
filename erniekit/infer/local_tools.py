"""`erniekit chat --tools tools.py`: the public functions of a Python file become tools the model
may call; their calls run here and the results go back to the model (an agent round trip).

A function's schema comes from its signature: parameters annotated int / float / bool / str /
list / dict map to JSON types, the first docstring line is the description."""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
from typing import Any, Callable

from erniekit.errors import ConfigError

_JSON_TYPES = {int: "integer", float: "number", bool: "boolean", str: "string", list: "array", dict: "object"}


def tool_schema(name: str, fn: Callable) -> dict:
    """The OpenAI tool entry of a Python function."""
    props, required = {}, []
    for p in inspect.signature(fn).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        kind = _JSON_TYPES.get(p.annotation if p.annotation is not p.empty else str, "string")
        props[p.name] = {"type": kind}
        if p.default is p.empty:
            required.append(p.name)
    fn_entry: dict[str, Any] = {
        "name": name,
        "parameters": {"type": "object", "properties": props, "required": required},
    }
    doc = inspect.getdoc(fn)
    if doc:
        fn_entry["description"] = doc.splitlines()[0]
    return {"type": "function", "function": fn_entry}


def load_tools(path: str) -> tuple[list[dict], dict[str, Callable]]:
    """(tool schemas, name -> function) of the public functions defined in the file at `path`."""
    if not os.path.isfile(path):
        raise ConfigError(f"--tools {path}: file not found; pass a Python file defining the tool functions")
    spec = importlib.util.spec_from_file_location("erniekit_user_tools", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)  # the user's own file, run as `python tools.py` would
    except Exception as e:  # noqa: BLE001 - any error in user code is reported in one line
        raise ConfigError(f"--tools {path}: importing it failed ({type(e).__name__}: {e})") from None
    funcs = {
        n: f
        for n, f in vars(module).items()
        if inspect.isfunction(f) and f.__module__ == module.__name__ and not n.startswith("_")
    }
    if not funcs:
        raise ConfigError(f"--tools {path}: defines no public functions; each top-level def becomes a tool")
    return [tool_schema(n, f) for n, f in funcs.items()], funcs


def call_tool(funcs: dict[str, Callable], name: str, arguments: str | dict) -> str:
    """Run one call; what goes back to the model is the result as text, or the error (as a tool
    reports a failure to an agent)."""
    if name not in funcs:
        return f"error: no tool named {name!r}"
    try:
        args = json.loads(arguments) if isinstance(arguments, str) else arguments
        result = funcs[name](**args)
    except Exception as e:  # noqa: BLE001 - the model sees the tool's failure, the session goes on
        return f"error: {type(e).__name__}: {e}"
    return result if isinstance(result, str) else json.dumps(result, ensure_ascii=False)
