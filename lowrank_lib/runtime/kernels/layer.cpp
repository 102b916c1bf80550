// lowrank_lib's fused decode layer: ONE call per transformer layer of a decode step over the dense KV store (or the
// tiered store of lowrank_lib/kv: decode_layer_tiers).
//
// Why: a decode token of SmolLM2 is ~240 small GEMV calls plus norms, RoPE, KV writes and attention, each one a
// dispatch from the step's Python (eager) or inductor's Python wrapper (compiled step); a torch profile put ~4.9 ms
// of a ~30 ms token in that code (issue 29). This op runs the whole layer in C++:
//
//   h  = rmsnorm(x) [* ln1]                     (_rms: fp32 statistics; bf16 rounds x * rstd, then w * y)
//   qkv: h1 = S h [+ b1]; y2 = U_m h1[m] [+ b2]    (ProjectionGroup: packed stage 1, ONE segmented stage 2)
//   q, k = RoPE(q, k) at position length - pad[b]  (apply_rope: folded [y, rot y] . (cos, sin), or unfolded)
//   K[slot length], V[slot length] = k, v         (DenseKV.append, bhsd layout)
//   o = attend(q, K, V)                           (lrk::attend_into, the lrk_attend kernel)
//   x1 = x + o_proj(o); h = rmsnorm(x1) [* ln2]; g, u = gate_up(h); x2 = x1 + down(silu(g) * u)
//
// Design: the GEMVs and the attention are lrk.cpp's and qgemv.cpp's own code (lrk_api.h: gemv_into, or qgemv_into for
// a quantized group; attend_into), each splitting its block jobs / (row, head) pairs over the kernel pool
// (lrk_pool.h), so every GEMV output and attention head is the
// same bits as the separate ops compute, at every thread count; the elementwise steps (norms, RoPE, KV write, bias,
// SiLU, residuals: a few thousand values) run on the calling thread. Rounding follows the eager step op by op:
// every GEMV output rounded once to the element type, and in bf16 each elementwise op of the step rounds its result
// to bf16 where the eager op does (x * rstd, w * y, y * cos, rot * sin, their sum, bias adds, silu, * u, residual
// adds). Where inductor's fused kernels of the compiled step round differently (it may keep fp32 between fused
// elementwise ops) the two differ by bf16 roundings, not more.
//
// Ops (namespace lowrank_lrk):
//   layer_plan(ln1?, ln2? [H], w Tensor[], meta int[], hidden H, head_dim D, bf16, eps, n_heads, n_kv, folded,
//              final_norm, final_w? [H]) -> id
//   parses and checks one layer's weights ONCE (the engine builds a plan per layer) and keeps references to its
//   tensors until drop_layer_plan(id) (-> whether the id was live; ids are never reused, so a stale id is refused).
//   final_norm: the layer's output is then the model's final RMSNorm of it (* final_w if given): the last layer's
//   plan does the norm before the LM head while its output is hot (an eager norm after the last layer cost ~0.25 ms
//   on SmolLM2: the first ATen op after the weight stream finds its code and data evicted).
//   Why: parsing w / meta and marshalling a list of ~15 tensors and ~60 ints from Python cost ~20 us per layer call
//   on SmolLM2 (0.6 ms of a ~8.6 ms token at 1 thread); a call now passes the plan's id.
//   w, meta: the four projection groups (qkv, o, gate_up, down) in order, each described by meta as
//     qbits, qgroup, rows1, has_b1, nseg, (out, in, xoff) * nseg, has_b2, nmem, (src, off, width) * nmem
//   and taking from w in order: S (packed [rows1, in]), b1 [rows1] if has_b1, the nseg packed stage-2 factors,
//   b2 [sum outs] if has_b2. qbits 0: S and the factors are lrk::pack blobs of the layer's dtype (gemv_into); qbits
//   8 / 4: qpack blobs (uint8) of that many bits and qgroup columns per fp16 scale (qgemv_into, at most 8 rows), each
//   group's own kind, so a layer may mix quantized and fp32 / bf16 groups; biases are always the layer's dtype.
//   Member i's output is columns [off, off + width) of the stage-1 output (src 0) or of the stage-2 output (src 1).
//   qkv has 3 members (q, k, v), gate_up 2 (gate, up), o and down 1.
//   decode_layer(x [B, H], plan, rope [Smax, 2, D], kv(a!) [2L, >=B, Hkv, S, D], layer, length [1], pad [>=B])
//     -> x_out [B, H]: the plan's layer over layer `layer` of the dense store.
//   decode_stack(x [B, H], plans [L], rope, kv(a!) [2L', >=B, Hkv, S, D], length [1], pad [>=B]) -> x_out [B, H]:
//     decode_layer of plans[i] over layer i of the dense store, i = 0 .. L-1 in order, in ONE call (the per-layer
//     Python and dispatcher round trip is paid once per step: ~4-5 % of a SmolLM2 token at 1 thread), on a TEAM of
//     the pool's threads (lrk_pool.h; $LOWRANK_LIB_TEAM=0: the calling thread, as decode_layer): every member runs
//     every layer, each GEMV and the attention a construct whose outputs the members share, so one hand-off per step
//     replaces one per split call and the small factor matrices split too. Measured on SmolLM2 keep 0.5 at 2 threads
//     (paired steps, AMD Zen 4): 7.63 -> 5.67 ms with bf16 factors, 4.81 -> 4.27 int8, 3.65 -> 3.45-3.54 int4. The
//     same bits as decode_layer's loop at every thread count.
//   decode_layer_tiers(x, plan, rope, k_new(a!), v_new(b!) [>=B, Hkv, cap, D], k_exact, v_exact, e_off, runs, r_off,
//                      a_k, a_v, b_k, b_v, k_scale?, v_scale?, t0 [1], length [1], pad) -> x_out [B, H]
//   the same layer over the tiered KV store of lowrank_lib/kv (MethodStore): the token's k / v are written at
//   appended row length - t0 (t0: the prompt length) and the attention is tiers.cpp's tier_attend over the fitted
//   tiers (the layout of kv/tiers.py, checked by tier_attend) and the appended rows up to that one.
// The Python side (layer.py) builds w / meta from the engine's ProjectionGroups and decides when the op runs.
//   silu_mul(g, u, level) -> Tensor   the layer's SiLU(g) * u on its own (level -1: this CPU's code; 0 scalar, 1 AVX2,
//     2 AVX-512), for the tests that compare it with ATen
//   layer_profile(bool on) -> int[]   phase timers of decode_layer (issue 29's per-token breakdown): returns
//     [calls, ns of each Phase below] accumulated since the previous layer_profile call, resets them, and turns the
//     timers on or off (off: one relaxed load per decode_layer call; on: ~11 clock reads per call)
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include "lrk_api.h"
#include "lrk_pool.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define LRK_LAYER_X86 1
#else
#define LRK_LAYER_X86 0
#endif

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace lrk {
int64_t isa_flags();  // lrk.cpp: bit 0 avx512f, 1 avx512bw, 2 avx512vl, 5 avx2, 6 fma (under set_isa_mask)
namespace tiers {      // tiers.cpp: the fused decode attention over a tiered KV layer, into caller memory
// q [B, H, G, D] contiguous of dt at qp -> out [B, H*G*D] (dt): tier_attend's result and checks. state: nullptr, or
// state_floats(B*H, G, D, threads) floats the members of the team this runs in share (every member calls it with the
// same arguments: the pieces are a construct, one member merges them into out, then a barrier)
void attend_into(const void* qp, at::ScalarType dt, int64_t B, int64_t H, int64_t G, int64_t D,
                 const at::Tensor& k_exact, const at::Tensor& v_exact, const at::Tensor& e_off, const at::Tensor& runs,
                 const at::Tensor& r_off, const at::Tensor& a_k, const at::Tensor& a_v, const at::Tensor& b_k,
                 const at::Tensor& b_v, const std::optional<at::Tensor>& k_scale,
                 const std::optional<at::Tensor>& v_scale, const std::optional<at::Tensor>& k_new,
                 const std::optional<at::Tensor>& v_new, int64_t nn, double scale, float* state, void* out);
// A layout validated once (every check of tier_attend that reads neither q nor the appended rows; its tensors must
// outlive it), and attend_into over it: per call only the appended rows are checked and the work items cut
struct Layout;
std::shared_ptr<const Layout> make_layout(at::ScalarType dt, int64_t B, int64_t H, int64_t D,
                                          const at::Tensor& k_exact, const at::Tensor& v_exact,
                                          const at::Tensor& e_off, const at::Tensor& runs, const at::Tensor& r_off,
                                          const at::Tensor& a_k, const at::Tensor& a_v, const at::Tensor& b_k,
                                          const at::Tensor& b_v, const std::optional<at::Tensor>& k_scale,
                                          const std::optional<at::Tensor>& v_scale);
void attend_layout(const Layout& y, const void* qp, int64_t G, const at::Tensor& k_new, const at::Tensor& v_new,
                   int64_t nn, double scale, float* state, void* out);
int64_t state_floats(int64_t S, int64_t G, int64_t D, int64_t threads);
}
namespace layer {

// ---- phase timers (layer_profile): where a layer call's time goes; the order is layer.py's PHASES
enum Phase { P_PROLOG, P_NORM, P_QKV, P_ROPE_KV, P_ATTN, P_O, P_RESID, P_GATE_UP, P_SILU, P_DOWN, N_PHASES };
static std::atomic<bool> g_prof{false};
static std::atomic<int64_t> g_prof_ns[N_PHASES];
static std::atomic<int64_t> g_prof_calls{0};

struct Clock {  // lap(p): the time since the previous lap (or the start) is phase p's
  bool on;
  std::chrono::steady_clock::time_point t;
  explicit Clock(bool on_ = g_prof.load(std::memory_order_relaxed)) : on(on_) {
    if (on) t = std::chrono::steady_clock::now();
  }
  void lap(Phase p) {
    if (!on) return;
    const auto n = std::chrono::steady_clock::now();
    g_prof_ns[p].fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(n - t).count(),
                           std::memory_order_relaxed);
    t = n;
  }
};

std::vector<int64_t> layer_profile(bool on) {
  std::vector<int64_t> r{g_prof_calls.exchange(0)};
  for (auto& a : g_prof_ns) r.push_back(a.exchange(0));
  g_prof.store(on);
  return r;
}

static inline float bf2f(uint16_t b) {
  const uint32_t u = (uint32_t)b << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
static inline uint16_t f2bf(float f) {  // round to nearest even, as c10::BFloat16 (NaN stays a quiet NaN)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}
// element access of T (float or bf16 bits); rnd: the value as the element type rounds it
static inline float ldf(const float* p, int64_t i) { return p[i]; }
static inline float ldf(const uint16_t* p, int64_t i) { return bf2f(p[i]); }
static inline void stf(float* p, int64_t i, float v) { p[i] = v; }
static inline void stf(uint16_t* p, int64_t i, float v) { p[i] = f2bf(v); }
static inline float rnd(float v, const float*) { return v; }
static inline float rnd(float v, const uint16_t*) { return bf2f(f2bf(v)); }

struct Member {
  int64_t src, off, width;
};
struct Group {
  int64_t qbits = 0, qgroup = 0;  // quantized matrices (qgemv_into: int8 / int4, fp16 scales per qgroup), or 0
  const void* S = nullptr;
  int64_t rows = 0, in = 0;
  const void* b1 = nullptr;
  std::vector<GemvMat> seg;
  int64_t segw = 0;
  const void* b2 = nullptr;
  std::vector<Member> mem;
};

// y [N, ld] += b (one add per value, rounded to T): the eager `y + bias`
template <typename T>
static void add_bias(T* y, int64_t N, int64_t n, const T* b) {
  for (int64_t r = 0; r < N; r++)
    for (int64_t j = 0; j < n; j++) stf(y, r * n + j, ldf(y, r * n + j) + ldf(b, j));
}

// one GEMV call of a group: the packed fp32 / bf16 kernel, or the quantized one (the ops gemv / qgemv)
static void group_gemv(bool bf, const Group& g, const void* x, int64_t ldx, int64_t N, const GemvMat* mats,
                       int64_t M, void* y, int64_t ldy) {
  if (g.qbits)
    qgemv_into(bf, x, ldx, N, mats, M, y, ldy, g.qbits, g.qgroup);
  else
    gemv_into(bf, x, ldx, N, mats, M, y, ldy);
}

// f() on one member of a team, the others waiting until it is done (a write to memory the members share); outside a
// team f() then nothing
template <typename F>
static void once(F&& f) {
  if (pool::rank() == 0) f();
  pool::barrier();
}

// x [N, in] (row stride ldx) -> h1 [N, rows], y2 [N, segw] (the group's two GEMV calls, biases added). In a team each
// GEMV call is a construct (lrk_pool.h): h1 / y2 are shared and complete on every member when it returns.
template <typename T>
static void run_group(bool bf, const Group& g, const T* x, int64_t ldx, int64_t N, T* h1, T* y2) {
  GemvMat s1{g.S, g.rows, g.in, 0, 0};
  group_gemv(bf, g, x, ldx, N, &s1, 1, h1, g.rows);
  if (g.b1) once([&] { add_bias(h1, N, g.rows, (const T*)g.b1); });
  if (!g.seg.empty()) {
    group_gemv(bf, g, h1, g.rows, N, g.seg.data(), (int64_t)g.seg.size(), y2, g.segw);
    if (g.b2) once([&] { add_bias(y2, N, g.segw, (const T*)g.b2); });
  }
}

template <typename T>
static const T* member(const Group& g, int64_t i, const T* h1, const T* y2, int64_t* ld) {
  const Member& m = g.mem[i];
  *ld = m.src ? g.segw : g.rows;
  return (m.src ? y2 : h1) + m.off;
}

// apply_rope of one row's member output y (nh heads of D; folded: [y, rot y]) with (cos, sin) rows c, s -> out
template <typename T>
static void rope_row(const T* y, int64_t nh, int64_t D, bool folded, const T* c, const T* s, T* out) {
  const int64_t half = D / 2, n = nh * D;
  float cf[128], sf[128];  // D <= 128 (layer_plan checks it)
  for (int64_t d = 0; d < D; d++) cf[d] = ldf(c, d), sf[d] = ldf(s, d);
  // out = rnd(c * v) + rnd(s * r), r the rotated partner: [y, rot y] folded, else (-y[d + half], y[d - half])
  auto put = [&](T* o, const T* v, const T* r, float sign, int64_t d0, int64_t d1) {
    for (int64_t d = d0; d < d1; d++) stf(o, d, rnd(cf[d] * ldf(v, d), y) + rnd(sf[d] * (sign * ldf(r, d)), y));
  };
  for (int64_t h = 0; h < nh; h++) {
    const T* yh = y + h * D;
    T* oh = out + h * D;
    if (folded) {
      put(oh, yh, y + n + h * D, 1.0f, 0, D);
    } else {
      put(oh, yh, yh + half, -1.0f, 0, half);   // r[d] = -y[d + half]
      put(oh, yh, yh - half, 1.0f, half, D);    // r[d] = y[d - half]
    }
  }
}

// ---- SiLU(g) * u over one row of I values: the eager `silu(g) * u` (each op rounded to T)
// silu(g) = g / (1 + exp(-g)) in fp32, as ATen's CPU kernel computes it; exp by the kernels' own e^x (exp512 /
// exp256 of lrk_simd.h / lrk_simd2.h: Cody-Waite + degree-6 Taylor, ~2e-7 relative; ATen's vectorised exp is Sleef's,
// within 1 ulp: after the bf16 rounding of silu the two agree except at rounding ties). exp256 clamps at 88.38 (silu of
// g < -88.38 is -3.7e-37 there, -0.0 in ATen and in the AVX-512 code); NaN stays NaN (g / anything). AVX-512 (16
// lanes) or AVX2 + FMA (8 lanes), the tail through a padded copy so every value takes the same path; scalar std::exp
// elsewhere.
template <typename T>
static void silu_mul_scalar(const T* g, const T* u, int64_t n, T* out) {
  for (int64_t i = 0; i < n; i++) {
    const float gv = ldf(g, i);
    const float a = rnd(gv / (1.0f + std::exp(-gv)), g);
    stf(out, i, a * ldf(u, i));
  }
}

#if LRK_LAYER_X86

// one(g, u, out) on every run of W values of [0, n), the last short run through zero-padded copies, so every value takes
// the same vector path (inlined into each ISA's caller, which gives the vector code its target)
template <int W, typename T, typename One>
__attribute__((always_inline)) static inline void by_lanes(const T* g, const T* u, int64_t n, T* out, One&& one) {
  int64_t i = 0;
  for (; i + W <= n; i += W) one(g + i, u + i, out + i);
  if (i < n) {
    T gb[W] = {}, ub[W] = {}, ob[W];
    std::memcpy(gb, g + i, (n - i) * sizeof(T));
    std::memcpy(ub, u + i, (n - i) * sizeof(T));
    one(gb, ub, ob);
    std::memcpy(out + i, ob, (n - i) * sizeof(T));
  }
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma")
#include "lrk_simd.h"  // exp512, ld (fp32, bf16); its bf16 `st` needs AVX512_BF16, so the stores below are ours
// round to the element type (round to nearest even; NaN -> quiet NaN), as f2bf
static inline __m512i bf16_bits16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i rne = _mm512_srli_epi32(
      _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)),
                       _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))), 16);
  const __m512i qnan = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF)),
                                                _mm512_set1_epi32(0x7F800000));
  return _mm512_mask_mov_epi32(rne, nan, qnan);
}
static inline __m512 rnd16(__m512 v, const float*) { return v; }
static inline __m512 rnd16(__m512 v, const uint16_t*) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits16(v), 16));
}
static inline void st16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
static inline void st16(uint16_t* p, __m512 v) {
  _mm256_storeu_si256((__m256i*)p, _mm512_cvtepi32_epi16(bf16_bits16(v)));
}
template <typename T>
static void silu_mul_512(const T* g, const T* u, int64_t n, T* out) {
  by_lanes<16>(g, u, n, out, [&](const T* gp, const T* up, T* op) {
    const __m512 gv = ld(gp);
    const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv));
    const __m512 a = rnd16(_mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0f), e)), gp);
    st16(op, _mm512_mul_ps(a, ld(up)));
  });
}
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma")
#include "lrk_simd2.h"  // exp256, to_bf16x8, ld8 / st8 (fp32, bf16)
static inline __m256 rnd8(__m256 v, const float*) { return v; }
static inline __m256 rnd8(__m256 v, const uint16_t*) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(to_bf16x8(v)), 16));
}
template <typename T>
static void silu_mul_256(const T* g, const T* u, int64_t n, T* out) {
  by_lanes<8>(g, u, n, out, [&](const T* gp, const T* up, T* op) {
    const __m256 gv = ld8(gp);
    const __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), gv));
    const __m256 a = rnd8(_mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), gp);
    st8(op, _mm256_mul_ps(a, ld8(up)));
  });
}
#pragma GCC pop_options
#endif

