"""KV methods: one dataclass per method (config + math), one registry, one tiered state, two adapters.

Work in progress (issue 19): ``tiers.py`` is the tiered state every method fits and its attention.
"""
