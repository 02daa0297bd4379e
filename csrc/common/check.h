// Checked calls: every CUDA/HIP, verbs, libfabric and POSIX call goes through one of these, and a failure
// becomes a std::runtime_error naming the call, its location and the library's own error string.
#pragma once

#include <cerrno>
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <string>

#include "common/portability.h"

namespace uccl {

[[noreturn]] inline void throw_error(const char* file, int line, const std::string& what) {
  std::ostringstream os;
  os << "uccl_ep_train native: " << what << " (" << file << ":" << line << ")";
  throw std::runtime_error(os.str());
}

}  // namespace uccl

#define UCCL_THROW(msg_stream)                                   \
  do {                                                           \
    std::ostringstream uccl_os_;                                 \
    uccl_os_ << msg_stream;                                      \
    ::uccl::throw_error(__FILE__, __LINE__, uccl_os_.str());     \
  } while (0)

#define UCCL_CHECK(cond, msg_stream)                             \
  do {                                                           \
    if (!(cond)) UCCL_THROW("check failed: " #cond ": " << msg_stream); \
  } while (0)

// POSIX-style: returns -1 and sets errno.
#define UCCL_CHECK_ERRNO(expr)                                                    \
  do {                                                                            \
    if ((expr) < 0) UCCL_THROW(#expr " failed: " << std::strerror(errno));       \
  } while (0)

#if UCCL_EP_WITH_GPU
#define UCCL_CHECK_GPU(expr)                                                                \
  do {                                                                                      \
    gpuError_t uccl_e_ = (expr);                                                            \
    if (uccl_e_ != gpuSuccess)                                                              \
      UCCL_THROW(#expr " failed: " << gpuGetErrorString(uccl_e_) << " (" << (int)uccl_e_ << ")"); \
  } while (0)
#define UCCL_CHECK_CUDA(expr) UCCL_CHECK_GPU(expr)
#define UCCL_CHECK_HIP(expr) UCCL_CHECK_GPU(expr)
#endif

// libibverbs: most calls return 0 or an errno value (some return -1 with errno set).
#define UCCL_CHECK_VERBS(expr)                                                              \
  do {                                                                                      \
    int uccl_rc_ = (expr);                                                                  \
    if (uccl_rc_ != 0) {                                                                    \
      int uccl_err_ = uccl_rc_ < 0 ? errno : uccl_rc_;                                      \
      UCCL_THROW(#expr " failed: " << std::strerror(uccl_err_) << " (" << uccl_err_ << ")"); \
    }                                                                                       \
  } while (0)
#define UCCL_CHECK_VERBS_PTR(ptr, expr)                                                     \
  do {                                                                                      \
    (ptr) = (expr);                                                                         \
    if (!(ptr)) UCCL_THROW(#expr " returned NULL: " << std::strerror(errno));              \
  } while (0)

// libfabric: calls return 0 or a negative fi_errno; fi_strerror gives the text.
#define UCCL_CHECK_FI(expr)                                                                 \
  do {                                                                                      \
    long uccl_rc_ = (long)(expr);                                                           \
    if (uccl_rc_ < 0)                                                                       \
      UCCL_THROW(#expr " failed: " << fi_strerror((int)-uccl_rc_) << " (" << uccl_rc_ << ")"); \
  } while (0)