// which code runs silu_mul now: 2 AVX-512, 1 AVX2 + FMA, 0 scalar (the kernels' ISA mask applies)
static int silu_level() {
#if LRK_LAYER_X86
  const int64_t f = isa_flags();
  if ((f & 7) == 7) return 2;
  if ((f & 96) == 96) return 1;
#endif
  return 0;
}

template <typename T>
static void silu_mul(const T* g, const T* u, int64_t n, T* out, int level) {
#if LRK_LAYER_X86
  if (level == 2) return silu_mul_512(g, u, n, out);
  if (level == 1) return silu_mul_256(g, u, n, out);
#endif
  silu_mul_scalar(g, u, n, out);
}

// _rms: fp32 x * rsqrt(mean(x^2) + eps) (* w); bf16 rounds x * rstd to bf16, then w * y to bf16. The scaling pass
// by the silu_mul levels (16 / 8 lanes, the tail through padded copies; each value rounded as the scalar code does:
// x * rstd, its rounding to T, w * y, the store's rounding: the same bits at every level); h may be x.
template <typename T>
static void rms_scale_scalar(const T* x, const T* w, int64_t n, float rstd, T* h) {
  for (int64_t i = 0; i < n; i++) {
    float y = rnd(ldf(x, i) * rstd, x);
    if (w) y = ldf(w, i) * y;
    stf(h, i, y);
  }
}
#if LRK_LAYER_X86
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma")
template <typename T>
static void rms_scale_512(const T* x, const T* w, int64_t n, float rstd, T* h) {
  const __m512 r = _mm512_set1_ps(rstd);
  by_lanes<16>(x, w ? w : x, n, h, [&](const T* xp, const T* wp, T* op) {
    __m512 y = rnd16(_mm512_mul_ps(ld(xp), r), xp);
    if (w) y = _mm512_mul_ps(ld(wp), y);
    st16(op, y);
  });
}
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx2,fma")
template <typename T>
static void rms_scale_256(const T* x, const T* w, int64_t n, float rstd, T* h) {
  const __m256 r = _mm256_set1_ps(rstd);
  by_lanes<8>(x, w ? w : x, n, h, [&](const T* xp, const T* wp, T* op) {
    __m256 y = rnd8(_mm256_mul_ps(ld8(xp), r), xp);
    if (w) y = _mm256_mul_ps(ld8(wp), y);
    st8(op, y);
  });
}
#pragma GCC pop_options
#endif

