// lowrank_lib's compiled CPU kernels for the decode step ("lrk"): packed GEMV and decode attention.
//
// Built ahead of time by `pip install` (setup.py, when torch is importable in the build environment)
// or just in time by lowrank_lib/runtime/kernels/build.py (torch.utils.cpp_extension.load): the SAME
// source and flags on both routes. No -march flag: the AVX-512 and the AVX2 code are each compiled for
// their ISA with target pragmas and only run after a run-time CPUID check (isa_flags): a kind (fp32,
// bf16, int8) runs its AVX-512 kernel where the CPU has that kind's AVX-512 subset, else its AVX2 + FMA
// kernel (same packed layout, same accumulation order, one row of x per pass), else refuses and the
// portable path runs. The library builds and loads on any x86-64 (and on other CPUs).
//
// Ops (namespace lowrank_lrk, called through torch.ops so torch.compile traces them as extern calls):
//   isa_flags() -> int                       bit 0 avx512f, 1 avx512bw, 2 avx512vl, 3 avx512_bf16, 4 avx512_vnni,
//                                            5 avx2, 6 fma (the CPU's, under the mask of set_isa_mask)
//   set_isa_mask(mask) -> int                lowers the features the kernels use (-1: all); returns the old mask
//   pack(W [out, in]) -> P [n]               the packed layout below (fp32 or bf16)
//   unpack(P, out, in) -> W [out, in]        the inverse (prefill and batched GEMMs run aten on it)
//   gemv(x [N, X], Ps[], outs[], ins[], xoffs[]) -> y [N, sum outs]
//        matrix m reads columns [xoffs[m], xoffs[m] + ins[m]) of x and writes its outs[m] columns of y,
//        in order: one call serves a packed stage-1 matrix (one m) or every stage-2 factor of a group
//        (block-diagonal: each member reads its slice of the stage-1 output, shared bases included).
//   attend(q [B, Hkv, G, D], K, V [>=B, Hkv, S, D], length [1], pad [>=B], scale) -> o [B, Hkv*G*D]
//        decode attention of the token at slot `length` over the slots pad[b] <= s <= length.
//   tier_attend(...)                         the fused attention over a tiered KV layer: see tiers.cpp
//   set_pool(threads, min_bytes, spin_us, mode) -> int[]   the thread pool's settings (pool.cpp; -1: unchanged)
//   pool_info() -> int[]                     its counters
//   set_arena(on) -> int, arena_info() -> int[]   the weight arena that pack / qpack allocate from (arena.cpp: 2 MB
//                                            transparent huge pages); its switch (returns the previous state), its state
//   arena_zeros(numel, dtype) -> Tensor [numel] zeros in that arena (torch's allocator when it is off): the dense KV
//                                            store's buffer, which the decode attention streams every token like a weight
//
// Threads: gemv (and the certified head) cut their block jobs into contiguous runs of about equal weight bytes,
// attend its (row, KV head) pairs; the calling thread and the kernel pool's workers claim the runs (lrk_pool.h).
// Every output row / head is computed by the same code whichever thread runs it: the same bits at every thread count.
//   certified_head(x [N, d], Q, meta [V, 3], P, V, max_fraction, stats [5]) -> logits [N, V]
//        the LM head whose argmax is provably the exact head's (runtime/lm_head.py): an int8 copy Q of
//        the head scores every row (integer dot products with x quantised to int16), per-row bounds
//        (meta) give the rows that can still win, and only their 64-row blocks of the exact packed head
//        P run (the same block kernels as gemv, so those logits are gemv's bit for bit); all blocks
//        when more than max_fraction of them would. stats (int64, updated in place): calls, rows,
//        fallback calls, candidate rows, exact rows evaluated.
//
// Packed layout of W [out, in]: output rows in blocks of 64 (the last block rounded up to a multiple
// of 16, zero rows), each block ONE contiguous stream of its weights in the order the kernel reads:
//   fp32: block[k][j]     = W[64 b + j][k]               (k < in, j < block width)
//   bf16: block[p][j][e]  = W[64 b + j][2 p + e]         (p < ceil(in / 2); a zero column pads odd in)
//   int8: as bf16 (pairs), one byte per weight (the certified head's approximate copy)
// so one row of x is read once per block from L1 and the weights stream once from memory. bf16 uses
// vdpbf16ps (two products per lane, fp32 accumulation), fp32 one FMA per weight; the accumulators
// are rounded to the output dtype once (round to nearest even), as aten's GEMV does. int8 weights
// multiply int16 pairs of x with vpdpwssd (exact int32 accumulation).
// Each .cpp includes the ATen headers of what it calls, not <ATen/ATen.h>: that header was 2-5 s of each translation
// unit's 12-19 s compile (the four: 61 -> 47 CPU-s, measured), and the build is on the critical path of `make test`.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "lrk_api.h"
#include "lrk_arena_tensor.h"
#include "lrk_pool.h"

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
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
// Pieces of a pair's n live slots on the dot-product kernel and the AVX2 one (attend_split): one below 2 * ATTN_PIECE
// slots, else about n / ATTN_PIECE
// (at most ATTN_MAX_PIECES), slot runs of multiples of 16. A function of n alone, so the same bits at every thread
// count; they let threads share pairs (SmolLM2: 3 KV heads on 2 threads) and a merge costs ~G * D * P flops. The
// op alone, 3 pairs of G = 3, D = 64 (AMD Zen 4, bf16), unsplit -> pieces: at 8000 slots 104 -> 88 us at 2 threads
// (153 -> 158 at 1); pieces of 256 slots cost more than they gave at 544 slots (11.4 -> 17.4 us at 2 threads).
constexpr int64_t ATTN_PIECE = 1024, ATTN_MAX_PIECES = 8;
// the merge weights of query g's P piece states (each [D] output, score max, probability sum; G queries a piece):
// w_p = l_p e^(m_p - max m); returns their sum (merge_dp and merge2 then sum w_p o_p in their lanes)
static inline float piece_weights(const float* stp, int64_t P, int64_t G, int64_t g, int64_t D, float* w) {
  float M = -INFINITY, wsum = 0.0f;
  for (int64_t p = 0; p < P; p++) M = std::max(M, stp[(p * G + g) * (D + 2) + D]);
  for (int64_t p = 0; p < P; p++) {
    const float* sp = stp + (p * G + g) * (D + 2);
    w[p] = sp[D + 1] * expf(sp[D] - M);
    wsum += w[p];
  }
  return wsum;
}
// Software prefetch distance in bytes ahead of the weight stream (0: none). 2 KB measured side by side
// (bench: /tmp variant libraries in one process, calls interleaved, 7 repeats, 1 thread, bf16, the 2-core
// SHARED machine at load 5-7): faster than no prefetch on every decode GEMV class of SmolLM2 / 1B / 7B,
// +2 % to +75 % (median +40 %); 4 KB and 8 KB in between; fp32 unchanged within noise. The hardware streamers
// alone leave the core with too few misses in flight when other processes compete for memory.
#ifndef LRK_PREFETCH
#define LRK_PREFETCH 2048
#endif
#if LRK_PREFETCH > 0
#define LRK_PF(p) prefetch_weight(p)
#else
#define LRK_PF(p) ((void)0)
#endif
const bool g_pf_nta = [] {  // lrk_api.h (declared extern there)
  const char* e = std::getenv("LOWRANK_LIB_PF_NTA");
  return !(e && e[0] == '0');
}();
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

// The CPU's features (bits below), detected once; isa_flags() reports them under a mask that
// set_isa_mask() lowers (tests and benchmarks run the AVX2 kernels on an AVX-512 CPU that way).
static int64_t hw_flags() {
#if LRK_X86
  static const int64_t f = [] {
    __builtin_cpu_init();
    int64_t v = 0;
    if (__builtin_cpu_supports("avx512f")) v |= 1;
    if (__builtin_cpu_supports("avx512bw")) v |= 2;
    if (__builtin_cpu_supports("avx512vl")) v |= 4;
    if (__builtin_cpu_supports("avx512bf16")) v |= 8;
    if (__builtin_cpu_supports("avx512vnni")) v |= 16;
    if (__builtin_cpu_supports("avx2")) v |= 32;
    if (__builtin_cpu_supports("fma")) v |= 64;
    return v;
  }();
  return f;
#else
  return 0;
#endif
}

static std::atomic<int64_t> g_isa_mask{-1};

// bit 0 avx512f, 1 avx512bw, 2 avx512vl, 3 avx512_bf16, 4 avx512_vnni, 5 avx2, 6 fma
int64_t isa_flags() { return hw_flags() & g_isa_mask.load(); }

// Lowers the features the kernels may use to hw & mask (-1: all); returns the previous mask.
int64_t set_isa_mask(int64_t mask) { return g_isa_mask.exchange(mask); }

// element kinds of a packed matrix: fp32, bf16, int8 (bf16 and int8 store column pairs)
enum Kind { KF32 = 0, KBF16 = 1, KQ8 = 2 };
static inline bool paired(Kind k) { return k != KF32; }
static inline int64_t esize(Kind k) { return k == KF32 ? 4 : (k == KBF16 ? 2 : 1); }

// Which code runs a kind: the AVX-512 kernels (fp32: AVX512F/BW/VL; bf16: + AVX512_BF16; int8: + AVX512_VNNI),
// else the AVX2 kernels (AVX2 + FMA: every kind, bf16 widened to fp32 by shifts, int8 by vpmaddwd), else none.
static bool use512(Kind k) {
  const int64_t f = isa_flags(), need = k == KF32 ? 7 : (k == KBF16 ? 15 : 23);
  return (f & need) == need;
}
static bool has_avx2() { return (isa_flags() & 96) == 96; }
static bool runs(Kind k) { return use512(k) || has_avx2(); }
// rows of x per block job: the AVX-512 kernels hold up to MAX_ROWS rows' accumulators in 32 registers, the AVX2
// kernels one row's in 16 (a second row re-streams the block)
static int64_t rows_per_job(Kind k) { return use512(k) ? MAX_ROWS : 1; }

