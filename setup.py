"""Build hook: compiles our CPU kernels (``lowrank_lib/runtime/kernels/lrk.cpp``) at ``pip install`` time.

Everything else about the package is in ``pyproject.toml``. The extension is built only when torch is
importable in the build environment (``make`` installs torch first, then this package with
``--no-build-isolation``); otherwise, or when the compile fails, or with ``LOWRANK_LIB_NO_EXT=1``, the
install goes on without it and the library is built just in time on first use (or the portable path
runs, with the reason in ``Engine.report()``). Source, flags and the module name come from
``lowrank_lib/runtime/kernels/build.py``, the ONE place they are defined (it imports only the standard
library at module level, so it is loaded here from its file).
"""
import importlib.util
import os
import sys
from pathlib import Path

from setuptools import setup

HERE = Path(__file__).resolve().parent


def _kernel_build_module():
    spec = importlib.util.spec_from_file_location("_lowrank_kernels_build",
                                                  HERE / "lowrank_lib" / "runtime" / "kernels" / "build.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod          # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def _extensions():
    if os.environ.get("LOWRANK_LIB_NO_EXT") == "1":
        print("[lowrank_lib] LOWRANK_LIB_NO_EXT=1: kernels not built (built just in time on first use)")
        return {}
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        print("[lowrank_lib] torch is not importable at build time: kernels are built just in time on first use")
        return {}
    kw = _kernel_build_module().extension_kwargs()
    kw["sources"] = [os.path.relpath(s, HERE) for s in kw["sources"]]

    class OptionalBuildExtension(BuildExtension):
        """A failed compile never fails the install: the JIT route (or the portable path) takes over."""

        def run(self):
            try:
                super().run()
            except Exception as e:  # noqa: BLE001
                print(f"[lowrank_lib] building the CPU kernels failed ({type(e).__name__}: {e}); "
                      "they will be built just in time on first use", file=sys.stderr)

        def build_extension(self, ext):
            # distutils sorts the sources by name before compiling them; ninja then starts them in that order. The
            # kernels' list is longest compile first (build.py), so the last to start is a short one on two cores
            order = {Path(s).name: i for i, s in enumerate(ext.sources)}
            compile_ = self.compiler.compile
            self.compiler.compile = lambda sources, *a, **k: compile_(
                sorted(sources, key=lambda s: order.get(Path(s).name, len(order))), *a, **k)
            try:
                super().build_extension(ext)
            except Exception as e:  # noqa: BLE001
                print(f"[lowrank_lib] building {ext.name} failed ({type(e).__name__}: {e})", file=sys.stderr)

    return {"ext_modules": [CppExtension(**kw)], "cmdclass": {"build_ext": OptionalBuildExtension}}


setup(**_extensions())
