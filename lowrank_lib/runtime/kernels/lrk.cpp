// lowrank_lib's compiled CPU kernels for the decode step ("lrk"): packed GEMV and decode attention.
//
// Built ahead of time by `pip install` (setup.py, when torch is importable in the build environment)
// or just in time by lowrank_lib/runtime/kernels/build.py (torch.utils.cpp_extension.load): the SAME
// source and flags on both routes. No -march flag: the AVX-512 code is compiled for its ISA with
// target pragmas and only runs after a run-time CPUID check (isa_flags), so the library builds and
// loads on any x86-64 (and on other CPUs, where every kernel refuses and the portable path runs).
//
// Ops (namespace lowrank_lrk, called through torch.ops so torch.compile traces them as extern calls):
//   isa_flags() -> int                       bit 0 avx512f, 1 avx512bw, 2 avx512vl, 3 avx512_bf16
//   pack(W [out, in]) -> P [n]               the packed layout below (fp32 or bf16)
//   unpack(P, out, in) -> W [out, in]        the inverse (prefill and batched GEMMs run aten on it)
//   gemv(x [N, X], Ps[], outs[], ins[], xoffs[]) -> y [N, sum outs]
//        matrix m reads columns [xoffs[m], xoffs[m] + ins[m]) of x and writes its outs[m] columns of y,
//        in order: one call serves a packed stage-1 matrix (one m) or every stage-2 factor of a group
//        (block-diagonal: each member reads its slice of the stage-1 output, shared bases included).
//   attend(q [B, Hkv, G, D], K, V [>=B, Hkv, S, D], length [1], pad [>=B], scale) -> o [B, Hkv*G*D]
//        decode attention of the token at slot `length` over the slots pad[b] <= s <= length.
//   tier_attend(...)                         the fused attention over a tiered KV layer: see tiers.cpp
//
// Packed layout of W [out, in]: output rows in blocks of 64 (the last block rounded up to a multiple
// of 16, zero rows), each block ONE contiguous stream of its weights in the order the kernel reads:
//   fp32: block[k][j]     = W[64 b + j][k]               (k < in, j < block width)
//   bf16: block[p][j][e]  = W[64 b + j][2 p + e]         (p < ceil(in / 2); a zero column pads odd in)
// so one row of x is read once per block from L1 and the weights stream once from memory. bf16 uses
// vdpbf16ps (two products per lane, fp32 accumulation), fp32 one FMA per weight; the accumulators
// are rounded to the output dtype once (round to nearest even), as aten's GEMV does.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#define LRK_X86 1
#include <immintrin.h>
#else
#define LRK_X86 0
#endif

namespace lrk {

constexpr int64_t BW = 64;    // outputs per block
constexpr int64_t TAIL = 16;  // the last block is rounded up to a multiple of this many outputs
constexpr int64_t MAX_ROWS = 4;  // rows of x per pass over a block (more rows: more passes)
#ifndef LRK_PREFETCH
#define LRK_PREFETCH 0            // software prefetch distance in bytes (0: none; the hardware's streams win)
#endif
#if LRK_PREFETCH > 0
#define LRK_PF(p) _mm_prefetch((const char*)(p), _MM_HINT_T0)
#else
#define LRK_PF(p) ((void)0)
#endif
#ifndef LRK_UNROLL
#define LRK_UNROLL 1              // independent accumulator sets per block (hides FMA latency)
#endif
#ifndef LRK_SOURCE_TAG
#define LRK_SOURCE_TAG unknown
#endif
#define LRK_STR2(x) #x
#define LRK_STR(x) LRK_STR2(x)

static inline int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
static inline int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }

int64_t isa_flags() {
#if LRK_X86
  __builtin_cpu_init();
  int64_t f = 0;
  if (__builtin_cpu_supports("avx512f")) f |= 1;
  if (__builtin_cpu_supports("avx512bw")) f |= 2;
  if (__builtin_cpu_supports("avx512vl")) f |= 4;
  if (__builtin_cpu_supports("avx512bf16")) f |= 8;
  return f;
#else
  return 0;
#endif
}

