// lowrank_lib's kernel thread pool (pool.cpp): how lrk.cpp and tiers.cpp split one call over threads.
//
// A call cuts its work into contiguous chunks (runs of GEMV blocks, of attention heads, of tier pieces) whose
// results do not depend on which thread runs them, and hands them to pool::run: the calling thread and up to
// nthreads - 1 workers claim chunks one at a time from a shared counter until none is left, so a worker that wakes
// late (or not at all) just takes fewer chunks; run returns when every chunk has finished. The workers belong to
// the library (created on first use, grown to the thread count asked for, never destroyed; re-created lazily in a
// forked child), spin briefly after each call, then sleep on a condition variable. Mode 1 runs the same claiming
// loop in an OpenMP parallel region instead (torch's intra-op threads): the default where torch's backend is OpenMP
// (build.default_pool_mode()).
#pragma once

#include <cstdint>
#include <type_traits>
#include <vector>

namespace lrk {
namespace pool {

typedef void (*ChunkFn)(void* ctx, int64_t chunk);

// Threads a kernel call may use now: the set_pool override when > 0, else at::get_num_threads(); 1 when called from
// inside a parallel region.
int64_t threads();
// Threads worth using for `bytes` of streamed work: min(threads(), bytes / min_bytes), at least 1 (below 2 * min_bytes
// one thread does everything: waking a worker costs more than it saves).
int64_t threads_for(int64_t bytes);
// The threshold of threads_for: streamed bytes per thread (128 KB; set_pool changes it).
int64_t min_bytes();
// Chunks per thread a caller should cut (dynamic claiming evens out late workers).
constexpr int64_t CHUNKS_PER_THREAD = 4;

// fn(ctx, c) for every c in [0, nchunks), on up to nthreads threads (the caller included); returns when all are done.
// One call at a time uses the workers: a concurrent or nested call runs its chunks on its own thread.
void run(int64_t nchunks, int64_t nthreads, ChunkFn fn, void* ctx);

template <typename F>
void run(int64_t nchunks, int64_t nthreads, F&& f) {
  using G = std::remove_reference_t<F>;
  run(nchunks, nthreads, [](void* c, int64_t i) { (*static_cast<G*>(c))(i); }, (void*)&f);
}

// Cuts [0, n) into at most `parts` contiguous ranges of about equal weight (w[i] >= 0): cut[0] = 0 < ... = n.
std::vector<int64_t> cuts(const std::vector<double>& w, int64_t parts);

// the ops (registered by lrk.cpp): set_pool(threads (0: follow torch), min_bytes per thread, spin_us, mode (0: our
// workers, 1: OpenMP)), each negative value leaving its setting unchanged -> the previous four; pool_info() ->
// [threads now, workers started, parallel calls, chunks run off the caller, calls run on the caller alone]
std::vector<int64_t> set_pool(int64_t threads, int64_t min_bytes, int64_t spin_us, int64_t mode);
std::vector<int64_t> pool_info();

}  // namespace pool
}  // namespace lrk
