// Gradients written in place, and the zeroing they make unnecessary: the registry of slots that
// layers write into (grad_buffer/grad_in_place.h) and the GradBuffer members that keep slots right
// without a zeroing pass.
//
// Note [Slots written in place]
// A step used to begin with a fill of every flat buffer (zero_grad_buffer()), after which each
// gradient was added into its slot: AccumulateGrad's in-place add, or the hook's add. That is two
// passes over the gradients that local training does not make (torch's AccumulateGrad steals the
// fresh gradient). Now each slot has a state per step:
//   zeroed   zero_grad_buffer() zeroed it (the param got no gradient in the last step; also padding).
//   stale    zero_grad_buffer() left it as it was, because a layer of meshddp's wrote its param's
//            gradient in place in the last step (write_grad_in_place) and most likely does so again in
//            this step, whose first write then overwrites it.
//   written  this step's first gradient is in; later ones (micro-batches, a second use) add to it.
// The first write of a step into a stale slot overwrites it, whichever way the gradient comes:
//   - in place: a layer's backward calls write_grad_in_place(); the GEMM writes with beta = 0
//     (accumulate = false) and returns a placeholder, which before_grad_accumulation() takes out
//     before AccumulateGrad, so .grad is not touched again;
//   - through autograd: before_grad_accumulation() (a pre-hook on AccumulateGrad) releases .grad,
//     so AccumulateGrad steals the gradient as in local training, and on_grad_accumulated() copies
//     it into the slot (one pass, not a fill plus an add) and points .grad back at the slot.
// Only slots written in place are kept stale. A slot filled through autograd is zeroed by
// zero_grad_buffer() as in Megatron: code outside meshddp may add into a param's .grad or main_grad
// before autograd's first gradient of the step (torch's pipelining weight pass does `.grad += dw`;
// Megatron-style layers accumulate into main_grad), and a stale slot would have lost that addition
// to the overwrite. Params of meshddp's in-place layers get their gradient from those layers alone;
// code that adds into their .grad / main_grad itself needs gradient_accumulation_fusion = false.
// A slot still stale when its bucket launches belongs to a param that got no gradient this step
// (unused, or find_unused_parameters marked it): launch_bucket() zeroes it before the collective,
// so it contributes zeros, as before. Nothing reads a slot between zero_grad_buffer() and that
// point except its own writes, so no step can see a stale value; param.grad() read by the user
// before the param's first gradient of a step shows the last step's value (documented on
// zero_grad_buffer()).
#include "grad_buffer/grad_in_place.h"

#include "grad_buffer/grad_buffer.h"

#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <mutex>
#include <unordered_map>
#include <utility>

namespace meshddp {
namespace {

struct SlotEntry {
  GradBuffer* buffer = nullptr;
  int64_t index = 0;
};

std::mutex registry_mutex;
std::unordered_map<const c10::TensorImpl*, SlotEntry>& registry() {
  static auto* map = new std::unordered_map<const c10::TensorImpl*, SlotEntry>();  // never destroyed: used at exit
  return *map;
}

// Whether the backward running now will execute `param`'s AccumulateGrad (add into .grad, where the
// buffer's hooks run). A graph task's exec_info is empty for loss.backward() (every node runs); for
// torch.autograd.grad(loss, [w]) or backward(inputs=...), only the nodes it marks needed run: w's
// gradient is then captured and returned to the caller, not accumulated. Outside a backward (no
// graph task), assume it will.
bool backward_accumulates_into(const at::Tensor& param) {
  const auto* exec_info = torch::autograd::get_current_graph_task_exec_info();
  if (exec_info == nullptr || exec_info->empty()) return true;
  const std::shared_ptr<torch::autograd::Node> accumulator = torch::autograd::impl::try_get_grad_accumulator(param);
  if (!accumulator) return false;
  const auto it = exec_info->find(accumulator.get());
  return it != exec_info->end() && it->second.needed_;
}

}  // namespace

void register_grad_slot(const at::Tensor& param, GradBuffer* buffer, int64_t index) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  registry().insert_or_assign(param.unsafeGetTensorImpl(), SlotEntry{buffer, index});
}

void unregister_grad_slot(const at::Tensor& param, const GradBuffer* buffer) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  auto it = registry().find(param.unsafeGetTensorImpl());
  if (it != registry().end() && it->second.buffer == buffer) registry().erase(it);
}

at::Tensor write_grad_in_place(const at::Tensor& param, GradSlotWriter write, SlotDtypes accepts) {
  if (c10::GradMode::is_enabled()) return {};  // create_graph: the gradient must carry its graph
  SlotEntry entry;
  {
    std::lock_guard<std::mutex> lock(registry_mutex);
    auto it = registry().find(param.unsafeGetTensorImpl());
    if (it == registry().end()) return {};
    entry = it->second;
  }
  // torch.autograd.grad (or a backward that does not reach this param's AccumulateGrad): the caller
  // gets the gradient as a tensor and the buffer is left alone, as for a gradient through autograd.
  if (!backward_accumulates_into(param)) return {};
  if (accepts == SlotDtypes::kParamDtype && entry.buffer->main_grad(entry.index).scalar_type() != param.scalar_type()) {
    return {};  // an fp32 main grad of a bf16/fp16 param, and a writer that computes in the param's dtype
  }
  // The buffer outlives every backward through its params (destroying a DistributedDataParallel
  // while a backward runs through its module is already undefined).
  return entry.buffer->write_grad_in_place(entry.index, write);
}