template <typename T>
static void rms(const T* x, int64_t N, int64_t H, const T* w, float eps, T* h) {
  const int level = silu_level();
  for (int64_t r = 0; r < N; r++) {
    // the sum of squares in double over 8 lanes (lane k: the elements i = k mod 8; every v * v is exact in double,
    // so a contracted multiply-add gives the same bits), added in a fixed tree: no serial chain of H dependent adds
    double a[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    const T* xr = x + r * H;
    int64_t i = 0;
    for (; i + 8 <= H; i += 8)
      for (int k = 0; k < 8; k++) {
        const float v = ldf(xr, i + k);
        a[k] += (double)v * v;
      }
    for (; i < H; i++) {
      const float v = ldf(xr, i);
      a[i % 8] += (double)v * v;
    }
    const double ss = ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
    const float rstd = 1.0f / std::sqrt((float)(ss / (double)H) + eps);
#if LRK_LAYER_X86
    if (level == 2) {
      rms_scale_512(xr, w, H, rstd, h + r * H);
      continue;
    }
    if (level == 1) {
      rms_scale_256(xr, w, H, rstd, h + r * H);
      continue;
    }
#endif
    rms_scale_scalar(xr, w, H, rstd, h + r * H);
  }
}

// op silu_mul(g, u, level) -> g's SiLU times u, the fused layer's code (level -1: what this CPU runs; 0 / 1 / 2 force
// scalar / AVX2 / AVX-512 when the CPU has it): the tests compare it with ATen's silu(g) * u
at::Tensor silu_mul_op(const at::Tensor& g, const at::Tensor& u, int64_t level) {
  TORCH_CHECK(g.dim() == 1 && g.sizes() == u.sizes() && g.scalar_type() == u.scalar_type() && g.is_contiguous() &&
                  u.is_contiguous() && (g.scalar_type() == at::kFloat || g.scalar_type() == at::kBFloat16),
              "lowrank_lrk::silu_mul: g and u must be contiguous 1-d fp32 or bf16 of one size");
  const int have = silu_level();
  TORCH_CHECK(level <= have, "lowrank_lrk::silu_mul: level ", level, " needs an ISA this CPU (or the mask) lacks");
  const int lv = level < 0 ? have : (int)level;
  auto out = at::empty_like(g);
  if (g.scalar_type() == at::kBFloat16)
    silu_mul((const uint16_t*)g.data_ptr(), (const uint16_t*)u.data_ptr(), g.numel(), (uint16_t*)out.data_ptr(), lv);
  else
    silu_mul(g.data_ptr<float>(), u.data_ptr<float>(), g.numel(), out.data_ptr<float>(), lv);
  return out;
}

// The tiered store's buffers (decode_layer_tiers): the appended rows k_new / v_new [>=B, Hkv, cap, D] this token is
// written to at row `slot`, and the fitted layout tiers.cpp's tier_attend reads (the first slot + 1 appended rows)
struct Tier {
  at::Tensor k_new, v_new, k_exact, v_exact, e_off, runs, r_off, a_k, a_v, b_k, b_v;
  std::optional<at::Tensor> k_scale, v_scale;
  int64_t slot;
  std::shared_ptr<const tiers::Layout> layout = nullptr;  // validated once (tier_layout), or checked per call
};

// Where one layer call's activations live. In a team (decode_stack on two or more threads) the outputs of the kernel
// calls are shared by the members, and the rest each member computes itself, the same bits on each (a few thousand
// values: cheaper than a barrier). Two sets of GEMV outputs, used by the groups in turn (qkv and gate_up: set 0, o
// and down: set 1): a member may still read a group's outputs (residual, SiLU, RoPE) while a faster one already runs
// the next group's first GEMV, which writes the other set; the set it reads is written again only two groups later,
// after a barrier every member has passed.
template <typename T>
struct Bufs {
  T* h1[2];  // shared: stage-1 outputs [N, max rows]
  T* y2[2];  // shared: stage-2 outputs [N, max segw]
  T* o;      // shared: the attention's output [N, Hq D]
  T* h;      // own: a norm's output, then silu(g) * u [N, max(H, I)]
  T* q;      // own: the rotated queries [N, Hq D]
  T* x1;     // own: the residual after the attention [N, H]
  T* kr;     // own: one row's rotated keys [Hkv D]
  float* ts = nullptr;  // shared: the attention's piece states (tiers::state_floats / attend_state_floats), or null
                        // (solo: its own)
};

// One layer's weights and geometry, parsed and checked once (layer_plan's; the registry is below)
struct Plan {
  std::vector<Group> G;
  std::vector<at::Tensor> keep;         // w, ln1, ln2: alive while the plan is
  const void* ln1 = nullptr;
  const void* ln2 = nullptr;
  const void* fin_w = nullptr;           // the final norm's weight (fin), or none
  bool bf = false, folded = false, quantized = false, fin = false;
  int64_t H = 0, D = 0, n_heads = 0, n_kv = 0;
  float eps = 0;
};

// the sizes of Bufs' pieces (values) for N rows of the layers of plans ps[0 .. L)
struct Sizes {
  int64_t h1 = 0, y2 = 1, o = 0, h = 0, q = 0, x1 = 0, kr = 0;
  int64_t shared() const { return 2 * h1 + 2 * y2 + o; }
  int64_t own() const { return h + q + x1 + kr; }
};
static Sizes buf_sizes(const std::shared_ptr<const Plan>* ps, int64_t L, int64_t N) {
  Sizes z;
  for (int64_t i = 0; i < L; i++) {
    const Plan& P = *ps[i];
    for (const Group& g : P.G) z.h1 = std::max(z.h1, N * g.rows), z.y2 = std::max(z.y2, N * g.segw);
    z.o = std::max(z.o, N * P.n_heads * P.D), z.q = z.o;
    z.h = std::max(z.h, N * std::max(P.H, P.G[2].mem[0].width));
    z.x1 = std::max(z.x1, N * P.H), z.kr = std::max(z.kr, P.n_kv * P.D);
  }
  return z;
}
template <typename T>
static void carve_shared(Bufs<T>& b, T* p, const Sizes& z) {
  b.h1[0] = p, b.h1[1] = p + z.h1, p += 2 * z.h1;
  b.y2[0] = p, b.y2[1] = p + z.y2, p += 2 * z.y2;
  b.o = p;
}
template <typename T>
static void carve_own(Bufs<T>& b, T* p, const Sizes& z) {
  b.h = p, b.q = p + z.h, b.x1 = b.q + z.q, b.kr = b.x1 + z.x1;
}

// One layer: xp [N, H] -> xo [N, H] (xo != xp), K / V written at slot hi of layer `layer` of the dense store (kv) or
// at the tiered store's appended row (tier)
template <typename T>
static void layer_impl(const Plan& P, const T* xp, T* xo, int64_t N, const at::Tensor& rope, at::Tensor* kv,
                       const Tier* tier, int64_t layer, int64_t hi, const int64_t* pad, const Bufs<T>& B, Clock& clk) {
  const bool bf = P.bf, folded = P.folded, fin = P.fin;
  const T *ln1 = (const T*)P.ln1, *ln2 = (const T*)P.ln2, *fin_w = (const T*)P.fin_w;
  const std::vector<Group>& G = P.G;
  const float eps = P.eps;
  const int64_t Hq = P.n_heads, Hkv = P.n_kv, D = P.D, H = P.H, qg = Hq / Hkv;
  const Group &qkv = G[0], &og = G[1], &gu = G[2], &dn = G[3];
  const int64_t I = gu.mem[0].width;
  T *const h = B.h, *const q = B.q, *const x1 = B.x1, *const kr = B.kr, *const o = B.o;
  clk.lap(P_PROLOG);
  // attention half
  rms(xp, N, H, ln1, eps, h);
  clk.lap(P_NORM);
  run_group(bf, qkv, h, H, N, B.h1[0], B.y2[0]);
  clk.lap(P_QKV);
  int64_t lq, lk, lv;
  const T* yq = member(qkv, 0, B.h1[0], B.y2[0], &lq);
  const T* yk = member(qkv, 1, B.h1[0], B.y2[0], &lk);
  const T* yv = member(qkv, 2, B.h1[0], B.y2[0], &lv);
  const int64_t es = sizeof(T);
  // where this token's k / v rows go: slot `hi` of the dense cache, or appended row `slot` of the tiered store
  T *K, *V;
  int64_t ks[3], vs[3], row;
  if (tier) {
    K = (T*)tier->k_new.data_ptr(), V = (T*)tier->v_new.data_ptr();
    for (int i = 0; i < 3; i++) ks[i] = tier->k_new.stride(i), vs[i] = tier->v_new.stride(i);
    row = tier->slot;
  } else {
    K = (T*)((char*)kv->data_ptr() + 2 * layer * kv->stride(0) * es);
    V = (T*)((char*)kv->data_ptr() + (2 * layer + 1) * kv->stride(0) * es);
    for (int i = 0; i < 3; i++) ks[i] = vs[i] = kv->stride(i + 1);
    row = hi;
  }
  const T* cs = (const T*)rope.data_ptr();
  auto cos_sin = [&](int64_t b, const T** c, const T** s) {
    *c = cs + std::max<int64_t>(hi - pad[b], 0) * rope.stride(0);
    *s = *c + rope.stride(1);
  };
  for (int64_t b = 0; b < N; b++) {  // every member's own rotated queries
    const T *c, *s;
    cos_sin(b, &c, &s);
    rope_row(yq + b * lq, Hq, D, folded, c, s, q + b * Hq * D);
  }
  once([&] {  // the cache's rows: written by one member, read by all in the attention
    for (int64_t b = 0; b < N; b++) {
      const T *c, *s;
      cos_sin(b, &c, &s);
      rope_row(yk + b * lk, Hkv, D, folded, c, s, kr);
      for (int64_t hh = 0; hh < Hkv; hh++) {
        std::memcpy(K + b * ks[0] + hh * ks[1] + row * ks[2], kr + hh * D, D * es);
        std::memcpy(V + b * vs[0] + hh * vs[1] + row * vs[2], yv + b * lv + hh * D, D * es);
      }
    }
  });
  clk.lap(P_ROPE_KV);
  const float scale = (float)std::pow((double)D, -0.5);
  if (tier && tier->layout) {  // every tier and the appended rows through tiers.cpp's kernel (tier_attend's code)
    tiers::attend_layout(*tier->layout, q, qg, tier->k_new, tier->v_new, row + 1, scale, B.ts, o);
  } else if (tier) {
    tiers::attend_into(q, bf ? at::kBFloat16 : at::kFloat, N, Hkv, qg, D, tier->k_exact, tier->v_exact, tier->e_off,
                       tier->runs, tier->r_off, tier->a_k, tier->a_v, tier->b_k, tier->b_v, tier->k_scale,
                       tier->v_scale, tier->k_new, tier->v_new, row + 1, scale, B.ts, o);
  } else {
    attend_into(bf, q, K, ks, V, vs, N, Hkv, qg, D, hi, pad, scale, o, B.ts);
  }
  clk.lap(P_ATTN);
  run_group(bf, og, o, Hq * D, N, B.h1[1], B.y2[1]);
  clk.lap(P_O);
  int64_t la;
  const T* ya = member(og, 0, B.h1[1], B.y2[1], &la);
  for (int64_t r = 0; r < N; r++)
    for (int64_t i = 0; i < H; i++) stf(x1, r * H + i, ldf(xp, r * H + i) + ldf(ya, r * la + i));
  clk.lap(P_RESID);
  // MLP half
  rms(x1, N, H, ln2, eps, h);
  clk.lap(P_NORM);
  run_group(bf, gu, h, H, N, B.h1[0], B.y2[0]);
  clk.lap(P_GATE_UP);
  int64_t lg, lu;
  const T* yg = member(gu, 0, B.h1[0], B.y2[0], &lg);
  const T* yu = member(gu, 1, B.h1[0], B.y2[0], &lu);
  T* m = h;  // h is free again: silu(g) * u [N, I]
  const int sl = silu_level();
  for (int64_t r = 0; r < N; r++) silu_mul(yg + r * lg, yu + r * lu, I, m + r * I, sl);
  clk.lap(P_SILU);
  run_group(bf, dn, m, I, N, B.h1[1], B.y2[1]);
  clk.lap(P_DOWN);
  int64_t ld;
  const T* yd = member(dn, 0, B.h1[1], B.y2[1], &ld);
  for (int64_t r = 0; r < N; r++)
    for (int64_t i = 0; i < H; i++) stf(xo, r * H + i, ldf(x1, r * H + i) + ldf(yd, r * ld + i));
  clk.lap(P_RESID);
  if (fin) {  // the model's final RMSNorm (the last layer's plan): the engine's _norm before the LM head, in place
    rms(xo, N, H, fin_w, eps, xo);
    clk.lap(P_NORM);
  }
}

// Objects made once and named by an id in every call (layer plans, tier layouts): ids are never reused, so a dropped
// id is refused, never served by another object; find() hands out a shared reference, so a concurrent drop cannot
// free an object mid-call.
template <typename T>
class Registry {
 public:
  int64_t add(std::shared_ptr<const T> p) {
    std::lock_guard<std::mutex> lk(m_);
    const int64_t id = next_++;
    map_.emplace(id, std::move(p));
    return id;
  }
  bool drop(int64_t id) {
    std::lock_guard<std::mutex> lk(m_);
    return map_.erase(id) > 0;
  }
  std::shared_ptr<const T> find(int64_t id) {  // null: not held
    std::lock_guard<std::mutex> lk(m_);
    auto it = map_.find(id);
    return it == map_.end() ? nullptr : it->second;
  }

 private:
  std::mutex m_;
  std::unordered_map<int64_t, std::shared_ptr<const T>> map_;
  int64_t next_ = 1;
};

// ---- layer plans: one layer's weights parsed once (layer_plan), then named by an id in every decode call
static Registry<Plan> g_plans;

// Parses and checks one layer's description (the norms, w / meta of the four groups, the geometry) into a plan
static std::shared_ptr<const Plan> parse_plan(const c10::optional<at::Tensor>& ln1,
                                              const c10::optional<at::Tensor>& ln2, at::TensorList w,
                                              at::IntArrayRef meta, int64_t H, int64_t D, bool bf, double eps,
                                              int64_t n_heads, int64_t n_kv, bool folded, bool fin,
                                              const c10::optional<at::Tensor>& fin_w) {
  const char* E = "lowrank_lrk::layer_plan: ";
  const auto st = bf ? at::kBFloat16 : at::kFloat;
  TORCH_CHECK(kind_runs(bf), E, "this CPU runs no packed kernel for ", st);
  TORCH_CHECK(H > 0, E, "hidden must be positive, got ", H);
  TORCH_CHECK(D % 16 == 0 && D > 0 && D <= 128 && n_kv > 0 && n_heads % n_kv == 0 && n_heads / n_kv <= 256, E,
              "head_dim must be a multiple of 16 up to 128 and n_heads a multiple of n_kv (<= 256 per KV head)");
  auto P = std::make_shared<Plan>();
  P->bf = bf, P->folded = folded, P->H = H, P->D = D, P->n_heads = n_heads, P->n_kv = n_kv, P->eps = (float)eps;
  auto same = [&](const at::Tensor& t) { return t.scalar_type() == st && t.is_contiguous() && t.device().is_cpu(); };
  TORCH_CHECK(fin || !fin_w.has_value(), E, "a final norm weight without final_norm");
  P->fin = fin;
  for (const auto* ln : {&ln1, &ln2, &fin_w}) {
    TORCH_CHECK(!ln->has_value() || (same(**ln) && (*ln)->numel() == H), E, "norm weights must be [H] of ", st);
    if (ln->has_value()) P->keep.push_back(**ln);
  }
  P->ln1 = ln1.has_value() ? ln1->data_ptr() : nullptr;
  P->ln2 = ln2.has_value() ? ln2->data_ptr() : nullptr;
  P->fin_w = fin_w.has_value() ? fin_w->data_ptr() : nullptr;
  std::vector<Group>& G = P->G;
  G.resize(4);
  const int64_t ins[4] = {H, n_heads * D, H, -1};
  size_t mi = 0, ti = 0;
  auto next_int = [&]() {
    TORCH_CHECK(mi < meta.size(), E, "meta too short");
    return meta[mi++];
  };
  // q: a quantized matrix's qpack blob (uint8), else the plan's dtype
  auto next_t = [&](int64_t numel, bool q = false) -> const void* {
    TORCH_CHECK(ti < w.size(), E, "too few weight tensors");
    const at::Tensor& t = w[ti++];
    TORCH_CHECK((q ? t.scalar_type() == at::kByte && t.is_contiguous() && t.device().is_cpu() : same(t)) &&
                    t.dim() == 1 && t.numel() == numel,
                E, "weight tensor ", ti - 1, " has ", t.numel(), " values of ", t.scalar_type(), ", expected ", numel,
                q ? " uint8 (a qpack blob)" : " of the layer's dtype");
    P->keep.push_back(t);
    return t.data_ptr();
  };
  for (int gi = 0; gi < 4; gi++) {
    Group& g = G[gi];
    g.in = gi == 3 ? G[2].mem.at(0).width : ins[gi];
    g.qbits = next_int();
    g.qgroup = next_int();
    const bool q = g.qbits != 0;
    TORCH_CHECK(!q || qgemv_shape_ok(g.qbits, g.qgroup), E, "group ", gi, ": quantized as ", g.qbits, " bits, group ",
                g.qgroup, " (qgemv serves 8 / 4 bits, groups 32 / 64 / 128 / 256)");
    TORCH_CHECK(!q || qgemv_runs(), E, "group ", gi, " is quantized and qgemv has no code for this CPU");
    P->quantized = P->quantized || q;
    g.rows = next_int();
    const bool b1 = next_int() != 0;
    const int64_t nseg = next_int();
    std::vector<int64_t> sd;
    for (int64_t j = 0; j < 3 * nseg; j++) sd.push_back(next_int());
    const bool b2 = next_int() != 0;
    const int64_t nmem = next_int();
    TORCH_CHECK(g.rows > 0 && nseg >= 0 && nmem == (gi == 0 ? 3 : gi == 2 ? 2 : 1), E, "group ", gi, ": bad meta");
    auto size = [&](int64_t o, int64_t i) { return q ? qpacked_size(o, i, g.qbits, g.qgroup) : packed_size(o, i, bf); };
    g.S = next_t(size(g.rows, g.in), q);
    if (b1) g.b1 = next_t(g.rows);
    for (int64_t j = 0; j < nseg; j++) {
      const int64_t o = sd[3 * j], i = sd[3 * j + 1], xo = sd[3 * j + 2];
      TORCH_CHECK(o > 0 && i > 0 && xo >= 0 && xo + i <= g.rows, E, "group ", gi, ": stage-2 factor ", j,
                  " reads outside the stage-1 output");
      g.seg.push_back({next_t(size(o, i), q), o, i, xo, g.segw});
      g.segw += o;
    }
    if (b2) g.b2 = next_t(g.segw);
    for (int64_t j = 0; j < nmem; j++) {
      Member m{next_int(), next_int(), next_int()};
      TORCH_CHECK((m.src == 0 || m.src == 1) && m.off >= 0 && m.width > 0 &&
                      m.off + m.width <= (m.src ? g.segw : g.rows),
                  E, "group ", gi, ": member ", j, " outside its output");
      g.mem.push_back(m);
    }
  }
  TORCH_CHECK(mi == meta.size() && ti == w.size(), E, "meta / weights longer than the four groups");
  const int64_t f = folded ? 2 : 1;
  TORCH_CHECK(G[0].mem[0].width == f * n_heads * D && G[0].mem[1].width == f * n_kv * D &&
                  G[0].mem[2].width == n_kv * D && G[1].mem[0].width == H && G[2].mem[1].width == G[2].mem[0].width &&
                  G[3].mem[0].width == H,
              E, "member widths do not match the geometry");
  return P;
}

int64_t layer_plan(const c10::optional<at::Tensor>& ln1, const c10::optional<at::Tensor>& ln2, at::TensorList w,
                   at::IntArrayRef meta, int64_t hidden, int64_t head_dim, bool bf16, double eps, int64_t n_heads,
                   int64_t n_kv, bool folded, bool final_norm, const c10::optional<at::Tensor>& final_w) {
  auto P = parse_plan(ln1, ln2, w, meta, hidden, head_dim, bf16, eps, n_heads, n_kv, folded, final_norm, final_w);
  return g_plans.add(std::move(P));
}

bool drop_layer_plan(int64_t id) { return g_plans.drop(id); }

// the plan of a call (a shared reference: a concurrent drop cannot free it mid-call)
static std::shared_ptr<const Plan> get_plan(const char* E, int64_t id) {
  auto p = g_plans.find(id);
  TORCH_CHECK(p, E, "no layer plan ", id, " (dropped, or never made by layer_plan)");
  return p;
}

// The per-call checks both ops share: x, the RoPE table, length / pad against the plan -> the position (length)
static int64_t check_call(const char* E, const Plan& P, const at::Tensor& x, const at::Tensor& rope,
                          const at::Tensor& length, const at::Tensor& pad) {
  const auto st = P.bf ? at::kBFloat16 : at::kFloat;
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == st && x.size(1) == P.H && x.device().is_cpu(),
              E, "x must be a contiguous ", st, " [B, ", P.H, "] (the plan's), got ", x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(!P.quantized || x.size(0) <= QGEMV_MAX_ROWS, E, "at most ", QGEMV_MAX_ROWS,
              " rows with quantized groups, got ", x.size(0));
  TORCH_CHECK(rope.dim() == 3 && rope.scalar_type() == st && rope.is_contiguous() && rope.size(1) == 2 &&
                  rope.size(2) == P.D,
              E, "rope must be a contiguous [Smax, 2, ", P.D, "] table of ", st);
  TORCH_CHECK(length.scalar_type() == at::kLong && length.numel() == 1 && length.device().is_cpu() &&
                  pad.scalar_type() == at::kLong && pad.is_contiguous() && pad.numel() >= x.size(0),
              E, "length [1] and pad [>=B] int64");
  const int64_t hi = length.data_ptr<int64_t>()[0];
  TORCH_CHECK(hi >= 0 && hi < rope.size(0), E, "position ", hi, " outside the RoPE table (", rope.size(0), " rows)");
  return hi;
}

// One layer call on the calling thread (decode_layer, decode_layer_tiers): its kernel calls split over the kernel
// pool as the separate ops do; every buffer in this thread's grow-only arena (no allocation per call)
template <typename T>
static void solo_layer(const std::shared_ptr<const Plan>& P, const at::Tensor& x, const at::Tensor& rope, at::Tensor* kv,
                       const Tier* tier, int64_t layer, int64_t hi, const int64_t* pd, at::Tensor& out, Clock& clk) {
  const int64_t N = x.size(0);
  const Sizes z = buf_sizes(&P, 1, N);
  static thread_local std::vector<T> arena;
  T* base = grow(arena, z.shared() + z.own());
  Bufs<T> B;
  carve_shared(B, base, z);
  carve_own(B, base + z.shared(), z);
  layer_impl<T>(*P, (const T*)x.data_ptr(), (T*)out.data_ptr(), N, rope, kv, tier, layer, hi, pd, B, clk);
}

static at::Tensor run_layer(const at::Tensor& x, const std::shared_ptr<const Plan>& P, const at::Tensor& rope,
                            at::Tensor* kv, const Tier* tier, int64_t layer, int64_t hi, const at::Tensor& pad,
                            Clock& clk) {
  const int64_t N = x.size(0), H = x.size(1);
  auto out = at::empty({N, H}, x.options());
  if (N == 0) return out;
  const int64_t* pd = pad.data_ptr<int64_t>();
  if (clk.on) g_prof_calls.fetch_add(1, std::memory_order_relaxed);
  if (P->bf)
    solo_layer<uint16_t>(P, x, rope, kv, tier, layer, hi, pd, out, clk);
  else
    solo_layer<float>(P, x, rope, kv, tier, layer, hi, pd, out, clk);
  return out;
}

// the dense store's checks of layer `layer` (decode_layer, decode_stack)
static void check_kv(const char* E, const Plan& P, const at::Tensor& x, const at::Tensor& kv, int64_t layer,
                     int64_t hi) {
  TORCH_CHECK(kv.dim() == 5 && kv.scalar_type() == x.scalar_type() && kv.is_contiguous() && kv.size(0) % 2 == 0 &&
                  layer >= 0 && 2 * layer + 1 < kv.size(0) && kv.size(1) >= x.size(0) && kv.size(2) == P.n_kv &&
                  kv.size(4) == P.D,
              E, "kv must be the dense store's contiguous [2L, >=B, Hkv, S, D] buffer (layer ", layer, ")");
  TORCH_CHECK(hi < kv.size(3), E, "slot ", hi, " outside the cache (", kv.size(3), " slots)");
}

at::Tensor decode_layer(const at::Tensor& x, int64_t plan, const at::Tensor& rope, at::Tensor& kv, int64_t layer,
                        const at::Tensor& length, const at::Tensor& pad) {
  Clock clk;  // the checks below count as the call's prolog
  const char* E = "lowrank_lrk::decode_layer: ";
  const auto P = get_plan(E, plan);
  const int64_t hi = check_call(E, *P, x, rope, length, pad);
  check_kv(E, *P, x, kv, layer, hi);
  return run_layer(x, P, rope, &kv, nullptr, layer, hi, pad, clk);
}

// whether decode_stack runs as a team ($LOWRANK_LIB_TEAM=0: every layer on the calling thread, each kernel call split
// over the pool as decode_layer does; read at every call, so a benchmark can alternate the two in one process)
static bool team_on() {
  const char* e = std::getenv("LOWRANK_LIB_TEAM");
  return !(e && e[0] == '0');
}

// The layers of plans[0 .. L) in order on a team of the pool's threads (lrk_pool.h): one hand-off per step instead of
// one per split kernel call. Each member runs every layer (its own x, norms, RoPE'd queries, residuals and SiLU: the
// same bits as on one thread); the GEMVs and the attention are constructs whose outputs the members share; the
// cache's row is written by one member.
template <typename T>
static void stack_impl(const std::vector<std::shared_ptr<const Plan>>& plans, const at::Tensor& x,
                       const at::Tensor& rope, at::Tensor* kv, const std::vector<Tier>* tiers, int64_t hi,
                       const int64_t* pd, at::Tensor& out) {
  const int64_t N = x.size(0), H = x.size(1), L = (int64_t)plans.size();
  const Sizes z = buf_sizes(plans.data(), L, N);
  static thread_local std::vector<T> shared;  // the calling thread's: the members' shared buffers
  Bufs<T> S;
  carve_shared(S, grow(shared, z.shared()), z);
  {  // the attention's piece states, shared by the members (tiers: sized for the most threads a team has)
    static thread_local std::vector<float> states;
    int64_t n = 0;
    for (const auto& p : plans)
      n = std::max(n, tiers ? tiers::state_floats(N * p->n_kv, p->n_heads / p->n_kv, p->D, pool::threads())
                            : attend_state_floats(N * p->n_kv, p->n_heads / p->n_kv, p->D));
    S.ts = grow(states, n);
  }
  const bool prof = g_prof.load(std::memory_order_relaxed);
  auto body = [&](int64_t r, int64_t) {
    static thread_local std::vector<T> own;   // each member's: its buffers and two x rows
    T* base = grow(own, z.own() + 2 * N * H);
    Bufs<T> B = S;
    carve_own(B, base, z);
    T* xs[2] = {base + z.own(), base + z.own() + N * H};
    Clock clk(prof && r == 0);                // the phase timers: one member's wall time
    const T* cur = (const T*)x.data_ptr();
    for (int64_t i = 0; i < L; i++) {
      if (clk.on) g_prof_calls.fetch_add(1, std::memory_order_relaxed);
      layer_impl<T>(*plans[i], cur, xs[i & 1], N, rope, kv, tiers ? &(*tiers)[i] : nullptr, i, hi, pd, B, clk);
      cur = xs[i & 1];
    }
    if (r == 0) std::memcpy(out.data_ptr(), cur, N * H * sizeof(T));
  };
  pool::team(team_on() ? pool::threads() : 1, body);
}

at::Tensor decode_stack(const at::Tensor& x, at::IntArrayRef plans, const at::Tensor& rope, at::Tensor& kv,
                        const at::Tensor& length, const at::Tensor& pad) {
  const char* E = "lowrank_lrk::decode_stack: ";
  TORCH_CHECK(!plans.empty(), E, "no layer plans");
  std::vector<std::shared_ptr<const Plan>> ps;
  int64_t hi = 0;
  for (int64_t i = 0; i < (int64_t)plans.size(); i++) {  // every check before the first layer runs
    ps.push_back(get_plan(E, plans[i]));
    const Plan& P = *ps.back();
    hi = check_call(E, P, x, rope, length, pad);
    TORCH_CHECK(P.bf == ps[0]->bf && (!P.fin || i + 1 == (int64_t)plans.size()), E, "plan ", i,
                P.bf != ps[0]->bf ? " has another dtype than plan 0" : " has the final norm but is not the last");
    check_kv(E, P, x, kv, i, hi);
  }
  auto out = at::empty_like(x);
  if (x.size(0) == 0) return out;
  if (ps[0]->bf)
    stack_impl<uint16_t>(ps, x, rope, &kv, nullptr, hi, pad.data_ptr<int64_t>(), out);
  else
    stack_impl<float>(ps, x, rope, &kv, nullptr, hi, pad.data_ptr<int64_t>(), out);
  return out;
}

// k_new / v_new, a tiered layer's appended rows: [>=B, n_kv, cap, D] of dtype dt, unit stride in d (`where` names the
// layer in the message)
static void check_appended(const char* E, const std::string& where, const at::Tensor& k_new, const at::Tensor& v_new,
                           at::ScalarType dt, int64_t B, int64_t n_kv, int64_t cap, int64_t D) {
  for (auto [t, name] : {std::pair<const at::Tensor*, const char*>{&k_new, "k_new"}, {&v_new, "v_new"}})
    TORCH_CHECK(t->dim() == 4 && t->scalar_type() == dt && t->device().is_cpu() && t->size(0) >= B &&
                    t->size(1) == n_kv && t->size(2) == cap && t->size(3) == D && t->stride(3) == 1,
                E, where, name, " must be the appended rows [>=", B, ", ", n_kv, ", ", cap, ", ", D, "] of ", dt,
                " with unit stride in d, got ", t->sizes(), " ", t->scalar_type());
}

// The tiered store's buffers of one layer, checked against the plan and x (decode_layer_tiers, decode_stack_tiers):
// k_new / v_new the appended rows, the token's row slot = position - t0 (t0: the prompt length, a device scalar)
static Tier tier_of(const char* E, const Plan& P, const at::Tensor& x, int64_t hi, const at::Tensor& k_new,
                    const at::Tensor& v_new, const at::Tensor& k_exact, const at::Tensor& v_exact,
                    const at::Tensor& e_off, const at::Tensor& runs, const at::Tensor& r_off, const at::Tensor& a_k,
                    const at::Tensor& a_v, const at::Tensor& b_k, const at::Tensor& b_v,
                    const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale,
                    const at::Tensor& t0) {
  check_appended(E, "", k_new, v_new, x.scalar_type(), x.size(0), P.n_kv, k_new.dim() == 4 ? k_new.size(2) : -1, P.D);
  TORCH_CHECK(t0.scalar_type() == at::kLong && t0.numel() == 1 && t0.device().is_cpu(), E,
              "t0 must be a one-element int64 CPU tensor (the prompt length)");
  const int64_t slot = hi - t0.data_ptr<int64_t>()[0];
  TORCH_CHECK(slot >= 0 && slot < k_new.size(2), E, "appended row ", slot, " (position ", hi, ") outside the ",
              k_new.size(2), " reserved rows");
  return Tier{k_new, v_new, k_exact, v_exact, e_off, runs, r_off, a_k, a_v, b_k, b_v, k_scale, v_scale, slot};
}

// decode_layer over the tiered store of lowrank_lib/kv (MethodStore with the fused tier attention): the token's k / v
// are written at appended row length - t0 of k_new / v_new (t0: the prompt length, a device scalar), and the
// attention is tiers.cpp's tier_attend over the fitted tiers and the appended rows up to that one
at::Tensor decode_layer_tiers(const at::Tensor& x, int64_t plan, const at::Tensor& rope, at::Tensor& k_new,
                              at::Tensor& v_new, const at::Tensor& k_exact, const at::Tensor& v_exact,
                              const at::Tensor& e_off, const at::Tensor& runs, const at::Tensor& r_off,
                              const at::Tensor& a_k, const at::Tensor& a_v, const at::Tensor& b_k,
                              const at::Tensor& b_v, const c10::optional<at::Tensor>& k_scale,
                              const c10::optional<at::Tensor>& v_scale, const at::Tensor& t0,
                              const at::Tensor& length, const at::Tensor& pad) {
  Clock clk;
  const char* E = "lowrank_lrk::decode_layer_tiers: ";
  const auto P = get_plan(E, plan);
  const int64_t hi = check_call(E, *P, x, rope, length, pad);
  const Tier tier = tier_of(E, *P, x, hi, k_new, v_new, k_exact, v_exact, e_off, runs, r_off, a_k, a_v, b_k, b_v,
                            k_scale, v_scale, t0);
  return run_layer(x, P, rope, nullptr, &tier, 0, hi, pad, clk);
}

// ---- tier layouts: a tiered store's layers validated once per prefill (tier_layout), then named by an id (a [1]
// int64 tensor read at run time: a compiled step replays for every request) in every decode_stack_tiers call
struct TierSet {
  std::vector<Tier> tiers;           // slot unset; layout set
  at::ScalarType dt;
  int64_t B, n_kv, D, cap;
};
static Registry<TierSet> g_tiers;

// The layers' tiered buffers, entry i of each list being layer i's (k_scale / v_scale None for float factors): every
// check tier_attend makes of a layout, once; k_new / v_new [>=B, n_kv, cap, D] of the layers' dtype. -> its id
int64_t tier_layout(at::TensorList k_new, at::TensorList v_new, at::TensorList k_exact, at::TensorList v_exact,
                    at::TensorList e_off, at::TensorList runs, at::TensorList r_off, at::TensorList a_k,
                    at::TensorList a_v, at::TensorList b_k, at::TensorList b_v,
                    const c10::List<c10::optional<at::Tensor>>& k_scale,
                    const c10::List<c10::optional<at::Tensor>>& v_scale, int64_t n_kv) {
  const char* E = "lowrank_lrk::tier_layout: ";
  const int64_t L = (int64_t)k_new.size();
  TORCH_CHECK(L > 0 && n_kv > 0, E, "no layers, or n_kv < 1");
  for (int64_t n : {(int64_t)v_new.size(), (int64_t)k_exact.size(), (int64_t)v_exact.size(), (int64_t)e_off.size(),
                    (int64_t)runs.size(), (int64_t)r_off.size(), (int64_t)a_k.size(), (int64_t)a_v.size(),
                    (int64_t)b_k.size(), (int64_t)b_v.size(), (int64_t)k_scale.size(), (int64_t)v_scale.size()})
    TORCH_CHECK(n == L, E, "every list needs one entry per layer (", L, "), got one of ", n);
  auto T = std::make_shared<TierSet>();
  T->dt = k_new[0].scalar_type(), T->n_kv = n_kv, T->D = k_new[0].dim() == 4 ? k_new[0].size(3) : 0;
  T->B = e_off[0].numel() > 0 ? (e_off[0].numel() - 1) / n_kv : 0, T->cap = k_new[0].dim() == 4 ? k_new[0].size(2) : 0;
  TORCH_CHECK(T->dt == at::kFloat || T->dt == at::kBFloat16, E, "the layers' dtype must be fp32 or bf16, got ", T->dt);
  TORCH_CHECK(T->B >= 1 && e_off[0].numel() == T->B * n_kv + 1, E, "e_off of layer 0 has ", e_off[0].numel(),
              " entries: not B * n_kv + 1 for n_kv = ", n_kv);
  for (int64_t i = 0; i < L; i++) {
    check_appended(E, "layer " + std::to_string(i) + ": ", k_new[i], v_new[i], T->dt, T->B, n_kv, T->cap, T->D);
    Tier t{k_new[i], v_new[i], k_exact[i], v_exact[i], e_off[i], runs[i], r_off[i], a_k[i], a_v[i], b_k[i], b_v[i],
           k_scale.get(i), v_scale.get(i), 0};
    t.layout = tiers::make_layout(T->dt, T->B, n_kv, T->D, t.k_exact, t.v_exact, t.e_off, t.runs, t.r_off, t.a_k,
                                  t.a_v, t.b_k, t.b_v, t.k_scale, t.v_scale);
    T->tiers.push_back(std::move(t));
  }
  return g_tiers.add(std::move(T));
}

bool drop_tier_layout(int64_t id) { return g_tiers.drop(id); }

// decode_stack over a tiered store (layouts from tier_layout, named by the id in `layout`): every plan is checked
// against the layout before the first layer runs (the layouts were checked when made); then the layers run in order
// on a team of the pool's threads as decode_stack's do, each layer's tier attention a construct of the team (its
// pieces claimed by the members, merged by one). One call per step instead of one per layer, and no per-step list of
// the layers' buffers.
at::Tensor decode_stack_tiers(const at::Tensor& x, at::IntArrayRef plans, const at::Tensor& rope,
                              const at::Tensor& layout, const at::Tensor& t0, const at::Tensor& length,
                              const at::Tensor& pad) {
  const char* E = "lowrank_lrk::decode_stack_tiers: ";
  const int64_t L = (int64_t)plans.size();
  TORCH_CHECK(L > 0, E, "no layer plans");
  TORCH_CHECK(layout.scalar_type() == at::kLong && layout.numel() == 1 && layout.device().is_cpu(), E,
              "layout must be a one-element int64 CPU tensor (a tier_layout id)");
  const int64_t id = layout.data_ptr<int64_t>()[0];
  const auto T = g_tiers.find(id);
  TORCH_CHECK(T, E, "no tier layout ", id, " (dropped, or never made by tier_layout)");
  TORCH_CHECK((int64_t)T->tiers.size() == L, E, "the layout has ", T->tiers.size(), " layers, the plans ", L);
  TORCH_CHECK(t0.scalar_type() == at::kLong && t0.numel() == 1 && t0.device().is_cpu(), E,
              "t0 must be a one-element int64 CPU tensor (the prompt length)");
  std::vector<std::shared_ptr<const Plan>> ps;
  int64_t hi = 0;
  for (int64_t i = 0; i < L; i++) {  // every check before the first layer runs
    ps.push_back(get_plan(E, plans[i]));
    const Plan& P = *ps.back();
    hi = check_call(E, P, x, rope, length, pad);
    TORCH_CHECK(P.bf == ps[0]->bf && (!P.fin || i + 1 == L), E, "plan ", i,
                P.bf != ps[0]->bf ? " has another dtype than plan 0" : " has the final norm but is not the last");
    TORCH_CHECK(T->dt == x.scalar_type() && T->n_kv == P.n_kv && T->D == P.D && T->B == x.size(0), E,
                "the layout holds ", T->B, " rows of ", T->n_kv, " KV heads of ", T->D, " (", T->dt, "), layer ", i,
                "'s step ", x.size(0), " rows of ", P.n_kv, " x ", P.D, " (", x.scalar_type(), ")");
  }
  const int64_t slot = hi - t0.data_ptr<int64_t>()[0];
  TORCH_CHECK(slot >= 0 && slot < T->cap, E, "appended row ", slot, " (position ", hi, ") outside the ", T->cap,
              " reserved rows");
  std::vector<Tier> ts = T->tiers;
  for (auto& t : ts) t.slot = slot;
  auto out = at::empty_like(x);
  if (x.size(0) == 0) return out;
  if (ps[0]->bf)
    stack_impl<uint16_t>(ps, x, rope, nullptr, &ts, hi, pad.data_ptr<int64_t>(), out);
  else
    stack_impl<float>(ps, x, rope, nullptr, &ts, hi, pad.data_ptr<int64_t>(), out);
  return out;
}

}  // namespace layer
}  // namespace lrk

