"""safetensors files, validated against the format's own rules before a byte of tensor data is used.

The safetensors library checks headers too, but its errors (``SafetensorError``) name neither the
file nor which rule broke, and our own format maps files with ``torch.frombuffer`` (zero copy),
which checks nothing. :func:`check_safetensors` is the one validator both use (and
``lowrank_lib.models`` for plain HF folders); it enforces the format specification
(https://github.com/huggingface/safetensors#format):

* an 8-byte little-endian header length N with 0 < N <= 100 MB (the library's own cap) and
  8 + N <= file size;
* a UTF-8 JSON object, no duplicate keys, optional ``__metadata__`` of string -> string;
* per tensor exactly ``dtype`` (a known one), ``shape`` (non-negative ints) and ``data_offsets``
  ``[begin, end]`` with end - begin == numel x itemsize;
* the byte buffer entirely indexed, without holes or overlaps: sorted spans start at 0, each
  begins where the previous ended, the last ends at the end of the file (so a truncated file, a
  file with trailing bytes and two tensors sharing bytes are all refused).

:func:`read_safetensors` then maps the file (copy-on-write) and returns lazy tensors over exactly the
byte ranges the validated header declares (one parse of the header, the one we checked; nothing of
the data is read until the builder streams it), or loads it with the safetensors library
(``use_mmap=False``). Why not safetensors' own mmap (``safe_open``): it parses the header a second
time with its own rules, which let holes and overlapping spans pass.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import fail, guarded
from .files import open_regular, regular_file
from .lazy import LazyStorage, LazyTensor, Mapping, Record

#: The safetensors library refuses larger headers; so do we.
MAX_HEADER_BYTES = 100_000_000
MAX_DIMS = 16

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int   # offsets inside the byte buffer (after the header)
    end: int

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class SafetensorsHeader:
    path: Path
    header_bytes: int                 # N
    tensors: dict[str, TensorEntry]
    metadata: dict[str, str]

    @property
    def data_start(self) -> int:
        return 8 + self.header_bytes


def _no_duplicates(pairs):
    d = {}
    for k, v in pairs:
        if k in d:
            raise _Duplicate(k)
        d[k] = v
    return d


class _Duplicate(ValueError):
    pass


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@guarded
def check_safetensors(path) -> SafetensorsHeader:
    """Validate ``path`` as a safetensors file (see the module doc); CheckpointError names the rule broken."""
    path = Path(path)
    size = regular_file(path, "safetensors file").st_size
    if size < 8:
        fail(path, f"truncated: {size} bytes, shorter than the 8-byte header length")
    with open_regular(path, "safetensors file") as f:
        n = int.from_bytes(f.read(8), "little")
        if n == 0 or n > MAX_HEADER_BYTES:
            fail(path, f"header length {n} outside 1..{MAX_HEADER_BYTES} (corrupt or not a safetensors file)")
        if 8 + n > size:
            fail(path, f"header length {n} does not fit a {size}-byte file (truncated?)")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except _Duplicate as e:
        fail(path, f"header lists '{e}' twice", key=str(e))
    except RecursionError:
        fail(path, "header JSON is nested too deeply")
    except ValueError as e:   # UnicodeDecodeError, JSONDecodeError
        fail(path, f"header is not UTF-8 JSON ({e}); corrupt file")
    if not isinstance(header, dict):
        fail(path, f"header is a JSON {type(header).__name__}, expected an object")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        fail(path, "__metadata__ must map strings to strings")
    tensors: dict[str, TensorEntry] = {}
    for name, e in header.items():
        if not isinstance(e, dict) or set(e) != {"dtype", "shape", "data_offsets"}:
            fail(path, f"tensor '{name}': entry must have exactly dtype, shape, data_offsets; found "
                       f"{sorted(e) if isinstance(e, dict) else type(e).__name__}", key=name)
        dt = e["dtype"]
        if not isinstance(dt, str) or dt not in DTYPES:
            fail(path, f"tensor '{name}': unknown dtype {dt!r} (supported: {sorted(DTYPES)})", key=name)
        shape, offs = e["shape"], e["data_offsets"]
        if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(_int(d) and d >= 0 for d in shape):
            fail(path, f"tensor '{name}': shape {shape!r} is not a list of at most {MAX_DIMS} non-negative ints",
                 key=name)
        if not (isinstance(offs, list) and len(offs) == 2 and all(_int(o) for o in offs) and 0 <= offs[0] <= offs[1]):
            fail(path, f"tensor '{name}': data_offsets {offs!r} is not [begin, end] with 0 <= begin <= end", key=name)
        t = TensorEntry(name, DTYPES[dt], tuple(shape), offs[0], offs[1])
        need = t.numel * t.dtype.itemsize
        if offs[1] - offs[0] != need:
            fail(path, f"tensor '{name}': {dt} {list(shape)} needs {need} bytes but data_offsets {offs} span "
                       f"{offs[1] - offs[0]}", key=name)
        tensors[name] = t
    buf = size - 8 - n
    pos, prev = 0, None
    for t in sorted(tensors.values(), key=lambda t: (t.begin, t.end)):
        if t.begin < pos:
            fail(path, f"tensor '{t.name}' bytes [{t.begin}, {t.end}) overlap tensor '{prev}' (ends at {pos})",
                 key=t.name)
        if t.begin > pos:
            fail(path, f"tensor '{t.name}' begins at byte {t.begin}, leaving a hole after byte {pos} "
                       f"(the format forbids holes)", key=t.name)
        pos, prev = t.end, t.name
    if pos != buf:
        what = "truncated" if pos > buf else f"{buf - pos} trailing bytes after the last tensor"
        fail(path, f"tensors need {8 + n + pos} bytes but the file has {size} ({what})")
    return SafetensorsHeader(path, n, tensors, meta)


@guarded
def read_safetensors(path, use_mmap: bool = True) -> dict[str, LazyTensor]:
    """Lazy tensors of a validated safetensors file: spans of a copy-on-write mapping, or (``use_mmap=False``)
    tensors loaded by the safetensors library."""
    h = check_safetensors(path)
    if not use_mmap:
        from safetensors.torch import load_file

        try:
            return {k: LazyTensor.of(v) for k, v in load_file(str(h.path)).items()}
        except Exception as e:  # SafetensorError and friends: the file changed under us or the library disagrees
            fail(h.path, f"the safetensors library refused the file ({type(e).__name__}: {e})")
    m = Mapping(h.path, "safetensors file")
    if m.size != h.data_start + sum(t.end - t.begin for t in h.tensors.values()):
        fail(h.path, f"the file changed size while being read ({m.size} bytes now)")
    out = {}
    for name, t in h.tensors.items():
        rec = Record(h.path, name, t.end - t.begin, mapping=m, offset=h.data_start + t.begin)
        out[name] = LazyTensor(t.dtype, t.shape, LazyStorage(rec, t.dtype, t.numel))
    return out


__all__ = ["DTYPES", "MAX_HEADER_BYTES", "SafetensorsHeader", "TensorEntry", "check_safetensors", "read_safetensors"]
