"""The benchmark package: ``python -m lowrank_lib.bench <command>`` (see :mod:`.cli` for the table).

A client of the library: the measurements live there (``runtime.decode_bench``, ``runtime.ablation``,
``runtime.bandwidth``, ``runtime.profiling``, ``eval.factor_space``, ``eval.kv_decode``, ``eval.compressors``,
``attsvd.cost``, ``resolve``, ``synthetic``, ``timing``, ``host``). Here: :mod:`.load` (checkpoint loads in a
child), the peer family (:mod:`.peer_base`, :mod:`.peer`, :mod:`.peer_scale`: llama.cpp side by side), :mod:`.gpu`
(the prepared GPU checks), :mod:`.child` (the one child-process worker), :mod:`.results` (the one writer),
:mod:`.options` (the one flag vocabulary). :mod:`.commands` holds the thin CLI modules.
"""
