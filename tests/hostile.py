"""Building blocks of the adversarial corpus: hand-made pickles, torch.save containers, safetensors files.

Everything is generated at test time into a temporary folder; nothing here is ever unpickled by
anything but lowrank_lib's restricted reader (and, where a test proves an attack is real, by
``torch.load(weights_only=False)`` on a payload that only creates a marker file).
"""
from __future__ import annotations

import io
import json
import struct
import zipfile
from pathlib import Path

import torch

P2 = b"\x80\x02"


def glob(module: str, name: str) -> bytes:
    """A protocol-2 GLOBAL opcode."""
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def uni(s: str) -> bytes:
    b = s.encode()
    return b"X" + struct.pack("<I", len(b)) + b


def binint(n: int) -> bytes:
    """BININT for 32-bit values, else LONG1 (what pickle writes for big ints)."""
    if -(1 << 31) <= n < (1 << 31):
        return b"J" + struct.pack("<i", n)
    raw = n.to_bytes((n.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(raw)]) + raw


def storage_pid(stype: str = "FloatStorage", key: str = "0", numel: int = 4, location: str = "cpu",
                legacy: bool = False) -> bytes:
    """``('storage', torch.<stype>, key, location, numel[, None])`` then BINPERSID (legacy ids have a view slot)."""
    return (b"(" + uni("storage") + glob("torch", stype) + uni(key) + uni(location) + binint(numel)
            + (b"N" if legacy else b"") + b"tQ")


def rebuild(pid: bytes, offset: int, size: tuple, stride: tuple) -> bytes:
    """``torch._utils._rebuild_tensor_v2(<pid>, offset, size, stride, False, OrderedDict())``."""
    tup = lambda xs: b"(" + b"".join(binint(x) for x in xs) + b"t"   # noqa: E731
    return (glob("torch._utils", "_rebuild_tensor_v2") + b"(" + pid + binint(offset) + tup(size) + tup(stride)
            + b"\x89" + glob("collections", "OrderedDict") + b")R" + b"tR")


def dict_of(**items: bytes) -> bytes:
    """A pickle (no PROTO, no STOP) of ``{key: <item bytes>}``."""
    return b"}(" + b"".join(uni(k) + v for k, v in items.items()) + b"u"


def pickle_bytes(body: bytes) -> bytes:
    return P2 + body + b"."


def torch_zip(path: Path, data_pkl: bytes, records: dict[str, bytes] | None = None, prefix: str = "archive",
              compress: dict[str, int] | None = None) -> Path:
    """A torch.save-style zip archive with ``data.pkl`` and ``records`` (``data/0`` ...) under ``prefix/``."""
    path = Path(path)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr(f"{prefix}/data.pkl", data_pkl)
        zf.writestr(f"{prefix}/byteorder", b"little")
        for k, v in (records or {}).items():
            zf.writestr(zipfile.ZipInfo(f"{prefix}/{k}"), v, compress_type=(compress or {}).get(k, zipfile.ZIP_STORED))
        zf.writestr(f"{prefix}/version", b"3\n")
    return path


def floats(*xs: float) -> bytes:
    return struct.pack(f"<{len(xs)}f", *xs)


def safetensors_bytes(header: dict | bytes, data: bytes, header_len: int | None = None) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(raw) if header_len is None else header_len
    return struct.pack("<Q", n) + raw + data


def rewrite_zip_record(path: Path, name_suffix: str, fn) -> None:
    """Replace one record (``fn(old bytes) -> new bytes``) of a zip, keeping the others and their order."""
    with zipfile.ZipFile(path) as zf:
        recs = [(i, zf.read(i.filename)) for i in zf.infolist()]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        for info, data in recs:
            zf.writestr(info.filename, fn(data) if info.filename.endswith(name_suffix) else data)


def legacy_bytes(obj) -> bytes:
    b = io.BytesIO()
    torch.save(obj, b, _use_new_zipfile_serialization=False)
    return b.getvalue()


def legacy_stream(main_pickle: bytes, keys: list[str], storages: list[tuple[int, bytes]]) -> bytes:
    """A pre-1.6 ``torch.save`` stream: magic, protocol, sys_info, the object pickle, the key list, then each
    storage as ``int64 numel`` + bytes (``storages``: (numel, raw bytes) in key order)."""
    import pickle

    info = {"protocol_version": 1001, "little_endian": True, "type_sizes": {"short": 2, "int": 4, "long": 4}}
    out = [pickle.dumps(0x1950A86A20F9469CFC6C, 2), pickle.dumps(1001, 2), pickle.dumps(info, 2), main_pickle,
           pickle.dumps(keys, 2)]
    for numel, raw in storages:
        out.append(struct.pack("<q", numel) + raw)
    return b"".join(out)