static bool has_f32() { static const bool ok = (isa_flags() & 7) == 7; return ok; }
static bool has_bf16() { static const bool ok = (isa_flags() & 15) == 15; return ok; }

static void check_isa(bool bf) {
  TORCH_CHECK(bf ? has_bf16() : has_f32(), "lowrank_lrk: this CPU lacks ",
              bf ? "AVX512F/BW/VL + AVX512_BF16" : "AVX512F/BW/VL", " (isa_flags=", isa_flags(), ")");
}

// inner length of a packed matrix (bf16: pairs, so an even number of columns)
static inline int64_t inner(int64_t in, bool bf) { return bf ? 2 * cdiv(in, 2) : in; }
static inline int64_t padded_rows(int64_t out) { return (out / BW) * BW + cdiv(out % BW, TAIL) * TAIL; }
static inline int64_t packed_numel(int64_t out, int64_t in, bool bf) { return padded_rows(out) * inner(in, bf); }

static bool is_bf(const at::Tensor& t) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16,
              "lowrank_lrk: fp32 or bf16 only, got ", t.scalar_type());
  return t.scalar_type() == at::kBFloat16;
}

// ------------------------------------------------------------------------------------ pack / unpack
// to_packed: W [out, in] -> P; else P -> W
template <typename T>
static void pack_impl(T* W, int64_t out, int64_t in, T* P, bool bf, bool to_packed) {
  const int64_t K = inner(in, bf), rows = padded_rows(out), nblk = cdiv(rows, BW);
  at::parallel_for(0, nblk, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; b++) {
      const int64_t bw = imin(BW, rows - b * BW);
      T* blk = P + b * BW * K;
      for (int64_t j = 0; j < bw; j++) {
        const int64_t o = b * BW + j;
        if (o >= out) break;
        for (int64_t i = 0; i < in; i++) {
          const int64_t at = bf ? ((i / 2) * bw + j) * 2 + (i % 2) : i * bw + j;
          if (to_packed) blk[at] = W[o * in + i]; else W[o * in + i] = blk[at];
        }
      }
    }
  });
}

at::Tensor pack(const at::Tensor& W) {
  TORCH_CHECK(W.dim() == 2, "lowrank_lrk::pack: W must be [out, in], got ", W.sizes());
  const bool bf = is_bf(W);
  auto Wc = W.contiguous();
  const int64_t out = W.size(0), in = W.size(1);
  auto P = at::zeros({packed_numel(out, in, bf)}, W.options());
  if (bf)
    pack_impl<uint16_t>((uint16_t*)Wc.data_ptr(), out, in, (uint16_t*)P.data_ptr(), true, true);
  else
    pack_impl<float>(Wc.data_ptr<float>(), out, in, P.data_ptr<float>(), false, true);
  return P;
}

at::Tensor unpack(const at::Tensor& P, int64_t out, int64_t in) {
  const bool bf = is_bf(P);
  TORCH_CHECK(P.dim() == 1 && P.is_contiguous() && P.numel() == packed_numel(out, in, bf),
              "lowrank_lrk::unpack: P is not a packed [", out, ", ", in, "] matrix");
  auto W = at::empty({out, in}, P.options());
  if (bf)
    pack_impl<uint16_t>((uint16_t*)W.data_ptr(), out, in, (uint16_t*)P.data_ptr(), true, false);
  else
    pack_impl<float>(W.data_ptr<float>(), out, in, P.data_ptr<float>(), false, false);
  return W;
}

// ------------------------------------------------------------------------------------ AVX-512 code
// Everything between push_options and pop_options is compiled for AVX-512 and called only after
// check_isa(); the only header included in this region is our own lrk_simd.h (no inline function of a
// system header gets AVX-512 code).
#if LRK_X86
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16,fma,avx2")
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,fma,avx2"))), \
                             apply_to = function)
#endif

#include "lrk_simd.h"   // lanes, exp512, ld / st (fp32, bf16), hsum16: shared with tiers.cpp

