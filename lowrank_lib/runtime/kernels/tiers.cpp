// lowrank_lib's fused decode attention over a tiered KV layer (the layout of lowrank_lib/kv/tiers.py).
//
// Compiled into the same library as lrk.cpp (same flags, ops in the same namespace lowrank_lrk, the same
// run-time ISA check and mask): the AVX-512 code where the CPU has q's dtype's AVX-512 subset (fp32: AVX512F/BW/VL,
// bf16: + AVX512_BF16), else the AVX2 + FMA code (+ F16C for fp16 scales), else the op refuses. Both share their
// control flow (tiers_item.h, included once per ISA) and their vector helpers with lrk.cpp (lrk_simd.h,
// lrk_simd2.h); threads come from the kernel pool (lrk_pool.h).
//
// Op:
//   tier_attend(q [B, H, G, d], k_exact [N_e, d] (or bf16 blocked [N_e / 16, d / 2, 16, 2]), v_exact [N_e, d],
//               e_off [B*H+1], runs [R, 9], r_off [B*H+1],
//               a_k, a_v (flat rank-major factors: q's dtype, or int8), b_k, b_v (flat bases, q's dtype),
//               k_scale?, v_scale? ([sum n_j] fp16 or fp32: int8 factors only), k_new?, v_new? [B, H, cap, d],
//               n_new [1] int64 (read at run time: a compiled / captured step replays for every step), scale)
//        -> o [B, H*G*d] in q's dtype
//   Per segment s = b*H + h, its G query heads (q[b, h]) attend over, in this order: the exact rows
//   e_off[s] : e_off[s+1], every run j of r_off[s] : r_off[s+1] in factor space, and the first n_new appended
//   rows k_new[b, h]. Run j (columns SEG, N, RK, RV, AK_OFF, AV_OFF, TOK_OFF, BK_OFF, BV_OFF) holds A_K
//   [RK, N] at a_k[AK_OFF:] (rank-major: row r is the N tokens' r-th coefficient), B_K [RK, d] at b_k[BK_OFF:],
//   likewise A_V / B_V, and (int8) one scale per token at k_scale / v_scale[TOK_OFF:].
//
// Algorithm (all arithmetic fp32; bf16 inputs are widened on load, int8 factors converted in registers):
//   scores   exact / appended rows: (scale q_g) . k_i (16 rows per transpose-add, each row read once for the
//            G heads of its group; bf16 exact keys blocked, k_exact [N_e / 16, d / 2, 16, 2]: 16 rows' scores in the
//            lanes of d / 2 products, no transpose, see blk_scores); run j: s_i = k_scale_i * sum_r (scale q_g B_K^T)_r
//            A_K[r, i]
//   softmax  ONE online softmax per query head over every tier, updated per chunk of CH tokens (running max
//            m_g, denominator l_g, output accumulator [d] rescaled when the max grows)
//   values   exact / appended: acc_g += p_gi v_i; run j: pa_g = sum_i p_gi v_scale_i A_V[:, i] summed in rank
//            space over the run (rescaled with acc), then acc_g += pa_g B_V once per run
//   threads  1 thread (or a small layer): the segments one after another. More (pool::threads_for): every
//            segment is cut into pieces of about equal cost (a piece may span tiers), the caller and the pool's
//            workers claim pieces, and the pieces of a segment are merged by their (m, l, acc) states
//            (log-sum-exp), so long segments are split (flash-decoding).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "lrk_pool.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#define LRK_X86 1
#include <immintrin.h>
#else
#define LRK_X86 0
#endif

namespace lrk {

int64_t isa_flags();  // lrk.cpp
bool attn_dp();       // lrk.cpp: bf16 scores on AVX512_BF16 dot products ($LOWRANK_LIB_ATTN_DP)

namespace tiers {

#ifndef LRK_TIER_CH
#define LRK_TIER_CH 4096         // most tokens per online-softmax update (the scores scratch: G * CH floats)
#endif
#ifndef LRK_TIER_PF
#define LRK_TIER_PF 1            // compile the prefetch of the other stream of exact rows (V while scoring K, next K
#endif                           // while summing V); whether it runs is prefetch_exact_rows()'s choice
constexpr int64_t CH = LRK_TIER_CH;
// Tokens per online-softmax update (the scores of one chunk, then its values): CH unless tier_chunk() sets fewer (the
// tests cut long tiers into many chunks with it). Fewer, longer chunks mean fewer switches between the K and V streams
// and fewer rescales: over one SmolLM2 layout (3k tokens, budget 0.5, 30 layers, 1 thread, arena memory) the kernel
// took 3.86 ms at 256 tokens, 3.55 at 1024, 3.47 at 2048 and 3.42 at 4096 (the dense kernel, which scores a whole
// head before its values: 4.5). The AVX2 code takes at most 256 KB of K and V rows per update (a2::chunk_rows).
static std::atomic<int64_t> g_chunk{CH};
constexpr int NG_MAX = 4;    // query heads per register group in the factor loops
constexpr int64_t NCOL = 9;
enum { SEG, N, RK, RV, AK_OFF, AV_OFF, TOK_OFF, BK_OFF, BV_OFF };

// The validated layer as raw pointers (element offsets are in the element type of each buffer).
struct Layer {
  int64_t G, D;
  float scale;
  const void* q;                        // [B*H, G, D] contiguous
  const void *ke, *ve;                  // exact rows, row strides ske / sve (elements)
  int64_t ske, sve;
  bool kblk;                            // ke blocked [Nb, D / 2, 16, 2] (bf16; see blk_scores), ske unused
  const int64_t *eoff, *runs, *roff;
  const void *ak, *av, *bk, *bv;        // factors (T or int8) and bases (T)
  const void *ks, *vs;                  // per-token scales (int8 factors), fp16 or fp32 (s32)
  bool q8, s32;
  const void *kn, *vn;                  // appended rows: segment (b, h) at b * sb + h * sh, rows at ss
  int64_t H, kn_sb, kn_sh, kn_ss, vn_sb, vn_sh, vn_ss, nn;
  bool pf;                              // software prefetch of the exact rows (prefetch_exact_rows)
};

// Whether the exact-row loops prefetch the other stream in software: $LOWRANK_LIB_TIER_PF=1 / 0, else off on AMD
// CPUs with AVX-512 and on elsewhere. On the 2-core AMD EPYC (Zen 4) VM the prefetches cost more than they hide: 8000
// exact rows x 3 KV heads x 30 layers (fp32, G = 3, d = 64) took 21.4 ms with them and 17.0 without at 1 thread,
// 13.5 / 11.9 at 2 (its hardware prefetchers follow the two streams; the dense kernel, which prefetches nothing, took
// 13.7-17.0 in the same runs). On the AVX2-only AMD EPYC (Zen 3) they pay, as they do for the dense AVX2 kernel
// (attend_head2): SmolLM2's composed-kvzip-q8 layers at budget 0.5 of an 8k context (bf16, 3,584 exact rows per KV
// head on average, blocked keys, 30 layers), five interleaved processes each: 9.2-9.6 ms with the prefetch (the blocked
// score pass's V rows into L2, blk_scores_ng) and 11.0-12.4 without at 1 thread, 5.5-5.9 / 6.2-6.5 at 2. Intel keeps
// the earlier default (on), not re-measured since.
static bool prefetch_exact_rows() {
  static const bool on = [] {
    const char* e = std::getenv("LOWRANK_LIB_TIER_PF");
    if (e && *e) return std::atoi(e) != 0;
#if LRK_X86 && (defined(__GNUC__) || defined(__clang__))
    return !(__builtin_cpu_is("amd") && __builtin_cpu_supports("avx512f"));
#else
    return true;
#endif
  }();
  return on;
}

// Per-call scratch of one thread (allocated by the driver, outside the ISA regions).
struct Scratch {
  float* qs;   // [G, D]  scaled queries
  float* sc;   // [G, CH] scores, then probabilities
  float* qb;   // [G, rmax] queries in run j's key basis
  float* pa;   // [G * rmax + 16] one chunk's probabilities in run j's value basis (order r * NG + g per group)
  float* pr;   // [G, rmax] the run piece's running sum of them (rescaled with acc)
};

#if LRK_X86
static inline void prefetch_row(const void* p, int64_t bytes) {   // SSE: inlined into both ISAs' code
  for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch((const char*)p + o, _MM_HINT_T0);
}
// the same into L2 only (the AVX2 blocked score pass's V rows, as attend_head2 does; into L1 measured no better)
static inline void prefetch_row_l2(const void* p, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch((const char*)p + o, _MM_HINT_T1);
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16,fma,avx2")
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,fma,avx2"))), \
                             apply_to = function)
#endif

}  // namespace tiers
#include "lrk_simd.h"  // lanes, exp512, ld / st (fp32, bf16), hsum16 (namespace lrk)
namespace tiers {
namespace a512 {

// masked (tail) loads of 16 elements widened to fp32: fp32, bf16, int8; per-token scales fp16 / fp32
static inline __m512 ldm(const float* p, __mmask16 k) { return _mm512_maskz_loadu_ps(k, p); }
static inline __m512 ldm(const uint16_t* p, __mmask16 k) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, p)), 16));
}
static inline __m512 ld(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
}
static inline __m512 ldm(const int8_t* p, __mmask16 k) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(k, p)));
}
using lrk::ld;
// tokens per online-softmax update (the exact rows' and the runs'): tier_chunk()'s (a2::chunk_rows says why AVX2
// takes fewer)
static inline int64_t chunk_rows(int64_t /*row_bytes*/) {
  return g_chunk.load(std::memory_order_relaxed);
}
template <typename T>
static void scale_query(const T* q, int64_t n, float scale, float* qs) {   // qs = scale q (n: a multiple of 16)
  const __m512 sv = _mm512_set1_ps(scale);
  for (int64_t i = 0; i < n; i += 16) _mm512_storeu_ps(qs + i, _mm512_mul_ps(ld(q + i), sv));
}
static inline __m512 ld_scale(const void* base, bool s32, int64_t i, __mmask16 k) {
  return s32 ? _mm512_maskz_loadu_ps(k, (const float*)base + i)
             : _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, (const uint16_t*)base + i));
}
template <typename F>
static inline __m512 ld_tail(const F* p, int64_t left) {  // 16 elements, or the `left` < 16 of a tail
  return left >= 16 ? ld(p) : ldm(p, lanes(left));
}

