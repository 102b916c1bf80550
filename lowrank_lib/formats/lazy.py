"""Tensors of a checked file, described but not read yet: what every reader hands over, what the builder streams.

A reader checks what the file's headers claim (pickle, zip directory, safetensors header, sizes,
offsets, strides, dtypes) and hands over :class:`LazyTensor` objects: dtype, shape and where the
bytes are. No tensor byte has been read at that point, so a file refused on its header or pickle
costs only that header, and nothing is allocated from a size the file claims before the builder
(:mod:`.build`) has checked it against the config. The builder then reads each tensor ONCE, in file
order, with :func:`stream`:

* the bytes come from a copy-on-write mapping of the file (:class:`Mapping`, ``MAP_PRIVATE``: pages
  are read from the page cache on first touch and never written back);
* a zip record's CRC-32 is verified while the bytes are read (:class:`Record`), chunk by chunk in
  the same pass as the dtype cast and the NaN/Inf scan, before the tensor is handed to the model;
* a tensor kept in its stored dtype IS the mapping (zero copy: its pages are the model's memory);
  a tensor cast to another dtype is written chunk by chunk into its new buffer and the pages of
  the source are handed back (``madvise(MADV_DONTNEED)``) as each chunk is done, so a load never
  holds a second full copy of the model;
* the NaN/Inf scan is ``torch.aminmax`` per chunk (no allocation; NaN propagates and ±Inf shows in
  min or max), ~10 GB/s where ``isfinite(t).all()`` runs at 0.3 GB/s and allocates ``numel`` bytes;
  the exact counts of an error message are computed only when a chunk fails.

Why not the mappings torch and safetensors offer: ``torch.load(mmap=True)`` maps the file the same
way (``UntypedStorage.from_file(shared=False)``) but only behind its own unpickler (``weights_only=True``
refuses the families' classes; with ``weights_only=False`` torch's ``persistent_load`` hands out
storages of its own C++ zip reader, which neither applies our one-reading checks nor verifies CRCs
in mmap mode); ``UntypedStorage.from_file`` re-opens the file by path (after we checked the opened
descriptor is a regular file, the path could now name a FIFO) and exposes no ``madvise`` to hand
pages back; safetensors' ``safe_open`` parses the header a second time with its own, more
permissive rules (holes and overlaps pass). So the mapping here is Python's ``mmap`` of the
descriptor :func:`~.files.open_regular` checked, viewed with ``torch.frombuffer``.

A loaded model whose tensors kept their stored dtype reads the file's pages, like
``torch.load(mmap=True)``: do not rewrite the file in place while the model is alive.
"""
from __future__ import annotations

import contextlib
import mmap
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator

import torch

from .errors import fail
from .files import map_file

try:        # ISA-L's CRC-32 (carry-less multiply): the same values as zlib's, 4-5x faster (measured 3.9 vs
    from isal.isal_zlib import crc32   # 0.8 GB/s on the shared machine); the CRC is a load's slowest step
except ImportError:                     # pragma: no cover - the `isal` dependency is missing: zlib's
    from zlib import crc32

#: Bytes per streamed chunk: small enough to stay in the last-level cache between the CRC, the cast
#: and the scan of the same chunk, large enough that per-chunk Python overhead is negligible.
CHUNK_BYTES = 8 << 20
PAGE = mmap.PAGESIZE


