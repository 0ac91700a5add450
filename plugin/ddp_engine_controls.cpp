// DdpEngine's controls that forward to its GradBuffer, and the forward's param-wait scope: out of
// line, so that plugin/distributed_data_parallel.h (a public header) declares GradBuffer and
// ParamGather without including them.
#include "grad_buffer/comm_hook.h"
#include "grad_buffer/grad_buffer.h"
#include "grad_buffer/param_buffer.h"
#include "grad_buffer/param_gather.h"
#include "plugin/distributed_data_parallel.h"
#include "plugin/module_ownership.h"

#include <utility>

namespace meshddp {

DdpEngine::~DdpEngine() = default;
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

struct DdpEngine::ParamWaitScope::Open {
  Open(ParamGather* gather, ShardedParams* sharded) : scope(gather), use(sharded) {}
  ParamGather::ForwardScope scope;
  ShardedParams::UseScope use;
};

DdpEngine::ParamWaitScope::ParamWaitScope(ParamGather* gather, ShardedParams* sharded)
    : open_(gather || sharded ? std::make_unique<Open>(gather, sharded) : nullptr) {}

DdpEngine::ParamWaitScope::~ParamWaitScope() = default;

}  // namespace meshddp
