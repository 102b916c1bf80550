"""The import rules of docs/ARCHITECTURE.md, enforced on the source (``ast``, nothing is imported).

Each folder may import only what its row of ALLOWED lists (plus the standard library and third-party
packages); no module imports an underscore name from another module. KNOWN lists the violations that
exist today (each with its reason): the test fails on any NEW violation, and
also when a known one is gone, so the list only shrinks.
"""
from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "lowrank_lib"

CORE = {"geometry", "factorized", "ranks", "data", "models", "attention_mass", "generation", "families", "codecs",
        "compat", "tokentext", "quant"}
#: unit (top-level module or package of lowrank_lib) -> units it may import
ALLOWED: dict[str, set[str]] = {
    "geometry": set(), "attention_mass": set(), "codecs": set(), "tokentext": set(),
    "compat": set(), "executor": set(), "quant": set(),     # leaves: calling convention, sweep executor, quant codes
    "timing": set(),            # the one timing helper (interleaved rounds, medians): a leaf
    "host": {"timing"},         # the host facts every measurement records (CPU, bandwidth, load, RSS)
    "generation": {"tokentext"},        # answer() decodes without U+FFFD
    "families": set(),          # names its implementations as "module:function" strings, imported on use
    "ranks": {"families"},
    "factorized": {"ranks", "quant"}, "data": {"models"},
    "models": {"factorized", "ranks", "geometry", "formats"},   # formats' safetensors checker, for the cache
    "compress": CORE | {"host"},   # the memory available: when calibration statistics spill to disk
    "formats": CORE,
    "resolve": CORE | {"compress", "formats", "host"},   # (dense, compressed, tokenizer) from MODEL and CHECKPOINT
    "synthetic": CORE | {"compress", "formats"},   # every family's native file at a real shape, random weights
    "runtime": {"factorized", "generation", "geometry", "compat", "timing", "quant", "ranks", "host"},
    "hf": {"geometry", "compat"},
    "attsvd": CORE,
    "eviction": CORE,
    # KV methods (one class each, the composed cache's math with its method), their registry, the tiered state
    # and the two adapters
    "kv": CORE | {"hf", "attsvd", "eviction", "runtime.kv", "runtime.kernels"},
    "eval": CORE | {"compress", "formats", "runtime", "hf", "attsvd", "eviction", "kv", "families", "executor",
                    "timing", "host", "resolve"},    # resolve: the checkpoint you bring, through the model cache
    "bench": CORE | {"compress", "formats", "runtime", "hf", "attsvd", "eviction", "kv", "eval", "families",
                     "executor", "timing", "synthetic", "resolve", "host"},
    "explore": CORE | {"compress", "eval", "hf", "attsvd", "kv", "figures", "host"},   # the notebooks' sliders
    "figures": set(),           # the notebooks' figure check (a leaf: matplotlib only)
    "notebooks": None,          # the notebook runner may import anything
    "__init__": None,           # the package root re-exports the core API
}

#: (importing file, imported module or name) that break a rule today, and why they are still here
KNOWN: dict[tuple[str, str], str] = {
    ("eval/ik_llamacpp.py", "ik_llama_cpp._ctypes_api"):
        "ik-llama-cpp-python's public IkLlama samples inside its own loop; its ctypes binding of llama.h (ik_llama.cpp's "
        "public C API) is the only per-token interface, and its struct layouts are the fork's, not mainline's",
}


def _unit(rel: Path) -> str:
    return rel.parts[0].removesuffix(".py") if len(rel.parts) > 1 or rel.name != "__init__.py" else "__init__"


