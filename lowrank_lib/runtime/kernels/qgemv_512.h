// The AVX-512 code of qgemv.cpp (quantized packed GEMV), written once and compiled twice: qgemv.cpp includes this
// file inside two target regions, with QSFX (the name suffix) and QDPW(acc, w, x) (acc += the int16 pair products
// of w and x, in int32 lanes) defined:
//   _vnni  AVX512F/BW/VL + AVX512_VNNI: QDPW = vpdpwssd
//   _bw    AVX512F/BW/VL:               QDPW = vpmaddwd + vpaddd (the same exact int32 sums)
// Inside namespace lrk::q, after qgemv.cpp's shared declarations (Rows, qblk_fn, MAXR, QP_DIST, QPF, ld32, bits_to_f,
// QFENCE). No include guard: it is meant to be included twice.
#define QCAT2(a, b) a##b
#define QCAT(a, b) QCAT2(a, b)
#define QN(name) QCAT(name, QSFX)

static inline __mmask16 QN(lanes)(int64_t m) { return (__mmask16)(m >= 16 ? 0xFFFFu : (m <= 0 ? 0u : (1u << m) - 1u)); }

// x row (fp32, in_pad values, zeros past in) -> xq int16 [in_pad], xs [G], S [G] (sum of xq per group): the spec's
// activation quantisation (amax over the group with NaN propagated as torch's amax does, inv = 32767 / amax or 0,
// xq = clamp(round_half_even(x * inv), +-32767), NaN -> 0, xs = amax / 32767)
static void QN(quant_row)(const float* xf, int64_t G, int64_t g, int16_t* xq, float* xs, int32_t* S) {
  const __m512i absm = _mm512_set1_epi32(0x7FFFFFFF);
  const __m512 C = _mm512_set1_ps(32767.0f), mC = _mm512_set1_ps(-32767.0f);
  for (int64_t j = 0; j < G; j++) {
    const float* p = xf + j * g;
    __m512i m = _mm512_setzero_si512();  // |x| bits: integer order = float order, NaN above Inf above finite
    for (int64_t i = 0; i < g; i += 16)
      m = _mm512_max_epi32(m, _mm512_and_si512(_mm512_loadu_si512((const void*)(p + i)), absm));
    const float xa = bits_to_f((uint32_t)_mm512_reduce_max_epi32(m));
    const float inv = xa != 0.0f ? 32767.0f / xa : 0.0f;
    xs[j] = xa / 32767.0f;
    const __m512 iv = _mm512_set1_ps(inv);
    __m512i s = _mm512_setzero_si512();
    for (int64_t i = 0; i < g; i += 16) {
      const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(p + i), iv);
      const __mmask16 ok = _mm512_cmp_ps_mask(v, v, _CMP_ORD_Q);       // NaN -> 0 (torch.nan_to_num)
      const __m512i q = _mm512_maskz_cvtps_epi32(ok, _mm512_max_ps(_mm512_min_ps(v, C), mC));
      s = _mm512_add_epi32(s, q);
      _mm256_storeu_si256((__m256i*)(xq + j * g + i), _mm512_cvtepi32_epi16(q));
    }
    S[j] = _mm512_reduce_add_epi32(s);
  }
}

// fp32 -> bf16 (round to nearest even; NaN stays a quiet NaN) in the low 16 bits of 16 int16 lanes
static inline __m256i QN(to_bf16)(__m512 a) {
  const __m512i b = _mm512_castps_si512(a);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb)), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(0x40)));
  return _mm512_cvtepi32_epi16(r);
}

