#include "grad_buffer/grad_buffer_handle.h"

#include "grad_buffer/grad_buffer.h"

namespace meshddp {

void GradBufferHandle::finish_grad_sync() const { buffer_->finish_grad_sync(); }

ParamBuffer* GradBufferHandle::param_buffer() const { return buffer_->param_buffer(); }

}  // namespace meshddp
