// The control flow of tiers.cpp's fused tier attention, written once and compiled once per ISA: tiers.cpp includes
// this file inside each ISA's target region and namespace (a512: AVX-512, a2: AVX2 + FMA), after that namespace's
// primitives (chunk_rows, scale_query, exact_scores, exact_values, softmax_chunk, project, run_scores, run_values_pass
// with run_values_rb / vecf / VLANES / vzero / store_sums, basis_acc, blk_scores_ng), which the unqualified calls below
// resolve to. No include guard: it is meant to be included twice.

// pa[r * NG + g] = sum_{i < n} p[g * CH + i] A[r * lda + i]   (p's lanes >= n are 0): passes over the tokens of
// run_values_rb<NG>() ranks each (this ISA's run_values_pass, its accumulators in registers), the ranks left after the
// full passes in passes of 8, 4, 2 and 1 (those below RB); every VLANES (r, g) sums go out through one horizontal sum
// (store_sums). pa holds 16 spare floats for the last, partial group.
template <typename F, int NG>
static void run_values(const float* p, int64_t rv, const F* A, int64_t lda, int64_t n, float* pa) {
  constexpr int RB = run_values_rb<NG>();
  vecf part[VLANES];
  int cnt = 0;
  float* out = pa;
  auto emit = [&](vecf v) {
    part[cnt++] = v;
    if (cnt == VLANES) {
      store_sums(out, part);
      out += VLANES;
      cnt = 0;
    }
  };
  int64_t r0 = 0;
  auto pass = [&](auto rbc) {             // a pass over the next rbc ranks
    constexpr int K = decltype(rbc)::value;
    vecf acc[K][NG];
    run_values_pass<F, NG, K>(p, A + r0 * lda, lda, n, acc);
    for (int r = 0; r < K; r++)
      for (int g = 0; g < NG; g++) emit(acc[r][g]);
    r0 += K;
  };
  while (r0 + RB <= rv) pass(std::integral_constant<int, RB>{});
  if constexpr (RB > 8) if (rv - r0 >= 8) pass(std::integral_constant<int, 8>{});
  if constexpr (RB > 4) if (rv - r0 >= 4) pass(std::integral_constant<int, 4>{});
  if constexpr (RB > 2) if (rv - r0 >= 2) pass(std::integral_constant<int, 2>{});
  if (rv - r0 >= 1) pass(std::integral_constant<int, 1>{});
  if (cnt) {
    for (int i = cnt; i < VLANES; i++) part[i] = vzero();
    store_sums(out, part);
  }
}

// blocked exact keys' scores (this ISA's blk_scores_ng, NG_MAX query heads per pass): sc[g * CH + r - r0] = qs_g . K_r
// for the rows r of [r0, r0 + n) of the blocked keys at Kb
// pv, spv: the block's V rows, prefetched by the first group's pass (nullptr: none; see this ISA's blk_scores_ng)
static void blk_scores(const float* qs, int64_t G, int64_t D, const uint16_t* Kb, int64_t r0, int64_t n, float* sc,
                       const uint16_t* pv, int64_t spv) {
  for (int64_t g0 = 0; g0 < G; g0 += NG_MAX) {
    const float* qg = qs + g0 * D;
    float* s = sc + g0 * CH;
    const uint16_t* p = g0 == 0 ? pv : nullptr;
    switch (G - g0 < NG_MAX ? G - g0 : NG_MAX) {
      case 1: blk_scores_ng<1>(qg, D, Kb, r0, n, s, p, spv); break;
      case 2: blk_scores_ng<2>(qg, D, Kb, r0, n, s, p, spv); break;
      case 3: blk_scores_ng<3>(qg, D, Kb, r0, n, s, p, spv); break;
      default: blk_scores_ng<4>(qg, D, Kb, r0, n, s, p, spv); break;
    }
  }
}

