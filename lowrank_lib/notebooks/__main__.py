"""``python -m lowrank_lib.notebooks``: see :func:`lowrank_lib.notebooks.main`."""
from . import main

raise SystemExit(main())
