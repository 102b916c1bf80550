// lowrank_lib's weight arena: see lrk_arena.h for the contract. Plain C++ (no torch header): lrk.cpp and qgemv.cpp
// wrap its memory in tensors (at::from_blob with release() as the deleter).
#include "lrk_arena.h"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>

#if defined(__linux__)
#include <sys/mman.h>
#define LRK_ARENA_MMAP 1
#else
#define LRK_ARENA_MMAP 0
#endif

namespace lrk {
namespace arena {

constexpr size_t HUGE = size_t(2) << 20;   // a transparent huge page
constexpr size_t CHUNK = size_t(32) << 20; // the shared mapping small requests are carved from
constexpr size_t LARGE = size_t(8) << 20;  // requests this big get their own mapping
constexpr size_t ALIGN = 64;

struct Map {
  char* base;        // what mmap returned
  size_t len;        // what was mapped
  char* start;       // the first usable byte (2 MB aligned for a chunk)
  size_t cap, used;  // usable bytes, bytes carved (chunks)
  int64_t live;      // allocations not yet released
};

static std::mutex g_m;
static Map* g_current = nullptr;
static int64_t g_live = 0, g_maps = 0, g_mapped = 0, g_handed = 0, g_advised = -1;
static std::atomic<int> g_on{-1};          // -1: not read yet

static bool enabled() {
  int v = g_on.load();
  if (v < 0) {
    const char* e = std::getenv("LOWRANK_LIB_HUGEPAGES");
    v = (e && std::strcmp(e, "0") == 0) ? 0 : 1;
    g_on.store(v);
  }
  return v == 1;
}

bool set_enabled(bool on) {
  const bool was = enabled();
  g_on.store(on ? 1 : 0);
  return was;
}

#if LRK_ARENA_MMAP
// a fresh mapping of at least `len` usable bytes starting at an `align`-aligned address, advised huge before any
// page of it is touched
static Map* map_new(size_t len, size_t align) {
  const size_t total = len + align;
  void* p = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return nullptr;
  char* base = (char*)p;
  char* start = (char*)(((uintptr_t)base + align - 1) & ~(uintptr_t)(align - 1));
#if defined(MADV_HUGEPAGE)
  const int rc = madvise(base, total, MADV_HUGEPAGE);
  if (g_advised != 0) g_advised = rc == 0 ? 1 : 0;
#endif
  Map* m = new Map{base, total, start, len, 0, 0};
  g_maps += 1;
  g_mapped += (int64_t)total;
  return m;
}

static void map_free(Map* m) {
  munmap(m->base, m->len);
  g_maps -= 1;
  g_mapped -= (int64_t)m->len;
  delete m;
}
#endif

void* alloc(size_t n, void** handle) {
#if LRK_ARENA_MMAP
  if (!enabled() || n == 0) return nullptr;
  std::lock_guard<std::mutex> lk(g_m);
  const size_t need = (n + ALIGN - 1) & ~(ALIGN - 1);
  Map* m = nullptr;
  char* p = nullptr;
  if (need >= LARGE) {                       // its own mapping, page-rounded
    m = map_new((need + 4095) & ~size_t(4095), HUGE);
    if (!m) return nullptr;
    p = m->start;
    m->used = need;
  } else {
    if (!g_current || g_current->cap - g_current->used < need) {
      Map* fresh = map_new(CHUNK, HUGE);
      if (!fresh) return nullptr;
      g_current = fresh;                     // the old one goes when its last allocation does
    }
    m = g_current;
    p = m->start + m->used;
    m->used += need;
  }
  m->live += 1;
  g_live += 1;
  g_handed += (int64_t)need;
  *handle = new std::pair<Map*, size_t>(m, need);
  return p;
#else
  (void)n;
  (void)handle;
  return nullptr;
#endif
}

void release(void* handle) {
#if LRK_ARENA_MMAP
  auto* h = static_cast<std::pair<Map*, size_t>*>(handle);
  std::lock_guard<std::mutex> lk(g_m);
  Map* m = h->first;
  g_live -= 1;
  g_handed -= (int64_t)h->second;
  delete h;
  if (--m->live > 0) return;
  if (m == g_current) g_current = nullptr;   // an empty mapping goes back at once, the current chunk too
  map_free(m);
#else
  (void)handle;
#endif
}

std::vector<int64_t> info() {
  std::lock_guard<std::mutex> lk(g_m);
  return {enabled() ? 1 : 0, g_live, g_maps, g_mapped, g_handed, g_advised};
}

}  // namespace arena
}  // namespace lrk
