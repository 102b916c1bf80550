"""Dobi-SVD remap's 8-bit codes multiplied through a lookup table, against requantizing them to our int8 (issue 30).

    python benchmarks/dobi_lut_gemv.py [--threads 1] [--out benchmarks/results]

Issue 30 asks whether Dobi's dynamic-map codes should be decoded inside the GEMV (a 256-entry table) or requantized
at load to our int8 (what ``load_checkpoint(..., factor_bits=8)`` does). This measures both on the same factor shapes,
one thread, weights streamed from memory (enough copies that a round never fits in the caches), medians of
interleaved rounds (``lowrank_lib.timing``):

* ``lut_bf16``: the table kernel below. Per row of codes [rows, cols] and its absmax (Dobi's per-rank-component
  scale): y[r] = absmax[r] * sum_j table[codes[r, j]] * x[j], the table in bf16 (256 entries: 8 AVX-512 registers),
  32 codes decoded per step by four 64-entry word permutes (``vpermi2w``) and two blends on the codes' bits 6 / 7,
  then one ``vdpbf16ps`` with x in bf16; four rows share each load of x. It is not in the library: a measurement.
* ``int8_vnni``: the library's packed int8 GEMV (``runtime.kernels.ops.qgemv``, group 32, fp16 scales), the same
  matrix requantized (``quant.quantize``): what the engine serves a Dobi remap file with today.
* ``bf16``: the library's packed bf16 GEMV on the widened factor (``ops.gemv``): Dobi's own loader's bytes.

Both quantized kernels are checked against float64 references of their own math before timing. The JSON holds, per
shape and kernel, microseconds per product and GB/s of the bytes it streams (codes + scales, or bf16 weights), the
host and its copy bandwidth.
"""
from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load_inline

from lowrank_lib import quant
from lowrank_lib.codecs import dynamic_map, quantize_rows
from lowrank_lib.host import copy_bandwidth, load_average, machine
from lowrank_lib.runtime.kernels import load as load_kernels
from lowrank_lib.runtime.kernels import ops
from lowrank_lib.timing import interleaved, summary

CPP = r"""
#include <torch/extension.h>
#include <immintrin.h>

#define LUT_TARGET __attribute__((target("avx512f,avx512bw,avx512bf16")))

// 32 codes -> their 32 table entries (bf16): four 64-entry word permutes, then blends on the codes' bits 6 and 7
LUT_TARGET static inline __m512bh decode32(const __m512i* T, const uint8_t* p) {
  const __m512i idx = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)p));
  const __m512i q0 = _mm512_permutex2var_epi16(T[0], idx, T[1]);   // entries 0-63 (the index's low 6 bits)
  const __m512i q1 = _mm512_permutex2var_epi16(T[2], idx, T[3]);   // 64-127
  const __m512i q2 = _mm512_permutex2var_epi16(T[4], idx, T[5]);   // 128-191
  const __m512i q3 = _mm512_permutex2var_epi16(T[6], idx, T[7]);   // 192-255
  const __mmask32 m6 = _mm512_test_epi16_mask(idx, _mm512_set1_epi16(64));
  const __mmask32 m7 = _mm512_test_epi16_mask(idx, _mm512_set1_epi16(128));
  const __m512i lo = _mm512_mask_blend_epi16(m6, q0, q1), hi = _mm512_mask_blend_epi16(m6, q2, q3);
  return (__m512bh)_mm512_mask_blend_epi16(m7, lo, hi);
}

LUT_TARGET static void lut_rows(const uint8_t* C, int64_t rows, int64_t cols, const uint16_t* table,
                                const float* absmax, const uint16_t* x, float* y) {
  __m512i T[8];
  for (int i = 0; i < 8; i++) T[i] = _mm512_loadu_si512(table + 32 * i);
  auto decode = [&](const uint8_t* p) { return decode32(T, p); };
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    const uint8_t* c0 = C + r * cols;
    for (int64_t j = 0; j < cols; j += 32) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + j);
      a0 = _mm512_dpbf16_ps(a0, decode(c0 + j), xv);
      a1 = _mm512_dpbf16_ps(a1, decode(c0 + cols + j), xv);
      a2 = _mm512_dpbf16_ps(a2, decode(c0 + 2 * cols + j), xv);
      a3 = _mm512_dpbf16_ps(a3, decode(c0 + 3 * cols + j), xv);
    }
    y[r] = _mm512_reduce_add_ps(a0) * absmax[r];
    y[r + 1] = _mm512_reduce_add_ps(a1) * absmax[r + 1];
    y[r + 2] = _mm512_reduce_add_ps(a2) * absmax[r + 2];
    y[r + 3] = _mm512_reduce_add_ps(a3) * absmax[r + 3];
  }
  for (; r < rows; r++) {
    __m512 a = _mm512_setzero_ps();
    for (int64_t j = 0; j < cols; j += 32)
      a = _mm512_dpbf16_ps(a, decode(C + r * cols + j), (__m512bh)_mm512_loadu_si512(x + j));
    y[r] = _mm512_reduce_add_ps(a) * absmax[r];
  }
}

// codes uint8 [rows, cols] (cols a multiple of 32), table bf16 [256], absmax fp32 [rows], x bf16 [cols] -> fp32 [rows]
torch::Tensor lut_gemv(torch::Tensor codes, torch::Tensor table, torch::Tensor absmax, torch::Tensor x) {
  TORCH_CHECK(codes.scalar_type() == torch::kUInt8 && codes.dim() == 2 && codes.is_contiguous() &&
              codes.size(1) % 32 == 0, "codes: uint8 [rows, cols], cols a multiple of 32");
  TORCH_CHECK(table.scalar_type() == torch::kBFloat16 && table.numel() == 256, "table: bf16 [256]");
  TORCH_CHECK(absmax.scalar_type() == torch::kFloat && absmax.numel() == codes.size(0), "absmax: fp32 [rows]");
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && x.numel() == codes.size(1) && x.is_contiguous(), "x: bf16 [cols]");
  auto y = torch::empty({codes.size(0)}, absmax.options());
  lut_rows(codes.data_ptr<uint8_t>(), codes.size(0), codes.size(1), (const uint16_t*)table.data_ptr(),
           absmax.data_ptr<float>(), (const uint16_t*)x.data_ptr(), y.data_ptr<float>());
  return y;
}
"""

