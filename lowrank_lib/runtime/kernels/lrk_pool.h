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
//
// A team (team(), for the fused decode stack) is the other way to use the threads: every thread runs the SAME code
// from start to end (a whole decode step), and a kernel call inside it is a work-sharing construct: each member calls
// run() with the same arguments, the members claim the chunks from a counter of the team, and run() returns on every
// member after a barrier, when all chunks are done. Splitting a call then costs one barrier between hot threads
// (~0.1-0.3 us) instead of a hand-off (an OpenMP region, or waking our workers), so the step's small matrices can be
// split too. Code between the calls runs on every member (each on its own copy of the small activations, the same
// bits), except what must happen once (a write to shared memory: rank() == 0, then barrier()).
#pragma once

#include <cstdint>
#include <type_traits>
#include <vector>

namespace lrk {
namespace pool {

typedef void (*ChunkFn)(void* ctx, int64_t chunk);

// Threads a kernel call may use now: inside a team its size; else the set_pool override when > 0, else
// at::get_num_threads(); 1 when called from inside a parallel region.
int64_t threads();
// Threads worth using for `bytes` of streamed work: min(threads(), bytes / min_bytes), at least 1 (below 2 * min_bytes
// one thread does everything: waking a worker costs more than it saves).
int64_t threads_for(int64_t bytes);
// The threshold of threads_for: streamed bytes per thread (128 KB; set_pool changes it).
int64_t min_bytes();
// Chunks per thread a caller should cut (dynamic claiming evens out late workers).
constexpr int64_t CHUNKS_PER_THREAD = 4;
// What a call cuts now: CHUNKS_PER_THREAD, or 1 inside a team (its members are hot and start a construct together, so
// one contiguous run each keeps every member's stream long: paired at 2 threads, SmolLM2 keep 0.5, 1 chunk against
// 4: int4 factors 3.31 -> 3.12 and 3.60 -> 3.39 ms, int8 4.60 -> 4.40, bf16 5.59 -> 5.52)
int64_t chunks_per_thread();

// fn(ctx, c) for every c in [0, nchunks), on up to nthreads threads (the caller included); returns when all are done.
// One call at a time uses the workers: a concurrent or nested call runs its chunks on its own thread.
void run(int64_t nchunks, int64_t nthreads, ChunkFn fn, void* ctx);

template <typename F>
void run(int64_t nchunks, int64_t nthreads, F&& f) {
  using G = std::remove_reference_t<F>;
  run(nchunks, nthreads, [](void* c, int64_t i) { (*static_cast<G*>(c))(i); }, (void*)&f);
}

// fn(ctx, rank, size) on a team of up to nthreads threads, the caller one of them (ranks 0 .. size - 1; size: the
// team's real size, 1 when the workers are busy, inside another team, or nthreads <= 1), returning when every member
// has returned. Inside fn, run() is a work-sharing construct (see above), threads() is the team's size and
// threads_for() splits from team_min_bytes(); a member that throws makes every member leave at its next barrier, and
// team() rethrows the first exception.
typedef void (*TeamFn)(void* ctx, int64_t rank, int64_t size);
void team(int64_t nthreads, TeamFn fn, void* ctx);

template <typename F>
void team(int64_t nthreads, F&& f) {
  using G = std::remove_reference_t<F>;
  team(nthreads, [](void* c, int64_t r, int64_t n) { (*static_cast<G*>(c))(r, n); }, (void*)&f);
}
// this thread's rank in the team it runs in (0 outside a team)
int64_t rank();
// whether this thread runs inside a team of two or more
bool in_team();
// inside a team: returns when every member has called it (outside: nothing)
void barrier();
// the threshold of threads_for inside a team: bytes per thread, the smaller of min_bytes() and 16 KB
// ($LOWRANK_LIB_TEAM_MIN_BYTES at the first call)
int64_t team_min_bytes();

// Cuts [0, n) into at most `parts` contiguous ranges of about equal weight (w[i] >= 0): cut[0] = 0 < ... = n.
std::vector<int64_t> cuts(const std::vector<double>& w, int64_t parts);

// the ops (registered by lrk.cpp): set_pool(threads (0: follow torch), min_bytes per thread, spin_us, mode (0: our
// workers, 1: OpenMP)), each negative value leaving its setting unchanged -> the previous four; pool_info() ->
// [threads now, workers started, parallel calls, chunks run off the caller, calls run on the caller alone]
std::vector<int64_t> set_pool(int64_t threads, int64_t min_bytes, int64_t spin_us, int64_t mode);
std::vector<int64_t> pool_info();

}  // namespace pool
}  // namespace lrk