class Mapping:
    """A copy-on-write (``MAP_PRIVATE``) mapping of one regular file, shared by its records."""

    def __init__(self, path, what: str = "file"):
        self.path = path
        self.mm, self.size = map_file(path, what)

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        """The bytes ``[offset, offset + nbytes)`` as a 1-D uint8 tensor viewing the mapping (no copy)."""
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(self.mm, dtype=torch.uint8, count=nbytes, offset=offset)

    def crc(self, offset: int, nbytes: int, crc: int = 0) -> int:
        with memoryview(self.mm) as mv:
            return crc32(mv[offset:offset + nbytes], crc)

    def release(self, offset: int, nbytes: int) -> None:
        """Hand back the pages lying wholly inside ``[offset, offset + nbytes)`` (they are re-read from the
        file if touched again; nothing is ever written to a private mapping here, so nothing is lost)."""
        if self.mm is None or not hasattr(self.mm, "madvise"):
            return
        a = -(-offset // PAGE) * PAGE
        b = (offset + nbytes) // PAGE * PAGE
        if b > a:
            self.mm.madvise(mmap.MADV_DONTNEED, a, b - a)


class Record:
    """``nbytes`` bytes of one storage of a file (a zip record, a legacy storage, a safetensors span).

    ``offset`` may be set later (legacy storages follow the pickle). ``crc``: the zip directory's CRC-32,
    verified on the first full read (:meth:`data`) or while streaming (:func:`stream`). ``inflate``:
    for a deflated zip record, a function returning its bytes (checked against size and CRC there).
    """

    def __init__(self, path, key: str, nbytes: int, mapping: Mapping | None = None, offset: int | None = None,
                 crc: int | None = None, inflate: Callable[[], bytes] | None = None):
        self.path, self.key, self.nbytes = path, key, nbytes
        self.mapping, self.offset, self.crc, self.inflate = mapping, offset, crc, inflate
        self._data: torch.Tensor | None = None
        self.verified = crc is None

    @property
    def mapped(self) -> bool:
        return self.mapping is not None and self.inflate is None and self.nbytes > 0

    def check_crc(self, found: int) -> None:
        if self.crc is not None and found != self.crc:
            fail(self.path, f"storage record '{self.key}' fails its CRC check (corrupt data)", key=self.key)
        self.verified = True

    def data(self) -> torch.Tensor:
        """All bytes (1-D uint8), verified; a view of the mapping where the record is stored uncompressed."""
        if self._data is None:
            if self.nbytes == 0:
                self._data = torch.empty(0, dtype=torch.uint8)
            elif self.inflate is not None:
                self._data = torch.frombuffer(bytearray(self.inflate()), dtype=torch.uint8)
            else:
                if self.offset is None:
                    raise RuntimeError(f"{self.path}: storage '{self.key}' read before its offset is known")
                if not self.verified:
                    self.check_crc(self.mapping.crc(self.offset, self.nbytes))
                self._data = self.mapping.view(self.offset, self.nbytes)
        return self._data

    def release(self, start: int = 0, nbytes: int | None = None) -> None:
        """Hand back the pages of bytes ``[start, start + nbytes)`` of this record (all by default)."""
        n = self.nbytes - start if nbytes is None else nbytes
        if start == 0 and n >= self.nbytes:
            self._data = None
        if self.mapped and self.offset is not None:
            self.mapping.release(self.offset + start, n)


class LazyStorage:
    """A typed storage of the file (what the unpickler sees): a record read as ``numel`` x ``dtype``
    starting ``elem_offset`` elements in (legacy storage views)."""

    __slots__ = ("record", "dtype", "numel", "elem_offset")

    def __init__(self, record: Record, dtype: torch.dtype, numel: int, elem_offset: int = 0):
        self.record, self.dtype, self.numel, self.elem_offset = record, dtype, numel, elem_offset


def _contiguous_strides(shape) -> tuple[int, ...]:
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(out))