// one run's tokens [a, b) of the current item
template <typename T, typename F>
static void run_piece(const Layer& L, const int64_t* R, int64_t a, int64_t b, float* m, float* l, float* acc,
                      const Scratch& S) {
  const int64_t G = L.G, D = L.D, n = R[N], rk = R[RK], rv = R[RV], tok = R[TOK_OFF];
  const F* ak = (const F*)L.ak + R[AK_OFF];
  const F* av = (const F*)L.av + R[AV_OFF];
  const T* bk = (const T*)L.bk + R[BK_OFF];
  const T* bv = (const T*)L.bv + R[BV_OFF];
  project<T>(S.qs, G, D, bk, rk, S.qb);
  for (int64_t i = 0; i < G * rv; i++) S.pr[i] = 0.0f;
  const int64_t ch = chunk_rows((int64_t)(D * sizeof(T)));
  for (int64_t c0 = a; c0 < b; c0 += ch) {
    const int64_t cn = b - c0 < ch ? b - c0 : ch;
    const void* ks = nullptr;
    if (L.q8) ks = L.s32 ? (const void*)((const float*)L.ks + tok + c0) : (const void*)((const uint16_t*)L.ks + tok + c0);
    for (int64_t g0 = 0; g0 < G; g0 += NG_MAX) {
      const int ng = (int)(G - g0 < NG_MAX ? G - g0 : NG_MAX);
      const float* qb = S.qb + g0 * rk;
      float* sc = S.sc + g0 * CH;
      switch (ng) {
        case 1: run_scores<F, 1>(qb, rk, ak + c0, n, ks, L.s32, cn, sc); break;
        case 2: run_scores<F, 2>(qb, rk, ak + c0, n, ks, L.s32, cn, sc); break;
        case 3: run_scores<F, 3>(qb, rk, ak + c0, n, ks, L.s32, cn, sc); break;
        default: run_scores<F, 4>(qb, rk, ak + c0, n, ks, L.s32, cn, sc); break;
      }
    }
    const void* vs = nullptr;
    if (L.q8) vs = L.s32 ? (const void*)((const float*)L.vs + tok + c0) : (const void*)((const uint16_t*)L.vs + tok + c0);
    softmax_chunk(S.sc, G, cn, D, m, l, acc, S.pr, rv, vs, L.s32);       // sc: p_i (* v_scale_i)
    for (int64_t g0 = 0; g0 < G; g0 += NG_MAX) {
      const int ng = (int)(G - g0 < NG_MAX ? G - g0 : NG_MAX);
      const float* p = S.sc + g0 * CH;
      switch (ng) {
        case 1: run_values<F, 1>(p, rv, av + c0, n, cn, S.pa); break;
        case 2: run_values<F, 2>(p, rv, av + c0, n, cn, S.pa); break;
        case 3: run_values<F, 3>(p, rv, av + c0, n, cn, S.pa); break;
        default: run_values<F, 4>(p, rv, av + c0, n, cn, S.pa); break;
      }
      for (int64_t r = 0; r < rv; r++)
        for (int g = 0; g < ng; g++) S.pr[(g0 + g) * rv + r] += S.pa[r * ng + g];
    }
  }
  basis_acc<T>(S.pr, G, rv, bv, D, acc);
}

// rows [a, b) of an exact block (the exact tier or the appended rows); q: the segment's unscaled queries [G, D].
// kb0 >= 0: K is blocked (Layer::kblk, bf16 only), the block's row i is row kb0 + i of the blocked tensor at K
template <typename T>
static void rows_piece(const Layer& L, const T* q, const T* K, int64_t sk, const T* V, int64_t sv, int64_t a,
                       int64_t b, float* m, float* l, float* acc, const Scratch& S, int64_t kb0 = -1) {
  typedef void (*sc_fn)(const float*, int64_t, const T*, int64_t, int64_t, float*, const T*, int64_t);
  typedef void (*va_fn)(const float*, int64_t, const T*, int64_t, int64_t, float*, const T*, int64_t, int64_t);
  // [prefetch][D / 16 - 1]: the loops without the prefetch carry no test of it
#define LRK_TIER_TBL(f, PF) \
  { f<T, 1, PF>, f<T, 2, PF>, f<T, 3, PF>, f<T, 4, PF>, f<T, 5, PF>, f<T, 6, PF>, f<T, 7, PF>, f<T, 8, PF> }
  static const sc_fn SC[2][8] = {LRK_TIER_TBL(exact_scores, false), LRK_TIER_TBL(exact_scores, true)};
  static const va_fn VA[2][8] = {LRK_TIER_TBL(exact_values, false), LRK_TIER_TBL(exact_values, true)};
#undef LRK_TIER_TBL
  const int pf = L.pf ? 1 : 0;
  const int64_t G = L.G, D = L.D;
  typedef void (*dp_fn)(const T*, float, int64_t, const T*, int64_t, int64_t, float*, const T*, int64_t);
  dp_fn dp = nullptr;                     // bf16 scores on AVX512_BF16 dot products, where this ISA has them
#ifdef LRK_TIER_DP
  if constexpr (std::is_same<T, uint16_t>::value) {
    static const dp_fn SCD[2][4] = {{exact_scores_dp<1, false>, exact_scores_dp<2, false>, exact_scores_dp<3, false>,
                                     exact_scores_dp<4, false>},
                                    {exact_scores_dp<1, true>, exact_scores_dp<2, true>, exact_scores_dp<3, true>,
                                     exact_scores_dp<4, true>}};
    if (D % 32 == 0 && attn_dp()) dp = SCD[pf][D / 32 - 1];
  }
#endif
  const int64_t ch = chunk_rows((int64_t)(D * sizeof(T)));
  for (int64_t c0 = a; c0 < b; c0 += ch) {
    const int64_t cn = b - c0 < ch ? b - c0 : ch;
    const int64_t nx = b - c0 - cn < ch ? b - c0 - cn : ch;     // the next chunk's rows
    const T* knext = K + (c0 + cn) * sk;                        // where they start (prefetched with the values)
    if (kb0 >= 0) {
      if constexpr (std::is_same<T, uint16_t>::value) {
#ifdef LRK_TIER_DP
        if (attn_dp())
          blk_scores_dp(q, L.scale, G, D, K, kb0 + c0, cn, S.sc);
        else
#endif
          blk_scores(S.qs, G, D, K, kb0 + c0, cn, S.sc, pf ? (const uint16_t*)(V + c0 * sv) : nullptr, sv);
      }
      knext = K + ((kb0 + c0 + cn) >> 4) * 16 * D;              // their block: the blocks hold 16 rows' bytes each
    } else if (dp) {
      dp(q, L.scale, G, K + c0 * sk, sk, cn, S.sc, V + c0 * sv, sv);
    } else {
      SC[pf][D / 16 - 1](S.qs, G, K + c0 * sk, sk, cn, S.sc, V + c0 * sv, sv);
    }
    softmax_chunk(S.sc, G, cn, D, m, l, acc, nullptr, 0, nullptr, false);
    VA[pf][D / 16 - 1](S.sc, G, V + c0 * sv, sv, cn, acc, knext, sk, nx);
  }
}