// ---- exact / appended rows: sc[g * CH + i] = qs_g . K_i (i < n <= CH); K rows at stride sk. With PF, pf: rows
// at stride spf prefetched alongside (the V rows of the same tokens, read next)
template <typename T, int DC, bool PF>
static void exact_scores(const float* qs, int64_t G, const T* K, int64_t sk, int64_t n, float* sc, const T* pf,
                         int64_t spf) {
  constexpr int D = DC * 16;
  for (int64_t t0 = 0; t0 < n; t0 += 16) {
    const int m = (int)(n - t0 < 16 ? n - t0 : 16);
    if (PF)
      for (int i = 0; i < m; i++) prefetch_row(pf + (t0 + i) * spf, D * sizeof(T));
    for (int64_t g = 0; g < G; g++) {       // the block's rows come from memory once, then from L1
      __m512 qv[DC];
      for (int c = 0; c < DC; c++) qv[c] = _mm512_loadu_ps(qs + g * D + c * 16);
      __m512 part[16];
      for (int i = 0; i < 16; i++) {
        if (i < m) {
          const T* k = K + (t0 + i) * sk;
          __m512 a = _mm512_mul_ps(qv[0], ld(k));
          for (int c = 1; c < DC; c++) a = _mm512_fmadd_ps(qv[c], ld(k + c * 16), a);
          part[i] = a;
        } else {
          part[i] = _mm512_setzero_ps();
        }
      }
      _mm512_storeu_ps(sc + g * CH + t0, hsum16(part));
    }
  }
}

// bf16 rows with D a multiple of 32 (exact_values' contract, the same bits): a row is D / 32 64-byte vectors, each
// split into two exact fp32 vectors in registers, its even dims (the low halves shifted up) and its odd dims (the
// high halves masked), where ld widens 16 dims per cross-lane conversion; the accumulators hold the dims in that
// order, permuted from acc's order on entry and back on exit
template <int DC, bool PF>
static void exact_values_pairs(const float* p, int64_t G, const uint16_t* V, int64_t sv, int64_t n, float* acc,
                               const uint16_t* pf, int64_t spf, int64_t npf) {
  constexpr int D = DC * 16, NV = DC / 2;
  constexpr int GV = DC >= 16 ? 1 : 16 / DC;   // heads per pass: GV * DC <= 16 accumulators
  const __m512i hm = _mm512_set1_epi32((int)0xFFFF0000u);
  const __m512i ev = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i od = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  for (int64_t g0 = 0; g0 < G; g0 += GV) {
    const int gb = (int)(G - g0 < GV ? G - g0 : GV);
    __m512 a[GV][DC];
    for (int g = 0; g < gb; g++)
      for (int c = 0; c < NV; c++) {
        const float* s = acc + (g0 + g) * D + c * 32;
        const __m512 x0 = _mm512_loadu_ps(s), x1 = _mm512_loadu_ps(s + 16);
        a[g][2 * c] = _mm512_permutex2var_ps(x0, ev, x1);
        a[g][2 * c + 1] = _mm512_permutex2var_ps(x0, od, x1);
      }
    for (int64_t t = 0; t < n; t++) {
      if (PF && g0 == 0 && t < npf) prefetch_row(pf + t * spf, D * sizeof(uint16_t));
      const uint16_t* v = V + t * sv;
      __m512 vv[DC];
      for (int c = 0; c < NV; c++) {
        const __m512i x = _mm512_loadu_si512((const void*)(v + c * 32));
        vv[2 * c] = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
        vv[2 * c + 1] = _mm512_castsi512_ps(_mm512_and_si512(x, hm));
      }
      for (int g = 0; g < gb; g++) {
        const __m512 pb = _mm512_set1_ps(p[(g0 + g) * CH + t]);
        for (int c = 0; c < DC; c++) a[g][c] = _mm512_fmadd_ps(pb, vv[c], a[g][c]);
      }
    }
    for (int g = 0; g < gb; g++)
      for (int c = 0; c < NV; c++) {
        float* s = acc + (g0 + g) * D + c * 32;
        _mm512_storeu_ps(s, _mm512_permutex2var_ps(a[g][2 * c], lo, a[g][2 * c + 1]));
        _mm512_storeu_ps(s + 16, _mm512_permutex2var_ps(a[g][2 * c], hi, a[g][2 * c + 1]));
      }
  }
}

// acc[g * D + :] += sum_{i < n} p[g * CH + i] V_i. With PF, pf: npf rows at stride spf prefetched alongside (the
// next chunk's K rows)
template <typename T, int DC, bool PF>
static void exact_values_rows(const float* p, int64_t G, const T* V, int64_t sv, int64_t n, float* acc, const T* pf,
                              int64_t spf, int64_t npf) {
  constexpr int D = DC * 16;
  constexpr int GV = DC >= 16 ? 1 : 16 / DC;   // heads per pass: GV * DC <= 16 accumulators
  for (int64_t g0 = 0; g0 < G; g0 += GV) {
    const int gb = (int)(G - g0 < GV ? G - g0 : GV);
    __m512 a[GV][DC];
    for (int g = 0; g < gb; g++)
      for (int c = 0; c < DC; c++) a[g][c] = _mm512_loadu_ps(acc + (g0 + g) * D + c * 16);
    for (int64_t t = 0; t < n; t++) {
      if (PF && g0 == 0 && t < npf) prefetch_row(pf + t * spf, D * sizeof(T));
      const T* v = V + t * sv;
      __m512 vv[DC];
      for (int c = 0; c < DC; c++) vv[c] = ld(v + c * 16);
      for (int g = 0; g < gb; g++) {
        const __m512 pb = _mm512_set1_ps(p[(g0 + g) * CH + t]);
        for (int c = 0; c < DC; c++) a[g][c] = _mm512_fmadd_ps(pb, vv[c], a[g][c]);
      }
    }
    for (int g = 0; g < gb; g++)
      for (int c = 0; c < DC; c++) _mm512_storeu_ps(acc + (g0 + g) * D + c * 16, a[g][c]);
  }
}
template <typename T, int DC, bool PF>
static void exact_values(const float* p, int64_t G, const T* V, int64_t sv, int64_t n, float* acc, const T* pf,
                         int64_t spf, int64_t npf) {
  if constexpr (std::is_same<T, uint16_t>::value && DC % 2 == 0)   // bf16, D a multiple of 32
    exact_values_pairs<DC, PF>(p, G, V, sv, n, acc, pf, spf, npf);
  else
    exact_values_rows<T, DC, PF>(p, G, V, sv, n, acc, pf, spf, npf);
}

// ---- bf16 exact / appended rows' scores on AVX512_BF16 dot products (D = DP * 32): sc[g * CH + i] = scale (q_g .
// K_i) from the unscaled bf16 queries q [G, D] (bf16 products are exact in fp32, as the widened ones; only the order
// of the fp32 sums differs, so the kernel's 1-ULP bf16 contract holds), 16 rows per transpose-add. The values stay
// exact_values' (fp32 probabilities: rounding them to bf16 broke that contract, 8 ULPs).
template <int DP, bool PF>
static void exact_scores_dp(const uint16_t* q, float scale, int64_t G, const uint16_t* K, int64_t sk, int64_t n,
                            float* sc, const uint16_t* pf, int64_t spf) {
  constexpr int D = DP * 32;
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t t0 = 0; t0 < n; t0 += 16) {
    const int m = (int)(n - t0 < 16 ? n - t0 : 16);
    if (PF)
      for (int i = 0; i < m; i++) prefetch_row(pf + (t0 + i) * spf, D * 2);
    for (int64_t g = 0; g < G; g++) {       // the block's rows come from memory once, then from L1
      __m512i qb[DP];
      for (int c = 0; c < DP; c++) qb[c] = _mm512_loadu_si512((const void*)(q + g * D + c * 32));
      const __m512 dots = m == 16 ? dot16_bf16<DP, true>(qb, K + t0 * sk, sk, 16)
                                  : dot16_bf16<DP, false>(qb, K + t0 * sk, sk, m);
      _mm512_storeu_ps(sc + g * CH + t0, _mm512_mul_ps(dots, vscale));
    }
  }
}
#define LRK_TIER_DP 1  // tiers_item.h: this ISA has exact_scores_dp and blk_scores_dp