static void check_isa(Kind k) {
  TORCH_CHECK(runs(k), "lowrank_lrk: this CPU lacks AVX2 + FMA and ",
              k == KF32 ? "AVX512F/BW/VL" : (k == KBF16 ? "AVX512F/BW/VL + AVX512_BF16" : "AVX512F/BW/VL + AVX512_VNNI"),
              " (isa_flags=", isa_flags(), ")");
}

// inner length of a packed matrix (pairs: an even number of columns)
static inline int64_t inner(int64_t in, bool pairs) { return pairs ? 2 * cdiv(in, 2) : in; }
static inline int64_t padded_rows(int64_t out) { return (out / BW) * BW + cdiv(out % BW, TAIL) * TAIL; }
static inline int64_t packed_numel(int64_t out, int64_t in, bool pairs) { return padded_rows(out) * inner(in, pairs); }

static bool is_bf(const at::Tensor& t) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16,
              "lowrank_lrk: fp32 or bf16 only, got ", t.scalar_type());
  return t.scalar_type() == at::kBFloat16;
}

static Kind kind_of(const at::Tensor& t) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kChar,
              "lowrank_lrk: fp32, bf16 or int8 only, got ", t.scalar_type());
  return t.scalar_type() == at::kFloat ? KF32 : (t.scalar_type() == at::kBFloat16 ? KBF16 : KQ8);
}

// ------------------------------------------------------------------------------------ pack / unpack
// to_packed: W [out, in] -> P; else P -> W
template <typename T>
static void pack_impl(T* W, int64_t out, int64_t in, T* P, bool pairs, bool to_packed) {
  const int64_t K = inner(in, pairs), rows = padded_rows(out), nblk = cdiv(rows, BW);
  at::parallel_for(0, nblk, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; b++) {
      const int64_t bw = imin(BW, rows - b * BW);
      T* blk = P + b * BW * K;
      for (int64_t j = 0; j < bw; j++) {
        const int64_t o = b * BW + j;
        if (o >= out) break;
        for (int64_t i = 0; i < in; i++) {
          const int64_t at = pairs ? ((i / 2) * bw + j) * 2 + (i % 2) : i * bw + j;
          if (to_packed) blk[at] = W[o * in + i]; else W[o * in + i] = blk[at];
        }
      }
    }
  });
}

static void pack_any(Kind k, void* W, int64_t out, int64_t in, void* P, bool to_packed) {
  if (k == KF32)
    pack_impl<float>((float*)W, out, in, (float*)P, false, to_packed);
  else if (k == KBF16)
    pack_impl<uint16_t>((uint16_t*)W, out, in, (uint16_t*)P, true, to_packed);
  else
    pack_impl<int8_t>((int8_t*)W, out, in, (int8_t*)P, true, to_packed);
}

at::Tensor pack(const at::Tensor& W) {
  TORCH_CHECK(W.dim() == 2, "lowrank_lrk::pack: W must be [out, in], got ", W.sizes());
  const Kind k = kind_of(W);
  auto Wc = W.contiguous();
  const int64_t out = W.size(0), in = W.size(1);
  auto P = arena_empty(packed_numel(out, in, paired(k)), W.options());   // huge pages (lrk_arena.h)
  P.zero_();
  pack_any(k, Wc.data_ptr(), out, in, P.data_ptr(), true);
  return P;
}

at::Tensor unpack(const at::Tensor& P, int64_t out, int64_t in) {
  const Kind k = kind_of(P);
  TORCH_CHECK(P.dim() == 1 && P.is_contiguous() && P.numel() == packed_numel(out, in, paired(k)),
              "lowrank_lrk::unpack: P is not a packed [", out, ", ", in, "] matrix");
  auto W = at::empty({out, in}, P.options());
  pack_any(k, W.data_ptr(), out, in, P.data_ptr(), false);
  return W;
}

// the largest bf16 <= v (the certified head's approximate logits: below every candidate's exact logit)
static inline uint16_t bf16_round_down(float v) {
  uint32_t b;
  std::memcpy(&b, &v, 4);
  // truncation, plus one step down for a negative value truncated towards zero (branch-free: it vectorises)
  return (uint16_t)((b >> 16) + (((b & 0xFFFFu) != 0) & (b >> 31)));
}

// the certified head's score and bound of row i (see LRK_BOUND_PASS): z = sum * (s * s_h); z + d to up, z - d to lo
static inline float bound_row(const float* sums, const float* meta, int64_t i, float s_h, float hn, float rn,
                              float rho, float* up, float& lo) {
  const float u8 = 8.0f * 5.9604645e-08f, safety = 1.0f + 2.44140625e-04f;
  const float z = sums[i] * (meta[3 * i] * s_h);
  const float az = fabsf(z);
  float d = meta[3 * i + 1] * hn + meta[3 * i + 2] * rn + u8 * az;
  d = (d + rho * (az + d)) * safety + 1e-25f;
  up[i] = z + d;
  lo = z - d;
  return z;
}

// ------------------------------------------------------------------------------------ AVX-512 code
// Everything between push_options and pop_options is compiled for AVX-512 and called only after
// check_isa(); the only header included in this region is our own lrk_simd.h (no inline function of a
// system header gets AVX-512 code).
#if LRK_X86
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16,avx512vnni,fma,avx2")
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx512vnni,fma,avx2"))), \
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

// int8 weights (pairs) against int16 pairs of R rows of x: exact int32 sums, written as float (the
// caller keeps |sum| < 2^31: |x| <= (2^31 - 1) / (127 * K)).
template <int R, int NZ>
static void blk_q8(const int8_t* w, const uint32_t* const* xp, int64_t K2, float* const* ys, int64_t n) {
  __m512i acc[R][NZ];
  for (int r = 0; r < R; r++)
    for (int z = 0; z < NZ; z++) acc[r][z] = _mm512_setzero_si512();
  for (int64_t p = 0; p < K2; p++) {
    const int8_t* wp = w + p * (NZ * 32);
    __m512i wv[NZ];
    for (int z = 0; z < NZ; z++) {
      LRK_PF(wp + LRK_PREFETCH + 32 * z);
      wv[z] = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(wp + 32 * z)));
    }
    for (int r = 0; r < R; r++) {
      const __m512i xv = _mm512_set1_epi32((int)xp[r][p]);
      for (int z = 0; z < NZ; z++) acc[r][z] = _mm512_dpwssd_epi32(acc[r][z], wv[z], xv);
    }
  }
  for (int r = 0; r < R; r++)
    for (int z = 0; z < NZ && z * 16 < n; z++)
      _mm512_mask_storeu_ps(ys[r] + z * 16, lanes(n - z * 16), _mm512_cvtepi32_ps(acc[r][z]));
}

typedef void (*f32_fn)(const float*, const float* const*, int64_t, float* const*, int64_t);
typedef void (*bf16_fn)(const uint16_t*, const uint32_t* const*, int64_t, uint16_t* const*, int64_t);
typedef void (*q8_fn)(const int8_t*, const uint32_t* const*, int64_t, float* const*, int64_t);

#define LRK_ROW(f, R) {f<R, 1>, f<R, 2>, f<R, 3>, f<R, 4>}
static const f32_fn F32_KERNELS[4][4] = {LRK_ROW(blk_f32, 1), LRK_ROW(blk_f32, 2), LRK_ROW(blk_f32, 3),
                                         LRK_ROW(blk_f32, 4)};
static const bf16_fn BF16_KERNELS[4][4] = {LRK_ROW(blk_bf16, 1), LRK_ROW(blk_bf16, 2), LRK_ROW(blk_bf16, 3),
                                           LRK_ROW(blk_bf16, 4)};
static const q8_fn Q8_KERNELS[4][4] = {LRK_ROW(blk_q8, 1), LRK_ROW(blk_q8, 2), LRK_ROW(blk_q8, 3),
                                       LRK_ROW(blk_q8, 4)};
#undef LRK_ROW

// One block job: R rows of x (pointers xr: float rows, or uint32 pairs) against block width bw (n real
// outputs) of a packed matrix of inner length K; outputs to the R row pointers yr.
static void run_block512(Kind k, const char* blk, const void* const* xr, int64_t K, void* const* yr, int64_t R,
                         int64_t bw, int64_t n) {
  if (k == KF32)
    F32_KERNELS[R - 1][bw / 16 - 1]((const float*)blk, (const float* const*)xr, K, (float* const*)yr, n);
  else if (k == KBF16)
    BF16_KERNELS[R - 1][bw / 16 - 1]((const uint16_t*)blk, (const uint32_t* const*)xr, K / 2, (uint16_t* const*)yr, n);
  else
    Q8_KERNELS[R - 1][bw / 16 - 1]((const int8_t*)blk, (const uint32_t* const*)xr, K / 2, (float* const*)yr, n);
}

