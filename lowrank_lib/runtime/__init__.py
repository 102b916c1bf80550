"""Decode runtime (FlashSVD v1.5 and beyond): Engine, static dense KV cache, packed projections,
attention backends, graph modes, baselines on the same factors, profiling, fidelity audit."""
from .config import EngineConfig, PRESETS
from .engine import Engine, GenerateOutput, run_generation, sample_next
from .kv_cache import CacheFullError, StaticKVCache

__all__ = ["Engine", "EngineConfig", "PRESETS", "GenerateOutput", "run_generation", "sample_next",
           "CacheFullError", "StaticKVCache"]
