// lowrank_lib's kernel thread pool: see lrk_pool.h for the contract.
//
// Protocol (one dispatching call at a time, guarded by `owner`):
//   caller   writes the job (fn, ctx, nchunks, nworkers), next = 0, then state = (gen << 1) | 1 (open); wakes
//            sleeping workers (only when some sleep); claims chunks itself; state = gen << 1 (closed); waits until
//            no worker is inside the job; releases `owner`.
//   worker   waits (spins spin_us, then sleeps) for an open state of a new generation; enters (inside += 1); runs
//            chunks only if the state is still that open generation and its index < nworkers (so it never reads a
//            job whose caller has returned: the caller waits for inside == 0 after closing, and with sequentially
//            consistent atomics a worker entering after that wait sees the closed state); leaves (inside -= 1).
// Fork: a child inherits the memory but not the threads, so pthread_atfork drops the pool pointer in the child (the
// old pool is leaked, never touched again) and the next call builds a fresh one. Exit: the pool is never destroyed
// (workers may still be spinning on it while static destructors run); the OS ends the detached workers.
#include "lrk_pool.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__unix__)
#include <pthread.h>
#endif
#if defined(_OPENMP)
#include <omp.h>
#endif
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define LRK_PAUSE() _mm_pause()
#else
#define LRK_PAUSE() ((void)0)
#endif

#ifndef LRK_POOL_MIN_BYTES
// bytes of streamed work per thread below which a thread is not worth waking. A hot hand-off (workers spinning)
// costs the caller well under 1 us (a cache line written, read back by each worker, the join); a cold one (workers
// asleep) a condition-variable wake of a few us on the caller, while the dynamic claiming lets the caller do the
// chunks a late worker has not taken. One core streams 10-25 GB/s, so 32 KB is 1.3-3 us of work: in theory a 64 KB
// matrix split in two saves about as much as a cold hand-off costs. Measured (SmolLM2 keep 0.5 at 2 threads, OpenMP
// mode, paired decode steps switching the threshold per step): 32 / 64 / 128 / 256 / 512 KB gave 5.67 / 5.32 / 4.85 /
// 4.74 / 4.77 ms with int8 factors, 3.82 / 3.74 / 3.61 / 3.78 / 3.76 with int4 and 6.96 / 6.94 / 6.86 / 7.15 / 7.19 with
// bf16: splits of 20-250 KB matrices (the factors) cost more than they save (the hand-off, and a second thread's
// short streams that the hardware prefetcher never ramps up); 128 KB is the best or within 2 % of it in each.
#define LRK_POOL_MIN_BYTES (128 << 10)
#endif
#ifndef LRK_YIELD_AFTER
// pauses a waiter spins before it also yields its core, once every 1024 pauses: a barrier or a call's end waits
// microseconds while every member runs, far longer only when one was descheduled (more runnable threads than cores:
// a user's other work, the test suite's second worker), and the spinner then burns the slice that member needs. At
// ~16k pauses (0.05-0.6 ms, by the CPU's pause latency) the yield never fires in a step whose members all run, and
// a yield with nothing else runnable returns at once. Measured on the 2-core VM (two test files of 2-thread kernel
// calls in two pytest-xdist workers, OMP_WAIT_POLICY=PASSIVE): 80-85 CPU-s, 53.0 / 53.6 s, against 88-93 CPU-s,
// 55.3 / 57.3 s at 1 << 20 pauses and no yield at a call's end.
#define LRK_YIELD_AFTER (1 << 14)
#endif

// one pause of a spinning waiter's i-th round; past LRK_YIELD_AFTER rounds it also yields, once every 1024
static inline void wait_pause(int64_t i) {
  LRK_PAUSE();
  if (i > LRK_YIELD_AFTER && (i & 1023) == 0) std::this_thread::yield();
}

#ifndef LRK_POOL_SPIN_US
// how long a worker spins for the next call before sleeping: the kernel calls of one decode step come microseconds
// apart, so the workers stay hot through a step, and sleep between steps (and while other code needs the cores)
#define LRK_POOL_SPIN_US 50
#endif

