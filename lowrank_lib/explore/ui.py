"""Whether widgets can be shown here: ipywidgets importable and code running inside an IPython kernel."""
from __future__ import annotations


def in_kernel_with_widgets() -> bool:
    """True inside a Jupyter kernel (JupyterLab, papermill) with ipywidgets installed; False in plain Python."""
    try:
        import ipywidgets  # noqa: F401
        from IPython import get_ipython
    except ImportError:
        return False
    ip = get_ipython()
    return ip is not None and hasattr(ip, "kernel")