def _imports(path: Path, base: Path = PKG.parent):
    """(absolute module, imported names) of every import in the file, relative imports resolved (``base``: the
    folder holding the package)."""
    rel = path.relative_to(base)
    pkg = list(rel.parts[:-1])                     # the package the file lives in, e.g. lowrank_lib/attsvd
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, []
        elif isinstance(node, ast.ImportFrom):
            base = pkg[: len(pkg) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            yield mod, [a.name for a in node.names]


def _target(mod: str, names: list[str]) -> list[str]:
    """The lowrank_lib units an import reaches ('runtime.kv' kept apart: attsvd may import it alone)."""
    parts = mod.split(".")
    if parts[0] != "lowrank_lib":
        return []
    if len(parts) == 1:                            # from lowrank_lib import models, account, ...
        return [n for n in names if (PKG / f"{n}.py").exists() or (PKG / n).is_dir()] or ["__init__"]
    if parts[1] == "runtime" and len(parts) > 2 and parts[2] in ("kv", "kernels"):
        return [f"runtime.{parts[2]}"]
    if parts[1] == "runtime" and len(parts) == 2 and names and all(n == "kv" for n in names):
        return ["runtime.kv"]
    return [parts[1]]


def violations() -> dict[tuple[str, str], str]:
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG)
        unit = _unit(rel)
        allowed = ALLOWED.get(unit, set())
        for mod, names in _imports(path):
            for t in _target(mod, names):
                if t.split(".")[0] != unit and allowed is not None and t not in allowed and \
                        not ("." in t and t.split(".")[0] in allowed):
                    out[(str(rel), mod)] = f"{unit}/ may not import {t}"
            own = ".".join(["lowrank_lib", *rel.with_suffix("").parts]).removesuffix(".__init__")
            for n in names:
                if n.startswith("_") and not n.startswith("__") and mod != own:
                    out[(str(rel), f"{mod}.{n}")] = f"private name {n} imported from {mod}"
    return out


def test_import_rules_hold():
    found = violations()
    new = {k: v for k, v in found.items() if k not in KNOWN}
    assert not new, "import rules of docs/ARCHITECTURE.md broken:\n" + "\n".join(f"  {f}: {m} ({why})"
                                                                              for (f, m), why in new.items())
    gone = set(KNOWN) - set(found)
    assert not gone, f"fixed, remove from KNOWN: {sorted(gone)}"


def test_every_unit_has_a_rule():
    units = {_unit(p.relative_to(PKG)) for p in PKG.rglob("*.py")}
    assert units <= set(ALLOWED), f"add a row to ALLOWED (and docs/ARCHITECTURE.md) for {units - set(ALLOWED)}"


def test_the_checker_sees_a_violation():
    """The parser resolves relative imports: a runtime module importing attsvd would be caught."""
    assert _target("lowrank_lib.attsvd.basis", ["compress_prefill"]) == ["attsvd"]
    assert _target("lowrank_lib.runtime.kv", ["KVSpec"]) == ["runtime.kv"]
    assert _target("lowrank_lib.kv.tiers", ["Segment"]) == ["kv"]
    assert _target("lowrank_lib", ["models", "account"]) == ["models"]
    rel = list(_imports(PKG / "kv" / "engine_adapter.py"))
    assert ("lowrank_lib.runtime.kv", ["KVSpec", "StepContext"]) in rel