// The certified head's per-row pass over the approximate scores, written so that GCC vectorises it for each ISA
// region (16 lanes of running maxima: a float max reduction would not vectorise without -ffast-math; meta's
// stride-3 rows become permutes): zh = sum * (s * s_h), bound d = ((a * hn + b * rn) + 8 u |zh|) (+ the output
// rounding rho (|zh| + d)) times (1 + 2^-12) + 1e-25; upper = zh + d goes to up, zh to the output row (bf16: rounded
// DOWN, below every candidate's exact logit; fp32: as is). Returns max(zh - d).
#define LRK_BOUND_PASS(NAME)                                                                                   \
  static float NAME(const float* sums, const float* meta, int64_t V, float s_h, float hn, float rn, float rho, \
                    bool bf, void* yrow, float* up) {                                                          \
    float Ls[16];                                                                                              \
    for (int j = 0; j < 16; j++) Ls[j] = -INFINITY;                                                            \
    uint16_t* yb = (uint16_t*)yrow;                                                                            \
    float* yf = (float*)yrow;                                                                                  \
    for (int64_t i0 = 0; i0 < V; i0 += 16) {                                                                   \
      const int64_t m = V - i0 < 16 ? V - i0 : 16;                                                             \
      if (m < 16) {                                                                                            \
        for (int64_t j = 0; j < m; j++) {                                                                      \
          float lo;                                                                                            \
          const float z = bound_row(sums, meta, i0 + j, s_h, hn, rn, rho, up, lo);                             \
          Ls[j] = lo > Ls[j] ? lo : Ls[j];                                                                     \
          if (bf)                                                                                              \
            yb[i0 + j] = bf16_round_down(z);                                                                   \
          else                                                                                                 \
            yf[i0 + j] = z;                                                                                    \
        }                                                                                                      \
        break;                                                                                                 \
      }                                                                                                        \
      float zs[16];                                                                                            \
      for (int j = 0; j < 16; j++) {                                                                           \
        float lo;                                                                                              \
        zs[j] = bound_row(sums, meta, i0 + j, s_h, hn, rn, rho, up, lo);                                       \
        Ls[j] = lo > Ls[j] ? lo : Ls[j];                                                                       \
      }                                                                                                        \
      if (bf) {                                                                                                \
        for (int j = 0; j < 16; j++) yb[i0 + j] = bf16_round_down(zs[j]);                                     \
      } else {                                                                                                 \
        for (int j = 0; j < 16; j++) yf[i0 + j] = zs[j];                                                       \
      }                                                                                                        \
    }                                                                                                          \
    float L = -INFINITY;                                                                                       \
    for (int j = 0; j < 16; j++) L = Ls[j] > L ? Ls[j] : L;                                                    \
    return L;                                                                                                  \
  }

// The candidates of one row (up >= L): their count; each BW-row block holding one is marked in sel
#define LRK_CAND_PASS(NAME)                                                         \
  static int64_t NAME(const float* up, int64_t V, float L, char* sel) {             \
    int64_t c = 0;                                                                  \
    for (int64_t b0 = 0; b0 < V; b0 += BW) {                                        \
      const int64_t n = V - b0 < BW ? V - b0 : BW;                                  \
      int cnt = 0;                                                                  \
      for (int64_t j = 0; j < n; j++) cnt += up[b0 + j] >= L;                       \
      if (cnt) sel[b0 / BW] = 1;                                                    \
      c += cnt;                                                                     \
    }                                                                               \
    return c;                                                                       \
  }
LRK_BOUND_PASS(bound_pass512)
LRK_CAND_PASS(cand_pass512)

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

// one query's scores of 16 slots (M real, the rest -inf) from K rows at stride sk
template <int DP, bool FULL>
static inline void scores_dp(const __m512i* qv, const uint16_t* k, int64_t sk, int m, __m512 vscale, float* s) {
  const __m512 v = _mm512_mul_ps(dot16_bf16<DP, FULL>(qv, k, sk, m), vscale);
  _mm512_storeu_ps(s, FULL ? v : _mm512_mask_blend_ps(lanes(m), _mm512_set1_ps(-INFINITY), v));
}

// P V of NG queries over n slots, two at a time: acc[g][2c] / [2c + 1] take the unpacked lanes of dims 32c..32c+31
template <int DP, int NG>
static inline void pv_dp(const uint16_t* V, int64_t sv, int64_t n, const uint16_t* pb, int64_t np, __m512* acc) {
  auto step = [&](const uint16_t* v0, const uint16_t* v1, int64_t t) {
    __m512i ul[DP], uh[DP];
    for (int c = 0; c < DP; c++) {
      const __m512i a = _mm512_loadu_si512((const void*)(v0 + c * 32));
      const __m512i b = v1 ? _mm512_loadu_si512((const void*)(v1 + c * 32)) : _mm512_setzero_si512();
      ul[c] = _mm512_unpacklo_epi16(a, b);
      uh[c] = _mm512_unpackhi_epi16(a, b);
    }
    for (int g = 0; g < NG; g++) {
      uint32_t pair;
      std::memcpy(&pair, pb + g * np + t, 4);
      const __m512bh pp = (__m512bh)_mm512_set1_epi32((int)pair);
      for (int c = 0; c < DP; c++) {
        acc[g * 2 * DP + 2 * c] = _mm512_dpbf16_ps(acc[g * 2 * DP + 2 * c], (__m512bh)ul[c], pp);
        acc[g * 2 * DP + 2 * c + 1] = _mm512_dpbf16_ps(acc[g * 2 * DP + 2 * c + 1], (__m512bh)uh[c], pp);
      }
    }
  };
  int64_t t = 0;
  for (; t + 1 < n; t += 2) step(V + t * sv, V + (t + 1) * sv, t);
  if (t < n) step(V + t * sv, nullptr, t);  // odd n: p of the slot after is 0 (masked), its row is not read
}

// ---- bf16 decode attention on AVX512_BF16 dot products, one (batch row, kv head): G queries of dim D = DP * 32 over
// slots [lo, hi]. Zen 4 runs a 512-bit FMA at one per cycle, and attend_head's widen-then-FMA spends two of them per
// query, token and 32 dims (scores and P V); vdpbf16ps does the same work in one, on the rows as stored:
//   scores: s_t = scale * (q . k_t), bf16 products summed in fp32 (16 slots at a time, one transpose-add per query);
//   softmax: p_t = e^(s_t - max) rounded to bf16 (as FlashAttention's P), the sum taken over the rounded values;
//   P V: two slots at a time, rows t and t + 1 interleaved by 16-bit unpacks into (v_t[d], v_t+1[d]) pairs, one
//        vdpbf16ps per 32 dims and query against the pair (p_t, p_t+1); the unpacks' lane order is undone at the end.
// Outputs rounded to bf16 once. sc: scratch >= GB * ceil16(n) floats + GB * ceil16(n) bf16.
// stp: nullptr (o = the normalised output, bf16), or a piece's state: per query [D] fp32 normalised output, then its
// score max and probability sum (o unused)
template <int DP>
static void attend_head_dp(const uint16_t* q, const uint16_t* K, const uint16_t* V, int64_t sk, int64_t sv, int64_t lo,
                           int64_t hi, int64_t G, float scale, uint16_t* o, float* sc, float* stp) {
  constexpr int D = DP * 32;
  constexpr int GB = DP <= 2 ? 4 : 2;                 // queries per P V pass: GB * 2 * DP <= 16 accumulators
  const int64_t n = hi - lo + 1, np = cdiv(n, 16) * 16;
  uint16_t* const pb = (uint16_t*)(sc + GB * np);     // bf16 probabilities [GB, np]
  const __m512 vscale = _mm512_set1_ps(scale);
  const __m512i lo_idx = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i hi_idx = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  const uint16_t *const Kl = K + lo * sk, *const Vl = V + lo * sv;
  for (int64_t g0 = 0; g0 < G; g0 += GB) {
    const int gb = (int)imin(GB, G - g0);
    float inv[GB], mxs[GB], sums[GB];
    __m512i qv[GB][DP];
    for (int g = 0; g < gb; g++)
      for (int c = 0; c < DP; c++) qv[g][c] = _mm512_loadu_si512((const void*)(q + (g0 + g) * D + c * 32));
    // scores, 16 slots at a time for every query (the block's K rows come from memory once, then from L1)
    int64_t t0 = 0;
    for (; t0 + 16 <= n; t0 += 16)
      for (int g = 0; g < gb; g++) scores_dp<DP, true>(qv[g], Kl + t0 * sk, sk, 16, vscale, sc + g * np + t0);
    if (t0 < n)
      for (int g = 0; g < gb; g++)
        scores_dp<DP, false>(qv[g], Kl + t0 * sk, sk, (int)(n - t0), vscale, sc + g * np + t0);
    for (int g = 0; g < gb; g++) {
      float* s = sc + g * np;
      __m512 mx = _mm512_set1_ps(-INFINITY);
      for (int64_t t = 0; t < np; t += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(s + t));
      mxs[g] = _mm512_reduce_max_ps(mx);
      const __m512 mb = _mm512_set1_ps(mxs[g]);
      __m512 sum = _mm512_setzero_ps();
      uint16_t* p = pb + g * np;
      for (int64_t t = 0; t < np; t += 16) {
        const __m512 e = _mm512_maskz_mov_ps(lanes(n - t), exp512(_mm512_sub_ps(_mm512_loadu_ps(s + t), mb)));
        const __m256i eb = (__m256i)_mm512_cvtneps_pbh(e);
        _mm256_storeu_si256((__m256i*)(p + t), eb);
        sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(eb), 16)));
      }
      sums[g] = _mm512_reduce_add_ps(sum);
      inv[g] = 1.0f / sums[g];
    }
    __m512 acc[GB * 2 * DP];
    for (int i = 0; i < GB * 2 * DP; i++) acc[i] = _mm512_setzero_ps();
    switch (gb) {
      case 4: pv_dp<DP, GB >= 4 ? 4 : 1>(Vl, sv, n, pb, np, acc); break;
      case 3: pv_dp<DP, GB >= 3 ? 3 : 1>(Vl, sv, n, pb, np, acc); break;
      case 2: pv_dp<DP, 2>(Vl, sv, n, pb, np, acc); break;
      default: pv_dp<DP, 1>(Vl, sv, n, pb, np, acc); break;
    }
    for (int g = 0; g < gb; g++) {
      const __m512 iv = _mm512_set1_ps(inv[g]);
      for (int c = 0; c < DP; c++) {
        const __m512 a0 = acc[g * 2 * DP + 2 * c], a1 = acc[g * 2 * DP + 2 * c + 1];
        const __m512 r0 = _mm512_mul_ps(_mm512_permutex2var_ps(a0, lo_idx, a1), iv);
        const __m512 r1 = _mm512_mul_ps(_mm512_permutex2var_ps(a0, hi_idx, a1), iv);
        if (stp) {
          float* sg = stp + (g0 + g) * (D + 2) + c * 32;
          _mm512_storeu_ps(sg, r0);
          _mm512_storeu_ps(sg + 16, r1);
        } else {
          uint16_t* og = o + (g0 + g) * D + c * 32;
          st(og, r0);
          st(og + 16, r1);
        }
      }
      if (stp) stp[(g0 + g) * (D + 2) + D] = mxs[g], stp[(g0 + g) * (D + 2) + D + 1] = sums[g];
    }
  }
}
typedef void (*attn_dp_fn)(const uint16_t*, const uint16_t*, const uint16_t*, int64_t, int64_t, int64_t, int64_t,
                           int64_t, float, uint16_t*, float*, float*);