TORCH_LIBRARY_FRAGMENT(lowrank_lrk, m) {
  m.def(
      "layer_plan(Tensor? ln1, Tensor? ln2, Tensor[] w, int[] meta, int hidden, int head_dim, bool bf16, float eps, "
      "int n_heads, int n_kv, bool folded, bool final_norm=False, Tensor? final_w=None) -> int",
      &lrk::layer::layer_plan);
  m.def("drop_layer_plan(int plan) -> bool", &lrk::layer::drop_layer_plan);
  m.def("decode_layer(Tensor x, int plan, Tensor rope, Tensor(a!) kv, int layer, Tensor length, Tensor pad) -> Tensor");
  m.def("decode_stack(Tensor x, int[] plans, Tensor rope, Tensor(a!) kv, Tensor length, Tensor pad) -> Tensor");
  m.def(
      "decode_layer_tiers(Tensor x, int plan, Tensor rope, Tensor(a!) k_new, Tensor(b!) v_new, Tensor k_exact, "
      "Tensor v_exact, Tensor e_off, Tensor runs, Tensor r_off, Tensor a_k, Tensor a_v, Tensor b_k, Tensor b_v, "
      "Tensor? k_scale, Tensor? v_scale, Tensor t0, Tensor length, Tensor pad) -> Tensor");
  m.def(
      "tier_layout(Tensor[] k_new, Tensor[] v_new, Tensor[] k_exact, Tensor[] v_exact, Tensor[] e_off, Tensor[] runs, "
      "Tensor[] r_off, Tensor[] a_k, Tensor[] a_v, Tensor[] b_k, Tensor[] b_v, Tensor?[] k_scale, Tensor?[] v_scale, "
      "int n_kv) -> int",
      &lrk::layer::tier_layout);
  m.def("drop_tier_layout(int layout) -> bool", &lrk::layer::drop_tier_layout);
  // the layout's k_new / v_new are written in place; they are reached through the id, so the schema cannot say so:
  // nothing else in a step may read them (the engine's fused step reads them only inside this op)
  m.def("decode_stack_tiers(Tensor x, int[] plans, Tensor rope, Tensor layout, Tensor t0, Tensor length, Tensor pad) "
        "-> Tensor");
  m.def("layer_profile(bool on) -> int[]", &lrk::layer::layer_profile);
  m.def("silu_mul(Tensor g, Tensor u, int level) -> Tensor");
}

TORCH_LIBRARY_IMPL(lowrank_lrk, CPU, m) {
  m.impl("decode_layer", &lrk::layer::decode_layer);
  m.impl("decode_stack", &lrk::layer::decode_stack);
  m.impl("decode_layer_tiers", &lrk::layer::decode_layer_tiers);
  m.impl("decode_stack_tiers", &lrk::layer::decode_stack_tiers);
  m.impl("silu_mul", &lrk::layer::silu_mul_op);
}
