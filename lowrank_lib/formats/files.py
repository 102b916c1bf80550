"""Opening untrusted files: regular files only, sizes capped, folder members kept inside their folder.

A checkpoint folder is data from someone else. Every file a reader opens goes through here:

* :func:`regular_file` refuses what is not a regular file (a FIFO would block ``open``, a
  character device such as ``/dev/zero`` never ends) BEFORE opening it; :func:`read_bounded`
  then opens with ``O_NONBLOCK`` and re-checks the opened descriptor, so swapping the path for
  a FIFO between the two checks cannot block either, and reads at most its cap;
* :func:`read_json` parses a capped file and names the file on any decoding error;
* :func:`member` resolves a name found INSIDE a checkpoint (a shard-index entry, a manifest
  entry) and refuses it unless it stays in the folder: no absolute paths, no ``..``, no symlink
  leading elsewhere. The one exception is the Hugging Face cache layout, whose snapshot files are
  symlinks into the same repository's ``blobs/`` folder;
* :func:`map_file` maps a regular file copy-on-write, so big weight files are read lazily.
"""
from __future__ import annotations

import json
import mmap
import os
import stat
from pathlib import Path, PurePosixPath, PureWindowsPath

from .errors import CheckpointError, fail

#: Largest JSON file a reader parses (configs are kilobytes; shard indexes of 400B models ~100 kB).
MAX_JSON_BYTES = 32 << 20

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def regular_file(path, what: str = "file") -> os.stat_result:
    """``os.stat`` of ``path`` (symlinks followed), refusing anything that is not a regular file."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        fail(path, f"{what} missing")
    except OSError as e:
        fail(path, f"cannot stat {what} ({e.strerror or e})")
    if not stat.S_ISREG(st.st_mode):
        fail(path, f"{what} is {_kind(st.st_mode)}, not a regular file; refusing to read it")
    return st


def open_regular(path, what: str = "file"):
    """A binary file object for a regular file, opened without blocking and re-checked after opening."""
    regular_file(path, what)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        fail(path, f"cannot open {what} ({e.strerror or e})")
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        fail(path, f"{what} changed into {_kind(mode)} while being opened; refusing")
    return os.fdopen(fd, "rb")


def read_bounded(path, max_bytes: int, what: str = "file") -> bytes:
    """The bytes of a regular file of at most ``max_bytes`` (refused, not truncated, when larger)."""
    st = regular_file(path, what)
    if st.st_size > max_bytes:
        fail(path, f"{what} is {st.st_size} bytes, more than the {max_bytes}-byte limit for it")
    with open_regular(path, what) as f:
        try:
            data = f.read(max_bytes + 1)
        except OSError as e:
            fail(path, f"cannot read {what} ({e.strerror or e})")
    if len(data) > max_bytes:
        fail(path, f"{what} grew past the {max_bytes}-byte limit while being read")
    return data


def read_json(path, what: str = "JSON file", max_bytes: int = MAX_JSON_BYTES) -> dict:
    """A JSON object from a capped regular file; any decoding problem is a CheckpointError naming it."""
    raw = read_bounded(path, max_bytes, what)
    try:
        obj = json.loads(raw)
    except RecursionError:
        fail(path, f"{what} is nested too deeply to parse")
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, int too long
        fail(path, f"{what} is not valid JSON ({e})")
    if not isinstance(obj, dict):
        fail(path, f"{what} holds a JSON {type(obj).__name__}, expected an object")
    return obj


def member(folder, name, what: str = "file") -> Path:
    """``folder / name`` for a ``name`` read from inside a checkpoint, refused unless it stays inside.

    The file must exist and be a regular file (checked by the caller's reader through
    :func:`regular_file`); here only the location is judged.
    """
    folder = Path(folder)
    if not isinstance(name, str) or not name or "\x00" in name:
        fail(folder, f"{what} name {name!r} is not a file name")
    pp, wp = PurePosixPath(name), PureWindowsPath(name)
    if pp.is_absolute() or wp.is_absolute() or wp.drive or ".." in pp.parts or ".." in wp.parts:
        fail(folder, f"{what} {name!r} points outside the checkpoint folder; refusing")
    p = folder / name
    try:
        real, root = p.resolve(), folder.resolve()
    except (OSError, RuntimeError) as e:  # RuntimeError: symlink loop on older Pythons
        fail(p, f"cannot resolve {what} ({e})")
    if real == root or root not in real.parents:
        if not _in_hf_blobs(root, real):
            fail(folder, f"{what} {name!r} resolves to {real}, outside the checkpoint folder {root}; refusing")
    return p


def _in_hf_blobs(root: Path, real: Path) -> bool:
    """Hugging Face cache: ``<repo>/snapshots/<rev>/<file>`` -> ``<repo>/blobs/<sha>``."""
    if root.parent.name != "snapshots":
        return False
    blobs = root.parent.parent / "blobs"
    return real.parent == blobs


def map_file(path, what: str = "file") -> tuple[mmap.mmap | None, int]:
    """``(copy-on-write mapping or None for an empty file, size)`` of a regular file."""
    with open_regular(path, what) as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return None, 0
        try:
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY), size
        except (OSError, ValueError) as e:
            fail(path, f"cannot map {what} ({e})")


def shard_files(folder, index_name: str, default: str) -> list[Path]:
    """The weight files of an HF folder: the shards named by ``index_name`` if it exists, else ``default``.

    Every ``weight_map`` entry must be a string naming a file inside the folder (see :func:`member`).
    """
    folder = Path(folder)
    idx = folder / index_name
    if not idx.exists():
        return [member(folder, default, "weight file")]
    wm = read_json(idx, "shard index").get("weight_map")
    if not isinstance(wm, dict) or not wm:
        fail(idx, f"'weight_map' is {type(wm).__name__}, expected a non-empty object {{tensor: file}}")
    names = set()
    for k, v in wm.items():
        if not isinstance(v, str):
            fail(idx, f"weight_map['{k}'] is {type(v).__name__}, expected a file name", key=k)
        names.add(v)
    return [member(folder, n, "shard") for n in sorted(names)]


__all__ = ["CheckpointError", "MAX_JSON_BYTES", "map_file", "member", "open_regular", "read_bounded", "read_json",
           "regular_file", "shard_files"]
