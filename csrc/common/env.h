// Environment knobs (UCCL_* names from the seed README), read in one place.
#pragma once

#include <cstdlib>
#include <string>

namespace uccl {

inline long env_long(const char* name, long dflt) {
  const char* v = std::getenv(name);
  if (!v || !*v) return dflt;
  char* end = nullptr;
  long x = std::strtol(v, &end, 0);
  return (end && *end == 0) ? x : dflt;
}

inline std::string env_str(const char* name, const std::string& dflt = "") {
  const char* v = std::getenv(name);
  return (v && *v) ? std::string(v) : dflt;
}

}  // namespace uccl