// One block of a packed fp32 matrix against R rows of x: y_r[0:n] = block . x_r (NZ * 16 = block width).
// U independent accumulator sets (alternate k) hide the FMA latency when R * NZ is small.
template <int R, int NZ>
static void blk_f32(const float* w, const float* const* xs, int64_t K, float* const* ys, int64_t n) {
  constexpr int U = R * NZ <= 8 ? LRK_UNROLL : 1;
  __m512 acc[U][R][NZ];
  for (int u = 0; u < U; u++)
    for (int r = 0; r < R; r++)
      for (int z = 0; z < NZ; z++) acc[u][r][z] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + U <= K; k += U)
    for (int u = 0; u < U; u++) {
      const float* wk = w + (k + u) * (NZ * 16);
      __m512 wv[NZ];
      for (int z = 0; z < NZ; z++) {
        LRK_PF(wk + LRK_PREFETCH / 4 + 16 * z);
        wv[z] = _mm512_loadu_ps(wk + 16 * z);
      }
      for (int r = 0; r < R; r++) {
        const __m512 xv = _mm512_set1_ps(xs[r][k + u]);
        for (int z = 0; z < NZ; z++) acc[u][r][z] = _mm512_fmadd_ps(wv[z], xv, acc[u][r][z]);
      }
    }
  for (; k < K; k++) {
    const float* wk = w + k * (NZ * 16);
    for (int r = 0; r < R; r++) {
      const __m512 xv = _mm512_set1_ps(xs[r][k]);
      for (int z = 0; z < NZ; z++) acc[0][r][z] = _mm512_fmadd_ps(_mm512_loadu_ps(wk + 16 * z), xv, acc[0][r][z]);
    }
  }
  for (int r = 0; r < R; r++)
    for (int z = 0; z < NZ && z * 16 < n; z++) {
      __m512 a = acc[0][r][z];
      for (int u = 1; u < U; u++) a = _mm512_add_ps(a, acc[u][r][z]);
      _mm512_mask_storeu_ps(ys[r] + z * 16, lanes(n - z * 16), a);
    }
}

// bf16: xp_r[p] holds the pair (x_r[2p], x_r[2p+1]); block width NZ * 16, K2 pairs.
template <int R, int NZ>
static void blk_bf16(const uint16_t* w, const uint32_t* const* xp, int64_t K2, uint16_t* const* ys, int64_t n) {
  constexpr int U = R * NZ <= 8 ? LRK_UNROLL : 1;
  __m512 acc[U][R][NZ];
  for (int u = 0; u < U; u++)
    for (int r = 0; r < R; r++)
      for (int z = 0; z < NZ; z++) acc[u][r][z] = _mm512_setzero_ps();
  int64_t p = 0;
  for (; p + U <= K2; p += U)
    for (int u = 0; u < U; u++) {
      const uint16_t* wp = w + (p + u) * (NZ * 32);
      __m512i wv[NZ];
      for (int z = 0; z < NZ; z++) {
        LRK_PF(wp + LRK_PREFETCH / 2 + 32 * z);
        wv[z] = _mm512_loadu_si512((const void*)(wp + 32 * z));
      }
      for (int r = 0; r < R; r++) {
        const __m512i xv = _mm512_set1_epi32((int)xp[r][p + u]);
        for (int z = 0; z < NZ; z++) acc[u][r][z] = _mm512_dpbf16_ps(acc[u][r][z], (__m512bh)wv[z], (__m512bh)xv);
      }
    }
  for (; p < K2; p++) {
    const uint16_t* wp = w + p * (NZ * 32);
    for (int r = 0; r < R; r++) {
      const __m512i xv = _mm512_set1_epi32((int)xp[r][p]);
      for (int z = 0; z < NZ; z++)
        acc[0][r][z] = _mm512_dpbf16_ps(acc[0][r][z], (__m512bh)_mm512_loadu_si512((const void*)(wp + 32 * z)),
                                        (__m512bh)xv);
    }
  }
  for (int r = 0; r < R; r++)
    for (int z = 0; z < NZ && z * 16 < n; z++) {
      __m512 a = acc[0][r][z];
      for (int u = 1; u < U; u++) a = _mm512_add_ps(a, acc[u][r][z]);
      _mm256_mask_storeu_epi16(ys[r] + z * 16, lanes(n - z * 16), (__m256i)_mm512_cvtneps_pbh(a));
    }
}

