"""The one family registry: every reference resolves, one spelling per family, aliases, knobs, and the views of it."""
from __future__ import annotations

import math

import pytest

from lowrank_lib import families
from lowrank_lib.families import UnknownFamily


def test_every_reference_resolves_and_formats_have_both_directions():
    for f in families.FAMILIES.values():
        for ref in ("compressor", "reader", "writer"):
            if getattr(f, ref):
                assert callable(getattr(f, f"{ref}_fn")), (f.name, ref)
        fmt = families.FAMILIES[f.format]
        assert fmt.reader and fmt.writer, (f.name, f.format)
        assert set(fmt.notes) == {"U", "V", "sigma", "ratio", "container"}
        assert math.isclose(f.from_keep(f.to_keep(0.3)), 0.3)


def test_one_spelling_and_aliases():
    assert families.canonical("dobi_remap") == families.canonical("Dobi-Remap") == "dobi-remap"
    assert families.canonical("basis-sharing") == "basis_sharing"
    assert families.canonical("SVD-LLM") == "svdllm" and families.canonical("svdllm-v2") == "svdllm_v2"
    assert families.get_format("svdllm_v2").name == "svdllm" and families.get_format("svd").name == "lowrank"
    with pytest.raises(UnknownFamily, match=r"unknown family 'nope'; known: svd, asvd, svdllm"):
        families.get("nope")
    with pytest.raises(UnknownFamily):
        families.get_format(None)
    with pytest.raises(UnknownFamily, match="has no compressor"):
        families.get("lowrank").compressor_fn


@pytest.mark.parametrize("family,value,keep", [("svdllm", 0.2, 0.8), ("svd-llm", 0.2, 0.8), ("asvd", 0.9, 0.9),
                                               ("basis_sharing", 20, 0.8), ("basis-sharing", 20, 0.8),
                                               ("dobi", 0.4, 0.4), ("dobi_remap", 0.4, 0.4), ("palu", 0.5, 0.5)])
def test_native_knob_to_keep(family, value, keep):
    from lowrank_lib.ranks import native_to_keep

    assert math.isclose(families.native_to_keep(family, value), keep)
    assert math.isclose(native_to_keep(family, value), keep)      # ranks delegates to the registry


def test_views_of_the_registry():
    from lowrank_lib.compress import COMPRESSORS
    from lowrank_lib.formats import FAMILIES
    from lowrank_lib.formats.inspect import FAMILY_NOTES

    assert list(COMPRESSORS) == [f.name for f in families.methods() if f.needs_stats]
    assert COMPRESSORS["dobi-remap"].__name__ == "compress_dobi_remap"
    assert FAMILIES == ("asvd", "svdllm", "basis_sharing", "dobi", "dobi-remap", "palu", "lowrank")
    assert FAMILY_NOTES["svdllm"] is families.get("svdllm_v2").notes


def test_compress_and_formats_never_import_each_other():
    """The layering rule: formats/ and compress/ (except compress/quality.py, moving out) import neither the other."""
    import ast
    from pathlib import Path

    root = Path(families.__file__).parent
    for pkg, other in (("formats", "compress"), ("compress", "formats")):
        for py in (root / pkg).rglob("*.py"):
            if py.name == "quality.py":
                continue
            for node in ast.walk(ast.parse(py.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module:
                    mod = "." * node.level + node.module
                    assert not (mod.startswith(("..", "lowrank_lib.")) and mod.split(".")[-1] == other
                                or f".{other}." in mod or mod.endswith(f".{other}")), (py, mod)


def test_no_private_name_crosses_a_module_boundary():
    """formats/ and compress/ import no underscore name from another lowrank_lib module."""
    import ast
    from pathlib import Path

    root = Path(families.__file__).parent
    files = list((root / "formats").rglob("*.py")) + list((root / "compress").rglob("*.py")) + \
        [root / "families.py", root / "codecs.py", root / "models.py"]
    for py in files:
        if py.name == "quality.py":
            continue
        for node in ast.walk(ast.parse(py.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("lowrank_lib")):
                bad = [a.name for a in node.names if a.name.startswith("_")]
                assert not bad, (py, node.module, bad)