// ---- blocked exact K (bf16, TieredLayer.block_exact_k): [Nb, D / 2, 16, 2], block b = rows 16b .. 16b + 15, dims
// (2j, 2j + 1) of its 16 rows one 64-byte vector (row i's pair in 32-bit lane i). A block's 16 scores come out in
// lanes, so a query pays one vdpbf16ps per dim pair and 16 rows, against the row layout's one per 32 dims and row
// plus a transpose-add per 16 rows (exact_scores_dp). Rows [r0, r0 + n) (global indices; a chunk or piece need not
// start on a block): sc[g * CH + r - r0] for each row r; the lanes of a boundary block outside the range are not
// stored.
static inline void blk_store(float* sc, int64_t off, __mmask16 k, __m512 v) {  // sc[off + i] = v[i], lanes i in k
  _mm512_mask_storeu_ps(sc + off, k, v);   // off >= -15: masked-off lanes are never accessed
}
static inline __mmask16 blk_lanes(int64_t b, int64_t r0, int64_t n) {          // lanes of block b inside [r0, r0+n)
  const int64_t lo = r0 - 16 * b, hi = r0 + n - 16 * b;
  return (__mmask16)(lanes(hi > 16 ? 16 : hi) & ~lanes(lo > 0 ? lo : 0));
}
// dot-product flavour: scale (q_g . K_r) from the unscaled bf16 queries q [G, D]; NG queries per pass, two
// accumulator chains per query (even and odd pairs)
template <int NG>
static void blk_scores_dp_ng(const uint16_t* q, float scale, int64_t D, const uint16_t* Kb, int64_t r0, int64_t n,
                             float* sc) {
  const __m512 vs = _mm512_set1_ps(scale);
  const int64_t P = D / 2;
  for (int64_t b = r0 >> 4, bl = (r0 + n - 1) >> 4; b <= bl; b++) {
    const __m512i* kb = (const __m512i*)(Kb + b * 16 * D);
    __m512 a0[NG], a1[NG];
    for (int g = 0; g < NG; g++) a0[g] = a1[g] = _mm512_setzero_ps();
    for (int64_t j = 0; j < P; j += 2) {      // P = D / 2 is a multiple of 8 (D: a multiple of 16)
      const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kb + j), k1 = (__m512bh)_mm512_loadu_si512(kb + j + 1);
      for (int g = 0; g < NG; g++) {
        const int32_t* qg = (const int32_t*)(q + g * D);
        a0[g] = _mm512_dpbf16_ps(a0[g], k0, (__m512bh)_mm512_set1_epi32(qg[j]));
        a1[g] = _mm512_dpbf16_ps(a1[g], k1, (__m512bh)_mm512_set1_epi32(qg[j + 1]));
      }
    }
    const __mmask16 k = blk_lanes(b, r0, n);
    for (int g = 0; g < NG; g++) blk_store(sc + g * CH, 16 * b - r0, k, _mm512_mul_ps(_mm512_add_ps(a0[g], a1[g]), vs));
  }
}
static void blk_scores_dp(const uint16_t* q, float scale, int64_t G, int64_t D, const uint16_t* Kb, int64_t r0,
                          int64_t n, float* sc) {
  for (int64_t g0 = 0; g0 < G; g0 += NG_MAX) {
    const uint16_t* qg = q + g0 * D;
    float* s = sc + g0 * CH;
    switch (G - g0 < NG_MAX ? G - g0 : NG_MAX) {
      case 1: blk_scores_dp_ng<1>(qg, scale, D, Kb, r0, n, s); break;
      case 2: blk_scores_dp_ng<2>(qg, scale, D, Kb, r0, n, s); break;
      case 3: blk_scores_dp_ng<3>(qg, scale, D, Kb, r0, n, s); break;
      default: blk_scores_dp_ng<4>(qg, scale, D, Kb, r0, n, s); break;
    }
  }
}
// widening flavour (no AVX512_BF16 dot products, or $LOWRANK_LIB_ATTN_DP=0): qs_g . K_r from the scaled fp32 queries
// qs [G, D]; a lane's pair splits into two fp32 values exactly (dim 2j: the low half shifted up, 2j + 1: the high
// half masked), one FMA each
// (pv, spv: V rows to prefetch, unused here: the AVX-512 code's blocked keys prefetch nothing, as measured on Zen 4)
template <int NG>
static void blk_scores_ng(const float* qs, int64_t D, const uint16_t* Kb, int64_t r0, int64_t n, float* sc,
                          const uint16_t* /*pv*/, int64_t /*spv*/) {
  const __m512i hm = _mm512_set1_epi32((int)0xFFFF0000u);
  for (int64_t b = r0 >> 4, bl = (r0 + n - 1) >> 4; b <= bl; b++) {
    const __m512i* kb = (const __m512i*)(Kb + b * 16 * D);
    __m512 a0[NG], a1[NG];
    for (int g = 0; g < NG; g++) a0[g] = a1[g] = _mm512_setzero_ps();
    for (int64_t j = 0; j < D / 2; j++) {
      const __m512i x = _mm512_loadu_si512(kb + j);
      const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)), hi = _mm512_castsi512_ps(_mm512_and_si512(x, hm));
      for (int g = 0; g < NG; g++) {
        a0[g] = _mm512_fmadd_ps(_mm512_set1_ps(qs[g * D + 2 * j]), lo, a0[g]);
        a1[g] = _mm512_fmadd_ps(_mm512_set1_ps(qs[g * D + 2 * j + 1]), hi, a1[g]);
      }
    }
    const __mmask16 k = blk_lanes(b, r0, n);
    for (int g = 0; g < NG; g++) blk_store(sc + g * CH, 16 * b - r0, k, _mm512_add_ps(a0[g], a1[g]));
  }
}

// ---- the online softmax of one chunk: scores sc[g * CH + i] (i < n) become probabilities relative to the
// running max m[g] (times vs[i], the per-token value scales of int8 factors, when vs is given: what the value
// product reads); l[g], acc[g * D + :] and (run pieces) pr[g * rv + :] are rescaled when the max grows; lanes >= n
// of the last block are 0
static void softmax_chunk(float* sc, int64_t G, int64_t n, int64_t D, float* m, float* l, float* acc, float* pr,
                          int64_t rv, const void* vs, bool s32) {
  for (int64_t g = 0; g < G; g++) {
    float* s = sc + g * CH;
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int64_t t0 = 0; t0 < n; t0 += 16) mx = _mm512_mask_max_ps(mx, lanes(n - t0), mx, _mm512_loadu_ps(s + t0));
    const float mc = _mm512_reduce_max_ps(mx);
    if (mc > m[g]) {
      const float alpha = expf(m[g] - mc);          // 0 on the first chunk (m = -inf)
      l[g] *= alpha;
      const __m512 av = _mm512_set1_ps(alpha);
      for (int64_t c = 0; c < D; c += 16) _mm512_storeu_ps(acc + g * D + c, _mm512_mul_ps(_mm512_loadu_ps(acc + g * D + c), av));
      if (pr)
        for (int64_t r = 0; r < rv; r++) pr[g * rv + r] *= alpha;
      m[g] = mc;
    }
    const __m512 mb = _mm512_set1_ps(m[g]);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t0 = 0; t0 < n; t0 += 16) {
      const __mmask16 k = lanes(n - t0);
      const __m512 e = _mm512_maskz_mov_ps(k, exp512(_mm512_sub_ps(_mm512_loadu_ps(s + t0), mb)));
      _mm512_storeu_ps(s + t0, vs ? _mm512_mul_ps(e, ld_scale(vs, s32, t0, k)) : e);
      sum = _mm512_add_ps(sum, e);
    }
    l[g] += _mm512_reduce_add_ps(sum);
  }
}

// ---- runs: qb[g * rk + r] = qs_g . B_K[r] (B_K [rk, D] in T)
template <typename T>
static void project(const float* qs, int64_t G, int64_t D, const T* bk, int64_t rk, float* qb) {
  for (int64_t r = 0; r < rk; r++)
    for (int64_t g = 0; g < G; g++) {
      __m512 a = _mm512_setzero_ps();
      for (int64_t c = 0; c < D; c += 16) a = _mm512_fmadd_ps(_mm512_loadu_ps(qs + g * D + c), ld(bk + r * D + c), a);
      qb[g * rk + r] = _mm512_reduce_add_ps(a);
    }
}

// TB blocks of 16 tokens from t0 (TB > 1: whole blocks) of run_scores below: TB * NG independent accumulator chains
// (one block's NG chains alone waited on the FMA latency, rank after rank), each token's sum in rank order as before
template <typename F, int NG, int TB>
static inline void run_scores_blk(const float* qb, int64_t rk, const F* A, int64_t lda, const void* ks, bool s32,
                                  int64_t t0, int64_t n, float* sc) {
  __m512 acc[TB][NG];
  for (int b = 0; b < TB; b++)
    for (int g = 0; g < NG; g++) acc[b][g] = _mm512_setzero_ps();
  for (int64_t r = 0; r < rk; r++) {
    __m512 qv[NG];
    for (int g = 0; g < NG; g++) qv[g] = _mm512_set1_ps(qb[g * rk + r]);
    for (int b = 0; b < TB; b++) {
      const __m512 a = TB > 1 ? ld(A + r * lda + t0 + 16 * b) : ld_tail(A + r * lda + t0, n - t0);
      for (int g = 0; g < NG; g++) acc[b][g] = _mm512_fmadd_ps(qv[g], a, acc[b][g]);
    }
  }
  for (int b = 0; b < TB; b++) {
    if (ks) {
      const __m512 s = ld_scale(ks, s32, t0 + 16 * b, lanes(n - t0 - 16 * b));
      for (int g = 0; g < NG; g++) acc[b][g] = _mm512_mul_ps(acc[b][g], s);
    }
    for (int g = 0; g < NG; g++) _mm512_storeu_ps(sc + g * CH + t0 + 16 * b, acc[b][g]);
  }
}

// sc[g * CH + i] = k_scale_i * sum_r qb[g * rk + r] A[r * lda + i]  (i < n; NG heads; ks null: no scale)
template <typename F, int NG>
static void run_scores(const float* qb, int64_t rk, const F* A, int64_t lda, const void* ks, bool s32, int64_t n,
                       float* sc) {
  constexpr int TB = NG <= 2 ? 4 : NG == 3 ? 3 : 2;    // TB * NG <= 9 chains: enough to cover the FMA latency
  int64_t t0 = 0;
  for (; t0 + 16 * TB <= n; t0 += 16 * TB) run_scores_blk<F, NG, TB>(qb, rk, A, lda, ks, s32, t0, n, sc);
  for (; t0 < n; t0 += 16) run_scores_blk<F, NG, 1>(qb, rk, A, lda, ks, s32, t0, n, sc);
}

