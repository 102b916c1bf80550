// The raw entry points of lrk.cpp's decode kernels, for other translation units of the library (layer.cpp, the
// fused decode layer): the same code the ops `gemv`, `attend` and `qgemv` run after checking their arguments, on plain
// pointers, writing into buffers the caller owns. Callers check the ISA first (kind_runs) and the shapes themselves.
// Also the grow-only scratch helper the three translation units share for their per-call buffers.
#pragma once

#include <cstdint>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

namespace lrk {

// grow-only scratch: n elements of v (contents undefined), allocated only when n exceeds every earlier request; with
// a thread_local v, a kernel's per-call buffers cost no allocation once the largest call has been seen
template <typename T>
inline T* grow(std::vector<T>& v, int64_t n) {
  if ((int64_t)v.size() < n) v.resize(n);
  return v.data();
}

// Whether the GEMVs' software prefetch of the weight stream (lrk.cpp's LRK_PF, qgemv.cpp's QPF) uses the non-temporal
// hint (prefetchnta; $LOWRANK_LIB_PF_NTA=0 at load: prefetcht0). A decode step reads every weight once. Measured on the
// AMD Zen 4 VM (SmolLM2 keep 0.5, 512-token prompt, the hint switched every 8 steps in one process): 1 thread 7.57 ->
// 7.20 ms with bf16 factors, 5.56 -> 5.13 int8, 4.65 -> 4.26 int4; 2 threads 5.67 -> 5.60, 4.26 -> 4.23, 3.88 -> 3.59.
// Where (phase timers, int4, 1 thread, processes alternated): the layers' GEMVs ~3-4 % faster and most of the rest in
// the exact LM head's stream; the attention over the 512-token cache unchanged (0.71-0.81 ms either way). Not
// verified with counters (the VM has none): Zen's L3 is filled by lines evicted from L2, and an nta line skips that
// fill, so a read-once stream no longer spends L2-to-L3 traffic. Not measured on Intel, where nta lines skip L2 (the
// 2-4 KB prefetch distance keeps them in L1 until read).
extern const bool g_pf_nta;
#if defined(__x86_64__) || defined(_M_X64)
// one software prefetch of the weight stream with that hint (LRK_PF, QPF)
inline void prefetch_weight(const void* p) {
  if (g_pf_nta)
    _mm_prefetch((const char*)p, _MM_HINT_NTA);
  else
    _mm_prefetch((const char*)p, _MM_HINT_T0);
}
#endif

// whether this CPU (under set_isa_mask) runs the packed kernels of fp32 (bf = false) or bf16 (bf = true)
bool kind_runs(bool bf);
// values of pack(W [out, in]) (fp32, or bf16 when bf)
int64_t packed_size(int64_t out, int64_t in, bool bf);

// one packed matrix of a gemv call: reads columns [xoff, xoff + in) of x, writes its `out` outputs at column yoff of y
struct GemvMat {
  const void* P;  // lrk::pack's layout, the element type of x
  int64_t out, in, xoff, yoff;
};

// gemv's contract: x [N rows, row stride ldx] -> y [N rows, row stride ldy], each matrix's outputs rounded once to the
// element type (bf: bf16, else fp32); block jobs split over the kernel pool, the same bits at every thread count
void gemv_into(bool bf, const void* x, int64_t ldx, int64_t N, const GemvMat* mats, int64_t M, void* y, int64_t ldy);

// attend's contract: q [B, H, G, D] contiguous over slots pad[b] <= s <= hi of K / V (element strides sb, sh, ss of
// batch row, head, slot; unit stride in D) -> o [B, H * G * D]; (row, head) pairs split over the kernel pool, and
// on the bf16 dot-product kernel each pair's slots into pieces (attend_pieces: a function of the slot count alone,
// so the same bits at every thread count) merged by their softmax states. ts: memory for those states
// (attend_state_floats(B * H, G, D) floats) shared by a team's members; nullptr outside a team (then its own).
void attend_into(bool bf, const void* q, const void* K, const int64_t* ks, const void* V, const int64_t* vs, int64_t B,
                 int64_t H, int64_t G, int64_t D, int64_t hi, const int64_t* pad, float scale, void* o,
                 float* ts = nullptr);
int64_t attend_state_floats(int64_t pairs, int64_t G, int64_t D);

// qgemv.cpp's quantized GEMV (int8 / int4 codes with fp16 group scales, QUANT_SPEC), the op qgemv's code after its
// checks: whether it has code for this CPU (under set_isa_mask); whether it serves (bits, group); the bytes of one
// qpack blob; qgemv's contract with GemvMat.P a qpack blob (uint8) of the given bits / group, N <= QGEMV_MAX_ROWS,
// each matrix's outputs rounded once to the element type, the same bits as quant.qmatmul at every thread count
constexpr int64_t QGEMV_MAX_ROWS = 8;
bool qgemv_runs();
bool qgemv_shape_ok(int64_t bits, int64_t group);
int64_t qpacked_size(int64_t out, int64_t in, int64_t bits, int64_t group);
void qgemv_into(bool bf, const void* x, int64_t ldx, int64_t N, const GemvMat* mats, int64_t M, void* y, int64_t ldy,
                int64_t bits, int64_t group);

}  // namespace lrk