typedef void (*f32_fn)(const float*, const float* const*, int64_t, float* const*, int64_t);
typedef void (*bf16_fn)(const uint16_t*, const uint32_t* const*, int64_t, uint16_t* const*, int64_t);

#define LRK_ROW(T, f, R) {f<R, 1>, f<R, 2>, f<R, 3>, f<R, 4>}
static const f32_fn F32_KERNELS[4][4] = {LRK_ROW(f32, blk_f32, 1), LRK_ROW(f32, blk_f32, 2),
                                         LRK_ROW(f32, blk_f32, 3), LRK_ROW(f32, blk_f32, 4)};
static const bf16_fn BF16_KERNELS[4][4] = {LRK_ROW(bf16, blk_bf16, 1), LRK_ROW(bf16, blk_bf16, 2),
                                           LRK_ROW(bf16, blk_bf16, 3), LRK_ROW(bf16, blk_bf16, 4)};
#undef LRK_ROW

// ---- decode attention, one (batch row, kv head): G queries of dim D = DC * 16 over slots [lo, hi]
// q [G, D] (row stride D), K/V rows at stride sk / sv; sc: scratch >= GB * ceil16(n) floats
template <typename T, int DC>
static void attend_head(const T* q, const T* K, const T* V, int64_t sk, int64_t sv, int64_t lo, int64_t hi,
                        int64_t G, float scale, T* o, float* sc) {
  constexpr int D = DC * 16;
  constexpr int GB = DC >= 16 ? 1 : 16 / DC;          // queries per pass: GB * DC <= 16 accumulators
  const int64_t n = hi - lo + 1, np = cdiv(n, 16) * 16;
  for (int64_t g0 = 0; g0 < G; g0 += GB) {
    const int gb = (int)imin(GB, G - g0);
    __m512 qv[GB][DC];
    for (int g = 0; g < gb; g++)
      for (int c = 0; c < DC; c++) qv[g][c] = _mm512_mul_ps(ld(q + (g0 + g) * D + c * 16), _mm512_set1_ps(scale));
    // scores, 16 slots at a time
    for (int64_t t0 = 0; t0 < n; t0 += 16) {
      const int m = (int)imin(16, n - t0);
      __m512 part[GB][16];
      for (int i = 0; i < 16; i++) {
        if (i < m) {
          const T* k = K + (lo + t0 + i) * sk;
          __m512 kv[DC];
          for (int c = 0; c < DC; c++) kv[c] = ld(k + c * 16);
          for (int g = 0; g < gb; g++) {
            __m512 a = _mm512_mul_ps(qv[g][0], kv[0]);
            for (int c = 1; c < DC; c++) a = _mm512_fmadd_ps(qv[g][c], kv[c], a);
            part[g][i] = a;
          }
        } else {
          for (int g = 0; g < gb; g++) part[g][i] = _mm512_set1_ps(-INFINITY);
        }
      }
      for (int g = 0; g < gb; g++) _mm512_storeu_ps(sc + g * np + t0, hsum16(part[g]));
    }
    // softmax per query (tail lanes are -inf: exp -> 0)
    float inv[GB];
    for (int g = 0; g < gb; g++) {
      float* s = sc + g * np;
      __m512 mx = _mm512_set1_ps(-INFINITY);
      for (int64_t t = 0; t < np; t += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(s + t));
      const __m512 mb = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
      __m512 sum = _mm512_setzero_ps();
      for (int64_t t = 0; t < np; t += 16) {
        __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(s + t), mb));
        e = _mm512_maskz_mov_ps(lanes(n - t), e);
        _mm512_storeu_ps(s + t, e);
        sum = _mm512_add_ps(sum, e);
      }
      inv[g] = 1.0f / _mm512_reduce_add_ps(sum);
    }
    // o = p V
    __m512 acc[GB][DC];
    for (int g = 0; g < gb; g++)
      for (int c = 0; c < DC; c++) acc[g][c] = _mm512_setzero_ps();
    for (int64_t t = 0; t < n; t++) {
      const T* v = V + (lo + t) * sv;
      __m512 vv[DC];
      for (int c = 0; c < DC; c++) vv[c] = ld(v + c * 16);
      for (int g = 0; g < gb; g++) {
        const __m512 p = _mm512_set1_ps(sc[g * np + t]);
        for (int c = 0; c < DC; c++) acc[g][c] = _mm512_fmadd_ps(p, vv[c], acc[g][c]);
      }
    }
    for (int g = 0; g < gb; g++)
      for (int c = 0; c < DC; c++) st(o + (g0 + g) * D + c * 16, _mm512_mul_ps(acc[g][c], _mm512_set1_ps(inv[g])));
  }
}