class LazyTensor:
    """A tensor of a checked file: ``dtype``, ``shape`` and where its bytes are; read by :meth:`load` or
    :func:`stream`. A *derived* tensor (``fn`` of other lazy tensors: a Palu block-diagonal U, a Dobi
    remap decode) knows its shape and dtype up front and computes its value when read."""

    __slots__ = ("dtype", "shape", "stride", "offset", "storage", "fn", "inputs", "parameter", "tensor")

    def __init__(self, dtype: torch.dtype, shape, storage: LazyStorage | None = None, offset: int = 0,
                 stride=None, fn: Callable | None = None, inputs: tuple = (), tensor: torch.Tensor | None = None):
        self.dtype, self.shape = dtype, torch.Size(shape)
        self.stride = tuple(stride) if stride is not None else _contiguous_strides(self.shape)
        self.storage, self.offset, self.fn, self.inputs, self.tensor = storage, offset, fn, tuple(inputs), tensor
        self.parameter = False

    # -- constructors
    @classmethod
    def of(cls, t: torch.Tensor) -> "LazyTensor":
        """A tensor already in memory (a state dict loaded by a library, a test's tensor)."""
        return cls(t.dtype, t.shape, tensor=t)

    @classmethod
    def derived(cls, dtype: torch.dtype, shape, fn: Callable, *inputs: "LazyTensor") -> "LazyTensor":
        """``fn(*[x.load() for x in inputs])``, of the given dtype and shape (checked when computed)."""
        return cls(dtype, shape, fn=fn, inputs=inputs)

    # -- metadata, as torch.Tensor spells it
    def dim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        return self.shape.numel()

    def element_size(self) -> int:
        return self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.numel() * self.dtype.itemsize

    @property
    def record(self) -> Record | None:
        return self.storage.record if self.storage is not None else None

    def stored_bytes(self) -> int:
        """Bytes of the file this tensor reads (a derived tensor: its inputs')."""
        if self.fn is not None:
            return sum(x.stored_bytes() for x in self.inputs)
        return self.nbytes

    def position(self) -> tuple:
        """Sort key: the file and byte where this tensor's bytes start (derived: its first input's)."""
        if self.fn is not None:
            return self.inputs[0].position() if self.inputs else ("", 0)
        rec = self.record
        if rec is None or rec.offset is None:
            return ("", 0)
        return (str(rec.path), rec.offset + self.offset * self.dtype.itemsize)

    def same_bytes(self, other: "LazyTensor") -> bool:
        """Both read the same bytes of the same storage with the same geometry (aliases of one tensor)."""
        if self is other:
            return True
        if self.storage is None or other.storage is None or self.fn is not None or other.fn is not None:
            return False
        return (self.storage.record is other.storage.record and self.dtype == other.dtype and
                self.shape == other.shape and self.stride == other.stride and self.offset == other.offset)

    def is_contiguous(self) -> bool:
        return all(st == want for d, st, want in zip(self.shape, self.stride, _contiguous_strides(self.shape))
                   if d > 1)

    def whole_record(self) -> bool:
        """Contiguous and covering exactly its (mapped) record: the case streamed in one fused pass."""
        rec = self.record
        return (rec is not None and rec.mapped and self.offset == 0 and self.is_contiguous() and
                self.nbytes == rec.nbytes and self.numel() > 0)

    # -- reading
    def load(self) -> torch.Tensor:
        """The tensor (verified; a view of the mapping when stored uncompressed and aligned, else a copy)."""
        return self.read()[0]

    def read(self) -> tuple[torch.Tensor, bool]:
        """``(tensor, whether it views the file's mapping)``; see :meth:`load`."""
        if self.tensor is not None:
            return self.tensor, False
        if self.fn is not None:
            t = self.fn(*[x.load() for x in self.inputs])
            if t.dtype != self.dtype or t.shape != self.shape:
                raise RuntimeError(f"derived tensor is {t.dtype} {tuple(t.shape)}, expected {self.dtype} "
                                   f"{tuple(self.shape)}")
            return t, False
        if self.numel() == 0:
            return torch.empty(self.shape, dtype=self.dtype), False
        rec = self.storage.record
        raw = rec.data()
        typed, copied = _typed(raw, self.dtype)
        return typed.as_strided(self.shape, self.stride, self.offset), rec.mapped and not copied

    def release(self) -> None:
        """Hand back the memory of the bytes this tensor read (after they were copied or cast elsewhere)."""
        if self.fn is not None:
            for x in self.inputs:
                x.release()
            return
        rec = self.record
        if rec is None:
            return
        if self.whole_record():
            rec.release()
        elif rec.mapped and rec.offset is not None and self.is_contiguous():
            rec.release(self.offset * self.dtype.itemsize, self.nbytes)

    def __repr__(self):
        return f"LazyTensor({str(self.dtype).replace('torch.', '')}, {list(self.shape)})"


