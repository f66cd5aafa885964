"""The house's structure, read from the code: the layers and who may import whom, the map
in docs/layout.md, module sizes, and no runtime class surgery. Nothing here runs a model.

An exception to a rule is listed by name with the issue that removes it, and a listed
exception the code no longer needs fails the test too: the lists can only shrink."""

import ast
import graphlib
import re
from functools import lru_cache
from pathlib import Path

import pytest

import edgemoe

ROOT = Path(edgemoe.__file__).parent
REPO = ROOT.parent

# the layers, lowest first; a module imports its own package and lower layers only (every
# other module, the entry points, serving and the what-if room included, is a tool: the top
# layer)
LAYERS = ({"format", "kernels", "machines"}, {"streaming", "routing"},
          {"hub", "distributed", "options", "load_plan"}, {"mlx_backend", "cuda"})
APART = {("streaming", "routing"), ("routing", "streaming")}  # same layer, no imports

BACKENDS = {"mlx", "mlx_lm", "torch", "transformers", "triton"}  # the frameworks
# what no backend owns: it imports no framework, and nothing that does
BACKEND_FREE = ("edgemoe.format", "edgemoe.streaming", "edgemoe.routing", "edgemoe.hub",
                "edgemoe.options", "edgemoe.load_plan", "edgemoe.machines",
                "edgemoe.whatif.replay", "edgemoe.whatif.questions",
                "edgemoe.whatif.experimental")
NOT_YET_BACKEND_FREE = {}

# serving's engine side: it runs requests, whatever API they came in by (http runs one
# request of any API; canonical is the one request every API's parser produces)
ENGINE = tuple(f"edgemoe.serving.{name}" for name in (
    "engine", "job", "sampling", "speculation", "prompt_cache", "metrics", "lockstep",
    "http", "canonical"))
DIALECTS = tuple(f"edgemoe.serving.{name}" for name in (
    "openai", "openai_view", "anthropic", "ollama", "responses", "responses_view"))

# what decodes and serves, and the room for what-if questions (replays, cache simulation,
# the learned policy, the twin: one package, and cache_sim, its command line), which
# imports it
RUNTIME = ("edgemoe.format", "edgemoe.streaming", "edgemoe.routing", "edgemoe.mlx_backend",
           "edgemoe.cuda", "edgemoe.serving", "edgemoe.kernels", "edgemoe.load_plan",
           "edgemoe.options", "edgemoe.hub", "edgemoe.distributed", "edgemoe.machines",
           "edgemoe.sampling_params", "edgemoe.generate", "edgemoe.server")
WHAT_IF = ("edgemoe.whatif", "edgemoe.cache_sim")
NOT_YET_APART = {}

MAX_LINES = 400  # a product module's; a longer one is split by job
NOT_YET_SHORT = {  # module: the issue that splits it
}


def within(module: str, places) -> bool:
    """Whether `module` is one of `places` (modules or packages) or inside one."""
    return any(module == p or module.startswith(p + ".") for p in places)


@lru_cache(maxsize=None)
def package_modules() -> dict:
    """{module name: its file}: the package's modules (edgemoe.kernels is the repository's
    kernels/; the bundled models' folder holds no code)."""
    files = {".".join(("edgemoe",) + f.relative_to(ROOT).with_suffix("").parts): f
             for f in ROOT.rglob("*.py") if "models" not in f.relative_to(ROOT).parts}
    files.update({f"edgemoe.kernels.{f.stem}": f for f in (REPO / "kernels").glob("*.py")})
    return {name.removesuffix(".__init__"): f for name, f in files.items()}


