// The schedules' order (pure) and the loop that runs one step of it. Transfers are c10d's isend and
// irecv (ProcessGroup::send / recv return a Work without waiting): a forward posts the receive of its
// input and waits for it just before it runs, and sends its output without waiting; a backward
// receives its output's gradient the same way and sends its input's gradient on. Sends complete in
// the background (Gloo and NCCL both progress them once the peer posts the matching receive) and are
// waited for at the end of the step, so a rank only ever blocks on a receive whose sender reaches it
// in its own order. A blocking send would deadlock 1F1B: in the steady state stage s sends its
// activation to s + 1 while s + 1 sends its gradient to s, both before receiving.
#include "examples/02_dp_x_tp_gpt/pipeline_schedule.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <sstream>

namespace gpt {

std::vector<Action> schedule_actions(int64_t pp, int64_t vpp, int64_t rank, int64_t microbatches) {
  TORCH_CHECK(pp >= 1 && vpp >= 1 && microbatches >= 1 && rank >= 0 && rank < pp, "schedule_actions: pp ", pp, ", vpp ",
              vpp, ", rank ", rank, ", microbatches ", microbatches, " out of range");
  std::vector<Action> out;
  if (vpp == 1) {  // 1F1B
    const int64_t warmup = std::min(pp - rank - 1, microbatches);
    int64_t f = 0, b = 0;
    for (; f < warmup; ++f) out.push_back({Pass::kForward, 0, f});
    for (; f < microbatches; ++f, ++b) {
      out.push_back({Pass::kForward, 0, f});
      out.push_back({Pass::kBackward, 0, b});
    }
    for (; b < microbatches; ++b) out.push_back({Pass::kBackward, 0, b});
    return out;
  }
  TORCH_CHECK(microbatches % pp == 0, "schedule_actions: the interleaved schedule (vpp ", vpp,
              ") needs microbatches divisible by pp; got microbatches ", microbatches, ", pp ", pp);
  // Megatron's forward_backward_pipelining_with_interleaving: virtual micro-batch k runs micro-batch
  // (k / (pp vpp)) pp + k % pp on chunk (k % (pp vpp)) / pp; backwards take the chunks in reverse.
  const int64_t total = microbatches * vpp;
  const auto chunk_of = [&](int64_t k, bool forward) {
    const int64_t c = (k % (pp * vpp)) / pp;
    return forward ? c : vpp - 1 - c;
  };
  const auto microbatch_of = [&](int64_t k) { return (k / (pp * vpp)) * pp + k % pp; };
  const int64_t warmup = std::min(2 * (pp - rank - 1) + (vpp - 1) * pp, total);
  for (int64_t k = 0; k < warmup; ++k) out.push_back({Pass::kForward, chunk_of(k, true), microbatch_of(k)});
  for (int64_t k = 0; k < total - warmup; ++k) {
    const int64_t f = k + warmup;
    out.push_back({Pass::kForward, chunk_of(f, true), microbatch_of(f)});
    out.push_back({Pass::kBackward, chunk_of(k, false), microbatch_of(k)});
  }
  for (int64_t k = total - warmup; k < total; ++k)
    out.push_back({Pass::kBackward, chunk_of(k, false), microbatch_of(k)});
  return out;
}

std::string describe_actions(const std::vector<Action>& actions) {
  std::ostringstream out;
  for (size_t i = 0; i < actions.size(); ++i) {
    const Action& a = actions[i];
    out << (i ? " " : "") << (a.pass == Pass::kForward ? 'F' : 'B') << a.chunk << '.' << a.microbatch;
  }
  return out.str();
}

PipelineSchedule::PipelineSchedule(c10::intrusive_ptr<c10d::ProcessGroup> pp_group, int64_t vpp, int64_t microbatches,
                                   std::vector<int64_t> hidden_shape, at::ScalarType dtype)
    : pp_group_(std::move(pp_group)),
      pp_(pp_group_->getSize()),
      rank_(pp_group_->getRank()),
      vpp_(vpp),
      microbatches_(microbatches),
      hidden_shape_(std::move(hidden_shape)),
      dtype_(dtype),
      actions_(schedule_actions(pp_, vpp, rank_, microbatches)) {}

int PipelineSchedule::tag(int64_t m, int64_t c, Pass pass) const {
  return static_cast<int>((m * pp_ * vpp_ + c) * 2 + (pass == Pass::kBackward ? 1 : 0));
}

namespace {
std::string describe(const Action& a, const char* what, int64_t peer, int tag) {
  std::ostringstream out;
  out << (a.pass == Pass::kForward ? "forward" : "backward") << " of chunk " << a.chunk << ", micro-batch "
      << a.microbatch << ": " << what << " pipeline rank " << peer << " (tag " << tag << ")";
  return out.str();
}
}  // namespace

void PipelineSchedule::send(const at::Tensor& t, int64_t to, int tag, const Action& a) {
  const std::string what = describe(a, "sending to", to, tag);
  // The receiver's buffer has dtype_: a tensor of another dtype would arrive as garbage bytes.
  TORCH_CHECK(t.scalar_type() == dtype_, "pipeline: ", what, ": the tensor is ", t.scalar_type(),
              ", but the pipeline's send and receive buffers are ", dtype_,
              " (the params' dtype; hand on activations and their gradients in it)");
  std::vector<at::Tensor> tensors{t.detach().contiguous()};
  try {
    sends_.emplace_back(pp_group_->send(tensors, static_cast<int>(to), tag), what);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "pipeline: ", what, " failed: ", e.what());
  }
}