// the pieces' states of one pair -> its output (bf16): o = sum_p w_p o_p / sum_p w_p, w_p = l_p e^(m_p - max m)
static void merge_dp(const float* stp, int64_t P, int64_t G, int64_t D, uint16_t* o) {
  for (int64_t g = 0; g < G; g++) {
    float w[ATTN_MAX_PIECES];
    const float iw = 1.0f / piece_weights(stp, P, G, g, D, w);
    for (int64_t c = 0; c < D; c += 16) {
      __m512 a = _mm512_setzero_ps();
      for (int64_t p = 0; p < P; p++)
        a = _mm512_fmadd_ps(_mm512_set1_ps(w[p]), _mm512_loadu_ps(stp + (p * G + g) * (D + 2) + c), a);
      st(o + g * D + c, _mm512_mul_ps(a, _mm512_set1_ps(iw)));
    }
  }
}
static const attn_dp_fn ATTN_DP[4] = {attend_head_dp<1>, attend_head_dp<2>, attend_head_dp<3>, attend_head_dp<4>};

#if defined(__clang__)
#pragma clang attribute pop
#endif
#pragma GCC pop_options

// ------------------------------------------------------------------------------------ AVX2 code
// The same kernels for CPUs with AVX2 + FMA but not the AVX-512 subset a kind needs (AMD Zen 1-3, Intel
// client cores, or an AVX-512 CPU limited by set_isa_mask): same packed layouts, same accumulation order
// (one FMA per weight in k order; a bf16 pair as vdpbf16ps does it, the odd product first, each product
// exact in fp32), one row of x per pass (16 ymm registers hold one row's 64 accumulators).
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma"))), apply_to = function)
#endif

#include "lrk_simd2.h"  // lanes8, to_bf16x8, exp256, ld8 / st8 (fp32, bf16), hsum8, hsum8x8: shared with tiers.cpp

static inline void store_f32(float* y, __m256 a, int64_t m) {
  if (m >= 8)
    _mm256_storeu_ps(y, a);
  else if (m > 0)
    _mm256_maskstore_ps(y, lanes8(m), a);
}
static inline void store_bf16(uint16_t* y, __m256 a, int64_t m) {
  const __m128i h = to_bf16x8(a);
  if (m >= 8) {
    _mm_storeu_si128((__m128i*)y, h);
  } else if (m > 0) {
    uint16_t t[8];
    _mm_storeu_si128((__m128i*)t, h);
    std::memcpy(y, t, m * 2);
  }
}

// one block (width NZ * 16) of a packed fp32 matrix against one row of x
template <int NZ>
static void blk2_f32(const float* w, const float* x, int64_t K, float* y, int64_t n) {
  __m256 acc[2 * NZ];
  for (int i = 0; i < 2 * NZ; i++) acc[i] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k++) {
    const float* wk = w + k * (NZ * 16);
    for (int z = 0; z < NZ; z++) LRK_PF(wk + LRK_PREFETCH / 4 + 16 * z);
    const __m256 xv = _mm256_set1_ps(x[k]);
    for (int i = 0; i < 2 * NZ; i++) acc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(wk + 8 * i), xv, acc[i]);
  }
  for (int i = 0; i < 2 * NZ; i++) store_f32(y + 8 * i, acc[i], n - 8 * i);
}

// bf16 pairs: each 32-bit lane holds (W[j][2p], W[j][2p+1]); xp[p] the pair (x[2p], x[2p+1])
template <int NZ>
static void blk2_bf16(const uint16_t* w, const uint32_t* xp, int64_t K2, uint16_t* y, int64_t n) {
  __m256 acc[2 * NZ];
  for (int i = 0; i < 2 * NZ; i++) acc[i] = _mm256_setzero_ps();
  const __m256i hi_mask = _mm256_set1_epi32((int)0xFFFF0000u);
  for (int64_t p = 0; p < K2; p++) {
    const uint16_t* wp = w + p * (NZ * 32);
    for (int z = 0; z < NZ; z++) LRK_PF(wp + LRK_PREFETCH / 2 + 32 * z);
    const __m256 xlo = _mm256_set1_ps(bits_f(xp[p] << 16)), xhi = _mm256_set1_ps(bits_f(xp[p] & 0xFFFF0000u));
    for (int i = 0; i < 2 * NZ; i++) {
      const __m256i v = _mm256_loadu_si256((const __m256i*)(wp + 16 * i));
      acc[i] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(v, hi_mask)), xhi, acc[i]);
      acc[i] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(v, 16)), xlo, acc[i]);
    }
  }
  for (int i = 0; i < 2 * NZ; i++) store_bf16(y + 8 * i, acc[i], n - 8 * i);
}

// int8 pairs against int16 pairs of x: vpmaddwd + vpaddd, exact int32 sums (as vpdpwssd)
template <int NZ>
static void blk2_q8(const int8_t* w, const uint32_t* xp, int64_t K2, float* y, int64_t n) {
  __m256i acc[2 * NZ];
  for (int i = 0; i < 2 * NZ; i++) acc[i] = _mm256_setzero_si256();
  for (int64_t p = 0; p < K2; p++) {
    const int8_t* wp = w + p * (NZ * 32);
    for (int z = 0; z < NZ; z++) LRK_PF(wp + LRK_PREFETCH + 32 * z);
    const __m256i xv = _mm256_set1_epi32((int)xp[p]);
    for (int i = 0; i < 2 * NZ; i++) {
      const __m256i w16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(wp + 16 * i)));
      acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(w16, xv));
    }
  }
  for (int i = 0; i < 2 * NZ; i++) store_f32(y + 8 * i, _mm256_cvtepi32_ps(acc[i]), n - 8 * i);
}

typedef void (*f32_fn2)(const float*, const float*, int64_t, float*, int64_t);
typedef void (*bf16_fn2)(const uint16_t*, const uint32_t*, int64_t, uint16_t*, int64_t);
typedef void (*q8_fn2)(const int8_t*, const uint32_t*, int64_t, float*, int64_t);
static const f32_fn2 F32_KERNELS2[4] = {blk2_f32<1>, blk2_f32<2>, blk2_f32<3>, blk2_f32<4>};
static const bf16_fn2 BF16_KERNELS2[4] = {blk2_bf16<1>, blk2_bf16<2>, blk2_bf16<3>, blk2_bf16<4>};
static const q8_fn2 Q8_KERNELS2[4] = {blk2_q8<1>, blk2_q8<2>, blk2_q8<3>, blk2_q8<4>};

// run_block512's contract with R = 1
static void run_block2(Kind k, const char* blk, const void* const* xr, int64_t K, void* const* yr, int64_t bw,
                       int64_t n) {
  if (k == KF32)
    F32_KERNELS2[bw / 16 - 1]((const float*)blk, (const float*)xr[0], K, (float*)yr[0], n);
  else if (k == KBF16)
    BF16_KERNELS2[bw / 16 - 1]((const uint16_t*)blk, (const uint32_t*)xr[0], K / 2, (uint16_t*)yr[0], n);
  else
    Q8_KERNELS2[bw / 16 - 1]((const int8_t*)blk, (const uint32_t*)xr[0], K / 2, (float*)yr[0], n);
}

LRK_BOUND_PASS(bound_pass2)
LRK_CAND_PASS(cand_pass2)

// o[:D] = inv * P V for ONE query (p: its ceil8(n) probabilities) over chunks of CB = 12 8-float columns in registers:
// one chunk covers D <= 96, so a pass streams whole V rows. (It ran 2-4 queries per pass before, GB * CB <= 12
// accumulators, which cut each row into 12 / GB columns: every pass read V as partial rows, and at GB 3 / 4 the
// accumulators, broadcasts and row chunk overflowed the 16 ymm registers. One query per pass, its passes after the
// first from L2 / L3, measured with AVX2 code on the AMD Zen 4 VM over 30 layers of 8k slots, 3 KV heads x 3 queries,
// d 64, interleaved in one process: bf16 21.0 -> 15.0 ms at 1 thread, 15.1 -> 11.7 at 2; fp32 24.0 -> 19.4. Each
// output still sums its slots in order, one FMA each: the same bits.) The loop over the rows is lrk_simd2.h pv_cols12,
// shared with the tier kernel's exact values (tiers.cpp values_head).
template <typename T, typename O>
static void pv_query2(const float* p, const T* V, int64_t sv, int64_t lo, int64_t n, int64_t D, float inv, O* o) {
  constexpr int CB = 12;
  const int64_t DC = D / 8;
  for (int64_t c0 = 0; c0 < DC; c0 += CB) {
    const int64_t cn = imin(CB, DC - c0);
    __m256 acc[CB];
    for (int c = 0; c < CB; c++) acc[c] = _mm256_setzero_ps();
    pv_cols12(p, V + lo * sv + c0 * 8, sv, n, (int)cn, acc, [](int64_t) {});
    for (int c = 0; c < CB; c++)
      if (c < cn) st8(o + (c0 + c) * 8, _mm256_mul_ps(acc[c], _mm256_set1_ps(inv)));
  }
}