typedef void (*attn_f32_fn)(const float*, const float*, const float*, int64_t, int64_t, int64_t, int64_t, int64_t,
                            float, float*, float*);
typedef void (*attn_bf16_fn)(const uint16_t*, const uint16_t*, const uint16_t*, int64_t, int64_t, int64_t, int64_t,
                             int64_t, float, uint16_t*, float*);
static const attn_f32_fn ATTN_F32[8] = {attend_head<float, 1>, attend_head<float, 2>, attend_head<float, 3>,
                                        attend_head<float, 4>, attend_head<float, 5>, attend_head<float, 6>,
                                        attend_head<float, 7>, attend_head<float, 8>};
static const attn_bf16_fn ATTN_BF16[8] = {attend_head<uint16_t, 1>, attend_head<uint16_t, 2>,
                                          attend_head<uint16_t, 3>, attend_head<uint16_t, 4>,
                                          attend_head<uint16_t, 5>, attend_head<uint16_t, 6>,
                                          attend_head<uint16_t, 7>, attend_head<uint16_t, 8>};

#if defined(__clang__)
#pragma clang attribute pop
#endif
#pragma GCC pop_options
#endif  // LRK_X86

// ------------------------------------------------------------------------------------ gemv driver
struct Job {
  int64_t m;      // matrix
  int64_t b;      // block
  int64_t r0;     // first row of x
};

// splits [0, n) jobs into at most `tasks` contiguous ranges of about equal weight bytes; runs them
template <typename F>
static void run_jobs(const std::vector<Job>& jobs, const std::vector<int64_t>& bytes, F&& f) {
  const int64_t n = (int64_t)jobs.size();
  int64_t total = 0;
  for (auto b : bytes) total += b;
  // below ~256 KB of weights a parallel region costs more than it saves
  const int64_t threads = at::get_num_threads();
  const int64_t tasks = imin(threads, imin(n, total / (256 << 10)));
  if (tasks <= 1) {
    for (int64_t j = 0; j < n; j++) f(jobs[j]);
    return;
  }
  std::vector<int64_t> cut(tasks + 1, n);
  cut[0] = 0;
  int64_t acc = 0, t = 1;
  for (int64_t j = 0; j < n && t < tasks; j++) {
    acc += bytes[j];
    if (acc * tasks >= total * t) cut[t++] = j + 1;
  }
  at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; t++)
      for (int64_t j = cut[t]; j < cut[t + 1]; j++) f(jobs[j]);
  });
}

