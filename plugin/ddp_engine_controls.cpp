// DdpEngine's controls that forward to its GradBuffer, and the forward's param-wait scope: out of
// line, so that plugin/distributed_data_parallel.h (a public header) declares GradBuffer and
// ParamGather without including them.
#include "grad_buffer/comm_hook.h"
#include "grad_buffer/grad_buffer.h"
#include "grad_buffer/param_buffer.h"
#include "grad_buffer/param_gather.h"
#include "plugin/distributed_data_parallel.h"
#include "plugin/module_ownership.h"

#include <exception>
#include <utility>
#include <vector>

namespace meshddp {

// Note [A module outliving its ZeRO-3 wrapper]
//   Under "optim_grads_params" the module's params are views of the units' bucket storages, which hold
//   no bytes while released (Note [Sharded parameters]); once the wrapper (and its ShardedParams) is
//   gone, nothing could gather them, and a read would fail naming nothing (torch's "storage of size 0",
//   or a segfault on a raw read: seen in the test of this). So the destructor gathers every unit and points each param
//   at a plain copy of its whole value: the module is left as it was before wrapping, with the trained values. This is
//   a collective in a destructor. SPMD code destroys its wrapper at the same point on every rank (the end of a scope,
//   of training), which is what makes it safe; a wrapper destroyed on some ranks only would wait in its gather (a hang
//   reported by the group's timeout, then the params are left released). The one common case of that is an exception
//   unwinding one rank: there the destructor gathers nothing (std::uncaught_exceptions()), the params hold no bytes,
//   and the exception is what the user sees. The other ways out, refusing every later read with a clear message, would
//   need a registry that outlives the wrapper and the dispatch mode kept on for good; a copy taken at every step would
//   cost the whole params' memory that ZeRO-3 exists to save.
//   Not from Python: a Python wrapper is destroyed when its last reference goes or when the cyclic garbage
//   collector runs, at different points on different ranks (seen: a destructor's gather paired with
//   another rank's next collective, Gloo aborting on the size mismatch). PythonDdp turns the gather off;
//   its module's params are left without bytes, and wrapping them again is refused naming the param
//   (meshddp/ddp.py). Python code reads whole params through ddp.state_dict() before dropping the wrapper.
DdpEngine::~DdpEngine() {
  ShardedParams* sharded = buffer_ ? sharded_params() : nullptr;
  if (sharded == nullptr || !leave_params_whole_at_destruction_ || std::uncaught_exceptions() > 0) return;
  try {
    std::vector<at::Tensor> params;
    for (const NamedParam& p : unique_params_) params.push_back(p.param);
    sharded->leave_whole(params);
  } catch (const std::exception& e) {
    TORCH_WARN("DistributedDataParallel: gathering the params whole at the wrapper's destruction failed (", e.what(),
               "); the module's params are left released (no bytes): read a checkpoint instead");
  }
}
DdpEngine::DdpEngine(DdpEngine&&) noexcept = default;
DdpEngine& DdpEngine::operator=(DdpEngine&&) noexcept = default;

void DdpEngine::finish_grad_sync() { buffer_->finish_grad_sync(); }
void DdpEngine::start_grad_sync() { buffer_->start_grad_sync(); }
void DdpEngine::set_requires_gradient_sync(bool requires_sync) { buffer_->set_is_last_microbatch(requires_sync); }
bool DdpEngine::requires_gradient_sync() const { return buffer_->is_last_microbatch(); }
void DdpEngine::scale_gradients(double factor) { buffer_->scale_gradients(factor); }
bool DdpEngine::grad_sync_finished() const { return buffer_->grad_sync_finished(); }
void DdpEngine::set_is_last_microbatch(bool is_last) { buffer_->set_is_last_microbatch(is_last); }
void DdpEngine::register_comm_hook(std::shared_ptr<CommHook> hook) { buffer_->register_comm_hook(std::move(hook)); }

void DdpEngine::zero_grad_buffer() {
  buffer_->zero_grad_buffer();
  buffers_broadcast_due_ = true;
}

ParamGather* DdpEngine::param_gather() const {
  return buffer_->param_buffer() ? &buffer_->param_buffer()->gather() : nullptr;
}

void DdpEngine::after_forward(const at::Tensor& output) const {
  if (config_.find_unused_parameters) buffer_->mark_unreachable_params_ready({output});
}

void DdpEngine::after_forward(const std::vector<at::Tensor>& outputs) const {
  if (config_.find_unused_parameters) buffer_->mark_unreachable_params_ready(outputs);
}

DdpEngine::NoSyncGuard::NoSyncGuard(GradBuffer& buffer) : buffer_(buffer), previous_(buffer.is_last_microbatch()) {
  buffer_.set_is_last_microbatch(false);
}

DdpEngine::NoSyncGuard::~NoSyncGuard() { buffer_.set_is_last_microbatch(previous_); }

ShardedParams* DdpEngine::sharded_params() const {
  return buffer_->param_buffer() ? buffer_->param_buffer()->sharded() : nullptr;
}

DdpEngine::FullParamsScope::FullParamsScope(ShardedParams* sharded) : sharded_(sharded) {
  if (sharded_ == nullptr) return;
  alive_ = sharded_->lifetime();
  sharded_->hold_all();
}

DdpEngine::FullParamsScope::~FullParamsScope() {
  if (sharded_ == nullptr || alive_.expired()) return;  // the wrapper went first: nothing left to release
  try {
    sharded_->end_hold();
  } catch (const std::exception& e) {  // a failed wait for a gather: the scope's own error is the one to see
    TORCH_WARN("DistributedDataParallel::gather_full_params: releasing the units failed: ", e.what());
  }
}

DdpEngine::FullParamsScope DdpEngine::gather_full_params() {
  if (ParamGather* gather = param_gather()) gather->wait_all();  // "optim": the step's all-gather in flight
  return FullParamsScope(sharded_params());
}

struct DdpEngine::ParamWaitScope::Open {
  Open(ParamGather* gather, ShardedParams* sharded) : scope(gather), use(sharded) {}
  ParamGather::ForwardScope scope;
  ShardedParams::UseScope use;
};

DdpEngine::ParamWaitScope::ParamWaitScope(ParamGather* gather, ShardedParams* sharded)
    : open_(gather || sharded ? std::make_unique<Open>(gather, sharded) : nullptr) {}

DdpEngine::ParamWaitScope::~ParamWaitScope() = default;

}  // namespace meshddp
