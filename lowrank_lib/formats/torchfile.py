"""``torch.save`` files seen exactly as ``torch.load`` sees them, read without running anything.

The decision between the two ``torch.save`` containers is torch's own (``torch/serialization.py``
of torch 2.13, ``load`` and ``_legacy_load``):

1. a path ending in ``.safetensors`` is handed to safetensors by ``torch.load``: refused here;
2. the first four bytes are the zip local-header magic ``PK\\x03\\x04`` (``_is_zipfile``, which
   looks at the START only, unlike ``zipfile.is_zipfile``): a zip archive;
3. otherwise the legacy path: a readable tar archive (torch < 0.4) is refused, as ``torch.load``
   refuses it with ``weights_only=True``; anything else is the legacy pickle stream.

So a legacy pickle with a valid zip directory appended is read as the legacy pickle (and then
refused, because bytes trail its last storage), never as the zip. A zip archive must also have one
consistent reading (:class:`ZipArchive`): the record at byte 0 is its first entry, entries do not
overlap and lie before the central directory, names are unique and share torch's single top
folder, only torch's own record names occur (a TorchScript archive is refused), records are
stored or deflated with a declared size that is checked while reading (no decompression bomb),
CRCs are verified, and ``byteorder`` (if present) is ``little``.

Storages come back as :class:`~.lazy.Record` objects (nothing read yet) on the CPU whatever device
the file names (Dobi-SVD saves ``cuda:0``): a stored (uncompressed) zip record is a range of the
copy-on-write mapping of the file, its CRC verified when it is read; a deflated record is inflated
(bounded by its declared size) when it is read; a legacy storage's offset is known once the data
section after the pickle was walked (:meth:`LegacyFile.finish`). So unpickling reads the pickle and
nothing else, and a refused pickle costs its own bytes only.

Why not ``torch.load`` itself: with ``weights_only=True`` it refuses the families' classes and
accepts no ``pickle_module`` (so no allow-list of ours), and its safe-globals registry would need
the real 4.x classes importable; with ``weights_only=False`` it runs the file. The containers are
therefore read here with the standard library (``zipfile``, ``tarfile``, ``pickle``), following
torch's own decisions step by step.
"""
from __future__ import annotations

import io
import pickle
import struct
import tarfile
import zipfile
import zlib
from pathlib import Path


from .errors import CheckpointError, fail, guarded
from .files import open_regular
from .lazy import Mapping, Record
from .pickle_scan import scan

ZIP_MAGIC = b"PK\x03\x04"
LEGACY_MAGIC = 0x1950A86A20F9469CFC6C      # torch.serialization.MAGIC_NUMBER
LEGACY_PROTOCOL = 1001                     # torch.serialization.PROTOCOL_VERSION
#: Largest ``data.pkl`` we unpickle: real ones are a few MB (a 128k-vocab fast tokenizer ~10 MB).
MAX_PICKLE_BYTES = 64 << 20
MAX_RECORDS = 1 << 18
MAX_DIRECTORY_BYTES = 32 << 20
_SMALL_RECORD = 1 << 16
_LOCAL_HEADER = struct.Struct("<4s5HL2L2H")   # zip local file header, 30 bytes
_FLAGS_OK = 0x2 | 0x4 | 0x8 | 0x800            # deflate options, data descriptor, UTF-8 names


@guarded
def container_kind(path) -> str:
    """``"zip"`` or ``"legacy"``, decided as ``torch.load`` decides (see the module doc)."""
    path = Path(path)
    if str(path).endswith(".safetensors"):
        fail(path, "named .safetensors: torch.load reads such a path as safetensors, not as a torch.save pickle")
    with open_regular(path, "torch.save file") as f:
        if f.read(4) == ZIP_MAGIC:
            return "zip"
        f.seek(0)
        try:
            with tarfile.open(fileobj=f, mode="r:", format=tarfile.PAX_FORMAT):
                pass
        except tarfile.TarError:
            return "legacy"
        except Exception as e:  # torch.load would fail here too
            fail(path, f"unreadable ({type(e).__name__}: {e})")
    fail(path, "a legacy .tar torch.save archive (torch < 0.4): torch.load refuses it with weights_only=True "
               "and so do we; re-save it with a current torch")


class _Cursor(io.RawIOBase):
    """A read-only file over a buffer (bytes or mmap) from ``pos``: what pickle/pickletools need, no copy."""

    def __init__(self, buf, pos: int = 0):
        self._buf, self._mv, self._pos = buf, memoryview(buf), pos

    def readable(self):
        return True

    def tell(self):
        return self._pos

    def seek(self, pos, whence=0):
        self._pos = pos if whence == 0 else (self._pos + pos if whence == 1 else len(self._mv) + pos)
        return self._pos

    def read(self, n=-1):
        end = len(self._mv) if n is None or n < 0 else min(len(self._mv), self._pos + n)
        out = bytes(self._mv[self._pos:end])
        self._pos = max(self._pos, end)
        return out

    def readinto(self, b):
        data = self.read(len(b))
        b[:len(data)] = data
        return len(data)

    def readline(self, size=-1):
        nl = self._buf.find(b"\n", self._pos)
        end = len(self._mv) if nl < 0 else nl + 1
        if size is not None and size >= 0:
            end = min(end, self._pos + size)
        return self.read(end - self._pos)


