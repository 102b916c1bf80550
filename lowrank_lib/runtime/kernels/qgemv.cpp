// lowrank_lib's packed GEMV of QUANTIZED matrices (issue 30): int8 / int4 codes with fp16 scales per group of the
// reduction dim, the math of /work/coord/QUANT_SPEC.md (lowrank_lib/quant.py is its portable path: quantize,
// quantize_activations, qmatmul), the same bits as quant.qmatmul at every ISA level and thread count.
//
// Compiled into the one kernel library with lrk.cpp (same flags, ops in the namespace lowrank_lrk, the same run-time
// ISA check and mask: lrk::isa_flags / set_isa_mask; threads from the kernel pool, lrk_pool.h).
//
// Ops (namespace lowrank_lrk; Python wrappers in ops.py):
//   qpack(data, scale, bits, group, out, inp) -> P uint8 [n]
//        data: the canonical codes (bits 8: int8 [out, in_pad]; bits 4: uint8 [out, in_pad / 2], column 2k in the low
//        nibble of byte k, 2k + 1 in the high one, each as q + 8), scale fp16 [out, in_pad / group],
//        in_pad = ceil(inp / group) * group -> the packed blob below (codes and scales of ONE matrix)
//   qunpack(P, bits, group, out, inp) -> (data, scale)    the exact inverse
//   qgemv(x [N, X], Ps[], outs[], ins[], xoffs[], bits, group) -> y [N, sum outs] (x's dtype, fp32 or bf16; N <= 8)
//        matrix m reads columns [xoffs[m], xoffs[m] + ins[m]) of x (its groups start at xoffs[m]; columns past ins[m]
//        count as 0) and writes its outs[m] columns of y, in order (gemv's contract).
//
// Math (the spec): per row of x and group j of a matrix, xa = max |x| (fp32; NaN / Inf propagate), inv = 32767 / xa
// (0 where xa = 0), xq = clamp(round_half_even(x * inv), +-32767) (int16; NaN -> 0), xs = xa / 32767; per output o,
// isum = sum_k q[o, k] * xq[k] exactly in int32 (vpdpwssd with AVX512_VNNI; vpmaddwd + vpaddd with AVX-512BW or AVX2;
// int4 nibbles u = q + 8 are multiplied as they are and 8 * sum(xq) subtracted per group, an exact identity), then
// y = sum_j float(isum_j) * (float(scale[o, j]) * xs_j) in fp32, each product rounded before its sum (no FMA), j
// ascending, rounded once to x's dtype (bf16: nearest even). Every step is exactly rounded IEEE arithmetic in a fixed
// order, so the result is quant.qmatmul's bit for bit (no bias: the caller adds it).
//
// Packed layout of one matrix: output rows in blocks of BW = 64 (the last block rounded up to a multiple of 16 with
// zero-scale rows), block b of width bw = NZ * 16 one contiguous stream, for each group j = 0 .. G-1 (G = in_pad / g):
//   codes of group j, then scales of group j (bw fp16, output order), i.e. bw * (g * bits / 8 + 2) bytes per group;
//   int8 codes: pairs, byte [p][l][e] = q[b*64 + l][j*g + 2p + e]                (p < g / 2, l < bw, e < 2)
//               (one 32-byte load widened to 16 int32 lanes of int16 pairs: outputs l .. l + 15, columns 2p, 2p + 1)
//   int4 codes: chunks of 8 columns, byte [c][z][w][h] (c < g / 8, z < NZ, w < 32, h < 2): 16-bit word w of chunk
//               (c, z) holds four nibbles t = 0..3 (t = 2h + low/high nibble of byte h) = u[b*64 + 16z + w/2]
//               [j*g + 8c + 2t + w%2], u = q + 8; so (word >> 4t) & 15 is, per 32-bit lane, the int16 pair of output
//               16z + lane, columns 8c + 2t, 8c + 2t + 1 (one 64-byte load -> four vectors of pairs, by shifts).
// The kernel reads each block once from memory (software prefetch QP_DIST bytes ahead, as lrk.cpp), up to MAXR rows of
// x per pass (AVX-512; AVX2: one row), the fp32 group accumulators of the block in L1.
//
// ISA (run-time CPUID under the mask): AVX512F/BW/VL + AVX512_VNNI -> vpdpwssd (int4 with up to 2 rows per pass:
// vpdpbusd over the nibbles as bytes, qblk4_dpb); else AVX512F/BW/VL -> vpmaddwd; else
// AVX2 + FMA (+ F16C for the scales) -> the 8-lane code; else the op refuses and the portable path runs. All three give
// the same bits (the integer sums are exact and the fp32 steps are the same operations in the same order).
// Threads: (matrix, block, first row) jobs cut into contiguous runs of about equal bytes (lrk.cpp's split), claimed by
// the calling thread and the pool's workers; every job's outputs are computed by the same code whichever thread runs it.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "lrk_api.h"
#include "lrk_arena_tensor.h"
#include "lrk_pool.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#define LRK_X86 1
#include <immintrin.h>
#else
#define LRK_X86 0
#endif