def _typed(raw: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, bool]:
    """``(a uint8 buffer as dtype elements, copied)``: a view when its address is aligned, else an aligned copy
    (legal in legacy files and safetensors; a typed view must be aligned for vectorised kernels)."""
    if raw.data_ptr() % dtype.itemsize:
        return raw.clone().view(dtype), True
    return raw.view(dtype), False


def materialize(obj):
    """Replace every :class:`LazyTensor` inside containers (dicts, lists, tuples, in place where mutable) by
    its tensor; lazy tensors of one storage become views of one buffer (``torch.load`` keeps that sharing)."""
    done: dict[int, object] = {}

    def walk(o):
        if isinstance(o, LazyTensor):
            t = o.load()
            return torch.nn.Parameter(t, requires_grad=False) if o.parameter else t
        if not isinstance(o, (dict, list, tuple)):
            return o
        if id(o) in done:
            return done[id(o)]
        if isinstance(o, dict):
            done[id(o)] = o
            for k in list(o):
                o[k] = walk(o[k])
            return o
        if isinstance(o, list):
            done[id(o)] = o
            for i, v in enumerate(o):
                o[i] = walk(v)
            return o
        new = tuple(walk(v) for v in o)
        done[id(o)] = new
        return new

    return walk(obj)


# --------------------------------------------------------------------------- the NaN/Inf scan
def finite(t: torch.Tensor) -> bool:
    """Whether every element of a floating tensor is finite, without allocating (``aminmax`` propagates NaN)."""
    if not t.dtype.is_floating_point or t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))


def count_nonfinite(t: torch.Tensor, chunk_elems: int = 1 << 22) -> tuple[int, int, tuple] | None:
    """``(n_nan, n_inf, index of the first)`` of a floating tensor, chunk by chunk; None if all finite."""
    if not t.dtype.is_floating_point or t.numel() == 0:
        return None
    flat = t.reshape(-1)
    nan = inf = 0
    first = None
    for a in range(0, flat.numel(), chunk_elems):
        c = flat[a:a + chunk_elems]
        if finite(c):
            continue
        isn, isi = torch.isnan(c), torch.isinf(c)
        nan += int(isn.sum())
        inf += int(isi.sum())
        if first is None:
            i = a + int((isn | isi).nonzero()[0])
            first = tuple(int(x) for x in torch.unravel_index(torch.tensor(i), t.shape))
    return None if first is None else (nan, inf, first)


# --------------------------------------------------------------------------- streaming one tensor
@contextlib.contextmanager
def one_thread():
    """Intra-op threads set to 1 for the block (restored after). The streamed work is one memory-bound op
    per 8 MB chunk: an OpenMP parallel region per chunk costs more than it saves, and on a shared
    machine its barrier waits for a busy core (measured: 0.5 GB/s with 2 threads, 5 GB/s with 1)."""
    n = torch.get_num_threads()
    if n != 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if n != 1:
            torch.set_num_threads(n)


def _ranges(n: int, step: int) -> Iterator[tuple[int, int]]:
    for a in range(0, n, step):
        yield a, min(n, a + step)


