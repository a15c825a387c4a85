"""The package's import structure (../shared/DESIGN.md "Layout", issue #24): no import cycles between
modules, and the layering holds. Read from the source with `ast`, imports inside functions included,
so a cycle hidden in a function-local import counts too."""

import ast
import os
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[3])
PKG = os.path.join(ROOT, "erniekit")


def _modules() -> dict[str, str]:
    out = {}
    for d, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(d, f), ROOT)[:-3].replace(os.sep, ".")
                out[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = os.path.join(d, f)
    return out


def _imports(mods: dict[str, str]) -> dict[str, set[str]]:
    """module -> the erniekit modules it imports (a `from pkg import name` counts pkg.name when
    that is a module, else pkg); TYPE_CHECKING-only imports are skipped."""
    graph = {}
    for mod, path in mods.items():
        tree = ast.parse(open(path, encoding="utf-8").read())
        skip = {
            id(n)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.dump(node.test)
            for n in ast.walk(node)
        }
        deps = set()
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.startswith("erniekit")}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("erniekit"):
                for a in node.names:
                    deps.add(f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods else node.module)
        graph[mod] = {d for d in deps if d in mods and d != mod}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


GRAPH = _imports(_modules())


def test_no_import_cycles():
    assert _cycles(GRAPH) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _layer(mod: str) -> str:
    return mod.split(".")[1] if mod.count(".") else mod


def test_layering():
    """models and nn never import train, config, cli; train never imports cli; stages never import each other."""
    bad = []
    for mod, deps in GRAPH.items():
        for d in deps:
            if _layer(mod) in ("models", "nn") and _layer(d) in ("train", "config", "cli", "rl", "distributed"):
                bad.append((mod, d))
            if _layer(mod) == "train" and d == "erniekit.cli":
                bad.append((mod, d))
            if mod.startswith("erniekit.train.stages.") and d.startswith("erniekit.train.stages."):
                bad.append((mod, d))
    assert bad == []


def test_distributed_never_imports_train():
    """The PS server and worker get the optimizer and the stop signal from the training side
    (launch_entry is the launched processes' entry point: it starts the CLI)."""
    assert [
        (m, d)
        for m, deps in GRAPH.items()
        for d in deps
        if _layer(m) == "distributed" and _layer(d) in ("train", "cli") and m != "erniekit.distributed.launch_entry"
    ] == []


def test_models_are_built_loaded_and_saved_through_the_family_registry():
    """Outside erniekit/models/ no module imports a family's checkpoint io or its registration:
    a checkpoint's model_type picks the code (erniekit/models/registry.py)."""
    family_io = {"checkpoint", "family"}
    assert [
        (m, d)
        for m, deps in GRAPH.items()
        for d in deps
        if _layer(m) != "models" and d.startswith("erniekit.models.") and d.rsplit(".", 1)[-1] in family_io
    ] == []


_CONFIG_PATH_PROBE = r"""
import json, os, sys
from erniekit import cli
from erniekit.config.schema import TrainConfig
import erniekit
PKG = os.path.dirname(erniekit.__file__)
seen, done = {}, []

def holds_config(frame):
    return any(isinstance(v, TrainConfig) for v in frame.f_locals.values())

def probe(frame, event, arg):
    if done or event not in ("call", "return"):
        return
    path = frame.f_code.co_filename
    if not path.startswith(PKG):
        return
    if frame.f_code.co_name == "step" and path.endswith(os.path.join("train", "optim.py")):
        done.append(1)  # the first optimizer step: what is on the stack counts too
        f = frame
        while f is not None:
            if f.f_code.co_filename.startswith(PKG) and holds_config(f):
                seen.setdefault(os.path.relpath(f.f_code.co_filename, PKG), f.f_code.co_name)
            f = f.f_back
        return
    if holds_config(frame):
        seen.setdefault(os.path.relpath(path, PKG), frame.f_code.co_name)

sys.setprofile(probe)
cli.main(["train", "examples/configs/tiny/sft.yaml", "max_steps=1", "do_eval=false", "save_steps=100",
          "disable_tqdm=true", "output_dir=" + sys.argv[1]])
sys.setprofile(None)
print("FILES " + json.dumps(seen))
"""


def test_the_config_reaches_the_first_step_through_at_most_12_files(tmp_path):
    """Issue #24: following the run config from `erniekit train` to the first optimizer step (every
    erniekit frame that holds a TrainConfig) touches at most 12 files; nn/ and models/ get their own
    section or a model config, never the run config."""
    import json
    import subprocess
    import sys

    probe = tmp_path / "probe.py"
    probe.write_text(_CONFIG_PATH_PROBE)
    out = subprocess.run(
        [sys.executable, str(probe), str(tmp_path / "run")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    files = json.loads(out.stdout.split("FILES ", 1)[1])
    assert {"cli.py", "train/run.py", "train/loop.py", "train/stages/sft.py"} <= set(files), (
        files
    )  # the probe saw the path
    assert not [f for f in files if f.startswith(("nn/", "models/"))], files
    assert len(files) <= 12, sorted(files)


def test_no_function_in_train_is_over_60_lines():
    """The training side stays readable: a long function there is a sign of a mode growing a branch."""
    long = []
    for mod, path in _modules().items():
        if _layer(mod) != "train":
            continue
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60:
                long.append((mod, node.name, node.end_lineno - node.lineno + 1))
    assert long == []