namespace lrk {

int64_t isa_flags();  // lrk.cpp

namespace q {

constexpr int64_t BW = 64;     // outputs per block
constexpr int64_t TAIL = 16;   // the last block rounded up to a multiple of this many outputs
constexpr int MAXR = 4;        // rows of x per pass over a block (AVX-512)
constexpr int64_t MAX_N = QGEMV_MAX_ROWS;  // rows of x per call (more: the caller dequantizes)
#ifndef LRK_QPREFETCH
// bytes ahead of the weight stream: 4096, twice lrk.cpp's LRK_PREFETCH (measured on the 2-core AMD AVX-512 VM, 1B keep-0.5
// classes streamed cold, 1 / 2 threads: int8 28.4 / 35 GB/s at 2048, 30.3 / 38 at 4096, 31.7 / 31 at 8192; int4 +1-4 %)
#define LRK_QPREFETCH 4096
#endif
constexpr int64_t QP_DIST = LRK_QPREFETCH;
#if LRK_QPREFETCH > 0
#define QPF(p) ::lrk::prefetch_weight(p)
#else
#define QPF(p) ((void)0)
#endif

static inline int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
static inline int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }
static inline int64_t padded_rows(int64_t out) { return (out / BW) * BW + cdiv(out % BW, TAIL) * TAIL; }
static inline float bits_to_f(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}
static inline int32_t ld32(const int16_t* p) {  // an int16 pair as one 32-bit lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// the geometry of one packed matrix
struct Geo {
  int64_t bits, g, out, in, in_pad, G, cb, rows;
  Geo(int64_t bits_, int64_t g_, int64_t out_, int64_t in_)
      : bits(bits_), g(g_), out(out_), in(in_), in_pad(cdiv(in_, g_) * g_), G(cdiv(in_, g_)),
        cb(bits_ == 8 ? g_ : g_ / 2), rows(padded_rows(out_)) {}
  int64_t block_bytes(int64_t bw) const { return G * bw * (cb + 2); }
  int64_t nbytes() const { return rows * G * (cb + 2); }
  int64_t block_off(int64_t b) const { return b * BW * G * (cb + 2); }
};

// one pass's rows of quantized x: int16 codes (in_pad), scales and code sums per group
struct Rows {
  const int16_t* xq[MAXR];
  const float* xs[MAXR];
  const int32_t* S[MAXR];
  const int32_t* xp[MAXR];  // int4 with VNNI (qblk4_dpb): x's bytes per chunk of 8 columns (quads_row), else null
};

typedef void (*qblk_fn)(const uint8_t*, int64_t, int64_t, const Rows&, void* const*, bool, int64_t);

#if LRK_X86
// makes v opaque to the optimiser: a product stays a product (no contraction with the following add into an FMA)
#define QFENCE(v) __asm__("" : "+v"(v))

// ------------------------------------------------------------------------------------ AVX-512 + VNNI
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c"))), \
                             apply_to = function)
#endif
#define QSFX _vnni
#define QDPW(acc, w, x) _mm512_dpwssd_epi32(acc, w, x)
#include "qgemv_512.h"
#undef QDPW
#undef QSFX

// int4 blocks with u8 x s8 dot products (vpdpbusd, 4 products per 32-bit lane) instead of widening the nibbles to int16
// pairs: x's int16 codes split exactly as xq = 256 * hi + lo (hi = xq >> 8, signed; lo = xq & 255, unsigned), so
// sum u * xq = 256 * sum u * hi + sum lo * u, where the nibble u (0..15) is the unsigned operand against hi and the
// signed one against lo. One 64-byte load gives two vectors of nibbles (an and, a shift and an and) where the int16
// path needs four (seven operations), and each accumulator takes two products per chunk instead of four (a shorter
// dependency chain). The low nibbles of a 32-bit lane are columns (0, 4, 1, 5) of the chunk for that lane's output, the
// high ones (2, 6, 3, 7) (the packed layout above); Rows::xp holds x's bytes in that order (quads_row). The sums are
// exact in int32 (|256 * sum u * hi| <= 256 * 15 * 128 * 256 < 2^31, |sum lo * u| <= 15 * 255 * 256), so every output
// is qblk's bit for bit. R <= 2 rows per pass (2 * R * NZ accumulators in registers).
static void quads_row(const int16_t* xq, int64_t in_pad, int32_t* xp) {
  const __m128i ctl = _mm_setr_epi8(0, 8, 2, 10, 1, 9, 3, 11, 4, 12, 6, 14, 5, 13, 7, 15);
  for (int64_t c = 0; c < in_pad / 8; c++)
    _mm_storeu_si128((__m128i*)(xp + 4 * c), _mm_shuffle_epi8(_mm_loadu_si128((const __m128i*)(xq + 8 * c)), ctl));
}

template <int R, int NZ>
static void qblk4_dpb(const uint8_t* blk, int64_t G, int64_t g, const Rows& X, void* const* ys, bool bf, int64_t n) {
  constexpr int64_t BWD = NZ * 16;
  const int64_t cb = g / 2, gs = BWD * (cb + 2), nc = g / 8;
  alignas(64) float fa[R][BWD];
  for (int r = 0; r < R; r++)
    for (int z = 0; z < NZ; z++) _mm512_store_ps(fa[r] + 16 * z, _mm512_setzero_ps());
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  for (int64_t j = 0; j < G; j++) {
    const uint8_t* w = blk + j * gs;
    __m512i ah[R][NZ], al[R][NZ];
    for (int r = 0; r < R; r++)
      for (int z = 0; z < NZ; z++) ah[r][z] = al[r][z] = _mm512_setzero_si512();
    for (int64_t c = 0; c < nc; c++) {
      __m512i alo[R], ahi[R], blo[R], bhi[R];
      for (int r = 0; r < R; r++) {
        const int32_t* q = X.xp[r] + (j * nc + c) * 4;
        alo[r] = _mm512_set1_epi32(q[0]), ahi[r] = _mm512_set1_epi32(q[1]);
        blo[r] = _mm512_set1_epi32(q[2]), bhi[r] = _mm512_set1_epi32(q[3]);
      }
      for (int z = 0; z < NZ; z++) {
        const uint8_t* wp = w + (c * NZ + z) * 64;
        QPF(wp + QP_DIST);
        const __m512i v = _mm512_loadu_si512((const void*)wp);
        const __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
        for (int r = 0; r < R; r++) {
          ah[r][z] = _mm512_dpbusd_epi32(ah[r][z], lo, ahi[r]);
          al[r][z] = _mm512_dpbusd_epi32(al[r][z], alo[r], lo);
          ah[r][z] = _mm512_dpbusd_epi32(ah[r][z], hi, bhi[r]);
          al[r][z] = _mm512_dpbusd_epi32(al[r][z], blo[r], hi);
        }
      }
    }
    const uint16_t* sp = (const uint16_t*)(w + BWD * cb);
    __m512 sc[NZ];
    for (int z = 0; z < NZ; z++) sc[z] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(sp + 16 * z)));
    for (int r = 0; r < R; r++) {
      const __m512 xsv = _mm512_set1_ps(X.xs[r][j]);
      const __m512i corr = _mm512_set1_epi32(8 * X.S[r][j]);
      for (int z = 0; z < NZ; z++) {
        const __m512i acc = _mm512_add_epi32(_mm512_slli_epi32(ah[r][z], 8), al[r][z]);
        const __m512 cz = _mm512_mul_ps(sc[z], xsv);
        __m512 prod = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc, corr)), cz);
        QFENCE(prod);
        _mm512_store_ps(fa[r] + 16 * z, _mm512_add_ps(_mm512_load_ps(fa[r] + 16 * z), prod));
      }
    }
  }
  for (int r = 0; r < R; r++)
    for (int z = 0; z < NZ && z * 16 < n; z++) {
      const __m512 a = _mm512_load_ps(fa[r] + 16 * z);
      if (bf)
        _mm256_mask_storeu_epi16((uint16_t*)ys[r] + 16 * z, lanes_vnni(n - 16 * z), to_bf16_vnni(a));
      else
        _mm512_mask_storeu_ps((float*)ys[r] + 16 * z, lanes_vnni(n - 16 * z), a);
    }
}