// rows of K ahead that attend_head2's bf16 score pass prefetches (AMD Zen 3, AVX2, 30 layers x 3 heads of 8000 slots,
// d 64, a standalone copy of the kernel: 16 / 32 / 64 rows gave 14.6 / 14.7 / 15.3 ms, none 21.8)
constexpr int64_t QK_PF_ROWS = 32;
// scores of GB (<= 3) queries over RB slots of bf16 K rows, without a widened copy: a 32-byte load of a row holds
// 16 bf16, its even elements widened by one shift and its odd ones by one AND; qs holds each query's scaled fp32 in
// the same split order (per 16 columns: the 8 even, then the 8 odd). GB * RB accumulators in registers (12 of the 16
// ymm at GB 3, RB 4), the query from memory. Rows at or past m repeat row m - 1 (never read past the store; their
// scores are masked by the softmax). s: GB rows of scores at stride np, RB of them from column t0.
template <int GB, int RB>
static inline void scores_bf16(const float* qs, int64_t D, const uint16_t* K, int64_t sk, int64_t m, float* s,
                               int64_t np) {
  __m256 a[GB][RB];
  for (int g = 0; g < GB; g++)
    for (int i = 0; i < RB; i++) a[g][i] = _mm256_setzero_ps();
  const uint16_t* row[RB];
  for (int i = 0; i < RB; i++) row[i] = K + (i < m ? i : m - 1) * sk;
  for (int64_t j = 0; j < D; j += 16)
    for (int i = 0; i < RB; i++) {
      const __m256i w = _mm256_loadu_si256((const __m256i*)(row[i] + j));
      const __m256 ev = bf16_even(w), od = bf16_odd(w);
      for (int g = 0; g < GB; g++) {
        a[g][i] = _mm256_fmadd_ps(ev, _mm256_loadu_ps(qs + g * D + j), a[g][i]);
        a[g][i] = _mm256_fmadd_ps(od, _mm256_loadu_ps(qs + g * D + j + 8), a[g][i]);
      }
    }
  for (int g = 0; g < GB; g++)
    for (int i = 0; i < RB; i += 4) {          // 4 accumulators -> their 4 sums
      const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a[g][i], a[g][i + 1]), _mm256_hadd_ps(a[g][i + 2], a[g][i + 3]));
      _mm_storeu_ps(s + g * np + i, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
    }
}

// decode attention of one (batch row, kv head), attend_head's contract: G queries of dim D (a multiple of 16,
// <= 128) over slots [lo, hi]. bf16 scores: scores_bf16, up to 3 queries per pass over K, with K prefetched ahead
// and V into L2 (30 layers x 3 heads x 3 queries of 8000 slots, d 64, AMD Zen 3, a standalone copy of the kernel:
// 20.0 -> 14.7 ms, the score pass alone 8.4 -> 7.6 ms with V's prefetch added to it; before pv_cols12's pairs).
// fp32 scores: each K row is loaded once for all G queries into a copy, 8 slots at a time (8 independent dot
// products, one transpose-add). P V one query per pass over whole V rows (pv_query2).
// sc: scratch of G * ceil8(n) scores, G * D scaled queries and 8 * D widened K rows (fp32 rows).
// stp: nullptr (o = the normalised output), or a piece's state as attend_head_dp writes it: per query [D] fp32
// normalised output, then its score max and probability sum (o unused)
template <typename T>
static void attend_head2(const T* q, const T* K, const T* V, int64_t sk, int64_t sv, int64_t lo, int64_t hi,
                         int64_t G, int64_t D, float scale, T* o, float* sc, float* stp) {
  const int64_t n = hi - lo + 1, np = cdiv(n, 8) * 8, DC = D / 8;
  float* qs = sc + G * np;
  float* kf = qs + G * D;
  if constexpr (sizeof(T) == 2) {               // bf16: scores_bf16, 4 slots (8 for one query) per pass
    for (int64_t g = 0; g < G; g++)
      for (int64_t j = 0; j < D; j += 16) {     // the split order: even columns, then odd ones
        const __m256i w = _mm256_loadu_si256((const __m256i*)(q + g * D + j));
        _mm256_storeu_ps(qs + g * D + j, _mm256_mul_ps(bf16_even(w), _mm256_set1_ps(scale)));
        _mm256_storeu_ps(qs + g * D + j + 8, _mm256_mul_ps(bf16_odd(w), _mm256_set1_ps(scale)));
      }
    const uint16_t* Kb = (const uint16_t*)K + lo * sk;
    const uint16_t* Vb = (const uint16_t*)V + lo * sv;
    // the first query group's pass prefetches K QK_PF_ROWS rows ahead and each V row it passes into L2, so the P V
    // passes read V from L2 (a pair's piece: 1024-2047 slots from 2048 live slots, 128-256 KB of V at d 64)
    for (int64_t t = 0; t < imin(n, QK_PF_ROWS); t++)
      for (int64_t b = 0; b < D * 2; b += 64) _mm_prefetch((const char*)(Kb + t * sk) + b, _MM_HINT_T0);
    for (int64_t g0 = 0; g0 < G; g0 += 3) {
      const int64_t gb = imin(3, G - g0);
      const float* qg = qs + g0 * D;
      float* sg = sc + g0 * np;
      const int64_t rb = gb == 1 ? 8 : 4;
      for (int64_t t0 = 0; t0 < n; t0 += rb) {
        if (g0 == 0)
          for (int64_t t = t0; t < imin(n, t0 + rb); t++) {
            if (t + QK_PF_ROWS < n)
              for (int64_t b = 0; b < D * 2; b += 64)
                _mm_prefetch((const char*)(Kb + (t + QK_PF_ROWS) * sk) + b, _MM_HINT_T0);
            for (int64_t b = 0; b < D * 2; b += 64) _mm_prefetch((const char*)(Vb + t * sv) + b, _MM_HINT_T1);
          }
        if (gb == 1)
          scores_bf16<1, 8>(qg, D, Kb + t0 * sk, sk, n - t0, sg + t0, np);
        else if (gb == 2)
          scores_bf16<2, 4>(qg, D, Kb + t0 * sk, sk, n - t0, sg + t0, np);
        else
          scores_bf16<3, 4>(qg, D, Kb + t0 * sk, sk, n - t0, sg + t0, np);
      }
    }
  } else {
    for (int64_t g = 0; g < G; g++)
      for (int64_t c = 0; c < DC; c++)
        _mm256_storeu_ps(qs + g * D + c * 8, _mm256_mul_ps(ld8(q + g * D + c * 8), _mm256_set1_ps(scale)));
    // scores, 8 slots at a time
    for (int64_t t0 = 0; t0 < n; t0 += 8) {
      const int64_t m = imin(8, n - t0);
      for (int64_t i = 0; i < 8; i++)
        for (int64_t c = 0; c < DC; c++)
          _mm256_storeu_ps(kf + i * D + c * 8, i < m ? ld8(K + (lo + t0 + i) * sk + c * 8) : _mm256_setzero_ps());
      for (int64_t g = 0; g < G; g++) {
        const float* qg = qs + g * D;
        __m256 a[8];
        for (int i = 0; i < 8; i++) a[i] = _mm256_mul_ps(_mm256_loadu_ps(qg), _mm256_loadu_ps(kf + i * D));
        for (int64_t c = 1; c < DC; c++) {
          const __m256 qv = _mm256_loadu_ps(qg + c * 8);
          for (int i = 0; i < 8; i++) a[i] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kf + i * D + c * 8), a[i]);
        }
        _mm256_storeu_ps(sc + g * np + t0, hsum8x8(a));
      }
    }
  }
  // softmax per query (tail lanes -inf: exp -> masked to 0)
  float inv[256], mxs[256], sums[256];
  for (int64_t g = 0; g < G; g++) {
    float* s = sc + g * np;
    for (int64_t t = n; t < np; t++) s[t] = -INFINITY;
    __m256 mx = _mm256_set1_ps(-INFINITY);
    for (int64_t t = 0; t < np; t += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(s + t));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
    mxs[g] = _mm_cvtss_f32(m4);
    const __m256 mb = _mm256_set1_ps(mxs[g]);
    __m256 sum = _mm256_setzero_ps();
    for (int64_t t = 0; t < np; t += 8) {
      __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + t), mb));
      e = _mm256_and_ps(e, _mm256_castsi256_ps(lanes8(n - t)));
      _mm256_storeu_ps(s + t, e);
      sum = _mm256_add_ps(sum, e);
    }
    sums[g] = hsum8(sum);
    inv[g] = 1.0f / sums[g];
  }
  // o = P V, one query per pass over V (pv_query2 says why)
  for (int64_t g = 0; g < G; g++) {
    if (!stp) {
      pv_query2<T, T>(sc + g * np, V, sv, lo, n, D, inv[g], o + g * D);
      continue;
    }
    float* sg = stp + g * (D + 2);
    pv_query2<T, float>(sc + g * np, V, sv, lo, n, D, inv[g], sg);
    sg[D] = mxs[g], sg[D + 1] = sums[g];
  }
}

// the pieces' states of one pair -> its output, merge_dp's sums in 8 lanes: o = sum_p w_p o_p / sum_p w_p,
// w_p = l_p e^(m_p - max m)
template <typename T>
static void merge2(const float* stp, int64_t P, int64_t G, int64_t D, T* o) {
  for (int64_t g = 0; g < G; g++) {
    float w[ATTN_MAX_PIECES];
    const __m256 iw = _mm256_set1_ps(1.0f / piece_weights(stp, P, G, g, D, w));
    for (int64_t c = 0; c < D; c += 8) {
      __m256 a = _mm256_setzero_ps();
      for (int64_t p = 0; p < P; p++)
        a = _mm256_fmadd_ps(_mm256_set1_ps(w[p]), _mm256_loadu_ps(stp + (p * G + g) * (D + 2) + c), a);
      st8(o + g * D + c, _mm256_mul_ps(a, iw));
    }
  }
}

#if defined(__clang__)
#pragma clang attribute pop
#endif
#pragma GCC pop_options

// the block kernel of this kind's ISA (R <= rows_per_job(k))
static void run_block(Kind k, const char* blk, const void* const* xr, int64_t K, void* const* yr, int64_t R,
                      int64_t bw, int64_t n) {
  if (use512(k))
    run_block512(k, blk, xr, K, yr, R, bw, n);
  else
    run_block2(k, blk, xr, K, yr, bw, n);
}
static float bound_pass(const float* sums, const float* meta, int64_t V, float s_h, float hn, float rn, float rho,
                        bool bf, void* yrow, float* up) {
  return use512(KQ8) ? bound_pass512(sums, meta, V, s_h, hn, rn, rho, bf, yrow, up)
                     : bound_pass2(sums, meta, V, s_h, hn, rn, rho, bf, yrow, up);
}
static int64_t cand_pass(const float* up, int64_t V, float L, char* sel) {
  return use512(KQ8) ? cand_pass512(up, V, L, sel) : cand_pass2(up, V, L, sel);
}
#endif  // LRK_X86