#: (rows, cols) of the factor matrices timed: SmolLM2 keep 0.8 and Llama-3.2-1B keep 0.8 ranks in both orientations
SHAPES = [(480, 576), (576, 480), (1248, 1536), (576, 1248), (1632, 2048), (2048, 1632), (1632, 8192), (8192, 1632)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1], help="one value: torch.set_num_threads")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--stream-mb", type=int, default=256, help="bytes of copies each kernel cycles through")
    a = ap.parse_args()
    (threads,) = a.threads
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    ext = load_inline("dobi_lut_gemv", CPP, functions=["lut_gemv"], extra_cflags=["-O3"], verbose=False)
    load_kernels()
    table = dynamic_map().to(torch.bfloat16)
    res = {"command": "python benchmarks/dobi_lut_gemv.py " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in
                                                                        vars(a).items() if k != "threads")
                      + f" --threads {threads}",
           "machine": machine(), "threads": threads, "load_average": {"start": load_average()},
           "copy_bandwidth_GBps": copy_bandwidth("cpu"), "qgemv_isa": ops.qgemv_isa(), "rows": []}
    for rows, cols in SHAPES:
        W = torch.randn(rows, cols) / cols ** 0.5
        codes, am = quantize_rows(W)                       # Dobi's own codes of W (per-row absmax)
        am32 = am.float()
        x = torch.randn(cols)
        xb = x.to(torch.bfloat16)
        # correctness of each kernel against its own math in float64
        lut_ref = (table.double()[codes.long()] @ xb.double()) * am32.double()
        got = ext.lut_gemv(codes, table, am32, xb).double()
        assert torch.allclose(got, lut_ref, rtol=1e-3, atol=1e-3 * float(lut_ref.abs().max())), (rows, cols)
        Wd = (table.float()[codes.long()] * am32[:, None])  # the widened factor (Dobi's loader, here in fp32)
        q = quant.quantize(Wd, 8, 32)
        qp = ops.qpack(q.data, q.scale, 8, 32, rows, cols)
        bp = ops.pack(Wd.to(torch.bfloat16))
        yq = ops.qgemv(xb[None], [qp], [rows], [cols], [0], 8, 32)[0].double()
        want = Wd.double() @ xb.double()
        assert float((yq - want).norm() / want.norm()) < 2e-2, (rows, cols)

        def copies(t):                                      # cycled through: each call streams a cold copy
            n = max(2, a.stream_mb * 2 ** 20 // (t.numel() * t.element_size()))
            return itertools.cycle([t.clone() for _ in range(n)])

        cc, qq, bb = copies(codes), copies(qp), copies(bp)
        runs = {"lut_bf16": lambda: ext.lut_gemv(next(cc), table, am32, xb),
                "int8_vnni": lambda: ops.qgemv(xb[None], [next(qq)], [rows], [cols], [0], 8, 32),
                "bf16": lambda: ops.gemv(xb[None], [next(bb)], [rows], [cols], [0])}
        secs = interleaved(runs, rounds=a.rounds, calls=3, warmup=20, inner=100)
        nbytes = {"lut_bf16": codes.numel() + 4 * rows, "int8_vnni": qp.numel(), "bf16": bp.numel() * bp.element_size()}
        for k in runs:
            us = summary(secs[k])["median_ms"] * 1e3
            res["rows"].append({"shape": [rows, cols], "kernel": k, "us": round(us, 2), "bytes": int(nbytes[k]),
                                "GBps": round(nbytes[k] / us / 1e3, 2)})
        print(rows, cols, {r["kernel"]: (r["us"], r["GBps"]) for r in res["rows"][-3:]}, flush=True)
    res["load_average"]["end"] = load_average()
    res["written"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"dobi_lut_gemv_t{threads}.json"
    n = 2
    while path.exists():
        path, n = out / f"dobi_lut_gemv_t{threads}_{n}.json", n + 1
    path.write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
