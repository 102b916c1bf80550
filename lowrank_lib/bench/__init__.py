"""The benchmark package: ``python -m lowrank_lib.bench <command>`` (see :mod:`.cli` for the table).

Library modules hold the measurements (notebooks import them): :mod:`.decode` (systems side by side),
:mod:`.ablation` (mechanism on/off, sweeps), :mod:`.layout` (weight-layout GEMV bandwidth),
:mod:`.factor_space` (factor-space attention vs rebuild vs dense), :mod:`.cost` (its cost model),
:mod:`.kv_decode` (KV methods in the engine), :mod:`.gpu` (the prepared GPU checks), :mod:`.models` (benchmark
models), :mod:`.timing` (the one timing helper), :mod:`.results` (the one writer), :mod:`.options` (the one flag
vocabulary). :mod:`.commands` holds the thin CLI modules; evaluation protocols live in ``lowrank_lib.eval``.
"""