def stream(lt: LazyTensor, dtype: torch.dtype | None, on_bytes: Callable[[int], None] | None = None
           ) -> tuple[torch.Tensor, bool]:
    """Read ``lt`` once: ``(tensor in dtype (None: as stored), all finite)``.

    Whole mapped records (what ``torch.save`` and safetensors write) are read in one pass of
    :data:`CHUNK_BYTES` chunks: CRC, cast (or aligning copy) into the new buffer, scan, hand the source
    pages back. Other tensors (views into a storage, deflated records, derived tensors) are loaded
    whole (verified), then cast and scanned chunk by chunk, and their source released. ``on_bytes(n)``
    is called with the stored bytes done (progress).
    """
    cast = dtype is not None and dtype != lt.dtype
    out_dtype = dtype if cast else lt.dtype
    tick = on_bytes or (lambda n: None)
    rec = lt.record
    if lt.whole_record() and rec.offset is not None:
        return _stream_record(lt, rec, cast, out_dtype, tick)
    src, is_view = lt.read()
    ok = True
    if not cast and src.is_contiguous():
        flat = src.reshape(-1)
        for a, b in _ranges(flat.numel(), max(1, CHUNK_BYTES // src.element_size())):
            ok = ok and finite(flat[a:b])
        if not is_view:
            lt.release()
        tick(lt.stored_bytes())
        return src, ok
    dest = torch.empty(lt.shape, dtype=out_dtype)
    if src.is_contiguous():
        d, s = dest.reshape(-1), src.reshape(-1)
        for a, b in _ranges(d.numel(), max(1, CHUNK_BYTES // src.element_size())):
            d[a:b].copy_(s[a:b])
            ok = ok and finite(d[a:b])
    else:
        dest.copy_(src)
        ok = finite(dest)
    del src
    lt.release()
    tick(lt.stored_bytes())
    return dest, ok


_CRC_WORKER: ThreadPoolExecutor | None = None
#: Chunks the CRC worker may run ahead of the cast / scan (bounds the source pages resident at once).
CRC_AHEAD = 4


def _crc_worker() -> ThreadPoolExecutor:
    """One background thread computing record CRCs while the caller casts and scans (``crc32`` releases the
    GIL): on two cores the CRC overlaps the rest of the pass."""
    global _CRC_WORKER
    if _CRC_WORKER is None:
        _CRC_WORKER = ThreadPoolExecutor(1, thread_name_prefix="lowrank-crc")
    return _CRC_WORKER


def _stream_record(lt: LazyTensor, rec: Record, cast: bool, out_dtype: torch.dtype, tick) -> tuple[torch.Tensor, bool]:
    """The fused pass over one whole mapped record (see :func:`stream`)."""
    es = lt.dtype.itemsize
    base = rec.mapping.view(rec.offset, rec.nbytes)
    aligned = base.data_ptr() % es == 0
    copy = cast or not aligned
    src = base.view(lt.dtype) if aligned else None
    dest = torch.empty(lt.numel(), dtype=out_dtype) if copy else src
    dest_bytes = dest.view(torch.uint8) if copy and not cast else None
    chunks = list(_ranges(lt.numel(), max(1, CHUNK_BYTES // es)))
    crc = [0]
    pending: deque = deque()

    def crc_chunk(a8: int, n8: int) -> None:           # runs in the worker, chunks in order
        crc[0] = rec.mapping.crc(rec.offset + a8, n8, crc[0])

    def submit(i: int) -> None:
        if not rec.verified and i < len(chunks):
            a, b = chunks[i]
            if CRC_AHEAD:
                pending.append(_crc_worker().submit(crc_chunk, a * es, (b - a) * es))
            else:
                crc_chunk(a * es, (b - a) * es)

    for i in range(max(1, CRC_AHEAD)):
        submit(i)
    ok = True
    try:
        for i, (a, b) in enumerate(chunks):
            a8, n8 = a * es, (b - a) * es
            if copy:
                if dest_bytes is not None:                      # unaligned, same dtype: a byte copy
                    dest_bytes[a8:a8 + n8].copy_(base[a8:a8 + n8])
                else:
                    s = src[a:b] if aligned else base[a8:a8 + n8].clone().view(lt.dtype)
                    dest[a:b].copy_(s)
            ok = ok and finite(dest[a:b])
            if pending:
                pending.popleft().result()                       # chunk i's CRC is done: its pages may go
            if copy:
                rec.release(a8, n8)
            submit(i + max(1, CRC_AHEAD))
            tick(n8)
    finally:
        for f in pending:
            f.result()
    if not rec.verified:
        rec.check_crc(crc[0])
    if copy:
        rec.release()
    return dest.view(lt.shape), ok


__all__ = ["CHUNK_BYTES", "LazyStorage", "LazyTensor", "Mapping", "Record", "count_nonfinite", "finite",
           "materialize", "stream"]
