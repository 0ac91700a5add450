// The example's pipeline schedules, written plainly: which (chunk, micro-batch) each pipeline rank
// runs forward or backward, in which order (1F1B for one chunk per rank, Megatron's interleaved order
// for several), and the loop that runs them, moving activations forward and their gradients back
// between ranks with c10d isend/irecv on the "pp" group. meshddp ships the gradient-sync controls; the
// schedule is the user's (docs/guide/pipelines.md): this file calls back into the training loop
// (pipeline_train.cpp) before and after each chunk's last backward micro-batch, which is where that
// chunk's DP gradient sync is allowed and started.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace gpt {

enum class Pass { kForward, kBackward };

struct Action {
  Pass pass;
  int64_t chunk;       // this rank's chunk (0..vpp-1): model chunk chunk * pp + pp_rank
  int64_t microbatch;  // 0..microbatches-1
  bool operator==(const Action& o) const { return pass == o.pass && chunk == o.chunk && microbatch == o.microbatch; }
};

// Pipeline rank `rank` of `pp`'s actions for one step, `vpp` chunks per rank, `microbatches` each.
// vpp 1: 1F1B (PipeDream-flush): pp - rank - 1 warm-up forwards, then one forward one backward, then
// the remaining backwards. vpp > 1: Megatron's interleaved schedule (micro-batches in groups of pp per
// chunk; 2 (pp - rank - 1) + (vpp - 1) pp warm-up forwards); needs microbatches % pp == 0.
// Pure: every rank can compute every rank's list (tests do).
std::vector<Action> schedule_actions(int64_t pp, int64_t vpp, int64_t rank, int64_t microbatches);

// "F2.0" (forward of chunk 2, micro-batch 0) / "B0.3" lists, for messages and the docs' picture.
std::string describe_actions(const std::vector<Action>& actions);

// What the schedule asks of the training loop.
struct StageWork {
  // Runs this rank's chunk `chunk` forward on micro-batch `microbatch`. `input` is the previous chunk's
  // output (undefined for the model's first chunk, which reads its own ids). Returns the chunk's
  // output (hidden states to send on), or, on the model's last chunk, the scalar loss to backpropagate.
  std::function<at::Tensor(int64_t chunk, int64_t microbatch, const at::Tensor& input)> forward;
  // Called just before chunk `chunk`'s last backward micro-batch of the step (its gradients become final
  // during it: the place to let its DP sync run) and just after it (to start what is not yet launched).
  std::function<void(int64_t chunk)> before_last_backward, after_last_backward;
};

class PipelineSchedule {
 public:
  // `pp_group`: this rank's pipeline group (ranks holding the other stages of the same data, with the
  // same DP / CP / TP coordinates). `hidden_shape`: the activation every chunk but the last sends on
  // ([micro-batch, this rank's sequence share, dim]); `dtype`: its dtype, and its gradient's (the
  // params' dtype: bf16 activations travel as bf16, as Megatron's p2p does). Every send and receive
  // buffer has that dtype; a chunk handing on another is an error naming both.
  PipelineSchedule(c10::intrusive_ptr<c10d::ProcessGroup> pp_group, int64_t vpp, int64_t microbatches,
                   std::vector<int64_t> hidden_shape, at::ScalarType dtype);

  // One step's forward and backward passes in schedule order. Every pending send has completed on
  // return. Throws naming the action, the peer and the tag when a transfer fails (a peer's timeout is
  // the group's: --timeout-s).
  void run(const StageWork& work);
  const std::vector<Action>& actions() const { return actions_; }
  // The dtype of every buffer sent and received (the step log prints it).
  at::ScalarType dtype() const { return dtype_; }

 private:
  int64_t model_chunk(int64_t chunk) const { return chunk * pp_ + rank_; }
  // Tag of the message carrying model chunk `c`'s output (forward) or its gradient (backward) for
  // micro-batch `m`: unique within a step, so no two messages can be confused whatever their order.
  int tag(int64_t m, int64_t c, Pass pass) const;
  void send(const at::Tensor& t, int64_t to, int tag, const Action& a);
  at::Tensor recv(int64_t from, int tag, const Action& a);
  void wait_sends();

  c10::intrusive_ptr<c10d::ProcessGroup> pp_group_;
  int64_t pp_, rank_, vpp_, microbatches_;
  std::vector<int64_t> hidden_shape_;
  at::ScalarType dtype_;
  std::vector<Action> actions_;
  std::vector<std::pair<c10::intrusive_ptr<c10d::Work>, std::string>> sends_;      // pending, with a description
  std::map<std::pair<int64_t, int64_t>, std::pair<at::Tensor, at::Tensor>> live_;  // (chunk, mb) -> (input, output)
};

}  // namespace gpt