class _NoGlobals(pickle.Unpickler):
    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"global {module}.{name} in a header pickle")

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("persistent id in a header pickle")


def _plain_pickle(cur: _Cursor, source, what: str):
    """One small pickle of plain data (no globals) at the cursor; the cursor moves past it."""
    start = cur.tell()
    s = scan(cur, source, max_ops=100_000)
    cur.seek(start)
    try:
        obj = _NoGlobals(cur, encoding="utf-8").load()
    except Exception as e:  # noqa: BLE001 - any failure of a header pickle is corruption
        fail(source, f"corrupt {what} ({type(e).__name__}: {e})")
    if cur.tell() != start + s.end:
        fail(source, f"corrupt {what} (pickle length disagrees)")
    return obj


class TorchFile:
    """Common interface of the two containers for :class:`~.safe_pickle.RestrictedUnpickler`."""

    path: Path
    kind: str

    def pickle_stream(self):
        """A binary file object at the first byte of the object pickle, and the bytes it may read."""
        raise NotImplementedError

    def storage(self, key: str, nbytes: int) -> Record:
        """The record of storage ``key`` (``nbytes`` long, checked against the container; nothing read)."""
        raise NotImplementedError

    def finish(self, used: dict[str, tuple[Record, int]], pickle_end: int) -> None:
        """Called after unpickling with the storages handed out, ``key -> (record, element size)``,
        and the length of the object pickle (legacy files locate their storages now)."""

    def close(self):
        pass


def _check_directory(f, path) -> None:
    """Read the entry count and directory size from the end-of-central-directory record BEFORE ``zipfile``
    builds one object per entry: ``zipfile`` parses the whole directory whatever count it claims, so a
    directory of millions of tiny entries would exhaust memory."""
    size = f.seek(0, 2)
    f.seek(max(0, size - (22 + 65535)))
    tail = f.read()
    at = tail.rfind(b"PK\x05\x06")
    if at < 0 or at + 22 > len(tail):
        return                                   # zipfile reports the missing record itself
    count, cd_size = struct.unpack_from("<HL", tail, at + 10)
    loc = at - 20
    if (count == 0xFFFF or cd_size == 0xFFFFFFFF) and loc >= 0 and tail[loc:loc + 4] == b"PK\x06\x07":
        z64 = struct.unpack_from("<Q", tail, loc + 8)[0]
        if z64 > size - 56:
            return                               # zipfile refuses the broken zip64 record itself
        f.seek(z64)
        rec = f.read(56)
        if len(rec) == 56 and rec[:4] == b"PK\x06\x06":
            count, cd_size = struct.unpack_from("<QQ", rec, 32)
    if count > MAX_RECORDS or cd_size > MAX_DIRECTORY_BYTES:
        fail(path, f"zip directory lists {count} records in {cd_size} bytes, more than a torch.save archive can "
                   f"need ({MAX_RECORDS} records, {MAX_DIRECTORY_BYTES} bytes)")