at::Tensor gemv(const at::Tensor& x, at::TensorList Ps, at::IntArrayRef outs, at::IntArrayRef ins,
                at::IntArrayRef xoffs) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "lowrank_lrk::gemv: x must be [N, X] with unit column stride");
  const bool bf = is_bf(x);
  check_isa(bf);
  const int64_t M = (int64_t)Ps.size(), N = x.size(0), ldx = x.stride(0);
  TORCH_CHECK((int64_t)outs.size() == M && (int64_t)ins.size() == M && (int64_t)xoffs.size() == M,
              "lowrank_lrk::gemv: one out, in and x offset per matrix");
  std::vector<int64_t> yoff(M + 1, 0);
  for (int64_t m = 0; m < M; m++) {
    const at::Tensor& P = Ps[m];
    TORCH_CHECK(P.scalar_type() == x.scalar_type() && P.dim() == 1 && P.is_contiguous() &&
                    P.numel() == packed_numel(outs[m], ins[m], bf),
                "lowrank_lrk::gemv: matrix ", m, " is not a packed [", outs[m], ", ", ins[m], "] ", x.scalar_type());
    TORCH_CHECK(xoffs[m] >= 0 && xoffs[m] + ins[m] <= x.size(1), "lowrank_lrk::gemv: matrix ", m,
                " reads columns [", xoffs[m], ", ", xoffs[m] + ins[m], ") of x [", N, ", ", x.size(1), "]");
    yoff[m + 1] = yoff[m] + outs[m];
  }
  auto y = at::empty({N, yoff[M]}, x.options());
  if (N == 0 || M == 0) return y;
  const int64_t ldy = yoff[M], es = bf ? 2 : 4;
  // bf16: x as pairs (x[2p], x[2p+1]) per matrix and row, a zero completing an odd width
  std::vector<int64_t> xpo(M + 1, 0);
  for (int64_t m = 0; m < M; m++) xpo[m + 1] = xpo[m] + N * cdiv(ins[m], 2);
  std::vector<uint32_t> xp(bf ? xpo[M] : 0);
  if (bf) {
    const uint16_t* xs = (const uint16_t*)x.data_ptr();
    for (int64_t m = 0; m < M; m++)
      for (int64_t r = 0; r < N; r++) {
        const uint16_t* row = xs + r * ldx + xoffs[m];
        uint32_t* dst = xp.data() + xpo[m] + r * cdiv(ins[m], 2);
        for (int64_t p = 0; p < cdiv(ins[m], 2); p++) {
          const uint32_t lo = row[2 * p], hi = 2 * p + 1 < ins[m] ? row[2 * p + 1] : 0;
          dst[p] = lo | (hi << 16);
        }
      }
  }
  std::vector<Job> jobs;
  std::vector<int64_t> bytes;
  for (int64_t m = 0; m < M; m++) {
    const int64_t rows = padded_rows(outs[m]), K = inner(ins[m], bf);
    for (int64_t b = 0; b * BW < rows; b++)
      for (int64_t r0 = 0; r0 < N; r0 += MAX_ROWS) {
        jobs.push_back({m, b, r0});
        bytes.push_back(imin(BW, rows - b * BW) * K * es);
      }
  }
#if LRK_X86
  const char* xb = (const char*)x.data_ptr();
  char* yb = (char*)y.data_ptr();
  run_jobs(jobs, bytes, [&](const Job& J) {
    const int64_t m = J.m, rows = padded_rows(outs[m]), K = inner(ins[m], bf);
    const int64_t bw = imin(BW, rows - J.b * BW), n = imin(bw, outs[m] - J.b * BW), R = imin(MAX_ROWS, N - J.r0);
    const char* blk = (const char*)Ps[m].data_ptr() + J.b * BW * K * es;
    void* yr[MAX_ROWS];
    for (int64_t r = 0; r < R; r++) yr[r] = yb + ((J.r0 + r) * ldy + yoff[m] + J.b * BW) * es;
    if (bf) {
      const uint32_t* xr[MAX_ROWS];
      for (int64_t r = 0; r < R; r++) xr[r] = xp.data() + xpo[m] + (J.r0 + r) * cdiv(ins[m], 2);
      BF16_KERNELS[R - 1][bw / 16 - 1]((const uint16_t*)blk, xr, K / 2, (uint16_t* const*)yr, n);
    } else {
      const float* xr[MAX_ROWS];
      for (int64_t r = 0; r < R; r++) xr[r] = (const float*)(xb + ((J.r0 + r) * ldx + xoffs[m]) * es);
      F32_KERNELS[R - 1][bw / 16 - 1]((const float*)blk, xr, K, (float* const*)yr, n);
    }
  });
#endif
  return y;
}

