// Scratch directories for tests that write files. POSIX, not std::filesystem: the torch wheel
// exports an older std::filesystem that crashes when it shadows libstdc++'s (docs/reference/building.md).
#pragma once

#include <cstdlib>
#include <string>
#include <unistd.h>

namespace meshddp::test {

inline void remove_dir(const std::string& dir) { std::system(("rm -rf '" + dir + "'").c_str()); }

// $TMPDIR (or /tmp)/meshddp-<name>-<pid>, removed if it exists (not created).
inline std::string fresh_dir(const std::string& name) {
  const char* tmp = std::getenv("TMPDIR");
  std::string dir = std::string(tmp ? tmp : "/tmp") + "/meshddp-" + name + "-" + std::to_string(::getpid());
  remove_dir(dir);
  return dir;
}

}  // namespace meshddp::test