// One item: segment s, tokens [lo, hi) of [exact | runs | appended]; st = m [G], l [G], acc [G * D] (written).
template <typename T>
static void run_item(const Layer& L, int64_t s, int64_t lo, int64_t hi, float* st, const Scratch& S) {
  const int64_t G = L.G, D = L.D;
  float *m = st, *l = st + G, *acc = st + 2 * G;
  for (int64_t g = 0; g < G; g++) {
    m[g] = -INFINITY;
    l[g] = 0.0f;
  }
  for (int64_t i = 0; i < G * D; i++) acc[i] = 0.0f;
  const T* q = (const T*)L.q + s * G * D;
  scale_query(q, G * D, L.scale, S.qs);
  // exact tier
  const int64_t e0 = L.eoff[s], ne = L.eoff[s + 1] - e0;
  if (lo < ne) {
    if (L.kblk)   // blocked K: the base and the segment's first row (its rows need not start on a block)
      rows_piece<T>(L, q, (const T*)L.ke, L.D, (const T*)L.ve + e0 * L.sve, L.sve, lo, hi < ne ? hi : ne, m, l, acc,
                    S, e0);
    else
      rows_piece<T>(L, q, (const T*)L.ke + e0 * L.ske, L.ske, (const T*)L.ve + e0 * L.sve, L.sve, lo,
                    hi < ne ? hi : ne, m, l, acc, S);
  }
  int64_t base = ne;          // first token index of the next tier
  // runs
  for (int64_t j = L.roff[s]; j < L.roff[s + 1] && base < hi; j++) {
    const int64_t* R = L.runs + j * NCOL;
    const int64_t a = lo > base ? lo - base : 0, b = hi - base < R[N] ? hi - base : R[N];
    if (a < b) {
      if (L.q8)
        run_piece<T, int8_t>(L, R, a, b, m, l, acc, S);
      else
        run_piece<T, T>(L, R, a, b, m, l, acc, S);
    }
    base += R[N];
  }
  // appended rows
  if (hi > base && L.nn) {
    const int64_t bb = s / L.H, hh = s % L.H;
    const T* kn = (const T*)L.kn + bb * L.kn_sb + hh * L.kn_sh;
    const T* vn = (const T*)L.vn + bb * L.vn_sb + hh * L.vn_sh;
    const int64_t a = lo > base ? lo - base : 0, b = hi - base < L.nn ? hi - base : L.nn;
    if (a < b) rows_piece<T>(L, q, kn, L.kn_ss, vn, L.vn_ss, a, b, m, l, acc, S);
  }
}

