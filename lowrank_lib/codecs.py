"""Storage codecs of the families: how factors are laid out in their files, shared by compress/ and formats/.

Both packages need these exact transforms (a compressor produces what a writer stores and a reader
decodes), so they live here, below both, and neither package imports the other.

* Dobi-SVD remap (spec §4): per-component 8-bit codes of bitsandbytes' signed dynamic map
  (re-implemented: ``quantize``/``dequantize_no_absmax`` are deprecated upstream), with an fp16
  tail for the part beyond min(m, n); :func:`remap_encode` / :func:`remap_decode` are exact
  inverses on decoded data.
* Palu (spec §6): head-group U blocks held as one block-diagonal U; :func:`block_diag_u` /
  :func:`split_block_diag` convert between the two.
"""
from __future__ import annotations

from functools import lru_cache

import torch


@lru_cache(maxsize=1)
def dynamic_map() -> torch.Tensor:
    """bitsandbytes ``create_dynamic_map(signed=True, max_exponent_bits=7, total_bits=8)``: 256 sorted values."""
    data = []
    for i in range(7):
        b = torch.linspace(0.1, 1, 2 ** i + 1)
        means = ((b[:-1] + b[1:]) / 2.0).tolist()
        data += [(10 ** (-6 + i)) * x for x in means]
        data += [-(10 ** (-6 + i)) * x for x in means]
    data += [0.0, 1.0]
    assert len(data) == 256
    return torch.tensor(sorted(data), dtype=torch.float32)


def quantize_rows(X: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row dynamic 8-bit quantisation: X [k, d] -> (codes uint8 [k, d], absmax fp16 [k])."""
    code = dynamic_map()
    absmax = X.float().abs().amax(dim=1).to(torch.float16)
    scale = absmax.float().clamp_min(torch.finfo(torch.float16).tiny)
    x = X.float() / scale[:, None]
    mid = (code[1:] + code[:-1]) / 2
    idx = torch.bucketize(x.contiguous(), mid)      # nearest code entry
    return idx.to(torch.uint8), absmax


def dequantize_rows(codes: torch.Tensor, absmax: torch.Tensor) -> torch.Tensor:
    """``code[idx] * absmax`` -> fp16 [k, d] (an int32 ``index_select``: 3x the int64 gather, no 8-byte
    index per code)."""
    v = torch.index_select(dynamic_map(), 0, codes.reshape(-1).to(torch.int32)).view(codes.shape)
    return v.mul_(absmax.float()[:, None]).to(torch.float16)


def remap_encode(US: torch.Tensor, VT: torch.Tensor) -> dict:
    """Factors US [m, k], VT [k, n] -> Dobi's remap entry (us_quan, vt_quan, us_absmax, vt_absmax, tuple_info)."""
    m, k = US.shape
    n = VT.shape[1]
    d = min(m, n)
    us_q, us_a = quantize_rows(US[:d].T)
    vt_q, vt_a = quantize_rows(VT[:, :d])
    if m > n:
        tail = ("us", US[n:].to(torch.float16).contiguous())
    elif m < n:
        tail = ("vt", VT[:, m:].to(torch.float16).contiguous())
    else:
        tail = None
    return {"us_quan": us_q, "vt_quan": vt_q, "us_absmax": us_a, "vt_absmax": vt_a, "tuple_info": tail}


def remap_us(entry: dict) -> torch.Tensor:
    """Dobi's loader, U side: US = deq(us_quan)^T (+ the "us" tail on dim 0), fp16 [m, k]."""
    return remap_us_rows(entry, 0, remap_shapes(entry)[0][0]).contiguous()


def remap_vt(entry: dict) -> torch.Tensor:
    """Dobi's loader, V side: VT = deq(vt_quan) (+ the "vt" tail on dim 1), fp16 [k, n]."""
    return remap_vt_rows(entry, 0, entry["vt_quan"].shape[0]).contiguous()


def remap_shapes(entry: dict) -> tuple[tuple[int, int], tuple[int, int]]:
    """The decoded shapes ``(US [m, k], VT [k, n])`` of a remap entry."""
    k, d = entry["us_quan"].shape
    kind, t = entry.get("tuple_info") or (None, None)
    return (d + (t.shape[0] if kind == "us" else 0), k), (k, d + (t.shape[1] if kind == "vt" else 0))


def remap_us_rows(entry: dict, r0: int, r1: int) -> torch.Tensor:
    """Rows ``r0:r1`` of :func:`remap_us` (fp16, decoded alone: a served factor is requantized block by block)."""
    d = entry["us_quan"].shape[1]
    tail = entry.get("tuple_info")
    parts = [dequantize_rows(entry["us_quan"][:, r0:min(r1, d)], entry["us_absmax"]).T] if r0 < d else []
    if r1 > d and tail is not None and tail[0] == "us":
        parts.append(tail[1][max(r0, d) - d:r1 - d].to(torch.float16))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


def remap_vt_rows(entry: dict, r0: int, r1: int) -> torch.Tensor:
    """Rows ``r0:r1`` of :func:`remap_vt` (fp16)."""
    VT = dequantize_rows(entry["vt_quan"][r0:r1], entry["vt_absmax"][r0:r1])
    tail = entry.get("tuple_info")
    if tail is not None and tail[0] == "vt":
        VT = torch.cat([VT, tail[1][r0:r1].to(torch.float16)], dim=1)
    return VT


def remap_decode(entry: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Dobi's loader: ``(US [m, k], VT [k, n])`` fp16 (:func:`remap_us`, :func:`remap_vt`)."""
    tail = entry.get("tuple_info")
    if tail is not None and tail[0] not in ("us", "vt"):
        raise ValueError(f"unknown tuple_info kind {tail[0]!r}")
    return remap_us(entry), remap_vt(entry)


def block_diag_u(blocks: list[torch.Tensor]) -> torch.Tensor:
    """[gd, r_g] blocks -> [sum gd, sum r_g] block-diagonal U."""
    return torch.block_diag(*blocks)


def split_block_diag(U: torch.Tensor, ranks: list[int]) -> list[torch.Tensor]:
    """Inverse of :func:`block_diag_u` for G equal row groups; checks off-block entries are zero."""
    G = len(ranks)
    gd = U.shape[0] // G
    blocks, c = [], 0
    for g, r in enumerate(ranks):
        blocks.append(U[g * gd:(g + 1) * gd, c:c + r])
        c += r
    if not torch.equal(block_diag_u(blocks), U):
        raise ValueError("U is not block-diagonal for the recorded head-group ranks")
    return blocks