// RBC ranks r0 .. r0 + RBC - 1 (a compile-time count: the RBC * NG accumulators stay in registers; with the count known
// only at run time GCC kept them on the stack, a store and a load per FMA) of run_values below
template <typename F, int NG, int RBC>
static inline void run_values_pass(const float* p, const F* A, int64_t lda, int64_t n, __m512 (&out)[RBC][NG]) {
  __m512 acc[RBC][NG];
  for (int r = 0; r < RBC; r++)
    for (int g = 0; g < NG; g++) acc[r][g] = _mm512_setzero_ps();
  const int64_t nf = n & ~(int64_t)15;
  for (int64_t t0 = 0; t0 < nf; t0 += 16) {
    __m512 pv[NG];
    for (int g = 0; g < NG; g++) pv[g] = _mm512_loadu_ps(p + g * CH + t0);
    for (int r = 0; r < RBC; r++) {
      const __m512 a = ld(A + r * lda + t0);
      for (int g = 0; g < NG; g++) acc[r][g] = _mm512_fmadd_ps(pv[g], a, acc[r][g]);
    }
  }
  if (nf < n) {
    __m512 pv[NG];
    for (int g = 0; g < NG; g++) pv[g] = _mm512_loadu_ps(p + g * CH + nf);
    for (int r = 0; r < RBC; r++) {
      const __m512 a = ld_tail(A + r * lda + nf, n - nf);
      for (int g = 0; g < NG; g++) acc[r][g] = _mm512_fmadd_ps(pv[g], a, acc[r][g]);
    }
  }
  for (int r = 0; r < RBC; r++)
    for (int g = 0; g < NG; g++) out[r][g] = acc[r][g];
}

// run_values (tiers_item.h) on this ISA: pa[r * NG + g] = sum_{i < n} p[g * CH + i] A[r * lda + i]. RB ranks per
// pass over the tokens (RB * NG accumulators of the 32 registers), so each 16 tokens' probabilities are loaded once per
// pass, not once per rank (a chunk's p, NG * 16 KB, does not stay in L1); each (r, g) sums its tokens in order as
// before: the same bits (24 layouts compared). Over the budget-0.25 layout (515k run tokens of int8 rank 8 + 8) this
// loop was the kernel's largest at 2 threads (17 % of samples), reading p eight times per token; alternating processes,
// the 30 layers took 2.02-2.26 ms against 2.10-2.41 at 2 threads, and the same within noise at 1 (3.07-3.49 /
// 3.15-3.34). The ranks left after the last full pass (fewer than RB <= 16) run in passes of 8, 4, 2 and 1.
template <int NG>
constexpr int run_values_rb() { return NG == 1 ? 16 : 24 / NG; }
using vecf = __m512;
constexpr int VLANES = 16;
static inline vecf vzero() { return _mm512_setzero_ps(); }
static inline void store_sums(float* out, const vecf* part) { _mm512_storeu_ps(out, hsum16(part)); }   // VLANES sums

// acc[g * D + :] += sum_r pr[g * rv + r] B_V[r, :]   (B_V [rv, D] in T; once per run piece)
template <typename T>
static void basis_acc(const float* pr, int64_t G, int64_t rv, const T* bv, int64_t D, float* acc) {
  for (int64_t g = 0; g < G; g++)
    for (int64_t c = 0; c < D; c += 16) {
      __m512 v = _mm512_loadu_ps(acc + g * D + c);
      for (int64_t r = 0; r < rv; r++) v = _mm512_fmadd_ps(_mm512_set1_ps(pr[g * rv + r]), ld(bv + r * D + c), v);
      _mm512_storeu_ps(acc + g * D + c, v);
    }
}

#include "tiers_item.h"  // run_item<T> and its pieces, on the primitives above
#undef LRK_TIER_DP
}  // namespace a512

#if defined(__clang__)
#pragma clang attribute pop
#endif
#pragma GCC pop_options

// ------------------------------------------------------------------------------------ AVX2 + FMA code
// The same primitives with 8-lane vectors, for CPUs without the AVX-512 subset a dtype needs (or an AVX-512 CPU
// limited by set_isa_mask): same layout, same chunking and online softmax, the same order of accumulation per score
// (d in order), per output element (tokens in order) and per rank-space sum; 8 tokens per transpose-add instead of
// 16, so the fp32 roundings of a score's partial sums differ from the AVX-512 code's. Tails (fewer than 8 elements)
// are loaded through a zeroed buffer (AVX2 has no masked 16-bit or 8-bit loads). fp16 scales need F16C.
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#endif

}  // namespace tiers
#include "lrk_simd2.h"  // lanes8, exp256, ld8 (fp32, bf16), hsum8, hsum8x8 (namespace lrk)
namespace tiers {
namespace a2 {

using lrk::ld8;
static inline __m256 ld8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}
// 8 elements widened to fp32, or the `left` < 8 of a tail (zeros past it; left <= 0: all zeros)
static inline __m256 ld_tail8(const float* p, int64_t left) {
  return left >= 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, lanes8(left > 0 ? left : 0));
}
template <typename F>
static inline __m256 ld_tail8(const F* p, int64_t left) {
  if (left >= 8) return ld8(p);
  F t[8] = {};
  for (int64_t i = 0; i < left; i++) t[i] = p[i];
  return ld8(t);
}
static inline __m256 ld_scale8(const void* base, bool s32, int64_t i, int64_t left) {
  if (s32) return ld_tail8((const float*)base + i, left);
  const uint16_t* p = (const uint16_t*)base + i;
  if (left >= 8) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
  uint16_t t[8] = {};
  for (int64_t k = 0; k < left; k++) t[k] = p[k];
  return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)t));
}
static inline float hmax8(__m256 a) {
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
  return _mm_cvtss_f32(m4);
}
// tokens per online-softmax update (the exact rows' and the runs'; row_bytes: one exact K row): at most the rows
// whose K and V fill 256 KB (1024 at d 64 in bf16; a multiple of 16), or tier_chunk()'s if fewer. The blocked score
// pass prefetches a chunk's V rows into L2 for the value pass that follows it; 4096-row chunks (1 MB of K and V at
// d 64) overflow the Zen 3's 512 KB L2, and their G * 4096 scores (48 KB at G 3) its L1. SmolLM2's composed-kvzip-q8
// layers at budget 0.5 of an 8k context (bf16, 3,584 exact rows per KV head on average, 30 layers, AMD EPYC Zen 3;
// tier_chunk() alternated in one process, 30 rounds, three processes): 8.24-8.68 ms at 1024 rows, 8.25-8.70 at 2048,
// 8.63-9.11 at 4096 at 1 thread; the exact tier alone 6.82-6.90 against 7.35-7.37; 2 threads and budget 0.25 (about
// 1,500 exact rows) 1-2 % faster. It does not depend on the prefetch choice, so that choice still changes no bit
static inline int64_t chunk_rows(int64_t row_bytes) {
  const int64_t ch = g_chunk.load(std::memory_order_relaxed);
  int64_t fit = (128 * 1024 / row_bytes) & ~(int64_t)15;
  fit = fit < 64 ? 64 : fit;
  return fit < ch ? fit : ch;
}
template <typename T>
static void scale_query(const T* q, int64_t n, float scale, float* qs) {   // qs = scale q (n: a multiple of 8)
  const __m256 sv = _mm256_set1_ps(scale);
  for (int64_t i = 0; i < n; i += 8) _mm256_storeu_ps(qs + i, _mm256_mul_ps(ld8(q + i), sv));
}

// ---- exact / appended rows: sc[g * CH + i] = qs_g . K_i (i < n <= CH), 8 rows per transpose-add (lanes >= n hold
// copies of a real row's score: the softmax masks them). With PF, pf: rows at stride spf prefetched alongside
template <typename T, int DC, bool PF>
static void exact_scores(const float* qs, int64_t G, const T* K, int64_t sk, int64_t n, float* sc, const T* pf,
                         int64_t spf) {
  constexpr int D = DC * 16;
  for (int64_t t0 = 0; t0 < n; t0 += 8) {
    const int64_t m = n - t0 < 8 ? n - t0 : 8;
    if (PF)
      for (int64_t i = 0; i < m; i++) prefetch_row(pf + (t0 + i) * spf, D * sizeof(T));
    const T* k[8];
    for (int i = 0; i < 8; i++) k[i] = K + (t0 + (i < m ? i : m - 1)) * sk;
    for (int64_t g = 0; g < G; g++) {       // the block's rows come from memory once, then from L1
      __m256 part[8];
      for (int i = 0; i < 8; i++) part[i] = _mm256_setzero_ps();
      for (int c = 0; c < 2 * DC; c++) {
        const __m256 qv = _mm256_loadu_ps(qs + g * D + c * 8);
        for (int i = 0; i < 8; i++) part[i] = _mm256_fmadd_ps(qv, ld8(k[i] + c * 8), part[i]);
      }
      _mm256_storeu_ps(sc + g * CH + t0, hsum8x8(part));
    }
  }
}