// ------------------------------------------------------------------------------------ gemv driver
struct Job {
  int64_t m;      // matrix
  int64_t b;      // block
  int64_t r0;     // first row of x
};

// Runs f on every job: one thread below the pool's threshold, else contiguous runs of jobs of about equal weight
// bytes (pool::chunks_per_thread() per thread) claimed by the caller and the pool's workers. A job writes its own outputs
// with the same code whichever thread runs it, so the result is the same bits at every thread count.
template <typename F>
static void run_jobs(const std::vector<Job>& jobs, const std::vector<int64_t>& bytes, F&& f) {
  const int64_t n = (int64_t)jobs.size();
  int64_t total = 0;
  for (auto b : bytes) total += b;
  const int64_t tu = imin(pool::threads_for(total), n);
  if (tu <= 1 && !pool::in_team()) {  // (in a team every call is a construct: the members meet after it)
    for (int64_t j = 0; j < n; j++) f(jobs[j]);
    return;
  }
  const std::vector<int64_t> cut = pool::cuts(std::vector<double>(bytes.begin(), bytes.end()),
                                              tu * pool::chunks_per_thread());
  pool::run((int64_t)cut.size() - 1, tu, [&](int64_t c) {
    for (int64_t j = cut[c]; j < cut[c + 1]; j++) f(jobs[j]);
  });
}

// x [N, X] (row stride ldx) -> per row, the int16/bf16 pairs (x[2p], x[2p+1]) of columns [off, off + in), a
// zero completing an odd width: dst[r * cdiv(in, 2) + p]
static void bf16_pairs(const uint16_t* xs, int64_t ldx, int64_t N, int64_t off, int64_t in, uint32_t* dst) {
  const int64_t P2 = cdiv(in, 2);
  for (int64_t r = 0; r < N; r++) {
    const uint16_t* row = xs + r * ldx + off;
    for (int64_t p = 0; p < P2; p++) {
      const uint32_t lo = row[2 * p], hi = 2 * p + 1 < in ? row[2 * p + 1] : 0;
      dst[r * P2 + p] = lo | (hi << 16);
    }
  }
}

// The block jobs of one call: for job (m, b, r0), rows r0 .. r0 + R - 1 (R <= rows_per_job) of x against
// block b of packed matrix m. xrow(m, r) / yrow(m, r, b): where row r's input / block b's outputs are.
struct Mat {
  const char* data;
  int64_t out, K;   // outputs, packed inner length
};

template <typename XRow, typename YRow>
static void exec_jobs(Kind k, const std::vector<Mat>& mats, const std::vector<Job>& jobs, int64_t N, XRow xrow,
                      YRow yrow) {
  const int64_t es = esize(k);
  std::vector<int64_t> bytes(jobs.size());
  for (size_t j = 0; j < jobs.size(); j++) {
    const Mat& M = mats[jobs[j].m];
    bytes[j] = imin(BW, padded_rows(M.out) - jobs[j].b * BW) * M.K * es;
  }
#if LRK_X86
  run_jobs(jobs, bytes, [&](const Job& J) {
    const Mat& M = mats[J.m];
    const int64_t bw = imin(BW, padded_rows(M.out) - J.b * BW), n = imin(bw, M.out - J.b * BW);
    const int64_t R = imin(rows_per_job(k), N - J.r0);
    const void* xr[MAX_ROWS];
    void* yr[MAX_ROWS];
    for (int64_t r = 0; r < R; r++) {
      xr[r] = xrow(J.m, J.r0 + r);
      yr[r] = yrow(J.m, J.r0 + r, J.b);
    }
    run_block(k, M.data + J.b * BW * M.K * es, xr, M.K, yr, R, bw, n);
  });
#endif
}

static void push_block_jobs(std::vector<Job>& jobs, Kind k, int64_t m, int64_t b, int64_t N) {
  for (int64_t r0 = 0; r0 < N; r0 += rows_per_job(k)) jobs.push_back({m, b, r0});
}

bool kind_runs(bool bf) { return runs(bf ? KBF16 : KF32); }
int64_t packed_size(int64_t out, int64_t in, bool bf) { return packed_numel(out, in, bf); }

void gemv_into(bool bf, const void* x, int64_t ldx, int64_t N, const GemvMat* gm, int64_t M, void* y, int64_t ldy) {
  if (N == 0 || M == 0) return;
  const Kind k = bf ? KBF16 : KF32;
  const int64_t es = esize(k);
  std::vector<int64_t> xpo(M + 1, 0);       // bf16: each matrix's pairs of every row
  for (int64_t m = 0; m < M; m++) xpo[m + 1] = xpo[m] + N * cdiv(gm[m].in, 2);
  std::vector<uint32_t> xp(bf ? xpo[M] : 0);
  if (bf)
    for (int64_t m = 0; m < M; m++)
      bf16_pairs((const uint16_t*)x, ldx, N, gm[m].xoff, gm[m].in, xp.data() + xpo[m]);
  std::vector<Mat> mats;
  std::vector<Job> jobs;
  for (int64_t m = 0; m < M; m++) {
    mats.push_back({(const char*)gm[m].P, gm[m].out, inner(gm[m].in, bf)});
    for (int64_t b = 0; b * BW < padded_rows(gm[m].out); b++) push_block_jobs(jobs, k, m, b, N);
  }
  const char* xb = (const char*)x;
  char* yb = (char*)y;
  exec_jobs(
      k, mats, jobs, N,
      [&](int64_t m, int64_t r) -> const void* {
        return bf ? (const void*)(xp.data() + xpo[m] + r * cdiv(gm[m].in, 2))
                  : (const void*)(xb + (r * ldx + gm[m].xoff) * es);
      },
      [&](int64_t m, int64_t r, int64_t b) -> void* { return yb + (r * ldy + gm[m].yoff + b * BW) * es; });
}

at::Tensor gemv(const at::Tensor& x, at::TensorList Ps, at::IntArrayRef outs, at::IntArrayRef ins,
                at::IntArrayRef xoffs) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "lowrank_lrk::gemv: x must be [N, X] with unit column stride");
  const bool bf = is_bf(x);
  const Kind k = bf ? KBF16 : KF32;
  check_isa(k);
  const int64_t M = (int64_t)Ps.size(), N = x.size(0), ldx = x.stride(0);
  TORCH_CHECK((int64_t)outs.size() == M && (int64_t)ins.size() == M && (int64_t)xoffs.size() == M,
              "lowrank_lrk::gemv: one out, in and x offset per matrix");
  std::vector<GemvMat> gm;
  int64_t ldy = 0;
  for (int64_t m = 0; m < M; m++) {
    const at::Tensor& P = Ps[m];
    TORCH_CHECK(P.scalar_type() == x.scalar_type() && P.dim() == 1 && P.is_contiguous() &&
                    P.numel() == packed_numel(outs[m], ins[m], bf),
                "lowrank_lrk::gemv: matrix ", m, " is not a packed [", outs[m], ", ", ins[m], "] ", x.scalar_type());
    TORCH_CHECK(xoffs[m] >= 0 && xoffs[m] + ins[m] <= x.size(1), "lowrank_lrk::gemv: matrix ", m,
                " reads columns [", xoffs[m], ", ", xoffs[m] + ins[m], ") of x [", N, ", ", x.size(1), "]");
    gm.push_back({P.data_ptr(), outs[m], ins[m], xoffs[m], ldy});
    ldy += outs[m];
  }
  auto y = at::empty({N, ldy}, x.options());
  gemv_into(bf, x.data_ptr(), ldx, N, gm.data(), M, y.data_ptr(), ldy);
  return y;
}

// ------------------------------------------------------------------------------------ certified LM head
static inline float round_up_f(double v) {       // the smallest float >= v (v finite, >= 0)
  float f = (float)v;
  return (double)f >= v ? f : std::nextafter(f, INFINITY);
}

