// A tensor in the weight arena (lrk_arena.h): what pack and qpack return. Falls back to at::empty when the arena
// gives no memory (off, or no mmap). The contents are undefined: the caller writes every element.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>

#include "lrk_arena.h"

namespace lrk {

inline at::Tensor arena_empty(int64_t numel, const at::TensorOptions& opts) {
  const size_t n = (size_t)numel * at::elementSize(at::typeMetaToScalarType(opts.dtype()));
  void* handle = nullptr;
  void* p = arena::alloc(n, &handle);
  if (!p) return at::empty({numel}, opts);
  return at::from_blob(p, {numel}, [handle](void*) { arena::release(handle); }, opts);
}

}  // namespace lrk
