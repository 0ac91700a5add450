#include "grad_buffer/comm_hook.h"

#include <c10/util/Exception.h>

namespace meshddp {
namespace {

Work launch_sum(const CommHookBucket& b, const at::Tensor& data, const at::Tensor& output, const std::string& what) {
  return b.reduce_scatter ? reduce_scatter_sum(*b.group, output, data, what) : all_reduce_sum(*b.group, data, what);
}

}  // namespace

CommHookWork SumCommHook::launch(const CommHookBucket& b) { return {launch_sum(b, b.data, b.output, b.what), {}}; }

CompressCommHook::CompressCommHook(c10::ScalarType dtype) : dtype_(dtype) {
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kHalf, "CompressCommHook: compresses to bf16 or fp16, got ",
              dtype);
}

std::string CompressCommHook::name() const { return dtype_ == at::kBFloat16 ? kBf16CompressHook : kFp16CompressHook; }

CommHookWork CompressCommHook::launch(const CommHookBucket& b) {
  if (b.data.scalar_type() == dtype_) return SumCommHook().launch(b);  // nothing to compress
  const at::Tensor low = b.data.to(dtype_);
  if (b.count_sent) b.count_sent(low);  // the cast may overflow (fp16: beyond 65504): count what is sent
  // `output` is `data` or a slice of it: the same slice of the compressed copy.
  const int64_t offset = b.output.storage_offset() - b.data.storage_offset();
  TORCH_INTERNAL_ASSERT(b.output.is_alias_of(b.data) && offset >= 0 && offset + b.output.numel() <= b.data.numel(),
                        "CompressCommHook: the output of ", b.what, " is not a slice of its bucket");
  const at::Tensor low_output = low.narrow(0, offset, b.output.numel());
  Work work = launch_sum(b, low, low_output, b.what + " (" + name() + ")");
  const at::Tensor output = b.output;
  // finish() holds `low` (through low_output) until GradBuffer has waited for the collective: Note
  // [Stream lifetimes of collective temporaries] (comm_hook.h).
  return {std::move(work), [output, low_output]() { output.copy_(low_output); }};
}

std::shared_ptr<CommHook> make_comm_hook(const std::string& name) {
  if (name == kNoCommHook) return std::make_shared<SumCommHook>();
  if (name == kBf16CompressHook) return std::make_shared<CompressCommHook>(at::kBFloat16);
  if (name == kFp16CompressHook) return std::make_shared<CompressCommHook>(at::kHalf);
  TORCH_CHECK(false, "GradBufferConfig: comm_hook = '", name, "' is not a built-in communication hook; use '",
              kNoCommHook, "', '", kBf16CompressHook, "' or '", kFp16CompressHook,
              "' (or register your own CommHook with GradBuffer::register_comm_hook)");
}

}  // namespace meshddp