// ------------------------------------------------------------------------------------ attention driver
at::Tensor attend(const at::Tensor& q, const at::Tensor& K, const at::Tensor& V, const at::Tensor& length,
                  const at::Tensor& pad, double scale) {
  TORCH_CHECK(q.dim() == 4 && K.dim() == 4 && V.dim() == 4, "lowrank_lrk::attend: q [B, Hkv, G, D], K/V [B, Hkv, S, D]");
  const bool bf = is_bf(q);
  check_isa(bf);
  const int64_t B = q.size(0), H = q.size(1), G = q.size(2), D = q.size(3), S = K.size(2);
  TORCH_CHECK(K.scalar_type() == q.scalar_type() && V.scalar_type() == q.scalar_type(), "lowrank_lrk::attend: dtypes");
  TORCH_CHECK(D % 16 == 0 && D <= 128, "lowrank_lrk::attend: head_dim must be a multiple of 16 up to 128, got ", D);
  TORCH_CHECK(K.size(0) >= B && V.size(0) >= B && K.size(1) == H && V.size(1) == H && V.size(2) == S &&
                  K.size(3) == D && V.size(3) == D && K.stride(3) == 1 && V.stride(3) == 1,
              "lowrank_lrk::attend: K/V must be [>=B, Hkv, S, D] with unit stride in D");
  TORCH_CHECK(length.scalar_type() == at::kLong && length.numel() == 1 && pad.scalar_type() == at::kLong &&
                  pad.numel() >= B && pad.is_contiguous(),
              "lowrank_lrk::attend: length [1] and pad [>=B] int64");
  const int64_t hi = length.data_ptr<int64_t>()[0];
  TORCH_CHECK(hi >= 0 && hi < S, "lowrank_lrk::attend: slot ", hi, " outside the cache of ", S, " slots");
  const int64_t* pd = pad.data_ptr<int64_t>();
  auto qc = q.contiguous();
  auto o = at::empty({B, H * G * D}, q.options());
  const int64_t es = bf ? 2 : 4;
  const int64_t work = B * H * (hi + 1) * D * 2 * es;
  const int64_t grain = work > (128 << 10) ? 1 : B * H;
#if LRK_X86
  at::parallel_for(0, B * H, grain, [&](int64_t i0, int64_t i1) {
    std::vector<float> sc(16 * (cdiv(hi + 1, 16) * 16));
    for (int64_t i = i0; i < i1; i++) {
      const int64_t b = i / H, h = i % H, lo = pd[b];
      const char* qp = (const char*)qc.data_ptr() + (i * G * D) * es;
      const char* kp = (const char*)K.data_ptr() + (b * K.stride(0) + h * K.stride(1)) * es;
      const char* vp = (const char*)V.data_ptr() + (b * V.stride(0) + h * V.stride(1)) * es;
      char* op = (char*)o.data_ptr() + (i * G * D) * es;
      if (lo > hi) {                    // no live slot (cannot happen for a real row): zeros, not NaN
        std::memset(op, 0, G * D * es);
        continue;
      }
      if (bf)
        ATTN_BF16[D / 16 - 1]((const uint16_t*)qp, (const uint16_t*)kp, (const uint16_t*)vp, K.stride(2), V.stride(2),
                              lo, hi, G, (float)scale, (uint16_t*)op, sc.data());
      else
        ATTN_F32[D / 16 - 1]((const float*)qp, (const float*)kp, (const float*)vp, K.stride(2), V.stride(2), lo, hi, G,
                             (float)scale, (float*)op, sc.data());
    }
  });
#endif
  return o;
}

std::string source_tag() { return LRK_STR(LRK_SOURCE_TAG); }

}  // namespace lrk

TORCH_LIBRARY(lowrank_lrk, m) {
  m.def("isa_flags() -> int", &lrk::isa_flags);
  m.def("source_tag() -> str", &lrk::source_tag);
  m.def("pack(Tensor W) -> Tensor");
  m.def("unpack(Tensor P, int out, int inp) -> Tensor");
  m.def("gemv(Tensor x, Tensor[] Ps, int[] outs, int[] ins, int[] xoffs) -> Tensor");
  m.def("attend(Tensor q, Tensor K, Tensor V, Tensor length, Tensor pad, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(lowrank_lrk, CPU, m) {
  m.impl("pack", &lrk::pack);
  m.impl("unpack", &lrk::unpack);
  m.impl("gemv", &lrk::gemv);
  m.impl("attend", &lrk::attend);
}
