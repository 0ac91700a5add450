// NamedParam: a parameter and the names it is registered under (NamedTensor: any tensor and its
// module path), and the pure functions that turn a
// module's parameter list into GradBuffer's (one entry per tensor, trainable ones apart from frozen
// ones) and name a param in messages. Pure host logic: no communication.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

namespace meshddp {

struct NamedTensor {
  std::string name;
  at::Tensor tensor;
};

struct NamedParam {
  std::string name;                       // module path, e.g. "blocks.3.mlp.fc1.weight"
  at::Tensor param;                       // a leaf that requires grad
  std::vector<std::string> aliases = {};  // other names the same tensor is registered under (tied
                                          // weights); filled by GradBuffer, which keeps one entry per tensor
};

// One entry per tensor (a TensorImpl): a tensor registered under several names (tied weights, e.g.
// an LM head that is the token embedding) is one parameter, kept under its first name, with the
// later names as aliases. Order of first appearance is kept. Throws naming a param that is undefined,
// sparse (or any non-strided layout) or on the meta device: none can live in a flat buffer. Pure: no
// communication.
std::vector<NamedParam> deduplicate_params(std::vector<NamedParam> params);

// "'wte.weight'" or "'wte.weight' (also 'lm_head.weight')", for messages.
std::string describe_param_name(const NamedParam& p);

// Deduplicates `params` (deduplicate_params) and splits them into the trainable ones (returned, each
// checked to be a leaf) and the frozen ones (requires_grad = false: appended to `frozen`).
std::vector<NamedParam> split_trainable_params(std::vector<NamedParam> params, std::vector<NamedParam>& frozen);

}  // namespace meshddp