// ---- blocked exact K (the AVX-512 blk_scores' layout and contract): each block as two halves of 8 lanes, a lane's
// dim pair split into two fp32 values exactly, one FMA each; the lanes of a boundary block outside [r0, r0 + n) are
// not stored (through a buffer: AVX2 has no masked store of a lane range)
// pv (not null: Layer::pf): the V rows of the block (row t of [r0, r0 + n) at pv + (t - r0) * spv) prefetched into L2
// while it is scored, as the dense AVX2 kernel does (attend_head2). Its other prefetch, K ahead into L1, measured a
// loss here (1, 2 or 4 blocks ahead: 7.6-9.1 ms against 7.3-8.5 without, four alternated processes each, Zen 3)
template <int NG>
static void blk_scores_ng(const float* qs, int64_t D, const uint16_t* Kb, int64_t r0, int64_t n, float* sc,
                          const uint16_t* pv, int64_t spv) {
  const __m256i hm = _mm256_set1_epi32((int)0xFFFF0000u);
  for (int64_t b = r0 >> 4, bl = (r0 + n - 1) >> 4; b <= bl; b++) {
    const uint16_t* kb = Kb + b * 16 * D;
    if (pv) {
      const int64_t t0 = 16 * b - r0 > 0 ? 16 * b - r0 : 0, t1 = 16 * b + 16 - r0 < n ? 16 * b + 16 - r0 : n;
      for (int64_t t = t0; t < t1; t++) prefetch_row_l2(pv + t * spv, D * 2);
    }
    // both halves per dim pair: each query pair broadcast once for the 16 lanes (the same sums in the same order)
    __m256 a0[NG], a1[NG];
    for (int g = 0; g < NG; g++) a0[g] = a1[g] = _mm256_setzero_ps();
    for (int64_t j = 0; j < D / 2; j++) {
      const __m256i x0 = _mm256_loadu_si256((const __m256i*)(kb + j * 32));
      const __m256i x1 = _mm256_loadu_si256((const __m256i*)(kb + j * 32 + 16));
      const __m256 lo0 = _mm256_castsi256_ps(_mm256_slli_epi32(x0, 16));
      const __m256 hi0 = _mm256_castsi256_ps(_mm256_and_si256(x0, hm));
      const __m256 lo1 = _mm256_castsi256_ps(_mm256_slli_epi32(x1, 16));
      const __m256 hi1 = _mm256_castsi256_ps(_mm256_and_si256(x1, hm));
      for (int g = 0; g < NG; g++) {
        const __m256 qe = _mm256_broadcast_ss(qs + g * D + 2 * j), qo = _mm256_broadcast_ss(qs + g * D + 2 * j + 1);
        a0[g] = _mm256_fmadd_ps(qo, hi0, _mm256_fmadd_ps(qe, lo0, a0[g]));
        a1[g] = _mm256_fmadd_ps(qo, hi1, _mm256_fmadd_ps(qe, lo1, a1[g]));
      }
    }
    const int64_t lo = r0 - 16 * b > 0 ? r0 - 16 * b : 0, hi = r0 + n - 16 * b < 16 ? r0 + n - 16 * b : 16;
    for (int g = 0; g < NG; g++) {
      float* out = sc + g * CH + 16 * b - r0;
      if (lo == 0 && hi == 16) {
        _mm256_storeu_ps(out, a0[g]);
        _mm256_storeu_ps(out + 8, a1[g]);
      } else {
        float t[16];
        _mm256_storeu_ps(t, a0[g]);
        _mm256_storeu_ps(t + 8, a1[g]);
        for (int64_t i = lo; i < hi; i++) out[i] = t[i];
      }
    }
  }
}

// acc[g][:] += sum_{t < n} p[g * CH + t] V_t for ONE head, 12 8-float columns per pass (lrk_simd2.h pv_cols12, shared
// with the dense kernel's pv_query2; d <= 96: whole rows).
// With PF (the first head only), pf: npf rows at stride spf prefetched alongside
template <typename T, int DC, bool PF>
static void values_head(const float* p, int64_t g, const T* V, int64_t sv, int64_t n, float* acc, const T* pf,
                        int64_t spf, int64_t npf) {
  constexpr int D = DC * 16, NC = 2 * DC, CB = 12;
  float* const ag = acc + g * D;
  const float* const pg = p + g * CH;
  for (int c0 = 0; c0 < NC; c0 += CB) {
    const int cn = NC - c0 < CB ? NC - c0 : CB;
    __m256 a[CB];
    for (int c = 0; c < CB; c++)
      if (c < cn) a[c] = _mm256_loadu_ps(ag + (c0 + c) * 8);
    const bool pfh = PF && g == 0 && c0 == 0;
    pv_cols12(pg, V + c0 * 8, sv, n, cn, a, [&](int64_t t) {
      if (pfh && t < npf) prefetch_row(pf + t * spf, D * sizeof(T));
    });
    for (int c = 0; c < CB; c++)
      if (c < cn) _mm256_storeu_ps(ag + (c0 + c) * 8, a[c]);
  }
}

// acc[g * D + :] += sum_{i < n} p[g * CH + i] V_i. With PF, pf: npf rows at stride spf prefetched alongside
template <typename T, int DC, bool PF>
static void exact_values(const float* p, int64_t G, const T* V, int64_t sv, int64_t n, float* acc, const T* pf,
                         int64_t spf, int64_t npf) {
  // one head per pass: 12 column chunks cover d <= 96, so each pass reads whole V rows (the chunk's rows stay in L1 /
  // L2 for the next head). 2-4 heads per pass cut the rows into 12 / GB columns and, at 3 / 4 heads, overflowed the
  // 16 ymm registers (the dense AVX2 kernel's P V ran 1.4x faster for the same change, lrk.cpp pv_query2); each
  // output still sums its tokens in order: the same bits
  for (int64_t g = 0; g < G; g++) values_head<T, DC, PF>(p, g, V, sv, n, acc, pf, spf, npf);
}

// ---- the online softmax of one chunk (the AVX-512 softmax_chunk's contract; lanes >= n of the last 8 are 0)
static void softmax_chunk(float* sc, int64_t G, int64_t n, int64_t D, float* m, float* l, float* acc, float* pr,
                          int64_t rv, const void* vs, bool s32) {
  const __m256 ninf = _mm256_set1_ps(-INFINITY);
  for (int64_t g = 0; g < G; g++) {
    float* s = sc + g * CH;
    const int64_t nf = n & ~(int64_t)7;     // whole blocks, then the tail's lanes under a mask (built once)
    __m256 mx = ninf;
    for (int64_t t0 = 0; t0 < nf; t0 += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(s + t0));
    if (nf < n)
      mx = _mm256_max_ps(mx, _mm256_blendv_ps(ninf, _mm256_loadu_ps(s + nf), _mm256_castsi256_ps(lanes8(n - nf))));
    const float mc = hmax8(mx);
    if (mc > m[g]) {
      const float alpha = expf(m[g] - mc);          // 0 on the first chunk (m = -inf)
      l[g] *= alpha;
      const __m256 av = _mm256_set1_ps(alpha);
      for (int64_t c = 0; c < D; c += 8) _mm256_storeu_ps(acc + g * D + c, _mm256_mul_ps(_mm256_loadu_ps(acc + g * D + c), av));
      if (pr)
        for (int64_t r = 0; r < rv; r++) pr[g * rv + r] *= alpha;
      m[g] = mc;
    }
    const __m256 mb = _mm256_set1_ps(m[g]);
    __m256 sum = _mm256_setzero_ps();
    for (int64_t t0 = 0; t0 < nf; t0 += 8) {
      const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + t0), mb));
      _mm256_storeu_ps(s + t0, vs ? _mm256_mul_ps(e, ld_scale8(vs, s32, t0, 8)) : e);
      sum = _mm256_add_ps(sum, e);
    }
    if (nf < n) {
      const __m256 e = _mm256_and_ps(exp256(_mm256_sub_ps(_mm256_loadu_ps(s + nf), mb)),
                                     _mm256_castsi256_ps(lanes8(n - nf)));
      _mm256_storeu_ps(s + nf, vs ? _mm256_mul_ps(e, ld_scale8(vs, s32, nf, n - nf)) : e);
      sum = _mm256_add_ps(sum, e);
    }
    l[g] += hsum8(sum);
  }
}

// ---- runs: qb[g * rk + r] = qs_g . B_K[r] (B_K [rk, D] in T)
template <typename T>
static void project(const float* qs, int64_t G, int64_t D, const T* bk, int64_t rk, float* qb) {
  for (int64_t r = 0; r < rk; r++)
    for (int64_t g = 0; g < G; g++) {
      __m256 a = _mm256_setzero_ps();
      for (int64_t c = 0; c < D; c += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(qs + g * D + c), ld8(bk + r * D + c), a);
      qb[g * rk + r] = hsum8(a);
    }
}

// sc[g * CH + i] = k_scale_i * sum_r qb[g * rk + r] A[r * lda + i]  (i < n; NG heads; ks null: no scale); 16 tokens
// per pass (two independent accumulators per head)
template <typename F, int NG>
static void run_scores(const float* qb, int64_t rk, const F* A, int64_t lda, const void* ks, bool s32, int64_t n,
                       float* sc) {
  for (int64_t t0 = 0; t0 < n; t0 += 16) {
    __m256 acc[2][NG];
    for (int h = 0; h < 2; h++)
      for (int g = 0; g < NG; g++) acc[h][g] = _mm256_setzero_ps();
    const bool whole = t0 + 16 <= n;      // no tail test per load (the same values)
    for (int64_t r = 0; r < rk; r++) {
      const __m256 a0 = whole ? ld8(A + r * lda + t0) : ld_tail8(A + r * lda + t0, n - t0),
                   a1 = whole ? ld8(A + r * lda + t0 + 8) : ld_tail8(A + r * lda + t0 + 8, n - t0 - 8);
      for (int g = 0; g < NG; g++) {
        const __m256 qv = _mm256_set1_ps(qb[g * rk + r]);
        acc[0][g] = _mm256_fmadd_ps(qv, a0, acc[0][g]);
        acc[1][g] = _mm256_fmadd_ps(qv, a1, acc[1][g]);
      }
    }
    if (ks) {
      const __m256 s0 = ld_scale8(ks, s32, t0, n - t0), s1 = ld_scale8(ks, s32, t0 + 8, n - t0 - 8);
      for (int g = 0; g < NG; g++) acc[0][g] = _mm256_mul_ps(acc[0][g], s0), acc[1][g] = _mm256_mul_ps(acc[1][g], s1);
    }
    for (int g = 0; g < NG; g++) {
      _mm256_storeu_ps(sc + g * CH + t0, acc[0][g]);
      _mm256_storeu_ps(sc + g * CH + t0 + 8, acc[1][g]);
    }
  }
}

