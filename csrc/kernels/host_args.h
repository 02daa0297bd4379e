// Host-side helpers the launchers share: Python hands pointers and streams over as int64, and layouts
// round offsets up to an alignment.
#pragma once

#include <cstdint>

#include "common/portability.h"

namespace uccl_ep {

inline int64_t align_up(int64_t v, int64_t a) { return (v + a - 1) / a * a; }
inline gpuStream_t as_stream(int64_t s) { return reinterpret_cast<gpuStream_t>(s); }
template <typename T>
T* as_ptr(int64_t p) {
  return reinterpret_cast<T*>(p);
}

}  // namespace uccl_ep
