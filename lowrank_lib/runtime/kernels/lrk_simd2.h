// lowrank_lib's AVX2 + FMA helpers shared by the AVX2 kernels of lrk.cpp and tiers.cpp (lane masks, e^x, fp32 /
// bf16 loads and stores of 8 lanes, horizontal sums).
//
// Include ONLY inside an AVX2 target region (`#pragma GCC push_options` + `#pragma GCC target("avx2,fma")` and
// `pop_options`, inside namespace lrk), after <immintrin.h> and <cstring>: every function here is static inline and
// gets AVX2 code, so none may be compiled outside such a region. This header includes nothing itself.
#pragma once

static inline __m256i lanes8(int64_t m) {      // lane i set when i < m (m <= 8)
  return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(m < 8 ? m : 8)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
static inline float bits_f(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}
// fp32 -> bf16, round to nearest even (NaN stays a quiet NaN), 8 lanes -> 8 uint16 in the low 128 bits
static inline __m128i to_bf16x8(__m256 a) {
  const __m256i b = _mm256_castps_si256(a);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb)), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(a, a, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_or_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(0x40)), nan);
  r = _mm256_packus_epi32(r, r);                                   // [r0..r3 r0..r3 | r4..r7 r4..r7]
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(r, 0x08));  // qwords 0, 2
}
static inline float hsum8(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}
// e^x (exp512's Cody-Waite + degree-6 Taylor), x clamped to [-87, 88.376] (2^n, n in [-126, 128], built in the
// exponent bits as two factors 2^h * 2^(n - h), each a normal number; exact scalings, so for x <= 0 the same bits as
// one factor 2^n)
static inline __m256 exp256(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.3762626647949f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187045e-06f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i ni = _mm256_cvtps_epi32(n), h = _mm256_srai_epi32(ni, 1);
  const __m256i e1 = _mm256_slli_epi32(_mm256_add_epi32(h, _mm256_set1_epi32(127)), 23);
  const __m256i e2 = _mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(ni, h), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e1)), _mm256_castsi256_ps(e2));
}
// a 32-bit lane holding a bf16 pair (element 2i low, 2i + 1 high) -> element 2i / 2i + 1 as fp32, exactly
static inline __m256 bf16_even(__m256i w) { return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)); }
static inline __m256 bf16_odd(__m256i w) {
  return _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32((int)0xFFFF0000u)));
}
static inline __m256 ld8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 ld8(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
static inline void st8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
static inline void st8(uint16_t* p, __m256 v) { _mm_storeu_si128((__m128i*)p, to_bf16x8(v)); }

// lane i = the sum of a[i]'s lanes, for 8 vectors
static inline __m256 hsum8x8(const __m256* a) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// a[c] += sum_{t < n} p[t] * V_t[8c : 8c + 8] for the first cn (<= 12) of 12 8-float columns held in registers: the
// P V of one query (lrk.cpp pv_query2) and of one head of the tier kernel's exact rows (tiers.cpp values_head). Rows
// at stride sv from V; before row t, row_hook(t) (the tier kernel prefetches there). 12 accumulators, the broadcast
// and a row's load fit the 16 ymm registers, and 12 columns cover d <= 96: a pass streams whole V rows. Each column
// sums its rows in order, one FMA each.
// bf16 rows with an even cn take the pair route: a 32-byte load holds 16 bf16, its even elements widened by one shift
// and its odd ones by one AND (a 32-bit lane holds the pair), so a[c] holds the 8 even / odd columns of a 16-column
// pair during the pass, back in column order at its end: 3 uops per 16 columns where vpmovzxwd + shift took 4 (3
// queries x 8000 rows, d 64, AMD Zen 3, a standalone copy: 72.5 -> 69 us). Every column still sums the same products
// in the same order: the same bits (checked bit for bit in that copy).
template <class Hook>
__attribute__((always_inline)) static inline void pv_pairs12(const float* p, const uint16_t* V, int64_t sv, int64_t n,
                                                             int cn, __m256* a, Hook row_hook) {
  for (int j = 0; j < 6; j++)                  // columns 16j..16j+15: (0..7, 8..15) -> (even, odd)
    if (2 * j < cn) {
      const __m256 n0 = a[2 * j], n1 = a[2 * j + 1];
      a[2 * j] = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(n0, n1, 0x88)), 0xD8));
      a[2 * j + 1] = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(n0, n1, 0xDD)), 0xD8));
    }
  for (int64_t t = 0; t < n; t++) {
    row_hook(t);
    const uint16_t* v = V + t * sv;
    const __m256 pt = _mm256_set1_ps(p[t]);
    for (int j = 0; j < 6; j++)
      if (2 * j < cn) {
        const __m256i w = _mm256_loadu_si256((const __m256i*)(v + 16 * j));
        a[2 * j] = _mm256_fmadd_ps(pt, bf16_even(w), a[2 * j]);
        a[2 * j + 1] = _mm256_fmadd_ps(pt, bf16_odd(w), a[2 * j + 1]);
      }
  }
  for (int j = 0; j < 6; j++)                  // (even, odd) -> (0..7, 8..15)
    if (2 * j < cn) {
      const __m256 lo = _mm256_unpacklo_ps(a[2 * j], a[2 * j + 1]), hi = _mm256_unpackhi_ps(a[2 * j], a[2 * j + 1]);
      a[2 * j] = _mm256_permute2f128_ps(lo, hi, 0x20);
      a[2 * j + 1] = _mm256_permute2f128_ps(lo, hi, 0x31);
    }
}
template <typename T, class Hook>
__attribute__((always_inline)) static inline void pv_cols12(const float* p, const T* V, int64_t sv, int64_t n, int cn,
                                                            __m256* a, Hook row_hook) {
  if constexpr (sizeof(T) == 2) {
    if (cn % 2 == 0) {
      pv_pairs12(p, V, sv, n, cn, a, row_hook);
      return;
    }
  }
  for (int64_t t = 0; t < n; t++) {
    row_hook(t);
    const T* v = V + t * sv;
    const __m256 pt = _mm256_set1_ps(p[t]);
    for (int c = 0; c < 12; c++)
      if (c < cn) a[c] = _mm256_fmadd_ps(pt, ld8(v + c * 8), a[c]);
  }
}