constexpr int DPB_MAXR = 2;
static const qblk_fn KERNELS_dpb[DPB_MAXR][4] = {
    {qblk4_dpb<1, 1>, qblk4_dpb<1, 2>, qblk4_dpb<1, 3>, qblk4_dpb<1, 4>},
    {qblk4_dpb<2, 1>, qblk4_dpb<2, 2>, qblk4_dpb<2, 3>, qblk4_dpb<2, 4>}};
#if defined(__clang__)
#pragma clang attribute pop
#endif
#pragma GCC pop_options

// ------------------------------------------------------------------------------------ AVX-512BW (no VNNI)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c"))), apply_to = function)
#endif
#define QSFX _bw
#define QDPW(acc, w, x) _mm512_add_epi32(acc, _mm512_madd_epi16(w, x))
#include "qgemv_512.h"
#undef QDPW
#undef QSFX
#if defined(__clang__)
#pragma clang attribute pop
#endif
#pragma GCC pop_options

// ------------------------------------------------------------------------------------ AVX2 + FMA + F16C
// The same layout and operations 8 lanes wide, one row of x per pass (a block's 64 int32 accumulators fill 8 ymm).
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#endif

#include "lrk_simd2.h"  // lanes8, to_bf16x8

static void quant_row_avx2(const float* xf, int64_t G, int64_t g, int16_t* xq, float* xs, int32_t* S) {
  const __m256i absm = _mm256_set1_epi32(0x7FFFFFFF);
  const __m256 C = _mm256_set1_ps(32767.0f), mC = _mm256_set1_ps(-32767.0f);
  for (int64_t j = 0; j < G; j++) {
    const float* p = xf + j * g;
    __m256i m = _mm256_setzero_si256();
    for (int64_t i = 0; i < g; i += 8)
      m = _mm256_max_epi32(m, _mm256_and_si256(_mm256_loadu_si256((const __m256i*)(p + i)), absm));
    __m128i h = _mm_max_epi32(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
    h = _mm_max_epi32(h, _mm_shuffle_epi32(h, 0x4E));
    h = _mm_max_epi32(h, _mm_shuffle_epi32(h, 0xB1));
    const float xa = bits_to_f((uint32_t)_mm_cvtsi128_si32(h));
    const float inv = xa != 0.0f ? 32767.0f / xa : 0.0f;
    xs[j] = xa / 32767.0f;
    const __m256 iv = _mm256_set1_ps(inv);
    __m256i s = _mm256_setzero_si256();
    for (int64_t i = 0; i < g; i += 8) {
      const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(p + i), iv);
      const __m256i ok = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_ORD_Q));
      const __m256i q = _mm256_and_si256(_mm256_cvtps_epi32(_mm256_max_ps(_mm256_min_ps(v, C), mC)), ok);
      s = _mm256_add_epi32(s, q);
      _mm_storeu_si128((__m128i*)(xq + j * g + i), _mm_packs_epi32(_mm256_castsi256_si128(q),
                                                                    _mm256_extracti128_si256(q, 1)));
    }
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
    S[j] = _mm_cvtsi128_si32(t);
  }
}