at::Tensor PipelineSchedule::recv(int64_t from, int tag, const Action& a) {
  std::vector<at::Tensor> tensors{at::empty(hidden_shape_, dtype_)};
  try {
    pp_group_->recv(tensors, static_cast<int>(from), tag)->wait();
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "pipeline: ", describe(a, "receiving from", from, tag), " failed: ", e.what());
  }
  return tensors[0];
}

void PipelineSchedule::wait_sends() {
  for (auto& [work, what] : sends_) {
    try {
      work->wait();
    } catch (const std::exception& e) {
      TORCH_CHECK(false, "pipeline: ", what, " failed: ", e.what());
    }
  }
  sends_.clear();
}

void PipelineSchedule::run(const StageWork& work) {
  const int64_t chunks = pp_ * vpp_;
  const int64_t next = (rank_ + 1) % pp_, previous = (rank_ + pp_ - 1) % pp_;
  std::vector<int64_t> backwards_done(vpp_, 0);
  live_.clear();
  for (const Action& a : actions_) {
    const int64_t c = model_chunk(a.chunk), m = a.microbatch;
    if (a.pass == Pass::kForward) {
      at::Tensor input;
      if (c > 0) input = recv(previous, tag(m, c - 1, Pass::kForward), a).requires_grad_(true);
      at::Tensor output = work.forward(a.chunk, m, input);
      if (c < chunks - 1) send(output, next, tag(m, c, Pass::kForward), a);
      live_[{a.chunk, m}] = {input, output};
      continue;
    }
    const auto it = live_.find({a.chunk, m});
    TORCH_INTERNAL_ASSERT(it != live_.end(), "pipeline: backward of chunk ", a.chunk, ", micro-batch ", m,
                          " before its forward");
    auto [input, output] = std::move(it->second);
    live_.erase(it);
    const bool last = ++backwards_done[a.chunk] == microbatches_;
    if (last) work.before_last_backward(a.chunk);
    if (c == chunks - 1) {
      output.backward();  // the loss
    } else {
      at::Tensor grad = recv(next, tag(m, c, Pass::kBackward), a);
      torch::autograd::backward({output}, {grad});
    }
    if (c > 0) send(input.grad(), previous, tag(m, c - 1, Pass::kBackward), a);
    if (last) work.after_last_backward(a.chunk);
  }
  wait_sends();
}

}  // namespace gpt