class ZipArchive(TorchFile):
    kind = "zip"

    def __init__(self, path):
        self.path = path = Path(path)
        self._f = open_regular(path, "torch.save archive")
        try:
            self._init()
        except BaseException:
            self._f.close()
            raise

    def _init(self):
        path = self.path
        _check_directory(self._f, path)
        try:
            self._zf = zipfile.ZipFile(self._f)
            infos = self._zf.infolist()
        except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError, ValueError, NotImplementedError) as e:
            fail(path, f"not a readable zip archive ({type(e).__name__}: {e}); truncated or corrupt")
        if not infos:
            fail(path, "empty zip archive")
        if len(infos) > MAX_RECORDS:
            fail(path, f"{len(infos)} zip records, more than the {MAX_RECORDS} a torch.save archive can need")
        names = [i.filename for i in infos]
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            fail(path, f"zip record '{dup}' appears twice; refusing an archive with two readings")
        top = names[0].split("/", 1)[0]
        self.prefix = top + "/"
        size = self._size = self._f.seek(0, 2)
        cd = getattr(self._zf, "start_dir", None)
        spans = []
        self._records: dict[str, tuple[zipfile.ZipInfo, int]] = {}
        for info in infos:
            n = info.filename
            if not n.startswith(self.prefix) or n == self.prefix:
                fail(path, f"zip record '{n}' is outside the archive folder '{self.prefix}' torch reads")
            rel = n[len(self.prefix):]
            if info.flag_bits & ~_FLAGS_OK:
                fail(path, f"zip record '{n}' has flags {info.flag_bits:#x} (encryption or patch data; torch.save "
                           f"writes none)")
            if not 0 <= info.header_offset <= size - 30:
                fail(path, f"zip record '{n}' claims a header at byte {info.header_offset}, outside the "
                           f"{size}-byte file (truncated?)")
            if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
                fail(path, f"zip record '{n}' uses compression method {info.compress_type} (torch.save stores)")
            if info.compress_type == zipfile.ZIP_STORED and info.compress_size != info.file_size:
                fail(path, f"zip record '{n}' is stored but declares {info.file_size} bytes in {info.compress_size}")
            if info.compress_type == zipfile.ZIP_DEFLATED and info.file_size > 1032 * info.compress_size + 64:
                fail(path, f"zip record '{n}' declares {info.file_size} bytes from {info.compress_size} compressed: "
                           f"beyond what deflate can produce (a decompression bomb)")
            self._f.seek(info.header_offset)
            raw = self._f.read(30)
            if len(raw) < 30:
                fail(path, f"zip record '{n}' local header lies past the end of the file (truncated)")
            sig, *_, name_len, extra_len = _LOCAL_HEADER.unpack(raw)
            if sig != ZIP_MAGIC:
                fail(path, f"zip record '{n}' has no local header at byte {info.header_offset}")
            data_off = info.header_offset + 30 + name_len + extra_len
            end = data_off + info.compress_size
            if end > size or (cd is not None and end > cd):
                fail(path, f"zip record '{n}' data [{data_off}, {end}) runs past the end of the entries (truncated?)")
            spans.append((info.header_offset, end, n))
            self._records[rel] = (info, data_off)
            self._check_name(rel, n)
        spans.sort()
        if spans[0][0] != 0:
            fail(path, f"the zip record at byte 0 is not '{spans[0][2]}': data precedes the archive")
        for (a0, a1, an), (b0, b1, bn) in zip(spans, spans[1:]):
            if b0 < a1:
                fail(path, f"zip records '{an}' and '{bn}' overlap (bytes {b0}..{a1}); refusing")
        if "data.pkl" not in self._records:
            fail(path, f"no {self.prefix}data.pkl in the archive: not a torch.save file")
        bo = self._records.get("byteorder")
        if bo is not None:
            order = self.read_record("byteorder", 16)
            if order != b"little":
                fail(path, f"byteorder record is {order!r}: only little-endian checkpoints are supported")
        self._map: Mapping | None = None

    def _check_name(self, rel: str, full: str):
        if rel in ("data.pkl", "version", ".format_version", ".storage_alignment", "byteorder") or \
                rel.startswith(".data/"):
            return
        if rel.startswith("data/") and rel[5:] and "/" not in rel[5:]:
            return
        if rel == "constants.pkl" or rel.startswith(("code/", "constants/")):
            fail(self.path, f"a TorchScript archive ('{full}'): torch.load would run it through torch.jit; refusing")
        fail(self.path, f"unexpected zip record '{full}' (a torch.save archive holds data.pkl, data/<key> and "
                        f"version records only)")

    def read_record(self, rel: str, cap: int) -> bytes:
        info, _ = self._records[rel]
        if info.file_size > cap:
            fail(self.path, f"zip record '{info.filename}' is {info.file_size} bytes, more than the {cap}-byte "
                            f"limit for it")
        try:
            with self._zf.open(info) as r:
                data = r.read(cap + 1)
        except (zipfile.BadZipFile, OSError, EOFError, zlib.error, ValueError, NotImplementedError) as e:
            fail(self.path, f"zip record '{info.filename}' is corrupt ({type(e).__name__}: {e})")
        if len(data) != info.file_size:
            fail(self.path, f"zip record '{info.filename}' holds {len(data)} bytes, its header says {info.file_size}")
        return data

    def pickle_stream(self):
        data = self.read_record("data.pkl", MAX_PICKLE_BYTES)
        return io.BytesIO(data), len(data)

    def storage(self, key: str, nbytes: int) -> Record:
        rel = f"data/{key}"
        if rel not in self._records:
            fail(self.path, f"storage record '{self.prefix}{rel}' is missing (truncated file?)", key=rel)
        info, off = self._records[rel]
        if info.file_size != nbytes:
            fail(self.path, f"storage record '{self.prefix}{rel}' holds {info.file_size} bytes, the pickle expects "
                            f"{nbytes}", key=rel)
        name = f"{self.prefix}{rel}"
        if info.compress_type != zipfile.ZIP_STORED:
            return Record(self.path, name, nbytes, crc=None,
                          inflate=lambda: _inflate(self.path, name, off, info.compress_size, nbytes, info.CRC))
        if self._map is None:
            self._map = Mapping(self.path, "torch.save archive")
        return Record(self.path, name, nbytes, mapping=self._map, offset=off, crc=info.CRC)

    def close(self):
        self._zf.close()
        self._f.close()