namespace lrk {
namespace pool {

static std::atomic<int64_t> g_threads{0};               // > 0: override of at::get_num_threads()
static std::atomic<int64_t> g_min_bytes{LRK_POOL_MIN_BYTES};
static std::atomic<int64_t> g_spin_us{-1};              // -1: not read yet ($LOWRANK_LIB_SPIN_US or the default)
static std::atomic<int64_t> g_mode{0};                  // 0: our workers, 1: an OpenMP parallel region
// counters: parallel calls, chunks run by a thread other than the caller, calls run on the caller alone
static std::atomic<int64_t> g_stats[3];

static int64_t spin_us() {
  int64_t v = g_spin_us.load(std::memory_order_relaxed);
  if (v < 0) {
    const char* e = std::getenv("LOWRANK_LIB_SPIN_US");
    v = e ? std::max<int64_t>(0, std::atoll(e)) : LRK_POOL_SPIN_US;
    g_spin_us.store(v);
  }
  return v;
}

// ---- teams (lrk_pool.h): the members' shared state, and each member's view of it
struct Team {
  int64_t size = 1;
  alignas(64) std::atomic<int64_t> arrived{0};          // members at the current barrier
  alignas(64) std::atomic<int64_t> epoch{0};            // barriers passed
  alignas(64) std::atomic<int64_t> next[2];             // a construct's chunk counter, by the parity of its epoch
  alignas(64) std::atomic<bool> failed{false};
  std::mutex m;
  std::exception_ptr error;                             // the first exception of a member
};
struct TeamAbort {};                                    // thrown in a member's barrier once another member failed
static thread_local Team* t_team = nullptr;
static thread_local int64_t t_rank = 0, t_epoch = 0;

static void team_fail(Team* T) {
  std::lock_guard<std::mutex> lk(T->m);
  if (!T->failed.load()) T->error = std::current_exception(), T->failed.store(true);
}

int64_t rank() { return t_team ? t_rank : 0; }
bool in_team() { return t_team != nullptr; }

// Sense by epoch: the last member to arrive resets the counter of the next epoch's construct (the slot the epoch
// before this one used, which nobody reads any more: every member has arrived here), then opens the next epoch.
void barrier() {
  Team* T = t_team;
  if (!T) return;
  const int64_t e = t_epoch;
  if (T->arrived.fetch_add(1) == T->size - 1) {
    T->arrived.store(0);
    T->next[(e + 1) & 1].store(0);
    T->epoch.store(e + 1);
  } else {
    for (int64_t i = 1; T->epoch.load(std::memory_order_acquire) == e; i++) {
      wait_pause(i);                                   // a member descheduled (more threads than cores): let it run
      if ((i & 1023) == 0 && T->failed.load()) throw TeamAbort{};
    }
  }
  t_epoch = e + 1;
}

int64_t chunks_per_thread() { return t_team ? 1 : CHUNKS_PER_THREAD; }

int64_t team_min_bytes() {
  // a split costs a team one barrier, which it pays after every call anyway: any call worth a second stream is split.
  // Measured (SmolLM2 keep 0.5 at 2 threads, paired steps): 8 / 16 / 32 / 64 KB within 1-2 % of each other with bf16,
  // int8 and int4 factors (5.71-5.75, 4.31-4.37, 3.67-3.70 ms); below set_pool's min_bytes (tests force splits with 1)
  static const int64_t v = [] {
    const char* e = std::getenv("LOWRANK_LIB_TEAM_MIN_BYTES");
    return e ? std::max<int64_t>(1, std::atoll(e)) : (int64_t)(16 << 10);
  }();
  return std::min(min_bytes(), v);
}

int64_t threads() {
  if (t_team) return t_team->size;
  if (at::in_parallel_region()) return 1;
  const int64_t n = g_threads.load(std::memory_order_relaxed);
  return std::max<int64_t>(1, n > 0 ? n : (int64_t)at::get_num_threads());
}

int64_t min_bytes() { return std::max<int64_t>(1, g_min_bytes.load(std::memory_order_relaxed)); }

int64_t threads_for(int64_t bytes) {
  const int64_t nt = threads();
  if (nt <= 1) return 1;
  const int64_t mb = t_team ? team_min_bytes() : min_bytes();
  return std::max<int64_t>(1, std::min<int64_t>(nt, bytes / mb));
}

std::vector<int64_t> cuts(const std::vector<double>& w, int64_t parts) {
  const int64_t n = (int64_t)w.size();
  parts = std::max<int64_t>(1, std::min(parts, n));
  double total = 0;
  for (double x : w) total += x;
  std::vector<int64_t> cut{0};
  double acc = 0;
  for (int64_t i = 0; i < n && (int64_t)cut.size() < parts; i++) {
    acc += w[i];
    if (acc * parts >= total * (double)cut.size() && i + 1 < n) cut.push_back(i + 1);
  }
  cut.push_back(n);
  return cut;
}

struct Pool {
  std::atomic<uint64_t> state{0};                       // (generation << 1) | open
  ChunkFn fn = nullptr;                                 // the job: written while closed, by the owner
  void* ctx = nullptr;
  int64_t nchunks = 0, nworkers = 0;
  alignas(64) std::atomic<int64_t> next{0};             // the next unclaimed chunk
  alignas(64) std::atomic<int64_t> inside{0};           // workers inside the current job
  alignas(64) std::atomic<int64_t> sleepers{0};
  std::atomic<bool> owner{false};                       // a call is using the workers
  std::atomic<bool> failed{false};
  std::exception_ptr error;                             // the first exception of a worker's chunk
  std::mutex m;
  std::condition_variable cv;
  int64_t spawned = 0;                                  // workers started (by the owner only)
};

static std::atomic<Pool*> g_pool{nullptr};

static void drop_after_fork() { g_pool.store(nullptr); }

static Pool* get_pool() {
  Pool* p = g_pool.load();
  if (p) return p;
#if defined(__unix__)
  static const int registered = pthread_atfork(nullptr, nullptr, drop_after_fork);
  (void)registered;
#endif
  Pool* fresh = new Pool();
  if (g_pool.compare_exchange_strong(p, fresh)) return fresh;
  delete fresh;                                         // another thread built it first (no worker started yet)
  return p;
}

static void run_chunks(Pool* P, bool worker) {
  for (int64_t c; (c = P->next.fetch_add(1)) < P->nchunks;) {
    if (worker) g_stats[1].fetch_add(1, std::memory_order_relaxed);
    P->fn(P->ctx, c);
  }
}

static void worker_loop(Pool* P, int64_t index) {
  uint64_t seen = 0;                                    // the last generation served
  for (;;) {
    uint64_t s = P->state.load();
    auto fresh = [&](uint64_t v) { return (v & 1) && (v >> 1) != seen; };
    if (!fresh(s)) {
      const auto t0 = std::chrono::steady_clock::now();
      const auto spin = std::chrono::microseconds(spin_us());
      for (int i = 1; !fresh(s = P->state.load(std::memory_order_acquire)); i++) {
        LRK_PAUSE();
        if ((i & 255) == 0 && std::chrono::steady_clock::now() - t0 > spin) break;
      }
      if (!fresh(s)) {
        std::unique_lock<std::mutex> lk(P->m);
        P->sleepers.fetch_add(1);
        while (!fresh(s = P->state.load())) P->cv.wait(lk);
        P->sleepers.fetch_sub(1);
      }
    }
    seen = s >> 1;
    P->inside.fetch_add(1);
    if (P->state.load() == s && index < P->nworkers) {
      try {
        run_chunks(P, true);
      } catch (...) {
        if (!P->failed.exchange(true)) P->error = std::current_exception();
        P->next.store(P->nchunks);
      }
    }
    P->inside.fetch_sub(1);
  }
}

static void run_own(Pool* P, int64_t nchunks, int64_t nworkers, ChunkFn fn, void* ctx) {
  while (P->spawned < nworkers && P->spawned < 255) {
    std::thread(worker_loop, P, P->spawned).detach();
    P->spawned++;
  }
  P->fn = fn, P->ctx = ctx, P->nchunks = nchunks, P->nworkers = std::min(nworkers, P->spawned);
  P->failed.store(false);
  P->error = nullptr;
  P->next.store(0);
  const uint64_t gen = (P->state.load() >> 1) + 1;
  P->state.store((gen << 1) | 1);
  if (P->sleepers.load() > 0) {
    { std::lock_guard<std::mutex> lk(P->m); }
    P->cv.notify_all();
  }
  std::exception_ptr mine;
  try {
    run_chunks(P, false);
  } catch (...) {
    mine = std::current_exception();
    P->next.store(nchunks);
  }
  P->state.store(gen << 1);
  for (int64_t i = 1; P->inside.load() != 0; i++) wait_pause(i);   // a worker descheduled inside: let it run
  std::exception_ptr theirs = P->failed.load() ? P->error : nullptr;
  P->owner.store(false);
  if (mine) std::rethrow_exception(mine);
  if (theirs) std::rethrow_exception(theirs);
}

// run() inside a team: members of rank < nthreads claim the chunks from the counter of this epoch, then all meet
static void run_team(Team* T, int64_t nchunks, int64_t nthreads, ChunkFn fn, void* ctx) {
  if (t_rank < std::min(nthreads, T->size)) {
    std::atomic<int64_t>& next = T->next[t_epoch & 1];
    try {
      for (int64_t c; (c = next.fetch_add(1)) < nchunks;) {
        if (t_rank != 0) g_stats[1].fetch_add(1, std::memory_order_relaxed);
        fn(ctx, c);
      }
    } catch (...) {
      team_fail(T);
      next.store(nchunks);
    }
  }
  if (t_rank == 0) g_stats[nthreads > 1 ? 0 : 2].fetch_add(1, std::memory_order_relaxed);
  barrier();
}

void run(int64_t nchunks, int64_t nthreads, ChunkFn fn, void* ctx) {
  if (t_team) return run_team(t_team, nchunks, std::max<int64_t>(1, std::min(nthreads, nchunks)),
                                                  fn, ctx);
  nthreads = std::min(nthreads, nchunks);
  if (nthreads <= 1) {
    g_stats[2].fetch_add(1, std::memory_order_relaxed);
    for (int64_t c = 0; c < nchunks; c++) fn(ctx, c);
    return;
  }
#if defined(_OPENMP)
  if (g_mode.load(std::memory_order_relaxed) == 1) {
    g_stats[0].fetch_add(1, std::memory_order_relaxed);
    std::atomic<int64_t> next{0};
    std::exception_ptr error;
    std::atomic<bool> failed{false};
#pragma omp parallel num_threads((int)nthreads)
    {
      const bool other = omp_get_thread_num() != 0;
      try {
        for (int64_t c; (c = next.fetch_add(1)) < nchunks;) {
          if (other) g_stats[1].fetch_add(1, std::memory_order_relaxed);
          fn(ctx, c);
        }
      } catch (...) {
        if (!failed.exchange(true)) error = std::current_exception();
        next.store(nchunks);
      }
    }
    if (error) std::rethrow_exception(error);
    return;
  }
#endif
  Pool* P = get_pool();
  if (P->owner.exchange(true)) {                        // another call holds the workers: run alone
    g_stats[2].fetch_add(1, std::memory_order_relaxed);
    for (int64_t c = 0; c < nchunks; c++) fn(ctx, c);
    return;
  }
  g_stats[0].fetch_add(1, std::memory_order_relaxed);
  run_own(P, nchunks, nthreads - 1, fn, ctx);
}

// one member of a team: its view set for the call (and restored after: a member may be a thread that runs other work
// later)
static void member(Team* T, int64_t r, TeamFn fn, void* ctx) {
  Team* prev = t_team;
  const int64_t prev_rank = t_rank, prev_epoch = t_epoch;
  t_team = T->size > 1 ? T : nullptr, t_rank = r, t_epoch = 0;  // a team of one: the calls split as outside one
  try {
    fn(ctx, r, T->size);
  } catch (const TeamAbort&) {
  } catch (...) {
    team_fail(T);
  }
  t_team = prev, t_rank = prev_rank, t_epoch = prev_epoch;
}

struct TeamJob {
  Team* T;
  TeamFn fn;
  void* ctx;
};

void team(int64_t nthreads, TeamFn fn, void* ctx) {
  Team T;
  T.next[0].store(0), T.next[1].store(0);
  nthreads = t_team ? 1 : std::max<int64_t>(1, std::min<int64_t>(nthreads, 256));  // nested: a team of one
  bool own = false;
  Pool* P = nullptr;
  if (nthreads > 1) {
#if defined(_OPENMP)
    if (g_mode.load(std::memory_order_relaxed) == 1) {
#pragma omp parallel num_threads((int)nthreads)
      {
#pragma omp single
        T.size = omp_get_num_threads();                 // what OpenMP gave (its implicit barrier publishes it)
        member(&T, omp_get_thread_num(), fn, ctx);
      }
      if (T.failed.load()) std::rethrow_exception(T.error);
      return;
    }
#endif
    P = get_pool();
    own = !P->owner.exchange(true);                     // else another call holds the workers: a team of one
  }
  if (!own) {
    T.size = 1;
    member(&T, 0, fn, ctx);
  } else {
    // our workers: one chunk per member, each claimed by a different thread (a member returns only once every
    // member has reached its last barrier, so no thread can claim two)
    T.size = nthreads;
    TeamJob job{&T, fn, ctx};
    run_own(P, nthreads, nthreads - 1, [](void* c, int64_t r) {
      const TeamJob* j = (const TeamJob*)c;
      member(j->T, r, j->fn, j->ctx);
    }, &job);
  }
  if (T.failed.load()) std::rethrow_exception(T.error);
}

// ---- ops: set_pool(threads, min_bytes, spin_us, mode) (negative: unchanged) -> the previous four; pool_info()
std::vector<int64_t> set_pool(int64_t threads, int64_t min_bytes, int64_t spin, int64_t mode) {
  std::vector<int64_t> prev{g_threads.load(), g_min_bytes.load(), spin_us(), g_mode.load()};
  if (threads >= 0) g_threads.store(threads);
  if (min_bytes >= 0) g_min_bytes.store(min_bytes);
  if (spin >= 0) g_spin_us.store(spin);
  if (mode >= 0) g_mode.store(mode == 1 ? 1 : 0);
  return prev;
}

// [threads now, workers started, parallel calls, chunks run off the caller, calls run on the caller alone]
std::vector<int64_t> pool_info() {
  Pool* p = g_pool.load();
  return {threads(), p ? p->spawned : 0, g_stats[0].load(), g_stats[1].load(), g_stats[2].load()};
}

}  // namespace pool
}  // namespace lrk