// qblk's contract with R = 1 (X.xq[0] etc.)
template <int NZ, int BITS>
static void qblk_avx2(const uint8_t* blk, int64_t G, int64_t g, const Rows& X, void* const* ys, bool bf, int64_t n) {
  constexpr int64_t BWD = NZ * 16;
  const int64_t cb = BITS == 8 ? g : g / 2, gs = BWD * (cb + 2);
  alignas(32) float fa[BWD];
  for (int i = 0; i < 2 * NZ; i++) _mm256_store_ps(fa + 8 * i, _mm256_setzero_ps());
  const __m256i nib = _mm256_set1_epi16(0x000F);
  const int16_t* xq = X.xq[0];
  for (int64_t j = 0; j < G; j++) {
    const uint8_t* w = blk + j * gs;
    __m256i acc[2 * NZ];
    for (int i = 0; i < 2 * NZ; i++) acc[i] = _mm256_setzero_si256();
    if (BITS == 8) {
      for (int64_t p = 0; p < g / 2; p++) {
        const uint8_t* wp = w + p * (BWD * 2);
        for (int z = 0; z < NZ; z++) QPF(wp + QP_DIST + 32 * z);
        const __m256i xv = _mm256_set1_epi32(ld32(xq + j * g + 2 * p));
        for (int i = 0; i < 2 * NZ; i++) {
          const __m256i w16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(wp + 16 * i)));
          acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(w16, xv));
        }
      }
    } else {
      for (int64_t c = 0; c < g / 8; c++) {
        const int16_t* xc = xq + j * g + 8 * c;
        __m256i xv[4];
        for (int t = 0; t < 4; t++) xv[t] = _mm256_set1_epi32(ld32(xc + 2 * t));
        for (int z = 0; z < NZ; z++) {
          const uint8_t* wp = w + (c * NZ + z) * 64;
          QPF(wp + QP_DIST);
          for (int hh = 0; hh < 2; hh++) {
            const __m256i v = _mm256_loadu_si256((const __m256i*)(wp + 32 * hh));
            const __m256i u[4] = {_mm256_and_si256(v, nib), _mm256_and_si256(_mm256_srli_epi16(v, 4), nib),
                                  _mm256_and_si256(_mm256_srli_epi16(v, 8), nib), _mm256_srli_epi16(v, 12)};
            __m256i a = acc[2 * z + hh];
            for (int t = 0; t < 4; t++) a = _mm256_add_epi32(a, _mm256_madd_epi16(u[t], xv[t]));
            acc[2 * z + hh] = a;
          }
        }
      }
    }
    const uint16_t* sp = (const uint16_t*)(w + BWD * cb);
    const __m256 xsv = _mm256_set1_ps(X.xs[0][j]);
    const __m256i corr = _mm256_set1_epi32(BITS == 8 ? 0 : 8 * X.S[0][j]);
    for (int i = 0; i < 2 * NZ; i++) {
      const __m256 cz = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(sp + 8 * i))), xsv);
      __m256 prod = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(acc[i], corr)), cz);
      QFENCE(prod);
      _mm256_store_ps(fa + 8 * i, _mm256_add_ps(_mm256_load_ps(fa + 8 * i), prod));
    }
  }
  for (int i = 0; i < 2 * NZ && 8 * i < n; i++) {
    const __m256 a = _mm256_load_ps(fa + 8 * i);
    const int64_t m = n - 8 * i;
    if (bf) {
      uint16_t* y = (uint16_t*)ys[0] + 8 * i;
      const __m128i h = to_bf16x8(a);
      if (m >= 8) {
        _mm_storeu_si128((__m128i*)y, h);
      } else {
        uint16_t tmp[8];
        _mm_storeu_si128((__m128i*)tmp, h);
        std::memcpy(y, tmp, m * 2);
      }
    } else {
      float* y = (float*)ys[0] + 8 * i;
      if (m >= 8)
        _mm256_storeu_ps(y, a);
      else
        _mm256_maskstore_ps(y, lanes8(m), a);
    }
  }
}