// One block (width NZ * 16, n real outputs) of a packed quantized matrix against R rows of quantized x:
//   per group j: exact int32 sums of the codes (int8, or int4 nibbles u = q + 8 with the 8 * sum(xq) correction) times
//   the int16 pairs of x; then acc += float(isum) * (float(scale) * xs[r][j]) (a product, then a sum: two roundings,
//   j ascending); at the end one rounding to the output type (bf: bf16, else fp32).
template <int R, int NZ, int BITS>
static void QN(qblk)(const uint8_t* blk, int64_t G, int64_t g, const Rows& X, void* const* ys, bool bf, int64_t n) {
  constexpr int64_t BWD = NZ * 16;
  const int64_t cb = BITS == 8 ? g : g / 2;                 // code bytes per output per group
  const int64_t gs = BWD * (cb + 2);                        // bytes of one group's stream
  alignas(64) float fa[R][BWD];
  for (int r = 0; r < R; r++)
    for (int z = 0; z < NZ; z++) _mm512_store_ps(fa[r] + 16 * z, _mm512_setzero_ps());
  const __m512i nib = _mm512_set1_epi16(0x000F);
  for (int64_t j = 0; j < G; j++) {
    const uint8_t* w = blk + j * gs;
    __m512i acc[R][NZ];
    for (int r = 0; r < R; r++)
      for (int z = 0; z < NZ; z++) acc[r][z] = _mm512_setzero_si512();
    if (BITS == 8) {
      for (int64_t p = 0; p < g / 2; p++) {
        const uint8_t* wp = w + p * (BWD * 2);
        __m512i wv[NZ];
        for (int z = 0; z < NZ; z++) {
          QPF(wp + QP_DIST + 32 * z);
          wv[z] = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(wp + 32 * z)));
        }
        for (int r = 0; r < R; r++) {
          const __m512i xv = _mm512_set1_epi32(ld32(X.xq[r] + j * g + 2 * p));
          for (int z = 0; z < NZ; z++) acc[r][z] = QDPW(acc[r][z], wv[z], xv);
        }
      }
    } else {
      for (int64_t c = 0; c < g / 8; c++) {
        const int16_t* xc[R];
        for (int r = 0; r < R; r++) xc[r] = X.xq[r] + j * g + 8 * c;
        for (int z = 0; z < NZ; z++) {
          const uint8_t* wp = w + (c * NZ + z) * 64;
          QPF(wp + QP_DIST);
          const __m512i v = _mm512_loadu_si512((const void*)wp);
          const __m512i u[4] = {_mm512_and_si512(v, nib), _mm512_and_si512(_mm512_srli_epi16(v, 4), nib),
                                _mm512_and_si512(_mm512_srli_epi16(v, 8), nib), _mm512_srli_epi16(v, 12)};
          for (int t = 0; t < 4; t++)
            for (int r = 0; r < R; r++) acc[r][z] = QDPW(acc[r][z], u[t], _mm512_set1_epi32(ld32(xc[r] + 2 * t)));
        }
      }
    }
    const uint16_t* sp = (const uint16_t*)(w + BWD * cb);
    __m512 sc[NZ];
    for (int z = 0; z < NZ; z++) sc[z] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(sp + 16 * z)));
    for (int r = 0; r < R; r++) {
      const __m512 xsv = _mm512_set1_ps(X.xs[r][j]);
      const __m512i corr = _mm512_set1_epi32(BITS == 8 ? 0 : 8 * X.S[r][j]);
      for (int z = 0; z < NZ; z++) {
        const __m512 cz = _mm512_mul_ps(sc[z], xsv);
        __m512 prod = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][z], corr)), cz);
        QFENCE(prod);                                       // no fused multiply-add: the spec rounds the product
        _mm512_store_ps(fa[r] + 16 * z, _mm512_add_ps(_mm512_load_ps(fa[r] + 16 * z), prod));
      }
    }
  }
  for (int r = 0; r < R; r++)
    for (int z = 0; z < NZ && z * 16 < n; z++) {
      const __m512 a = _mm512_load_ps(fa[r] + 16 * z);
      if (bf)
        _mm256_mask_storeu_epi16((uint16_t*)ys[r] + 16 * z, QN(lanes)(n - 16 * z), QN(to_bf16)(a));
      else
        _mm512_mask_storeu_ps((float*)ys[r] + 16 * z, QN(lanes)(n - 16 * z), a);
    }
}

#define QROW(B, R) {QN(qblk)<R, 1, B>, QN(qblk)<R, 2, B>, QN(qblk)<R, 3, B>, QN(qblk)<R, 4, B>}
static const qblk_fn QN(KERNELS)[2][MAXR][4] = {{QROW(8, 1), QROW(8, 2), QROW(8, 3), QROW(8, 4)},
                                                {QROW(4, 1), QROW(4, 2), QROW(4, 3), QROW(4, 4)}};
#undef QROW
#undef QN
#undef QCAT
#undef QCAT2