at::Tensor certified_head(const at::Tensor& x, const at::Tensor& Q, const at::Tensor& meta, const at::Tensor& P,
                          int64_t V, double max_fraction, at::Tensor& stats) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "lowrank_lrk::certified_head: x must be [N, d] with unit column stride");
  const bool bf = is_bf(x);
  check_isa(bf ? KBF16 : KF32);
  check_isa(KQ8);
  const int64_t N = x.size(0), d = x.size(1), ldx = x.stride(0);
  TORCH_CHECK(Q.scalar_type() == at::kChar && Q.dim() == 1 && Q.is_contiguous() && Q.numel() == packed_numel(V, d, true),
              "lowrank_lrk::certified_head: Q is not a packed int8 [", V, ", ", d, "] matrix");
  TORCH_CHECK(P.scalar_type() == x.scalar_type() && P.dim() == 1 && P.is_contiguous() &&
                  P.numel() == packed_numel(V, d, bf),
              "lowrank_lrk::certified_head: P is not a packed [", V, ", ", d, "] ", x.scalar_type(), " matrix");
  TORCH_CHECK(meta.scalar_type() == at::kFloat && meta.is_contiguous() && meta.numel() == 3 * V,
              "lowrank_lrk::certified_head: meta must be float32 [V, 3] (scale, a, b)");
  TORCH_CHECK(stats.scalar_type() == at::kLong && stats.is_contiguous() && stats.numel() == 5,
              "lowrank_lrk::certified_head: stats must be int64 [5]");
  auto y = at::empty({N, V}, x.options());
  if (N == 0) return y;
  const int64_t K = inner(d, true), K2 = K / 2, rows = padded_rows(V), nblk = cdiv(rows, BW), es = bf ? 2 : 4;
  // 1. x as int16 pairs: |q| <= m with 127 * m * K < 2^31 (exact int32 sums); hn = |x|, rn = |x - s_h q|
  const int64_t mq = imin(32767, ((int64_t(1) << 31) - 1) / (127 * K));
  std::vector<uint32_t> xq(N * K2, 0);
  std::vector<float> sh(N), hn(N), rn(N);
  bool finite = true;                               // a non-finite x: no bound holds, the exact head runs
  for (int64_t r = 0; r < N; r++) {
    std::vector<double> h(d);
    double mx = 0, h2 = 0, r2 = 0;
    for (int64_t i = 0; i < d; i++) {
      if (bf) {
        const uint32_t bits = (uint32_t)((const uint16_t*)x.data_ptr())[r * ldx + i] << 16;
        float f;
        std::memcpy(&f, &bits, 4);
        h[i] = f;
      } else {
        h[i] = x.data_ptr<float>()[r * ldx + i];
      }
      mx = std::fmax(mx, std::fabs(h[i]));
      h2 += h[i] * h[i];
    }
    if (!std::isfinite(h2)) {
      finite = false;
      continue;
    }
    const float s = mx > 0 ? (float)(mx / (double)mq) : 1.0f;
    for (int64_t i = 0; i < d; i++) {
      double q = std::nearbyint(h[i] / (double)s);
      q = std::fmin(std::fmax(q, (double)-mq), (double)mq);
      const double e = h[i] - (double)s * q;
      r2 += e * e;
      const uint32_t u = (uint32_t)(uint16_t)(int16_t)q;
      xq[r * K2 + i / 2] |= (i % 2) ? (u << 16) : u;
    }
    sh[r] = s;
    hn[r] = round_up_f(std::sqrt(h2) * (1 + 1e-12));
    rn[r] = round_up_f(std::sqrt(r2) * (1 + 1e-12));
  }
  // 2. approximate scores (int8 head): sums[r][i]
  // per-thread scratch reused across calls (no 200 KB zero-fill per token; every entry read is written first)
  // (a thread_local is this thread's own: the pool's workers see it through these pointers, never by name)
  thread_local std::vector<float> sums_buf, up_buf;
  if ((int64_t)sums_buf.size() < N * rows) sums_buf.resize(N * rows);
  if ((int64_t)up_buf.size() < V) up_buf.resize(V);
  float* const sums = sums_buf.data();
  float* const up = up_buf.data();
  std::vector<Mat> qmat{{(const char*)Q.data_ptr(), V, K}};
  std::vector<Job> jobs;
  for (int64_t b = 0; b < nblk; b++) push_block_jobs(jobs, KQ8, 0, b, N);
  exec_jobs(
      KQ8, qmat, jobs, N, [&](int64_t, int64_t r) -> const void* { return xq.data() + r * K2; },
      [&](int64_t, int64_t r, int64_t b) -> void* { return sums + r * rows + b * BW; });
  // 3. bounds, candidates, the union of their blocks
  const float rho = bf ? 0.00390625f : 0.0f;       // bf16 output: one rounding, unit roundoff 2^-8
  std::vector<char> sel(nblk, 0);
  int64_t cands = 0;
#if LRK_X86
  for (int64_t r = 0; r < N && finite; r++) {
    const float L = bound_pass(sums + r * rows, meta.data_ptr<float>(), V, sh[r], hn[r], rn[r], rho, bf,
                               (char*)y.data_ptr() + r * V * es, up);
    cands += cand_pass(up, V, L, sel.data());
  }
#endif
  int64_t nsel = 0;
  for (auto c : sel) nsel += c;
  const bool fallback = !finite || (double)nsel > max_fraction * (double)nblk;
  // 4. the exact head on the selected blocks (all of them on fallback): gemv's kernels and row grouping
  std::vector<uint32_t> xp(bf ? N * K2 : 0);
  if (bf) bf16_pairs((const uint16_t*)x.data_ptr(), ldx, N, 0, d, xp.data());
  std::vector<Mat> pmat{{(const char*)P.data_ptr(), V, inner(d, bf)}};
  jobs.clear();
  int64_t exact_rows = 0;
  for (int64_t b = 0; b < nblk; b++)
    if (fallback || sel[b]) {
      push_block_jobs(jobs, bf ? KBF16 : KF32, 0, b, N);
      exact_rows += imin(BW, V - b * BW);
    }
  // y rows are V wide; a block's outputs go straight into them (the kernels store n <= V - b * BW values)
  const char* xb = (const char*)x.data_ptr();
  char* yb = (char*)y.data_ptr();
  exec_jobs(
      bf ? KBF16 : KF32, pmat, jobs, N,
      [&](int64_t, int64_t r) -> const void* {
        return bf ? (const void*)(xp.data() + r * K2) : (const void*)(xb + r * ldx * es);
      },
      [&](int64_t, int64_t r, int64_t b) -> void* { return yb + (r * V + b * BW) * es; });
  int64_t* st = stats.data_ptr<int64_t>();
  st[0] += 1;
  st[1] += N;
  st[2] += fallback ? 1 : 0;
  st[3] += cands;
  st[4] += exact_rows;
  return y;
}

// ------------------------------------------------------------------------------------ attention driver
// Whether bf16 attention with D % 32 == 0 runs attend_head_dp (vdpbf16ps; default) or attend_head (widen, then fp32
// FMAs), and tiers.cpp's exact-row scores likewise: $LOWRANK_LIB_ATTN_DP=0 at load picks the latter.
bool attn_dp() {  // declared where used: tiers.cpp
  static const bool on = [] {
    const char* e = std::getenv("LOWRANK_LIB_ATTN_DP");
    return !(e && e[0] == '0');
  }();
  return on;
}
static int64_t attend_pieces(int64_t n) { return std::max<int64_t>(1, std::min(ATTN_MAX_PIECES, n / ATTN_PIECE)); }
int64_t attend_state_floats(int64_t pairs, int64_t G, int64_t D) { return pairs * ATTN_MAX_PIECES * G * (D + 2); }

#if LRK_X86
// attend_into with each (row, KV head) pair's slots cut into pieces (attend_pieces: 2048 live slots or more): items
// (pair, piece) weighted by their slots, run over the pool (or the team); a pair of one piece writes its output, the
// others their states, merged per pair in a second construct. The pieces depend on the slots only, not on the
// threads: the same bits at every thread count. kern(pair, lo, hi, scratch, state or nullptr) runs one item on a
// thread's scratch of sc_floats floats; merge(pair, its first state, pieces) writes a split pair's output.
template <typename Kern, typename Merge>
static void attend_split(int64_t B, int64_t H, int64_t G, int64_t D, int64_t hi, const int64_t* pd, int64_t es,
                         int64_t sc_floats, void* o, float* ts, Kern kern, Merge merge) {
  struct Item { int64_t pair, lo, hi, state; };
  std::vector<Item> items;
  std::vector<double> wt;
  std::vector<int64_t> first(B * H + 1);
  int64_t states = 0;
  for (int64_t i = 0; i < B * H; i++) {
    first[i] = (int64_t)items.size();
    const int64_t lo = pd[i / H];
    if (lo > hi) {                      // no live slot (cannot happen for a real row): zeros, not NaN
      std::memset((char*)o + i * G * D * es, 0, G * D * es);
      continue;
    }
    const int64_t n = hi - lo + 1, P = attend_pieces(n), step = cdiv(cdiv(n, P), 16) * 16;
    for (int64_t a = lo; a <= hi; a += step) {
      items.push_back({i, a, std::min(hi, a + step - 1), P > 1 ? states++ : -1});
      wt.push_back((double)(items.back().hi - a + 1) * D * 2 * es);
    }
  }
  first[B * H] = (int64_t)items.size();
  std::vector<float> own;
  float* S = nullptr;
  if (states) {
    TORCH_CHECK(ts || !pool::in_team(), "lowrank_lrk::attend: internal: no shared piece states inside a team");
    S = ts ? ts : grow(own, states * G * (D + 2));
  }
  double work = 0;
  for (double w : wt) work += w;
  const int64_t tu = imin(pool::threads_for((int64_t)work), (int64_t)items.size());
  const std::vector<int64_t> cut = pool::cuts(wt, tu * pool::chunks_per_thread());
  pool::run((int64_t)cut.size() - 1, tu, [&](int64_t c) {
    static thread_local std::vector<float> t_sc;  // the running thread's scratch (undefined contents)
    float* const sc = grow(t_sc, sc_floats);
    for (int64_t j = cut[c]; j < cut[c + 1]; j++) {
      const Item& it = items[j];
      kern(it.pair, it.lo, it.hi, sc, it.state < 0 ? nullptr : S + it.state * G * (D + 2));
    }
  });
  if (!states) return;
  std::vector<int64_t> split;           // the pairs of two or more pieces
  for (int64_t i = 0; i < B * H; i++)
    if (first[i + 1] - first[i] > 1) split.push_back(i);
  auto merge_one = [&](int64_t c) {
    const int64_t i = split[c];
    merge(i, S + items[first[i]].state * G * (D + 2), first[i + 1] - first[i]);
  };
  if (pool::in_team())                  // a construct of the team (its members wait at its barrier anyway)
    pool::run((int64_t)split.size(), imin(tu, (int64_t)split.size()), merge_one);
  else                                  // the caller alone: a few thousand flops, cheaper than a hand-off
    for (int64_t c = 0; c < (int64_t)split.size(); c++) merge_one(c);
}

// the dot-product kernel (AVX512_BF16) over the pieces
static void attend_dp(const uint16_t* q, const uint16_t* K, const int64_t* ks, const uint16_t* V, const int64_t* vs,
                      int64_t B, int64_t H, int64_t G, int64_t D, int64_t hi, const int64_t* pd, float scale,
                      uint16_t* o, float* ts) {
  attend_split(
      B, H, G, D, hi, pd, 2, 16 * (cdiv(hi + 1, 16) * 16), o, ts,
      [&](int64_t i, int64_t lo, int64_t ihi, float* sc, float* stp) {
        const int64_t b = i / H, h = i % H;
        ATTN_DP[D / 32 - 1](q + i * G * D, K + b * ks[0] + h * ks[1], V + b * vs[0] + h * vs[1], ks[2], vs[2], lo, ihi,
                            G, scale, o + i * G * D, sc, stp);
      },
      [&](int64_t i, const float* st, int64_t P) { merge_dp(st, P, G, D, o + i * G * D); });
}

