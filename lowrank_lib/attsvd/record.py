"""Compatibility path: the recorded prefill moved to :mod:`lowrank_lib.hf.record` (notebook 04 imports it here)."""
from ..hf.record import PrefillRecord, dense_from, record_prefill, replay

__all__ = ["PrefillRecord", "dense_from", "record_prefill", "replay"]
