// lowrank_lib's weight arena (arena.cpp): the memory that packed matrices (pack, qpack) live in.
//
// Why: the decode GEMVs stream every weight once per token, and with 4 KB pages the stream misses the TLB every
// 4 KB and the CPU's hardware prefetchers stop at every page boundary. Memory mapped for the arena is advised as
// transparent huge pages (madvise MADV_HUGEPAGE, before it is first touched), so the weights stream through 2 MB
// pages where the kernel grants them (Linux THP in "always" or "madvise" mode; elsewhere nothing changes but the
// allocator). Measured on an AMD EPYC host (THP madvise): the packed bf16 GEMV of 5-27 MB matrices went from 17-22 to
// 22-27 GB/s on 1 thread and from 24 to 29-44 GB/s on 2 (bench: /tmp script, three allocation modes side by side).
//
// How: a request of at least LARGE bytes gets its own mapping (page-rounded: no 2 MB rounding waste; the 2 MB pages
// inside it are huge); smaller ones are carved, 64-byte aligned, from the current CHUNK-byte mapping (2 MB aligned),
// a new one when the request does not fit. Each mapping counts the live allocations in it and is unmapped when the
// last one is released: memory a released allocation held inside a chunk comes back when the whole chunk does. Thread-safe (one mutex).
// Off ($LOWRANK_LIB_HUGEPAGES=0, read once, or set_enabled(false)), or on a system without mmap: alloc returns nullptr
// and the caller uses its ordinary allocator.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace lrk {
namespace arena {

// n bytes, 64-byte aligned (contents undefined: the caller writes them), in arena memory; *handle receives what release() needs. nullptr when the
// arena is off or the mapping fails (the caller then allocates as usual).
void* alloc(size_t n, void** handle);
// gives back an allocation of alloc (handle = its *handle)
void release(void* handle);
// the arena's switch (default: on unless $LOWRANK_LIB_HUGEPAGES=0); returns the previous state
bool set_enabled(bool on);
// [on, live allocations, live mappings, bytes mapped, bytes handed out, huge-page advice taken (1) or refused (0)]
std::vector<int64_t> info();

}  // namespace arena
}  // namespace lrk