// RBC ranks (compile-time: the RBC * NG accumulators stay in registers) of run_values below, over every token
template <typename F, int NG, int RBC>
static inline void run_values_pass(const float* p, const F* A, int64_t lda, int64_t n, __m256 (&out)[RBC][NG]) {
  __m256 acc[RBC][NG];
  for (int r = 0; r < RBC; r++)
    for (int g = 0; g < NG; g++) acc[r][g] = _mm256_setzero_ps();
  const int64_t nf = n & ~(int64_t)7;
  for (int64_t t0 = 0; t0 < nf; t0 += 8) {
    __m256 pv[NG];
    for (int g = 0; g < NG; g++) pv[g] = _mm256_loadu_ps(p + g * CH + t0);
    for (int r = 0; r < RBC; r++) {
      const __m256 a = ld8(A + r * lda + t0);
      for (int g = 0; g < NG; g++) acc[r][g] = _mm256_fmadd_ps(pv[g], a, acc[r][g]);
    }
  }
  if (nf < n) {
    __m256 pv[NG];
    for (int g = 0; g < NG; g++) pv[g] = _mm256_loadu_ps(p + g * CH + nf);
    for (int r = 0; r < RBC; r++) {
      const __m256 a = ld_tail8(A + r * lda + nf, n - nf);
      for (int g = 0; g < NG; g++) acc[r][g] = _mm256_fmadd_ps(pv[g], a, acc[r][g]);
    }
  }
  for (int r = 0; r < RBC; r++)
    for (int g = 0; g < NG; g++) out[r][g] = acc[r][g];
}

// run_values (tiers_item.h) on this ISA: pa[r * NG + g] = sum_{i < n} p[g * CH + i] A[r * lda + i]. RB ranks per
// pass over the tokens (RB * NG <= 12 accumulators, with the NG probabilities and the factor row within the 16
// registers), so each 8 tokens' probabilities are loaded once per pass, not once per rank, and RB * NG independent
// chains cover the FMA latency (one rank's NG chains did not); each (r, g) sums its tokens in order as before, the same
// bits. The ranks left after the full passes (fewer than RB <= 8) run in passes of 4, 2 and 1.
template <int NG>
constexpr int run_values_rb() { return NG == 1 ? 8 : NG == 2 ? 6 : NG == 3 ? 4 : 2; }
using vecf = __m256;
constexpr int VLANES = 8;
static inline vecf vzero() { return _mm256_setzero_ps(); }
static inline void store_sums(float* out, const vecf* part) { _mm256_storeu_ps(out, hsum8x8(part)); }   // VLANES sums

// acc[g * D + :] += sum_r pr[g * rv + r] B_V[r, :]   (B_V [rv, D] in T; once per run piece)
template <typename T>
static void basis_acc(const float* pr, int64_t G, int64_t rv, const T* bv, int64_t D, float* acc) {
  for (int64_t g = 0; g < G; g++)
    for (int64_t c = 0; c < D; c += 8) {
      __m256 v = _mm256_loadu_ps(acc + g * D + c);
      for (int64_t r = 0; r < rv; r++) v = _mm256_fmadd_ps(_mm256_set1_ps(pr[g * rv + r]), ld8(bv + r * D + c), v);
      _mm256_storeu_ps(acc + g * D + c, v);
    }
}

#include "tiers_item.h"  // run_item<T> and its pieces, on the primitives above
}  // namespace a2

#if defined(__clang__)
#pragma clang attribute pop
#endif
#pragma GCC pop_options
#endif  // LRK_X86

typedef void (*item_fn)(const Layer&, int64_t, int64_t, int64_t, float*, const Scratch&);
#if LRK_X86
static const item_fn ITEM512_F32 = a512::run_item<float>, ITEM512_BF16 = a512::run_item<uint16_t>;
static const item_fn ITEM2_F32 = a2::run_item<float>, ITEM2_BF16 = a2::run_item<uint16_t>;
#endif

// ------------------------------------------------------------------------------------ driver
struct Item {
  int64_t s, lo, hi;
};

static bool is_float_or_bf16(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16;
}

static const char* OP = "lowrank_lrk::tier_attend: ";

static void check_flat(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 1 && t.is_contiguous() && t.device().is_cpu(), OP, name,
              " must be a 1-D contiguous CPU tensor, got shape ", t.sizes(), " strides ", t.strides());
}

// One validated layout (validate: every check that reads neither q nor the appended rows; the layout's tensors must
// outlive it)
struct Layout {
  Layer L{};                       // everything but q, G, scale, nn, the appended rows and the prefetch choice
  at::ScalarType dt = at::kFloat;
  bool bf = false;
  int64_t B = 0, S = 0, rmax = 0;
  std::vector<int64_t> seg_tokens; // tokens of the fitted tiers per segment
};

// One validated call: the layer as raw pointers and its work items (the same on every member of a team: they
// depend on the layout and the team's size only)
struct Call {
  Layer L{};
  bool bf = false, w512 = false;
  int64_t rmax = 0, tu = 1;     // tu: the threads the items are cut for
  std::vector<Item> items;
};

int64_t state_floats(int64_t S, int64_t G, int64_t D, int64_t threads) {
  return (S + 4 * std::max<int64_t>(threads, 1) + 2) * (2 * G + G * D);
}

// every check of a layout (B rows of H KV heads of dim D, dtype dt) that reads neither q nor the appended rows: every
// offset against its buffer, so a bad layout is an error, never a read out of bounds
static Layout validate(at::ScalarType dt, int64_t B, int64_t H, int64_t D, const at::Tensor& k_exact,
                const at::Tensor& v_exact, const at::Tensor& e_off, const at::Tensor& runs, const at::Tensor& r_off,
                const at::Tensor& a_k, const at::Tensor& a_v, const at::Tensor& b_k, const at::Tensor& b_v,
                const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale) {
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16, OP, "q must be fp32 / bf16, got ", dt);
  const bool bf = dt == at::kBFloat16;
  const int64_t S = B * H;
  TORCH_CHECK(D % 16 == 0 && D >= 16 && D <= 128, OP, "head_dim must be a multiple of 16 up to 128, got ", D);
  // k_exact: rows [N_e, D], or (bf16) blocked [N_e / 16, D / 2, 16, 2] contiguous (TieredLayer.block_exact_k)
  const bool kblk = k_exact.dim() == 4;
  if (kblk)
    TORCH_CHECK(dt == at::kBFloat16 && k_exact.size(1) == D / 2 && k_exact.size(2) == 16 && k_exact.size(3) == 2 &&
                    k_exact.scalar_type() == dt && k_exact.is_contiguous() && k_exact.device().is_cpu(),
                OP, "a blocked k_exact must be contiguous bf16 [N_e / 16, ", D / 2, ", 16, 2] (bf16 q), got ",
                k_exact.sizes(), " ", k_exact.scalar_type(), " for ", dt, " q");
  for (auto [t, name] : {std::pair<const at::Tensor*, const char*>{&k_exact, "k_exact"}, {&v_exact, "v_exact"}}) {
    if (t == &k_exact && kblk) continue;
    TORCH_CHECK(t->dim() == 2 && t->size(1) == D && t->scalar_type() == dt && t->device().is_cpu() &&
                    (t->size(0) == 0 || t->stride(1) == 1),
                OP, name, " must be [N_e, ", D, "] ", dt, " with unit column stride, got ", t->sizes(), " ",
                t->scalar_type());
  }
  const int64_t n_k = kblk ? 16 * k_exact.size(0) : k_exact.size(0);   // rows k_exact holds (each is checked below)
  for (auto [t, name] : {std::pair<const at::Tensor*, const char*>{&e_off, "e_off"}, {&r_off, "r_off"}}) {
    check_flat(*t, name);
    TORCH_CHECK(t->scalar_type() == at::kLong && t->numel() == S + 1, OP, name, " must be [B*H + 1] = [", S + 1,
                "] int64, got [", t->numel(), "] ", t->scalar_type());
  }
  TORCH_CHECK(runs.dim() == 2 && runs.size(1) == NCOL && runs.scalar_type() == at::kLong && runs.is_contiguous(), OP,
              "runs must be [R, 9] contiguous int64, got ", runs.sizes(), " ", runs.scalar_type());
  for (auto [t, name] : {std::pair<const at::Tensor*, const char*>{&a_k, "a_k"}, {&a_v, "a_v"}, {&b_k, "b_k"},
                         {&b_v, "b_v"}})
    check_flat(*t, name);
  const bool q8 = a_k.scalar_type() == at::kChar;
  TORCH_CHECK((a_k.scalar_type() == dt || q8) && a_v.scalar_type() == a_k.scalar_type(), OP,
              "a_k / a_v must both be ", dt, " or both int8, got ", a_k.scalar_type(), " / ", a_v.scalar_type());
  TORCH_CHECK(b_k.scalar_type() == dt && b_v.scalar_type() == dt, OP, "b_k / b_v must be ", dt, ", got ",
              b_k.scalar_type(), " / ", b_v.scalar_type());
  bool s32 = false;
  if (q8) {
    TORCH_CHECK(k_scale.has_value() && v_scale.has_value(), OP, "int8 factors need k_scale and v_scale");
    check_flat(*k_scale, "k_scale");
    check_flat(*v_scale, "v_scale");
    const auto st = k_scale->scalar_type();
    TORCH_CHECK((st == at::kHalf || st == at::kFloat) && v_scale->scalar_type() == st, OP,
                "k_scale / v_scale must both be fp16 or both fp32, got ", st, " / ", v_scale->scalar_type());
    s32 = st == at::kFloat;
  }
  const int64_t* eo = e_off.data_ptr<int64_t>();
  const int64_t* ro = r_off.data_ptr<int64_t>();
  const int64_t* rd = runs.data_ptr<int64_t>();
  const int64_t R = runs.size(0);
  TORCH_CHECK(eo[0] == 0 && eo[S] <= n_k && eo[S] <= v_exact.size(0), OP,
              "e_off must start at 0 and end at most at the rows k_exact / v_exact hold (", n_k, " / ",
              v_exact.size(0), "), got ", eo[0], " .. ", eo[S]);
  TORCH_CHECK(ro[0] == 0 && ro[S] <= R, OP, "r_off must start at 0 and end at most at R = ", R, ", got ", ro[0], " .. ", ro[S]);
  const int64_t n_scale = q8 ? std::min(k_scale->numel(), v_scale->numel()) : 0;
  int64_t rmax = 0;
  Layout y;
  std::vector<int64_t>& seg_tokens = y.seg_tokens;
  seg_tokens.assign(S, 0);
  for (int64_t s = 0; s < S; s++) {
    TORCH_CHECK(eo[s + 1] >= eo[s] && ro[s + 1] >= ro[s], OP, "e_off / r_off decrease at segment ", s);
    seg_tokens[s] = eo[s + 1] - eo[s];
    for (int64_t j = ro[s]; j < ro[s + 1]; j++) {
      const int64_t* r = rd + j * NCOL;
      const int64_t n = r[N], rk = r[RK], rv = r[RV];
      TORCH_CHECK(r[SEG] == s, OP, "run ", j, " belongs to segment ", r[SEG], " but r_off gives it to ", s);
      TORCH_CHECK(n >= 0 && rk >= 0 && rv >= 0 && r[AK_OFF] >= 0 && r[AV_OFF] >= 0 && r[TOK_OFF] >= 0 &&
                      r[BK_OFF] >= 0 && r[BV_OFF] >= 0,
                  OP, "run ", j, " has a negative count or offset");
      TORCH_CHECK(r[AK_OFF] + rk * n <= a_k.numel() && r[AV_OFF] + rv * n <= a_v.numel(), OP, "run ", j,
                  ": factors [", rk, " + ", rv, ", ", n, "] at ", r[AK_OFF], " / ", r[AV_OFF], " overrun a_k [",
                  a_k.numel(), "] / a_v [", a_v.numel(), "]");
      TORCH_CHECK(r[BK_OFF] + rk * D <= b_k.numel() && r[BV_OFF] + rv * D <= b_v.numel(), OP, "run ", j,
                  ": bases at ", r[BK_OFF], " / ", r[BV_OFF], " overrun b_k [", b_k.numel(), "] / b_v [", b_v.numel(),
                  "]");
      TORCH_CHECK(!q8 || r[TOK_OFF] + n <= n_scale, OP, "run ", j, ": scales [", r[TOK_OFF], ", ", r[TOK_OFF] + n,
                  ") overrun k_scale / v_scale [", n_scale, "]");
      rmax = std::max(rmax, std::max(rk, rv));
      seg_tokens[s] += n;
    }
  }
  Layer& L = y.L;
  L.D = D, L.H = H;
  L.ke = k_exact.data_ptr(), L.ve = v_exact.data_ptr();
  L.ske = kblk ? D : k_exact.size(0) ? k_exact.stride(0) : D, L.sve = v_exact.size(0) ? v_exact.stride(0) : D;
  L.kblk = kblk;
  L.eoff = eo, L.runs = rd, L.roff = ro;
  L.ak = a_k.data_ptr(), L.av = a_v.data_ptr(), L.bk = b_k.data_ptr(), L.bv = b_v.data_ptr();
  L.q8 = q8, L.s32 = s32;
  L.ks = q8 ? k_scale->data_ptr() : nullptr, L.vs = q8 ? v_scale->data_ptr() : nullptr;
  y.dt = dt, y.bf = bf, y.B = B, y.S = S, y.rmax = rmax;
  return y;
}