@lru_cache(maxsize=None)
def imports() -> tuple:
    """({module: the package's modules it imports}, {module: the other top-level packages
    it imports}): every import, absolute or relative, at module level or in a function."""
    modules = package_modules()

    def module_of(name):  # an imported name to the module that holds it
        while name not in modules:
            name = name.rpartition(".")[0]
        return name

    graph, outside = {}, {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        ours, theirs = set(), set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                parts = package.split(".")
                base = (".".join(parts[:len(parts) + 1 - node.level] + [node.module or ""])
                        .strip(".") if node.level else node.module)
                names = ([f"{base}.{a.name}" for a in node.names]
                         if base.split(".")[0] == "edgemoe" else [base])
            else:
                continue
            for imported in names:
                if imported.split(".")[0] == "edgemoe":
                    ours.add(module_of(imported))
                else:
                    theirs.add(imported.split(".")[0])
        graph[name], outside[name] = ours - {name}, theirs
    return graph, outside


def package_imports() -> dict:
    return imports()[0]


def layer_of(module: str):
    """(the layer's index, the module's package below edgemoe)."""
    package = module.split(".")[1] if "." in module else ""
    return next((i for i, names in enumerate(LAYERS) if package in names),
                len(LAYERS)), package


def check(found: set, known: dict, rule: str):
    """Fail on what breaks `rule` and is not a known exception, and on a known exception
    that the code no longer has (remove it from the list)."""
    new, gone = found - set(known), set(known) - found
    assert not new, f"{rule}: {sorted(new)}"
    assert not gone, f"{rule}: no longer broken, take these off its exceptions: {sorted(gone)}"


def test_the_layers_import_downwards_only():
    """format -> streaming / routing -> hub / distributed / options / load_plan ->
    mlx_backend / cuda -> tools: no import goes up a layer (nor between streaming and routing), and no
    module imports one that imports it back, through any chain."""
    graph = package_imports()
    assert len(graph) > 60 and "edgemoe.serving.openai" in graph["edgemoe.serving.app"]
    upward = [(a, b) for a, targets in graph.items() for b in targets
              if layer_of(b)[0] > layer_of(a)[0]
              or (layer_of(a)[1], layer_of(b)[1]) in APART]
    assert upward == []
    try:
        tuple(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as e:
        pytest.fail(f"an import cycle: {' -> '.join(e.args[1])}")


def test_backend_free_modules_import_no_framework():
    """format, streaming, routing, hub, options, load_plan, machines, and the what-if
    room's replays, cache questions and learned policy import neither MLX nor PyTorch (nor
    mlx-lm, transformers, Triton), not even lazily, nor a module of the package that is not
    backend-free itself."""
    graph, outside = imports()
    free = [m for m in graph if within(m, BACKEND_FREE)]
    assert "edgemoe.format.pack" in free and "edgemoe.load_plan" in free
    found = {(m, name) for m in free for name in outside[m] & BACKENDS} | {
        (m, target) for m in free for target in graph[m] if not within(target, BACKEND_FREE)}
    check(found, NOT_YET_BACKEND_FREE, "a backend-free module imports a framework")


def test_the_engine_imports_no_dialect():
    """Serving's engine side (engine, job, sampling, speculation, prompt cache, metrics,
    lockstep, the shared HTTP server and the canonical request) imports none of the APIs (OpenAI, Anthropic, Ollama, Responses), through any
    chain."""
    graph = package_imports()
    assert all(m in graph for m in ENGINE + DIALECTS)
    found = set()
    for module in ENGINE:
        seen, todo = set(), [module]
        while todo:
            for target in graph[todo.pop()] - seen:
                seen.add(target)
                todo.append(target)
        found |= {(module, d) for d in seen if within(d, DIALECTS)}
    check(found, {}, "the engine imports a dialect")


def test_the_runtime_never_imports_the_what_if_room():
    """What decodes and serves imports nothing of the twin, replays, cache simulation and
    the experimental policies; they import the runtime (doctor, eval and the other tools
    may import both)."""
    graph = package_imports()
    runtime = [m for m in graph if within(m, RUNTIME) and not within(m, WHAT_IF)]
    assert "edgemoe.streaming.store" in runtime and {
        "edgemoe.whatif.replay", "edgemoe.whatif.experimental.learned",
        "edgemoe.whatif.twin.engine", "edgemoe.cache_sim"} <= set(graph) - set(runtime)
    found = {(m, target) for m in runtime for target in graph[m] if within(target, WHAT_IF)}
    check(found, NOT_YET_APART, "the runtime imports the what-if room")


def layout_entries() -> set:
    """The paths docs/layout.md's tree names under edgemoe/: one line an entry, two spaces
    of indent a level, a folder ending in `/`."""
    text = (REPO / "docs" / "layout.md").read_text()
    tree = re.search(r"```\n(edgemoe/\n.*?)```", text, re.S)
    assert tree, "docs/layout.md: no ``` block starting with the line `edgemoe/`"
    entries, folders = set(), []
    for line in tree.group(1).splitlines()[1:]:
        if not line.startswith("  "):
            break  # the package's tree ends where the repository's next folder begins
        depth = (len(line) - len(line.lstrip(" "))) // 2
        name = line.split()[0]
        folders[depth - 1:] = []
        path = "/".join(folders + [name.rstrip("/")])
        if name.endswith("/"):
            folders.append(name.rstrip("/"))
        entries.add(path)
    return entries


def test_the_layout_lists_every_module():
    """docs/layout.md names each module under edgemoe/ (one line on its job), and no module
    that is gone."""
    modules = {f.relative_to(ROOT).as_posix() for f in ROOT.rglob("*.py")
               if "models" not in f.relative_to(ROOT).parts}
    listed = {e for e in layout_entries() if e.endswith(".py")}
    assert not modules - listed, f"docs/layout.md lacks: {sorted(modules - listed)}"
    assert not listed - modules, f"docs/layout.md names what is gone: {sorted(listed - modules)}"


def test_the_layout_states_the_layer_rule():
    """docs/layout.md states the layers the import test enforces, in its order."""
    order = " → ".join(", ".join(sorted(names)) for names in LAYERS) + " → tools"
    assert order in (REPO / "docs" / "layout.md").read_text(), \
        f"docs/layout.md: the layer rule should read {order!r}"


def test_product_modules_stay_under_400_lines():
    """Every module under edgemoe/ holds at most 400 lines: a longer one is split by job."""
    lines = {f.relative_to(ROOT).as_posix(): len(f.read_text().splitlines())
             for f in ROOT.rglob("*.py") if "models" not in f.relative_to(ROOT).parts}
    check({m for m, n in lines.items() if n > MAX_LINES}, NOT_YET_SHORT,
          f"a module over {MAX_LINES} lines")


def test_no_runtime_class_surgery():
    """No `object.__setattr__` and no assignment to `__class__` in the package: a module
    holds what must not be a parameter in a plain object, and the model is built with its
    streaming parts. Allowed: the package's own class (edgemoe/__init__.py keeps
    `edgemoe.generate` the function: the import system binds a submodule over it)."""
    root = Path(edgemoe.__file__).parent
    allowed = {("__init__.py", "<module>")}
    found = set()
    for source in root.rglob("*.py"):
        if "models" in source.relative_to(root).parts:
            continue  # (the bundled models' folder holds no code of the package)
        where = source.relative_to(root).as_posix()
        tree = ast.parse(source.read_text())
        functions = {id(n): f.name for f in ast.walk(tree)
                     if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                     for n in ast.walk(f)}
        for node in ast.walk(tree):
            function = functions.get(id(node), "<module>")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr == "__setattr__" \
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "object":
                found.add((where, function, "object.__setattr__"))
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            if any(isinstance(t, ast.Attribute) and t.attr == "__class__" for t in targets):
                if (where, function) not in allowed:
                    found.add((where, function, "__class__ ="))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                    and node.func.id == "setattr" and len(node.args) > 1 \
                    and isinstance(node.args[1], ast.Constant) and node.args[1].value == "__class__":
                found.add((where, function, "setattr __class__"))
    assert not found, sorted(found)