static const qblk_fn KERNELS_AVX2[2][4] = {
    {qblk_avx2<1, 8>, qblk_avx2<2, 8>, qblk_avx2<3, 8>, qblk_avx2<4, 8>},
    {qblk_avx2<1, 4>, qblk_avx2<2, 4>, qblk_avx2<3, 4>, qblk_avx2<4, 4>}};

#if defined(__clang__)
#pragma clang attribute pop
#endif
#pragma GCC pop_options
#endif  // LRK_X86

// ------------------------------------------------------------------------------------ ISA choice
enum Path { NONE = 0, AVX2 = 1, BW512 = 2, VNNI512 = 3 };

static bool has_f16c() {
#if LRK_X86
  static const bool f = [] {
    __builtin_cpu_init();
    return (bool)__builtin_cpu_supports("f16c");
  }();
  return f;
#else
  return false;
#endif
}

// isa_flags bits: 0 avx512f, 1 avx512bw, 2 avx512vl, 4 avx512_vnni, 5 avx2, 6 fma
static Path path() {
  const int64_t f = isa_flags();
  if ((f & 23) == 23) return VNNI512;
  if ((f & 7) == 7) return BW512;
  if ((f & 96) == 96 && has_f16c()) return AVX2;
  return NONE;
}

static const char* path_name(Path p) {
  return p == VNNI512 ? "avx512_vnni" : (p == BW512 ? "avx512bw" : (p == AVX2 ? "avx2" : "none"));
}

static bool group_ok(int64_t group) { return group == 32 || group == 64 || group == 128 || group == 256; }

static void check_bits_group(const char* op, int64_t bits, int64_t group) {
  TORCH_CHECK(bits == 8 || bits == 4, "lowrank_lrk::", op, ": bits must be 8 or 4, got ", bits);
  TORCH_CHECK(group_ok(group), "lowrank_lrk::", op, ": group must be 32, 64, 128 or 256, got ", group);
}

// ------------------------------------------------------------------------------------ qpack / qunpack
// to_packed: (data, scale) -> P; else P -> (data, scale). Padding rows of P: codes of q = 0, scale 0.
static void qpack_impl(const Geo& M, uint8_t* data, uint16_t* scale, uint8_t* P, bool to_packed) {
  const int64_t nblk = cdiv(M.rows, BW), ldd = M.bits == 8 ? M.in_pad : M.in_pad / 2;
  at::parallel_for(0, nblk, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; b++) {
      const int64_t bw = imin(BW, M.rows - b * BW), NZ = bw / 16;
      uint8_t* blk = P + M.block_off(b);
      for (int64_t j = 0; j < M.G; j++) {
        uint8_t* w = blk + j * bw * (M.cb + 2);
        uint16_t* sp = (uint16_t*)(w + bw * M.cb);   // 2-byte aligned: every offset above is even
        for (int64_t l = 0; l < bw; l++) {
          const int64_t o = b * BW + l;
          const bool real = o < M.out;
          if (to_packed)
            sp[l] = real ? scale[o * M.G + j] : 0;
          else if (real)
            scale[o * M.G + j] = sp[l];
          for (int64_t k = 0; k < M.g; k++) {
            const int64_t col = j * M.g + k;
            if (M.bits == 8) {
              uint8_t& pk = w[(k / 2) * bw * 2 + l * 2 + (k % 2)];
              if (to_packed)
                pk = real ? data[o * ldd + col] : 0;
              else if (real)
                data[o * ldd + col] = pk;
            } else {
              const int64_t c = k / 8, t = (k % 8) / 2, z = l / 16, wd = (l % 16) * 2 + (k % 2);
              uint8_t& pk = w[(c * NZ + z) * 64 + wd * 2 + t / 2];
              const int sh = 4 * (t % 2), sd = 4 * (col % 2);
              if (to_packed) {
                const uint8_t u = real ? (uint8_t)((data[o * ldd + col / 2] >> sd) & 15) : 8;
                pk = (uint8_t)((pk & ~(15 << sh)) | (u << sh));
              } else if (real) {
                uint8_t& d = data[o * ldd + col / 2];
                d = (uint8_t)((d & ~(15 << sd)) | (((pk >> sh) & 15) << sd));
              }
            }
          }
        }
      }
    }
  });
}

