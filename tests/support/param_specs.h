// ParamSpecs for layout tests: fp32 params named p0, p1, ... on the CPU.
#pragma once

#include "grad_buffer/bucket_layout.h"

#include <string>
#include <vector>

namespace meshddp::test {

inline std::vector<ParamSpec> fp32_param_specs(const std::vector<int64_t>& numels) {
  std::vector<ParamSpec> params;
  for (size_t i = 0; i < numels.size(); ++i) {
    params.push_back(ParamSpec{"p" + std::to_string(i), numels[i], c10::kFloat, c10::kFloat, c10::Device(c10::kCPU)});
  }
  return params;
}

}  // namespace meshddp::test