class LegacyFile(TorchFile):
    """The pre-1.6 stream: magic, protocol and sys_info pickles, the object pickle, the storage keys,
    then each storage as ``int64 numel`` + raw bytes (``torch.serialization._legacy_load``)."""

    kind = "legacy"

    def __init__(self, path):
        self.path = path = Path(path)
        self._map = Mapping(path, "torch.save file")
        mm, self._size = self._map.mm, self._map.size
        if mm is None:
            fail(path, "empty file")
        self._mm = mm
        cur = _Cursor(mm)
        magic = _plain_pickle(cur, path, "magic number")
        if magic != LEGACY_MAGIC:
            fail(path, "not a torch.save file (neither a zip archive nor the legacy magic number)")
        proto = _plain_pickle(cur, path, "protocol version")
        if proto != LEGACY_PROTOCOL:
            fail(path, f"legacy protocol version {proto!r}, expected {LEGACY_PROTOCOL}")
        info = _plain_pickle(cur, path, "sys_info")
        if not isinstance(info, dict) or info.get("little_endian") is not True:
            fail(path, "legacy file saved on a big-endian machine (or without sys_info): not supported")
        self._start = cur.tell()
        self._alloc = 0

    def pickle_stream(self):
        return _Cursor(self._mm, self._start), self._size - self._start

    def storage(self, key: str, nbytes: int) -> Record:
        self._alloc += nbytes
        if self._alloc > self._size:
            fail(self.path, f"storages claim {self._alloc} bytes, more than the {self._size}-byte file holds", key=key)
        return Record(self.path, f"storage {key}", nbytes, mapping=self._map, offset=None)

    def finish(self, used: dict[str, tuple[Record, int]], pickle_end: int) -> None:
        """Walk the data section: each storage's ``int64 numel`` header is checked and its offset set;
        ``used``: key -> (record, element size). No storage byte is read."""
        cur = _Cursor(self._mm, self._start + pickle_end)
        keys = _plain_pickle(cur, self.path, "storage key list")
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
            fail(self.path, f"storage key list is {type(keys).__name__}, expected a list of strings")
        if len(set(keys)) != len(keys) or set(keys) != set(used):
            fail(self.path, f"storage key list {sorted(keys)[:5]}... does not match the {len(used)} storages the "
                            f"pickle references")
        pos = cur.tell()
        for k in keys:
            rec, elsize = used[k]
            if pos + 8 > self._size:
                fail(self.path, f"storage '{k}' is missing (truncated file)", key=k)
            numel = int.from_bytes(self._mm[pos:pos + 8], "little", signed=True)
            if numel * elsize != rec.nbytes:
                fail(self.path, f"storage '{k}' holds {numel} elements of {elsize} bytes, the pickle expects "
                                f"{rec.nbytes // elsize}", key=k)
            pos += 8
            if pos + rec.nbytes > self._size:
                fail(self.path, f"storage '{k}' runs past the end of the file (truncated)", key=k)
            rec.offset = pos
            pos += rec.nbytes
        if pos != self._size:
            fail(self.path, f"{self._size - pos} bytes trail the last storage; a torch.save file ends there "
                            f"(refusing a file with two readings)")


def _inflate(path, name: str, offset: int, compressed: int, nbytes: int, crc: int) -> bytes:
    """The bytes of a deflated zip record, re-read from the checked file when first needed: at most
    ``nbytes`` are produced (no decompression bomb), and the length and CRC must match the directory."""
    with open_regular(path, "torch.save archive") as f:
        f.seek(offset)
        raw = f.read(compressed)
    try:
        d = zlib.decompressobj(-15)
        data = d.decompress(raw, nbytes + 1)
    except zlib.error as e:
        fail(path, f"zip record '{name}' is corrupt ({e})", key=name)
    if len(raw) != compressed or len(data) != nbytes:
        fail(path, f"zip record '{name}' holds {len(data)} bytes, its header says {nbytes}", key=name)
    if zlib.crc32(data) != crc:
        fail(path, f"storage record '{name}' fails its CRC check (corrupt data)", key=name)
    return data


@guarded
def open_torch_file(path) -> TorchFile:
    """The container at ``path`` (decided as torch decides); CheckpointError if it is neither."""
    kind = container_kind(path)
    return ZipArchive(path) if kind == "zip" else LegacyFile(path)


__all__ = ["CheckpointError", "LEGACY_MAGIC", "LegacyFile", "MAX_PICKLE_BYTES", "TorchFile", "ZipArchive",
           "container_kind", "open_torch_file"]