static Geo check_geo(const char* op, int64_t bits, int64_t group, int64_t out, int64_t in) {
  check_bits_group(op, bits, group);
  TORCH_CHECK(out >= 1 && in >= 1, "lowrank_lrk::", op, ": out and in must be >= 1, got [", out, ", ", in, "]");
  return Geo(bits, group, out, in);
}

at::Tensor qpack(const at::Tensor& data, const at::Tensor& scale, int64_t bits, int64_t group, int64_t out,
                 int64_t in) {
  const Geo M = check_geo("qpack", bits, group, out, in);
  const auto dt = bits == 8 ? at::kChar : at::kByte;
  const int64_t cols = bits == 8 ? M.in_pad : M.in_pad / 2;
  TORCH_CHECK(data.scalar_type() == dt && data.dim() == 2 && data.size(0) == out && data.size(1) == cols,
              "lowrank_lrk::qpack: the ", bits, "-bit codes of a [", out, ", ", in, "] matrix (group ", group, ") are ",
              bits == 8 ? "int8" : "uint8", " [", out, ", ", cols, "], got ", data.scalar_type(), " ", data.sizes());
  TORCH_CHECK(scale.scalar_type() == at::kHalf && scale.dim() == 2 && scale.size(0) == out && scale.size(1) == M.G,
              "lowrank_lrk::qpack: the scales of a [", out, ", ", in, "] matrix (group ", group, ") are float16 [", out,
              ", ", M.G, "], got ", scale.scalar_type(), " ", scale.sizes());
  auto d = data.contiguous();
  auto s = scale.contiguous();
  auto P = arena_empty(M.nbytes(), data.options().dtype(at::kByte));   // huge pages (lrk_arena.h)
  P.zero_();
  qpack_impl(M, (uint8_t*)d.data_ptr(), (uint16_t*)s.data_ptr(), P.data_ptr<uint8_t>(), true);
  return P;
}

std::tuple<at::Tensor, at::Tensor> qunpack(const at::Tensor& P, int64_t bits, int64_t group, int64_t out, int64_t in) {
  const Geo M = check_geo("qunpack", bits, group, out, in);
  TORCH_CHECK(P.scalar_type() == at::kByte && P.dim() == 1 && P.is_contiguous() && P.numel() == M.nbytes(),
              "lowrank_lrk::qunpack: P is not a packed [", out, ", ", in, "] int", bits, " group ", group,
              " matrix (", M.nbytes(), " bytes)");
  auto data = at::empty({out, bits == 8 ? M.in_pad : M.in_pad / 2}, P.options().dtype(bits == 8 ? at::kChar : at::kByte));
  auto scale = at::empty({out, M.G}, P.options().dtype(at::kHalf));
  qpack_impl(M, (uint8_t*)data.data_ptr(), (uint16_t*)scale.data_ptr(), (uint8_t*)P.data_ptr(), false);
  return {data, scale};
}

// ------------------------------------------------------------------------------------ qgemv
struct Job {
  int64_t m, b, r0;
};

// whether int4 runs qblk4_dpb where VNNI is present: $LOWRANK_LIB_QDPB=0 turns it off (the int16-pair kernel runs, the
// same bits), for side-by-side timing; read once
#if LRK_X86
static bool dpb_on() {
  static const bool on = [] {
    const char* e = std::getenv("LOWRANK_LIB_QDPB");
    return !(e && e[0] == '0');
  }();
  return on;
}
#endif

