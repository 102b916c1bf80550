"""The import rules of docs/ARCHITECTURE.md, enforced on the source (``ast``, nothing is imported).

Each folder may import only what its row of ALLOWED lists (plus the standard library and third-party
packages); no module imports an underscore name from another module. KNOWN lists the violations that
exist today in code owned elsewhere (each with its reason): the test fails on any NEW violation, and
also when a known one is gone, so the list only shrinks.
"""
from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "lowrank_lib"

CORE = {"geometry", "factorized", "ranks", "data", "models", "attention_mass", "generation", "families", "codecs",
        "compat", "tokentext"}
#: unit (top-level module or package of lowrank_lib) -> units it may import
ALLOWED: dict[str, set[str]] = {
    "geometry": set(), "attention_mass": set(), "codecs": set(), "tokentext": set(),
    "compat": set(), "executor": set(),     # leaves: transformers' calling convention; the sweep executor
    "generation": {"tokentext"},        # answer() decodes without U+FFFD
    "families": set(),          # names its implementations as "module:function" strings, imported on use
    "ranks": {"families"},
    "factorized": {"ranks"}, "data": {"models"},
    "models": {"factorized", "ranks", "geometry", "formats"},   # formats' safetensors checker, for the cache
    "compress": CORE,
    "formats": CORE,
    "runtime": {"factorized", "generation", "geometry", "compat"},
    "hf": {"geometry", "compat"},
    "attsvd": CORE,
    "eviction": CORE,
    # the composed cache's math writes its fit as the tiered state's segments (kv.tiers, a leaf module)
    "composed": CORE | {"attsvd", "eviction", "kv.tiers"},
    # KV methods (one class each), their registry, the tiered state and the two adapters
    "kv": CORE | {"hf", "attsvd", "eviction", "composed", "runtime.kv", "runtime.kernels"},
    "eval": CORE | {"compress", "formats", "runtime", "hf", "attsvd", "eviction", "composed", "kv", "families",
                    "executor"},
    "bench": CORE | {"compress", "formats", "runtime", "hf", "attsvd", "eviction", "composed", "kv", "eval",
                     "families", "executor"},
    "explore": CORE | {"compress", "eval", "hf", "attsvd", "kv", "figures"},   # the notebooks' sliders
    "figures": set(),           # the notebooks' figure check (a leaf: matplotlib only)
    "notebooks": None,          # the notebook runner may import anything
    "__init__": None,           # the package root re-exports the core API
}

#: (importing file, imported module or name) that break a rule today, and why they are still here
KNOWN: dict[tuple[str, str], str] = {}


def _unit(rel: Path) -> str:
    return rel.parts[0].removesuffix(".py") if len(rel.parts) > 1 or rel.name != "__init__.py" else "__init__"


def _imports(path: Path):
    """(absolute module, imported names) of every import in the file, relative imports resolved."""
    rel = path.relative_to(PKG.parent)
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
    if parts[1] == "kv" and len(parts) > 2 and parts[2] == "tiers":
        return ["kv.tiers"]
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
    assert _target("lowrank_lib.kv.tiers", ["Segment"]) == ["kv.tiers"]
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