// the call of a validated layout: q (G heads per KV head, contiguous at qp), nn appended rows of k_new / v_new; its
// work items for the threads there are now
static Call make_call(const Layout& y, const void* qp, int64_t G, const std::optional<at::Tensor>& k_new,
                      const std::optional<at::Tensor>& v_new, int64_t nn, double scale) {
  const bool bf = y.bf, q8 = y.L.q8;
  const auto dt = y.dt;
  const int64_t B = y.B, H = y.L.H, D = y.L.D, S = y.S, rmax = y.rmax;
  const int64_t *eo = y.L.eoff, *ro = y.L.roff, *rd = y.L.runs;
  const std::vector<int64_t>& seg_tokens = y.seg_tokens;
  // the AVX-512 code where the CPU has this dtype's subset (as lrk.cpp's kinds), else the AVX2 + FMA code
  const int64_t isa = isa_flags(), need = bf ? 15 : 7;
  const bool w512 = (isa & need) == need;
  TORCH_CHECK(w512 || (isa & 96) == 96, OP, "this CPU lacks AVX2 + FMA and ",
              bf ? "AVX512F/BW/VL + AVX512_BF16" : "AVX512F/BW/VL", " (isa_flags=", isa, ")");
  TORCH_CHECK(G >= 1, OP, "q has no query head per KV head (G = 0)");
#if LRK_X86
  TORCH_CHECK(w512 || !q8 || y.L.s32 || __builtin_cpu_supports("f16c"), OP, "fp16 scales need F16C on the AVX2 path");
#endif
  TORCH_CHECK(nn >= 0, OP, "n_new must be non-negative, got ", nn);
  Call c;
  Layer& L = c.L;
  L = y.L;
  L.nn = nn;
  if (nn > 0) {
    TORCH_CHECK(k_new.has_value() && v_new.has_value(), OP, "n_new = ", nn, " but no k_new / v_new");
    for (auto [t, name] : {std::pair<const at::Tensor*, const char*>{&*k_new, "k_new"}, {&*v_new, "v_new"}})
      TORCH_CHECK(t->dim() == 4 && t->size(0) == B && t->size(1) == H && t->size(3) == D && t->scalar_type() == dt &&
                      t->stride(3) == 1 && t->device().is_cpu(),
                  OP, name, " must be [", B, ", ", H, ", cap, ", D, "] ", dt, " with unit stride in d, got ",
                  t->sizes(), " ", t->scalar_type());
    TORCH_CHECK(nn <= k_new->size(2) && nn <= v_new->size(2), OP, "n_new = ", nn, " exceeds the appended capacity ",
                k_new->size(2));
    L.kn = k_new->data_ptr();
    L.vn = v_new->data_ptr();
    L.kn_sb = k_new->stride(0), L.kn_sh = k_new->stride(1), L.kn_ss = k_new->stride(2);
    L.vn_sb = v_new->stride(0), L.vn_sh = v_new->stride(1), L.vn_ss = v_new->stride(2);
  }
  for (int64_t s = 0; s < S; s++)
    TORCH_CHECK(seg_tokens[s] + nn > 0, OP, "segment ", s, " (row ", s / H, ", KV head ", s % H, ") holds no token");

  L.G = G, L.scale = (float)scale, L.q = qp;
  L.pf = LRK_TIER_PF && prefetch_exact_rows();

  // ---- work items: one per segment, or (several threads, enough work) pieces of about equal cost
  // cost model (bytes-equivalent): an exact / appended row streams 2 d elements; a factor-space token reads
  // (r_k + r_v) factor entries and costs its rank-space products, softmax and scales in registers, 21 G. Calibrated
  // on perf of the bf16 composed cache at 8k, budget 0.5 (1 thread, blocked keys; 322k exact rows, 397k run tokens of
  // int8 rank 8 + 8): a run token cost 0.33 of an exact row, 84 of its 256 bytes (the earlier 12 G said 56, so a piece
  // holding runs ran long and its thread finished last); at 2 threads the layout's 30 layers took 3.24-3.29 ms with
  // 21 G against 3.24-3.45 with 12 G (budget 0.25: 2.04-2.50 against 2.35-2.36; 8 or 12 pieces per thread instead of
  // 4 were slower)
  const int64_t es = bf ? 2 : 4, fes = q8 ? 1 : es;
  const double w_row = 2.0 * D * es;
  auto w_run = [&](const int64_t* r) { return (double)((r[RK] + r[RV]) * fes + (q8 ? 4 : 0)) + 21.0 * G; };
  // f(tokens, cost per token) for the tiers of segment s in their order
  auto for_each_tier = [&](int64_t s, auto&& f) {
    f(eo[s + 1] - eo[s], w_row);
    for (int64_t j = ro[s]; j < ro[s + 1]; j++) f(rd[j * NCOL + N], w_run(rd + j * NCOL));
    f(nn, w_row);
  };
  double total = 0;
  for (int64_t s = 0; s < S; s++) for_each_tier(s, [&](int64_t n, double w) { total += n * w; });
  // threads (the kernel pool): one when the layer is small (pool::threads_for), else every segment is cut into
  // pieces of about total / (4 threads) cost (at least the pool's min_bytes, 128 KB-equivalent: a run piece projects
  // the queries onto its bases and back once; a piece may span tiers), each piece is a
  // chunk the caller and the workers claim, and the pieces of a segment are merged by their (m, l, acc) states
  // (flash-decoding). The pieces depend on the thread count, so a split layer's result differs across thread counts
  // by fp32 rounding; an unsplit one (1 thread, or below the threshold) is the same bits.
  const int64_t tu = pool::threads_for((int64_t)total);
  const bool split = tu > 1;
  const double target = split ? std::max(total / (4.0 * tu), (double)pool::min_bytes()) : 0.0;
  std::vector<Item>& items = c.items;
  items.reserve(split ? S + 4 * tu + 1 : S);
  for (int64_t s = 0; s < S; s++) {
    if (!split) {
      items.push_back({s, 0, seg_tokens[s] + nn});
      continue;
    }
    int64_t idx = 0, lo = 0;
    double acc = 0;
    for_each_tier(s, [&](int64_t rem, double w) {
      while (rem > 0) {
        const int64_t take = std::min(rem, std::max<int64_t>(1, (int64_t)std::ceil((target - acc) / w)));
        idx += take, rem -= take, acc += take * w;
        if (acc >= target) {
          items.push_back({s, lo, idx});
          lo = idx, acc = 0;
        }
      }
    });
    if (idx > lo) items.push_back({s, lo, idx});
  }
  c.bf = bf, c.w512 = w512, c.rmax = rmax, c.tu = tu;
  TORCH_CHECK((int64_t)items.size() <= state_floats(S, G, D, tu) / (2 * G + G * D), OP, "internal: ", items.size(),
              " work items overrun the state bound");
  return c;
}