// qgemv's work on raw pointers (lrk_api.h's qgemv_into): the caller checked the ISA, shapes and blob sizes
static void qgemv_raw(bool bf, const void* x, int64_t ldx, int64_t N, const GemvMat* mats, int64_t M, void* y,
                      int64_t ldy, int64_t bits, int64_t group) {
  if (N == 0 || M == 0) return;
#if LRK_X86
  const Path isa = path();
  // the per-call work lists and buffers live in this thread's scratch (the pool's workers only read them while the
  // calling thread waits in pool::run): a decode step makes ~200 of these calls, each once ~10 allocations. The
  // lambdas below reach them through these local references (a thread_local named inside a lambda would be the
  // worker's own).
  static thread_local std::vector<Geo> t_geo;
  static thread_local std::vector<int64_t> t_off;
  static thread_local std::vector<int16_t> t_xq;
  static thread_local std::vector<float> t_xs, t_xf;
  static thread_local std::vector<int32_t> t_S, t_xp;
  static thread_local std::vector<Job> t_jobs;
  static thread_local std::vector<double> t_wt;
  std::vector<Geo>& geo = t_geo;
  std::vector<Job>& jobs = t_jobs;
  std::vector<double>& wt = t_wt;
  geo.clear();
  for (int64_t m = 0; m < M; m++) geo.emplace_back(bits, group, mats[m].out, mats[m].in);
  const int64_t es = bf ? 2 : 4;
  // 1. x quantized per matrix, row and group (on the calling thread: in * N values, a small part of the bytes)
  int64_t* qo = grow(t_off, 2 * (M + 1));
  int64_t* go = qo + M + 1;
  qo[0] = go[0] = 0;
  int64_t pmax = 0;
  for (int64_t m = 0; m < M; m++) {
    qo[m + 1] = qo[m] + N * geo[m].in_pad;
    go[m + 1] = go[m] + N * geo[m].G;
    pmax = std::max(pmax, geo[m].in_pad);
  }
  int16_t* xq = grow(t_xq, qo[M]);
  float* xs = grow(t_xs, go[M]);
  float* xf = grow(t_xf, pmax);
  int32_t* S = grow(t_S, go[M]);
  const char* xb = (const char*)x;
  for (int64_t m = 0; m < M; m++)
    for (int64_t r = 0; r < N; r++) {
      const Geo& Gm = geo[m];
      const char* row = xb + (r * ldx + mats[m].xoff) * es;
      if (bf)
        for (int64_t i = 0; i < Gm.in; i++) xf[i] = bits_to_f((uint32_t)((const uint16_t*)row)[i] << 16);
      else
        std::memcpy(xf, row, Gm.in * 4);
      std::fill(xf + Gm.in, xf + Gm.in_pad, 0.0f);
      int16_t* q = xq + qo[m] + r * Gm.in_pad;
      float* s = xs + go[m] + r * Gm.G;
      int32_t* sm = S + go[m] + r * Gm.G;
      if (isa == VNNI512)
        quant_row_vnni(xf, Gm.G, Gm.g, q, s, sm);
      else if (isa == BW512)
        quant_row_bw(xf, Gm.G, Gm.g, q, s, sm);
      else
        quant_row_avx2(xf, Gm.G, Gm.g, q, s, sm);
    }
  // int4 with VNNI: x's bytes in the order of the nibbles (qblk4_dpb), in_pad / 2 int32 per matrix and row
  const bool dpb = isa == VNNI512 && bits == 4 && dpb_on();
  int32_t* xp = dpb ? grow(t_xp, qo[M] / 2) : nullptr;
  if (dpb)
    for (int64_t m = 0; m < M; m++)
      for (int64_t r = 0; r < N; r++)
        quads_row(xq + qo[m] + r * geo[m].in_pad, geo[m].in_pad, xp + (qo[m] + r * geo[m].in_pad) / 2);
  // 2. block jobs, cut into runs of about equal bytes over the kernel pool
  const int64_t rpj = isa == AVX2 ? 1 : MAXR;
  jobs.clear();
  wt.clear();
  int64_t total = 0;
  for (int64_t m = 0; m < M; m++)
    for (int64_t b = 0; b * BW < geo[m].rows; b++)
      for (int64_t r0 = 0; r0 < N; r0 += rpj) {
        jobs.push_back({m, b, r0});
        const int64_t bytes = geo[m].block_bytes(imin(BW, geo[m].rows - b * BW));
        wt.push_back((double)bytes);
        total += bytes;
      }
  const int bi = bits == 8 ? 0 : 1;
  char* yb = (char*)y;
  auto run = [&](const Job& J) {
    const Geo& Gm = geo[J.m];
    const int64_t bw = imin(BW, Gm.rows - J.b * BW), n = imin(bw, Gm.out - J.b * BW);
    const int64_t R = imin(rpj, N - J.r0);
    Rows X;
    void* yr[MAXR];
    for (int64_t r = 0; r < R; r++) {
      const int64_t row = J.r0 + r;
      X.xq[r] = xq + qo[J.m] + row * Gm.in_pad;
      X.xs[r] = xs + go[J.m] + row * Gm.G;
      X.S[r] = S + go[J.m] + row * Gm.G;
      X.xp[r] = dpb ? xp + (qo[J.m] + row * Gm.in_pad) / 2 : nullptr;
      yr[r] = yb + (row * ldy + mats[J.m].yoff + J.b * BW) * es;
    }
    const uint8_t* blk = (const uint8_t*)mats[J.m].P + Gm.block_off(J.b);
    const int64_t nz = bw / 16 - 1;
    if (dpb && R <= DPB_MAXR)
      KERNELS_dpb[R - 1][nz](blk, Gm.G, Gm.g, X, yr, bf, n);
    else if (isa == VNNI512)
      KERNELS_vnni[bi][R - 1][nz](blk, Gm.G, Gm.g, X, yr, bf, n);
    else if (isa == BW512)
      KERNELS_bw[bi][R - 1][nz](blk, Gm.G, Gm.g, X, yr, bf, n);
    else
      KERNELS_AVX2[bi][nz](blk, Gm.G, Gm.g, X, yr, bf, n);
  };
  const int64_t nj = (int64_t)jobs.size(), tu = imin(pool::threads_for(total), nj);
  if (tu <= 1 && !pool::in_team()) {  // (in a team every call is a construct: the members meet after it)
    for (const Job& J : jobs) run(J);
  } else {
    const std::vector<int64_t> cut = pool::cuts(wt, tu * pool::chunks_per_thread());
    pool::run((int64_t)cut.size() - 1, tu, [&](int64_t c) {
      for (int64_t j = cut[c]; j < cut[c + 1]; j++) run(jobs[j]);
    });
  }
#else
  (void)bf, (void)x, (void)ldx, (void)mats, (void)y, (void)ldy, (void)bits, (void)group;
#endif
}

