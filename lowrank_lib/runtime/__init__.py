"""Decode runtime (FlashSVD v1.5 and beyond): Engine, pluggable KV stores (dense static cache, rebuild),
packed projections, attention backends, graph modes, baselines on the same factors, profiling; the ``Runner``
protocol every runner implements."""
from ..generation import GenerateOutput, run_generation, sample_next
from .attention import BACKENDS as ATTENTION_REGISTRY
from .config import EngineConfig, PRESETS, parse_dtype
from .engine import Engine
from .kv import CacheFullError, DenseKV, KVStore, RebuildKV
from .lm_head import LM_HEADS
from .runner import Runner

__all__ = ["Engine", "EngineConfig", "PRESETS", "parse_dtype", "GenerateOutput", "run_generation", "sample_next",
           "CacheFullError", "DenseKV", "KVStore", "RebuildKV", "Runner", "LM_HEADS", "ATTENTION_REGISTRY"]