static Call prepare(const void* qp, at::ScalarType dt, int64_t B, int64_t H, int64_t G, int64_t D,
                    const at::Tensor& k_exact, const at::Tensor& v_exact, const at::Tensor& e_off,
                    const at::Tensor& runs, const at::Tensor& r_off, const at::Tensor& a_k, const at::Tensor& a_v,
                    const at::Tensor& b_k, const at::Tensor& b_v, const std::optional<at::Tensor>& k_scale,
                    const std::optional<at::Tensor>& v_scale, const std::optional<at::Tensor>& k_new,
                    const std::optional<at::Tensor>& v_new, int64_t nn, double scale) {
  return make_call(validate(dt, B, H, D, k_exact, v_exact, e_off, runs, r_off, a_k, a_v, b_k, b_v, k_scale, v_scale),
                   qp, G, k_new, v_new, nn, scale);
}

// the items (a construct inside a team: every member calls it, the members claim the items), each writing its (m, l,
// acc) state to state[i * ST]
static void run_items(const Call& c, float* state) {
  const Layer& L = c.L;
  const int64_t G = L.G, D = L.D, NI = (int64_t)c.items.size(), ST = 2 * G + G * D;
#if LRK_X86
  const item_fn fn = c.w512 ? (c.bf ? ITEM512_BF16 : ITEM512_F32) : (c.bf ? ITEM2_BF16 : ITEM2_F32);
  const int64_t need_sc = G * D + G * CH + 3 * G * c.rmax + 16;
  const int64_t rmax = c.rmax;
  pool::run(NI, c.tu, [&](int64_t i) {
    thread_local std::vector<float> buf;              // this thread's scratch, grown as needed
    if ((int64_t)buf.size() < need_sc) buf.resize(need_sc);
    float* p = buf.data();
    Scratch sc{p, p + G * D, p + G * D + G * CH, p + G * D + G * CH + G * rmax, p + G * D + G * CH + 2 * G * rmax + 16};
    fn(L, c.items[i].s, c.items[i].lo, c.items[i].hi, state + i * ST, sc);
  });
#endif
}

// merges the pieces of each segment (log-sum-exp of their states), normalises, writes out [B, H * G * D] (q's dtype)
static void merge(const Call& c, const float* state, void* out) {
  const int64_t G = c.L.G, D = c.L.D, NI = (int64_t)c.items.size(), ST = 2 * G + G * D;
  thread_local std::vector<float> o32;   // bf16 output: one segment in fp32 first
  if (c.bf && (int64_t)o32.size() < G * D) o32.resize(G * D);
  float* outf = c.bf ? o32.data() : nullptr;
  for (int64_t i0 = 0; i0 < NI;) {
    const int64_t s = c.items[i0].s;
    int64_t i1 = i0;
    while (i1 < NI && c.items[i1].s == s) i1++;
    float* og = c.bf ? outf : (float*)out + s * G * D;
    for (int64_t g = 0; g < G; g++) {
      float mx = -INFINITY;
      for (int64_t i = i0; i < i1; i++) mx = std::max(mx, state[i * ST + g]);
      float l = 0;
      for (int64_t k = 0; k < D; k++) og[g * D + k] = 0;
      for (int64_t i = i0; i < i1; i++) {
        const float* st = state + i * ST;
        const float w = std::exp(st[g] - mx);
        l += st[G + g] * w;
        for (int64_t k = 0; k < D; k++) og[g * D + k] += st[2 * G + g * D + k] * w;
      }
      const float inv = 1.0f / l;
      for (int64_t k = 0; k < D; k++) og[g * D + k] *= inv;
    }
    if (c.bf) {
      auto* op = (at::BFloat16*)out + s * G * D;
      for (int64_t k = 0; k < G * D; k++) op[k] = at::BFloat16(outf[k]);
    }
    i0 = i1;
  }
}

// the pieces, then one member's merge (a team's members all call it), then a barrier
static void run_call(const Call& c, float* state, void* out) {
  std::vector<float> own;
  if (!state) {
    TORCH_CHECK(!pool::in_team(), OP, "internal: inside a team the state must be the members' shared buffer");
    own.resize(c.items.size() * (2 * c.L.G + c.L.G * c.L.D));
    state = own.data();
  }
  run_items(c, state);                          // in a team: returns on every member after its barrier
  if (pool::rank() == 0) merge(c, state, out);  // one member writes the shared output, the others wait
  pool::barrier();
}

void attend_into(const void* qp, at::ScalarType dt, int64_t B, int64_t H, int64_t G, int64_t D,
                 const at::Tensor& k_exact, const at::Tensor& v_exact, const at::Tensor& e_off, const at::Tensor& runs,
                 const at::Tensor& r_off, const at::Tensor& a_k, const at::Tensor& a_v, const at::Tensor& b_k,
                 const at::Tensor& b_v, const std::optional<at::Tensor>& k_scale,
                 const std::optional<at::Tensor>& v_scale, const std::optional<at::Tensor>& k_new,
                 const std::optional<at::Tensor>& v_new, int64_t nn, double scale, float* state, void* out) {
  run_call(prepare(qp, dt, B, H, G, D, k_exact, v_exact, e_off, runs, r_off, a_k, a_v, b_k, b_v, k_scale, v_scale,
                   k_new, v_new, nn, scale),
           state, out);
}

std::shared_ptr<const Layout> make_layout(at::ScalarType dt, int64_t B, int64_t H, int64_t D,
                                          const at::Tensor& k_exact, const at::Tensor& v_exact,
                                          const at::Tensor& e_off, const at::Tensor& runs, const at::Tensor& r_off,
                                          const at::Tensor& a_k, const at::Tensor& a_v, const at::Tensor& b_k,
                                          const at::Tensor& b_v, const std::optional<at::Tensor>& k_scale,
                                          const std::optional<at::Tensor>& v_scale) {
  return std::make_shared<const Layout>(
      validate(dt, B, H, D, k_exact, v_exact, e_off, runs, r_off, a_k, a_v, b_k, b_v, k_scale, v_scale));
}

void attend_layout(const Layout& y, const void* qp, int64_t G, const at::Tensor& k_new, const at::Tensor& v_new,
                   int64_t nn, double scale, float* state, void* out) {
  run_call(make_call(y, qp, G, k_new, v_new, nn, scale), state, out);
}

at::Tensor tier_attend(const at::Tensor& q, const at::Tensor& k_exact, const at::Tensor& v_exact,
                       const at::Tensor& e_off, const at::Tensor& runs, const at::Tensor& r_off, const at::Tensor& a_k,
                       const at::Tensor& a_v, const at::Tensor& b_k, const at::Tensor& b_v,
                       const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
                       const std::optional<at::Tensor>& k_new, const std::optional<at::Tensor>& v_new,
                       const at::Tensor& n_new, double scale) {
  TORCH_CHECK(q.dim() == 4 && q.device().is_cpu() && is_float_or_bf16(q), OP,
              "q must be a CPU [B, H, G, d] fp32 / bf16 tensor, got ", q.sizes(), " ", q.scalar_type());
  const int64_t nn = n_new.numel() == 1 && n_new.scalar_type() == at::kLong && n_new.device().is_cpu()
                         ? n_new.data_ptr<int64_t>()[0]
                         : -1;
  TORCH_CHECK(nn >= 0, OP, "n_new must be a [1] non-negative int64 CPU tensor, got ", n_new.sizes(), " ",
              n_new.scalar_type(), nn < 0 && n_new.numel() == 1 && n_new.scalar_type() == at::kLong ? " (negative)" : "");
  auto qc = q.contiguous();
  auto o = at::empty({q.size(0), q.size(1) * q.size(2) * q.size(3)}, q.options());
  attend_into(qc.data_ptr(), q.scalar_type(), q.size(0), q.size(1), q.size(2), q.size(3), k_exact, v_exact, e_off,
              runs, r_off, a_k, a_v, b_k, b_v, k_scale, v_scale, k_new, v_new, nn, scale, nullptr, o.data_ptr());
  return o;
}

}  // namespace tiers
}  // namespace lrk

TORCH_LIBRARY_FRAGMENT(lowrank_lrk, m) {
  m.def(
      "tier_attend(Tensor q, Tensor k_exact, Tensor v_exact, Tensor e_off, Tensor runs, Tensor r_off, Tensor a_k, "
      "Tensor a_v, Tensor b_k, Tensor b_v, Tensor? k_scale, Tensor? v_scale, Tensor? k_new, Tensor? v_new, "
      "Tensor n_new, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(lowrank_lrk, CPU, m) { m.impl("tier_attend", &lrk::tiers::tier_attend); }

// tier_prefetch() -> whether tier_attend's exact-row loops prefetch in software in this process
// tier_chunk(n) -> the tokens per online-softmax update before the call; n > 0 sets it (a multiple of 16, at most the
// built maximum), n = 0 only reads it. Process-wide; the result changes by fp32 rounding only
TORCH_LIBRARY_FRAGMENT(lowrank_lrk, m) {
  m.def("tier_prefetch() -> bool", [] { return (bool)(LRK_TIER_PF && lrk::tiers::prefetch_exact_rows()); });
  m.def("tier_chunk(int n) -> int", [](int64_t n) -> int64_t {
    using lrk::tiers::CH;
    TORCH_CHECK(n == 0 || (n > 0 && n % 16 == 0 && n <= CH), "lowrank_lrk::tier_chunk: a multiple of 16 in [16, ", CH,
                "] (or 0 to read it), got ", n);
    return n ? lrk::tiers::g_chunk.exchange(n) : lrk::tiers::g_chunk.load();
  });
}
