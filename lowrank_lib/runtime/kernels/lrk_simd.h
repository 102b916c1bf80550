// lowrank_lib's AVX-512 helpers shared by the kernels of lrk.cpp and tiers.cpp (lane masks, e^x, fp32 / bf16
// row loads and stores, the 16-vector transpose-add, 16 bf16 dot products).
//
// Include ONLY inside an AVX-512 target region that also targets AVX512_BF16 (between `#pragma GCC push_options` +
// `#pragma GCC target(...)` and `pop_options`, inside namespace lrk), after <immintrin.h>: every function here is
// static inline and gets AVX-512 code, so none may be compiled outside such a region. This header includes nothing.
#pragma once

static inline __mmask16 lanes(int64_t m) { return (__mmask16)(m >= 16 ? 0xFFFFu : ((1u << m) - 1u)); }

// e^x, relative error ~2e-7 (Cody-Waite + degree-6 Taylor)
static inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

static inline __m512 ld(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 ld(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
static inline void st(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
static inline void st(uint16_t* p, __m512 v) { _mm256_storeu_si256((__m256i*)p, (__m256i)_mm512_cvtneps_pbh(v)); }

// sums of 16 vectors -> one vector (lane i = sum of a[i]): a transpose-add tree (3 levels + 1 permute)
static inline __m512 hsum16(const __m512* a) {
  __m512 t[8], u[4];
  for (int i = 0; i < 8; i++)
    t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44), _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
  for (int j = 0; j < 4; j++)
    u[j] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * j], t[2 * j + 1], 0x88), _mm512_shuffle_f32x4(t[2 * j], t[2 * j + 1], 0xDD));
  // lane 4q + c of u[j] holds a partial of a[4j + q]; reduce the 4 partials inside each 128-bit lane
  const __m512 v0 = _mm512_add_ps(_mm512_unpacklo_ps(u[0], u[1]), _mm512_unpackhi_ps(u[0], u[1]));
  const __m512 v1 = _mm512_add_ps(_mm512_unpacklo_ps(u[2], u[3]), _mm512_unpackhi_ps(u[2], u[3]));
  const __m512 w = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(v0), _mm512_castps_pd(v1))),
                                 _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(v0), _mm512_castps_pd(v1))));
  // lane 4q + j of w = sum of a[4j + q]
  const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(idx, w);
}

// one query's bf16 dot products with 16 rows of K (DP * 32 bf16 each, row stride sk; FULL, or the first m rows, the
// rest 0): lane i = q . k_i, products exact in fp32, one transpose-add (attend_head_dp's and the tier kernel's scores)
template <int DP, bool FULL>
static inline __m512 dot16_bf16(const __m512i* qb, const uint16_t* k, int64_t sk, int m) {
  __m512 part[16];
  for (int i = 0; i < 16; i++) {
    if (FULL || i < m) {
      const uint16_t* r = k + i * sk;
      __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)qb[0], (__m512bh)_mm512_loadu_si512((const void*)r));
      for (int c = 1; c < DP; c++)
        a = _mm512_dpbf16_ps(a, (__m512bh)qb[c], (__m512bh)_mm512_loadu_si512((const void*)(r + c * 32)));
      part[i] = a;
    } else {
      part[i] = _mm512_setzero_ps();
    }
  }
  return hsum16(part);
}