at::Tensor GradBuffer::write_grad_in_place(int64_t index, GradSlotWriter write) {
  Slot& slot = slots_[index];
  const at::Tensor& placeholder = slot.grad_placeholder;
  if (!placeholder.defined()) return {};
  bool accumulate = true;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    // After the sync, let the gradient take the usual path: the hook then names the mistake.
    if (state_ == StepState::kSynced) return {};
    accumulate = !slot.stale;
  }
  // Outside the lock: a GEMM. Only this param's backward writes this slot, and its bucket cannot
  // launch before its hook, which runs after this.
  write(slot.main_grad, accumulate);
  std::lock_guard<std::mutex> lock(mutex_);
  slot.stale = false;
  slot.got_grad = true;
  slot.written_in_place = true;
  return placeholder;
}

void GradBuffer::zero_slot_every_step(int64_t index) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(index >= 0 && index < static_cast<int64_t>(params_.size()), "GradBuffer::zero_slot_every_step: index ",
              index, " out of range (", params_.size(), " params)");
  Slot& slot = slots_[index];
  slot.zero_every_step = true;
  // No in-place writes either: they would mark the slot written where its real gradient is added.
  unregister_grad_slot(params_[index].param, this);
  slot.grad_placeholder = at::Tensor();
  if (slot.stale) {
    slot.main_grad.zero_();
    slot.stale = false;
  }
}

std::vector<at::Tensor> GradBuffer::before_grad_accumulation(int64_t index, std::vector<at::Tensor> grads) {
  // A dense param can get a sparse gradient (an embedding with sparse=True): refused where it
  // arrives, before AccumulateGrad would try to copy it into the dense slot.
  TORCH_CHECK(grads.empty() || !grads[0].defined() || grads[0].layout() == at::kStrided, "GradBuffer: parameter ",
              describe_param_name(params_[index]), " got a ", grads[0].layout(),
              " gradient, but meshddp reduces gradients in a dense flat buffer; use a dense gradient (e.g. ",
              "nn.Embedding(..., sparse=False), torch::nn::EmbeddingOptions().sparse(false)) or keep the module ",
              "out of DistributedDataParallel");
  const at::Tensor& placeholder = slots_[index].grad_placeholder;
  if (placeholder.defined() && !grads.empty() && grads[0].defined() && grads[0].is_same(placeholder)) {
    grads[0] = at::Tensor();  // the gradient is in the slot already; the post-hook still runs
    return grads;
  }
  bool stale = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stale = slots_[index].stale;
  }
  // Under create_graph (grad mode on) AccumulateGrad would replace .grad by `.grad + new` out of
  // place; on a stale slot it would add to stale data. Either way: release .grad (the slot keeps
  // its contents), AccumulateGrad stores the new gradient alone, on_grad_accumulated() moves it in.
  if (!grads.empty() && grads[0].defined() && (stale || c10::GradMode::is_enabled())) {
    params_[index].param.mutable_grad().reset();
  }
  return grads;
}

void GradBuffer::zero_stale_slots_of_bucket(int64_t b) {
  for (int64_t i : layout_.buckets[b].params) {
    Slot& slot = slots_[i];
    if (!slot.stale) continue;
    slot.main_grad.zero_();  // got no gradient this step: contributes zeros
    slot.stale = false;
  }
}

void GradBuffer::zero_slots_for_next_step() {
  if (shards_grads_) {  // no slot is written in place (Note [Sharded gradients]); only the shards persist
    for (at::Tensor& shards : shard_buffers_) shards.zero_();
    for (Slot& s : slots_) s.got_grad = s.written_in_place = false;
    return;
  }
  // Slots of params that got a gradient this step become stale; every other element (slots of params
  // that got none, padding) is zeroed, in as few contiguous fills as the layout allows.
  std::vector<std::vector<std::pair<int64_t, int64_t>>> kept(buffers_.size());  // [offset, end) per buffer
  for (size_t i = 0; i < params_.size(); ++i) {
    Slot& s = slots_[i];
    const bool keep = config_.gradient_accumulation_fusion && s.written_in_place && !s.zero_every_step;
    s.stale = keep;
    if (keep) {
      const ParamSlot& slot = layout_.slots[i];
      kept[slot.buffer].emplace_back(slot.offset, slot.offset + slot.numel);
    }
  }
  for (size_t buf = 0; buf < buffers_.size(); ++buf) {
    auto& ranges = kept[buf];
    std::sort(ranges.begin(), ranges.end());
    int64_t begin = 0;
    auto fill = [&](int64_t end) {
      if (end > begin) buffers_[buf].narrow(0, begin, end - begin).zero_();
    };
    for (const auto& [offset, end] : ranges) {
      fill(offset);
      begin = std::max(begin, end);
    }
    fill(buffers_[buf].numel());
  }
  for (Slot& s : slots_) s.got_grad = s.written_in_place = false;
}

}  // namespace meshddp
