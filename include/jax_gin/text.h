// Error-message text without iostreams. On the GPU machine the toolchain links libstdc++
// statically into our Python modules, and formatting a number through std::ostream there
// crashed inside libstdc++'s locale code (a segfault instead of jax_gin's timeout error,
// 2026-11-30). std::to_string and snprintf use no std::locale, so messages are built here.
// Host code only.
#pragma once

#include <cstdio>
#include <string>
#include <type_traits>

namespace jax_gin {

class Text {
 public:
  Text& operator<<(const char* s) { s_ += s; return *this; }
  Text& operator<<(const std::string& s) { s_ += s; return *this; }
  Text& operator<<(char c) { s_ += c; return *this; }
  Text& operator<<(bool b) { s_ += b ? "1" : "0"; return *this; }
  template <class T, std::enable_if_t<std::is_integral_v<T>, int> = 0>
  Text& operator<<(T v) { s_ += std::to_string(v); return *this; }
  template <class T, std::enable_if_t<std::is_enum_v<T>, int> = 0>
  Text& operator<<(T v) { return *this << std::underlying_type_t<T>(v); }
  Text& operator<<(double v) {
    char b[32];
    std::snprintf(b, sizeof b, "%g", v);
    s_ += b;
    return *this;
  }
  Text& hex(unsigned long long v) {
    char b[24];
    std::snprintf(b, sizeof b, "%llx", v);
    s_ += b;
    return *this;
  }
  const std::string& str() const { return s_; }

 private:
  std::string s_;
};

}  // namespace jax_gin