at::Tensor qgemv(const at::Tensor& x, at::TensorList Ps, at::IntArrayRef outs, at::IntArrayRef ins,
                 at::IntArrayRef xoffs, int64_t bits, int64_t group) {
  check_bits_group("qgemv", bits, group);
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "lowrank_lrk::qgemv: x must be fp32 or bf16, got ", x.scalar_type());
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "lowrank_lrk::qgemv: x must be [N, X] with unit column stride");
  const int64_t M = (int64_t)Ps.size(), N = x.size(0), ldx = x.stride(0);
  TORCH_CHECK(N <= MAX_N, "lowrank_lrk::qgemv: at most ", MAX_N, " rows of x per call, got ", N,
              " (dequantize the matrix for more rows)");
  TORCH_CHECK((int64_t)outs.size() == M && (int64_t)ins.size() == M && (int64_t)xoffs.size() == M,
              "lowrank_lrk::qgemv: one out, in and x offset per matrix (", M, " matrices, ", outs.size(), " outs, ",
              ins.size(), " ins, ", xoffs.size(), " x offsets)");
  const Path isa = path();
  TORCH_CHECK(isa != NONE, "lowrank_lrk::qgemv: this CPU lacks AVX512F/BW/VL and AVX2 + FMA + F16C (isa_flags=",
              isa_flags(), ")");
  std::vector<GemvMat> mats;
  int64_t yw = 0;
  for (int64_t m = 0; m < M; m++) {
    TORCH_CHECK(outs[m] >= 1 && ins[m] >= 1, "lowrank_lrk::qgemv: matrix ", m, " is [", outs[m], ", ", ins[m], "]");
    const Geo gm(bits, group, outs[m], ins[m]);
    const at::Tensor& P = Ps[m];
    TORCH_CHECK(P.scalar_type() == at::kByte && P.dim() == 1 && P.is_contiguous() && P.numel() == gm.nbytes(),
                "lowrank_lrk::qgemv: matrix ", m, " is not a packed [", outs[m], ", ", ins[m], "] int", bits, " group ",
                group, " matrix (", gm.nbytes(), " bytes)");
    TORCH_CHECK(xoffs[m] >= 0 && xoffs[m] + ins[m] <= x.size(1), "lowrank_lrk::qgemv: matrix ", m,
                " reads columns [", xoffs[m], ", ", xoffs[m] + ins[m], ") of x [", N, ", ", x.size(1), "]");
    mats.push_back({P.data_ptr(), outs[m], ins[m], xoffs[m], yw});
    yw += outs[m];
  }
  auto y = at::empty({N, yw}, x.options());
  qgemv_raw(x.scalar_type() == at::kBFloat16, x.data_ptr(), ldx, N, mats.data(), M, y.data_ptr(), yw, bits, group);
  return y;
}

// which code qgemv runs now: "avx512_vnni", "avx512bw", "avx2" or "none" (follows set_isa_mask)
std::string qgemv_isa() { return path_name(path()); }

}  // namespace q

// lrk_api.h's quantized entry points (layer.cpp's fused decode layer)
bool qgemv_runs() { return q::path() != q::NONE; }
bool qgemv_shape_ok(int64_t bits, int64_t group) {
  return (bits == 8 || bits == 4) && q::group_ok(group);
}
int64_t qpacked_size(int64_t out, int64_t in, int64_t bits, int64_t group) {
  return q::Geo(bits, group, out, in).nbytes();
}
void qgemv_into(bool bf, const void* x, int64_t ldx, int64_t N, const GemvMat* mats, int64_t M, void* y, int64_t ldy,
                int64_t bits, int64_t group) {
  q::qgemv_raw(bf, x, ldx, N, mats, M, y, ldy, bits, group);
}

}  // namespace lrk

TORCH_LIBRARY_FRAGMENT(lowrank_lrk, m) {
  m.def("qpack(Tensor data, Tensor scale, int bits, int group, int out, int inp) -> Tensor");
  m.def("qunpack(Tensor P, int bits, int group, int out, int inp) -> (Tensor, Tensor)");
  m.def("qgemv(Tensor x, Tensor[] Ps, int[] outs, int[] ins, int[] xoffs, int bits, int group) -> Tensor");
  m.def("qgemv_isa() -> str", &lrk::q::qgemv_isa);
}

TORCH_LIBRARY_IMPL(lowrank_lrk, CPU, m) {
  m.impl("qpack", &lrk::q::qpack);
  m.impl("qunpack", &lrk::q::qunpack);
  m.impl("qgemv", &lrk::q::qgemv);
}