def test_optional_extras_are_not_imported_by_the_packages():
    """matplotlib (the notebooks extra) is imported when a plot is drawn, not with lowrank_lib.figures."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['matplotlib'] = None; sys.modules['matplotlib.pyplot'] = None\n"
            "import lowrank_lib.attsvd, lowrank_lib.figures, lowrank_lib.runtime, lowrank_lib.eval, "
            "lowrank_lib.bench.cli, lowrank_lib.eviction, lowrank_lib.hf\n"
            "from lowrank_lib.bench.cli import parser; parser()\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


# --------------------------------------------------------------------------- no import cycle anywhere
def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _module_level_imports(tree: ast.Module) -> list[ast.stmt]:
    """The import statements executed when the module is imported: module level, inside module-level ``if`` /
    ``try`` / ``with`` blocks and class bodies; NOT inside functions (lazy imports run on call, after every module
    finished importing, so they cannot close a cycle at import time) and not under ``if TYPE_CHECKING:``."""
    out: list[ast.stmt] = []

    def walk(body):
        for n in body:
            if isinstance(n, (ast.Import, ast.ImportFrom)):
                out.append(n)
            elif isinstance(n, ast.If):
                if not (isinstance(n.test, (ast.Name, ast.Attribute))
                        and ast.unparse(n.test).endswith("TYPE_CHECKING")):
                    walk(n.body)
                walk(n.orelse)
            elif isinstance(n, (ast.Try, ast.With, ast.ClassDef)):
                walk(n.body)
                for h in getattr(n, "handlers", []):
                    walk(h.body)
                walk(getattr(n, "orelse", []))
                walk(getattr(n, "finalbody", []))

    walk(tree.body)
    return out


def module_graph(root: Path = PKG) -> dict[str, set[str]]:
    """module -> the modules of the package under ``root`` its import executes (a package is its ``__init__``).

    Relative imports are resolved; ``from package import module`` reaches that module; importing ``a.b.c`` from
    outside ``a.b`` also runs ``a.b`` and ``a`` (their ``__init__``), so those are edges too (from inside a package
    its own ``__init__`` is already running, so it is not)."""
    files = {_module_name(p, root): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        edges: set[str] = set()
        for node in _module_level_imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                parts = pkg.split(".")
                base = parts[: len(parts) - node.level + 1] if node.level else []
                src = ".".join(base + ([node.module] if node.module else []))
                targets = [f"{src}.{a.name}" if f"{src}.{a.name}" in files else src for a in node.names]
            for t in targets:
                while t not in files and "." in t:          # a name inside a module: the module
                    t = t.rpartition(".")[0]
                if t not in files:
                    continue                                  # outside the package
                edges.add(t)
                up = t
                while "." in up:
                    up = up.rpartition(".")[0]
                    if up in files and not (mod == up or mod.startswith(up + ".")):
                        edges.add(up)
        edges.discard(mod)
        graph[mod] = edges
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
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


def test_no_import_cycle_between_modules():
    """No module of lowrank_lib can reach itself through the imports executed at import time (``module_graph``:
    imports inside functions are excluded, see ``_module_level_imports``)."""
    cycles = find_cycles(module_graph())
    assert not cycles, "import cycles:\n" + "\n".join("  " + " <-> ".join(c) for c in cycles)


def unit_graph() -> dict[str, set[str]]:
    """unit (top-level module or package) -> the units it imports, lazy imports INCLUDED (``_imports`` walks every
    import): a cycle between packages hidden by a lazy import is still one."""
    g: dict[str, set[str]] = {}
    for path in sorted(PKG.rglob("*.py")):
        unit = _unit(path.relative_to(PKG))
        for mod, names in _imports(path):
            for t in _target(mod, names):
                if t.split(".")[0] != unit:
                    g.setdefault(unit, set()).add(t.split(".")[0])
    return g


def test_no_package_cycle():
    """No unit of lowrank_lib imports, even lazily, a unit that imports it back (the composed cache's math and
    ``kv`` did, hidden by ``kv/__init__``'s lazy names, until the math moved into ``kv/methods/composed``)."""
    cycles = find_cycles(unit_graph())
    assert not cycles, "package cycles:\n" + "\n".join("  " + " <-> ".join(c) for c in cycles)


def test_the_cycle_checker_sees_a_cycle(tmp_path):
    """The parser resolves relative imports, ``from package import module`` and package ``__init__``s, and
    the search finds a cycle through them (and none where the import is lazy)."""
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []
    pkg = tmp_path / "p"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from . import leaf\n")
    (pkg / "sub" / "leaf.py").write_text("from ..top import x\n")
    (pkg / "top.py").write_text("import typing\nif typing.TYPE_CHECKING:\n    from .lazy import y\n"
                                "def f():\n    from .lazy import y\n")
    (pkg / "lazy.py").write_text("from .top import f\n")
    g = module_graph(pkg)
    assert g["p.sub"] == {"p.sub.leaf"} and g["p.sub.leaf"] == {"p.top"} and g["p.top"] == set()
    assert find_cycles(g) == []
    (pkg / "top.py").write_text("from .sub.leaf import z\n")         # top -> p.sub (its __init__) -> leaf -> top
    assert find_cycles(module_graph(pkg)) == [["p.sub", "p.sub.leaf", "p.top"]]


# --------------------------------------------------------------------------- bench/ is a client of the library
BENCH = PKG / "bench"

#: (bench file, what it uses) that is not public today, and why it is still here (owned by the bench rewrite; the
#: list only shrinks: the test fails when an entry is fixed and still listed)
BENCH_KNOWN: dict[tuple[str, str], str] = {}


def _public_names(module: str) -> set[str] | None:
    """``__all__`` of a lowrank_lib module (imported), or None when it declares none."""
    import importlib

    return set(getattr(importlib.import_module(module), "__all__", None) or ()) or None


def bench_private_uses(bench: Path | None = None) -> dict[tuple[str, str], str]:
    """(bench file, name) -> why it is not a public use: a ``from lowrank_lib.X import name`` (X outside bench/)
    whose name is neither in X's ``__all__`` nor a public submodule of X, and any ``obj._attr`` on an object other
    than ``self`` / ``cls`` or an imported third-party module."""
    out = {}
    bench = bench or BENCH
    for path in sorted(bench.rglob("*.py")):
        rel = str(path.relative_to(bench.parent))
        tree = ast.parse(path.read_text(), str(path))
        third_party = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                third_party |= {(a.asname or a.name).split(".")[0] for a in node.names
                                if not a.name.startswith("lowrank_lib")}
            elif isinstance(node, ast.ImportFrom) and not node.level and not (node.module or "").startswith(
                    "lowrank_lib"):
                third_party |= {a.asname or a.name for a in node.names}
        for mod, names in _imports(path, bench.parent.parent):
            if not mod.startswith("lowrank_lib") or mod == "lowrank_lib.bench" or mod.startswith("lowrank_lib.bench."):
                continue
            public = _public_names(mod)
            for n in names:
                sub = PKG.parent.joinpath(*mod.split("."), n)
                if (sub.with_suffix(".py").exists() or (sub / "__init__.py").exists()) and not n.startswith("_"):
                    continue                                   # a public module of the package
                if public is None or n not in public:
                    out[(rel, f"{mod}.{n}")] = (f"{mod} declares no __all__" if public is None
                                                 else f"{n} is not in {mod}.__all__")
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                root = node.value
                while isinstance(root, ast.Attribute):
                    root = root.value
                if isinstance(root, ast.Name) and (root.id in ("self", "cls") and root is node.value
                                                   or root.id in third_party):
                    continue
                out[(rel, ast.unparse(node))] = "an underscore attribute of an object bench/ does not own"
    return out


def test_bench_uses_public_names_only():
    found = bench_private_uses()
    new = {k: v for k, v in found.items() if k not in BENCH_KNOWN}
    assert not new, "bench/ reaches past the library's public names:\n" + "\n".join(
        f"  {f}: {n} ({why})" for (f, n), why in sorted(new.items()))
    gone = set(BENCH_KNOWN) - set(found)
    assert not gone, f"fixed, remove from BENCH_KNOWN: {sorted(gone)}"


def test_the_bench_checker_sees_private_uses(tmp_path):
    """A private import and an underscore attribute of a foreign object are caught; self's and torch's are not."""
    fake = tmp_path / "lowrank_lib" / "bench"
    fake.mkdir(parents=True)
    (fake / "x.py").write_text("import torch\nfrom lowrank_lib.runtime import Engine, graphs\n"
                               "from lowrank_lib.runtime.engine import _rms\nfrom lowrank_lib.kv import METHODS\n"
                               "class A:\n    def f(self, eng):\n        self._a = torch._dynamo\n"
                               "        return eng.kv._t_dev, eng._B\n")
    found = {n for (_, n) in bench_private_uses(fake)}
    assert found == {"lowrank_lib.runtime.engine._rms", "eng.kv._t_dev", "eng._B"}, found


#: issue 26: bench/ is a thin client of the library, at most this many lines (measurement code belongs in runtime/ or
#: eval/, where notebooks can use it too)
BENCH_MAX_LINES = 3000


def test_bench_stays_a_thin_client():
    lines = {p.relative_to(BENCH).as_posix(): len(p.read_text().splitlines()) for p in sorted(BENCH.rglob("*.py"))}
    total = sum(lines.values())
    assert total <= BENCH_MAX_LINES, (f"bench/ has {total} lines (at most {BENCH_MAX_LINES}); the largest: "
                                      + ", ".join(f"{f} {n}" for f, n in sorted(lines.items(), key=lambda x: -x[1])[:5]))


# --------------------------------------------------------------------------- written protocols, no probing
#: names under which the library holds a runner (``runtime.runner.Runner``), a KV method, a KV store
#: (``runtime.kv.KVStore``), an attention backend (``runtime.backend``) or a projection group: what they can do is
#: their protocol's (or their declared capabilities), never found out with hasattr / getattr
PROTOCOL_NAMES = {"runner", "engine", "eng", "method", "spec", "store", "kv", "backend", "group"}


def protocol_probes(root: Path) -> list[str]:
    """``file:line`` of every ``hasattr(x, ...)`` / ``getattr(x, ...)`` under ``root`` whose ``x`` is a name in
    :data:`PROTOCOL_NAMES` (or ``x.runner`` and the like)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("hasattr", "getattr")
                    and node.args):
                x = node.args[0]
                name = x.id if isinstance(x, ast.Name) else x.attr if isinstance(x, ast.Attribute) else None
                if name in PROTOCOL_NAMES:
                    found.append(f"{path.relative_to(root.parent).as_posix()}:{node.lineno}")
    return found


def test_runners_and_methods_are_never_probed():
    assert protocol_probes(PKG) == [], "use (or extend) the written protocol instead of probing"


def test_the_probe_checker_sees_a_probe(tmp_path):
    pkg = tmp_path / "p"
    pkg.mkdir()
    (pkg / "a.py").write_text("def f(runner, self, x):\n    return hasattr(runner, 'prepare'), "
                              "getattr(self.method, 'fields', None), getattr(x, 'y', 0)\n")
    assert protocol_probes(pkg) == ["p/a.py:2", "p/a.py:2"]


# --------------------------------------------------------------------------- capabilities, not backend names
def backend_names(root: Path) -> set[str]:
    """Every registered backend's name: the first argument of each ``Backend("...", ...)`` call under ``root``."""
    names = set()
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Backend"
                    and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
                names.add(node.args[0].value)
    return names


def name_choices(root: Path, names: set[str]) -> list[str]:
    """``file:line`` of every comparison of an attribute ``x.name`` with a string in ``names`` (``==``, ``!=``,
    ``in`` / ``not in`` a literal tuple, list or set): behaviour chosen by a backend's name."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            if not any(isinstance(x, ast.Attribute) and x.attr == "name" for x in sides):
                continue
            consts = [c for x in sides for c in ((x,) if isinstance(x, ast.Constant) else
                                                getattr(x, "elts", ()) if isinstance(x, (ast.Tuple, ast.List, ast.Set))
                                                else ())]
            if any(isinstance(c, ast.Constant) and c.value in names for c in consts):
                found.append(f"{path.relative_to(root.parent).as_posix()}:{node.lineno}")
    return found


def test_no_behaviour_is_chosen_by_a_backend_name():
    names = backend_names(PKG)
    assert {"lrk_attend", "lrk_tiers", "sdpa", "portable"} <= names, names
    assert name_choices(PKG, names) == [], "read the backend's declared capabilities (BackendCaps) instead"


def test_the_name_checker_sees_a_choice(tmp_path):
    pkg = tmp_path / "p"
    pkg.mkdir()
    (pkg / "a.py").write_text("B = Backend('fast', f)\n"
                              "def f(store, mode):\n"
                              "    return store.backend.name != 'fast', mode == 'fast', 'fast' in (store.name,), "
                              "store.name in ('slow', 'fast')\n")
    assert backend_names(pkg) == {"fast"}
    assert name_choices(pkg, {"fast"}) == ["p/a.py:3", "p/a.py:3"]