// the AVX2 kernel (bf16 or fp32 rows) over the pieces: unsplit, SmolLM2's 3 KV heads of a row put two pairs on one
// thread and one on the other at 2 threads. The op over 30 layers of 8k slots (3 KV heads x 3 queries, d 64), AVX2
// code on the AMD Zen 4 VM, old and new alternating, 3 processes each: 2 threads bf16 10.2-10.4 -> 8.2-8.6 ms, fp32
// 13.8-18.1 -> 12.6-13.2 ms; 1 thread unchanged within the noise (bf16 14.1-15.2 / 14.2-16.1, fp32 18.5-21.0 /
// 18.5-22.0)
template <typename T>
static void attend_avx2(const T* q, const T* K, const int64_t* ks, const T* V, const int64_t* vs, int64_t B,
                        int64_t H, int64_t G, int64_t D, int64_t hi, const int64_t* pd, float scale, T* o, float* ts) {
  attend_split(
      B, H, G, D, hi, pd, (int64_t)sizeof(T), G * (cdiv(hi + 1, 8) * 8 + D) + 8 * D, o, ts,
      [&](int64_t i, int64_t lo, int64_t ihi, float* sc, float* stp) {
        const int64_t b = i / H, h = i % H;
        attend_head2<T>(q + i * G * D, K + b * ks[0] + h * ks[1], V + b * vs[0] + h * vs[1], ks[2], vs[2], lo, ihi, G,
                        D, scale, o + i * G * D, sc, stp);
      },
      [&](int64_t i, const float* st, int64_t P) { merge2<T>(st, P, G, D, o + i * G * D); });
}
#endif

void attend_into(bool bf, const void* q, const void* K, const int64_t* ks, const void* V, const int64_t* vs, int64_t B,
                 int64_t H, int64_t G, int64_t D, int64_t hi, const int64_t* pd, float scale, void* o, float* ts) {
  const bool w512 = use512(bf ? KBF16 : KF32);
  const int64_t es = bf ? 2 : 4;
#if LRK_X86
  if (w512 && bf && D % 32 == 0 && attn_dp()) {  // attend_head_dp: bf16 dot products, pairs split into pieces
    attend_dp((const uint16_t*)q, (const uint16_t*)K, ks, (const uint16_t*)V, vs, B, H, G, D, hi, pd, scale,
              (uint16_t*)o, ts);
    return;
  }
  if (!w512) {                                     // attend_head2 (AVX2), pairs split into pieces likewise
    if (bf)
      attend_avx2<uint16_t>((const uint16_t*)q, (const uint16_t*)K, ks, (const uint16_t*)V, vs, B, H, G, D, hi, pd,
                            scale, (uint16_t*)o, ts);
    else
      attend_avx2<float>((const float*)q, (const float*)K, ks, (const float*)V, vs, B, H, G, D, hi, pd, scale,
                         (float*)o, ts);
    return;
  }
#endif
  // threads: contiguous runs of (batch row, KV head) pairs, weighted by the K / V bytes each reads; each pair's
  // output is computed by the same code whichever thread runs it (the same bits at every thread count)
  std::vector<double> wt(B * H);
  for (int64_t i = 0; i < B * H; i++) wt[i] = (double)(hi + 1 - std::min(pd[i / H], hi + 1)) * D * 2 * es;
  double work = 0;
  for (double w : wt) work += w;
  const int64_t tu = imin(pool::threads_for((int64_t)work), B * H);
  const std::vector<int64_t> cut = pool::cuts(wt, tu * pool::chunks_per_thread());
#if LRK_X86
  auto heads = [&](int64_t i0, int64_t i1) {
    // GB * ceil16(n) scores, in the running thread's own grow-only scratch (this lambda runs on the caller and on the
    // pool's workers; contents undefined: the kernels write before they read)
    static thread_local std::vector<float> t_sc;
    float* const sc = grow(t_sc, 16 * (cdiv(hi + 1, 16) * 16));
    for (int64_t i = i0; i < i1; i++) {
      const int64_t b = i / H, h = i % H, lo = pd[b];
      const char* qp = (const char*)q + (i * G * D) * es;
      const char* kp = (const char*)K + (b * ks[0] + h * ks[1]) * es;
      const char* vp = (const char*)V + (b * vs[0] + h * vs[1]) * es;
      char* op = (char*)o + (i * G * D) * es;
      if (lo > hi) {                    // no live slot (cannot happen for a real row): zeros, not NaN
        std::memset(op, 0, G * D * es);
        continue;
      }
      if (bf)
        ATTN_BF16[D / 16 - 1]((const uint16_t*)qp, (const uint16_t*)kp, (const uint16_t*)vp, ks[2], vs[2], lo, hi, G,
                              scale, (uint16_t*)op, sc);
      else
        ATTN_F32[D / 16 - 1]((const float*)qp, (const float*)kp, (const float*)vp, ks[2], vs[2], lo, hi, G, scale,
                             (float*)op, sc);
    }
  };
  pool::run((int64_t)cut.size() - 1, tu, [&](int64_t c) { heads(cut[c], cut[c + 1]); });
#endif
}

at::Tensor attend(const at::Tensor& q, const at::Tensor& K, const at::Tensor& V, const at::Tensor& length,
                  const at::Tensor& pad, double scale) {
  TORCH_CHECK(q.dim() == 4 && K.dim() == 4 && V.dim() == 4, "lowrank_lrk::attend: q [B, Hkv, G, D], K/V [B, Hkv, S, D]");
  const bool bf = is_bf(q);
  const Kind kk = bf ? KBF16 : KF32;
  check_isa(kk);
  const int64_t B = q.size(0), H = q.size(1), G = q.size(2), D = q.size(3), S = K.size(2);
  TORCH_CHECK(K.scalar_type() == q.scalar_type() && V.scalar_type() == q.scalar_type(), "lowrank_lrk::attend: dtypes");
  TORCH_CHECK(D % 16 == 0 && D <= 128, "lowrank_lrk::attend: head_dim must be a multiple of 16 up to 128, got ", D);
  TORCH_CHECK(G <= 256, "lowrank_lrk::attend: at most 256 query heads per KV head, got ", G);
  TORCH_CHECK(K.size(0) >= B && V.size(0) >= B && K.size(1) == H && V.size(1) == H && V.size(2) == S &&
                  K.size(3) == D && V.size(3) == D && K.stride(3) == 1 && V.stride(3) == 1,
              "lowrank_lrk::attend: K/V must be [>=B, Hkv, S, D] with unit stride in D");
  TORCH_CHECK(length.scalar_type() == at::kLong && length.numel() == 1 && pad.scalar_type() == at::kLong &&
                  pad.numel() >= B && pad.is_contiguous(),
              "lowrank_lrk::attend: length [1] and pad [>=B] int64");
  const int64_t hi = length.data_ptr<int64_t>()[0];
  TORCH_CHECK(hi >= 0 && hi < S, "lowrank_lrk::attend: slot ", hi, " outside the cache of ", S, " slots");
  auto qc = q.contiguous();
  auto o = at::empty({B, H * G * D}, q.options());
  const int64_t ks[3] = {K.stride(0), K.stride(1), K.stride(2)}, vs[3] = {V.stride(0), V.stride(1), V.stride(2)};
  attend_into(bf, qc.data_ptr(), K.data_ptr(), ks, V.data_ptr(), vs, B, H, G, D, hi, pad.data_ptr<int64_t>(),
              (float)scale, o.data_ptr());
  return o;
}

std::string source_tag() { return LRK_STR(LRK_SOURCE_TAG); }

}  // namespace lrk

TORCH_LIBRARY(lowrank_lrk, m) {
  m.def("isa_flags() -> int", &lrk::isa_flags);
  m.def("set_isa_mask(int mask) -> int", &lrk::set_isa_mask);
  m.def("source_tag() -> str", &lrk::source_tag);
  m.def("pack(Tensor W) -> Tensor");
  m.def("unpack(Tensor P, int out, int inp) -> Tensor");
  m.def("gemv(Tensor x, Tensor[] Ps, int[] outs, int[] ins, int[] xoffs) -> Tensor");
  m.def("attend(Tensor q, Tensor K, Tensor V, Tensor length, Tensor pad, float scale) -> Tensor");
  m.def("certified_head(Tensor x, Tensor Q, Tensor meta, Tensor P, int V, float max_fraction, Tensor(a!) stats) -> Tensor");
  m.def("set_pool(int threads, int min_bytes, int spin_us, int mode) -> int[]", &lrk::pool::set_pool);
  m.def("pool_info() -> int[]", &lrk::pool::pool_info);
  // weight_prefetch() -> how the GEMVs prefetch their weight stream in this process: "nta", "t0" or "none"
  m.def("weight_prefetch() -> str", [] { return std::string(LRK_PREFETCH > 0 ? (lrk::g_pf_nta ? "nta" : "t0") : "none"); });
  m.def("set_arena(int on) -> int", [](int64_t on) -> int64_t { return lrk::arena::set_enabled(on != 0) ? 1 : 0; });
  m.def("arena_info() -> int[]", &lrk::arena::info);
  m.def("arena_zeros(int numel, ScalarType dtype) -> Tensor", [](int64_t numel, at::ScalarType dtype) -> at::Tensor {
    TORCH_CHECK(numel >= 0, "lowrank_lrk::arena_zeros: numel must be >= 0, got ", numel);
    return lrk::arena_empty(numel, at::TensorOptions().dtype(dtype)).zero_();
  });
}

TORCH_LIBRARY_IMPL(lowrank_lrk, CPU, m) {
  m.impl("pack", &lrk::pack);
  m.impl("unpack", &lrk::unpack);
  m.impl("gemv", &lrk::gemv);
  m.impl("attend", &lrk::attend);
  m.impl("certified_head", &lrk::certified_head);
}
