// Test support: runs N data-parallel ranks as threads of one process, each with its own process
// groups over one shared in-memory store (the pattern of c10d's own C++ tests).
#pragma once

#include "mesh/device_mesh.h"

#include <functional>
#include <string>
#include <vector>

namespace meshddp::test {

// Collective timeout in tests: long enough for a loaded 2-core CI machine, short enough that a
// broken test fails instead of hanging CI.
constexpr std::chrono::seconds kTestTimeout{60};

// Runs fn(rank) on `world_size` threads and joins them. If any rank throws, rethrows the lowest
// failing rank's exception (prefixed with its rank) after every thread has finished.
void run_ranks(int world_size, const std::function<void(int rank)>& fn);

// Runs fn(mesh) on every rank of a fresh mesh of `sizes` named `names` (CPU, Gloo).
void run_on_mesh(std::vector<int64_t> sizes, std::vector<std::string> names,
                 const std::function<void(DeviceMesh& mesh)>& fn);

}  // namespace meshddp::test
