"""``python -m lowrank_lib.bench <command> --help``."""
from .cli import main

raise SystemExit(main())
