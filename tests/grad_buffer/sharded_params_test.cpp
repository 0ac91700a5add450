// GradBuffer under the "optim_grads_params" sharding strategy (ZeRO-3; Note [Sharded parameters] in
// grad_buffer/sharded_params.h), on real Gloo groups (ranks as threads): a rank holds its param shards
// plus the units in use (never the whole params between units, nor after a step), backward re-gathers
// the units it reads and gives the "optim" strategy's gradients bit for bit, written shards reach the
// next forward; the FSDP units (a pure function of the names), the refusals and whole-param shards.
#include "grad_buffer/fsdp_units.h"
#include "grad_buffer/grad_buffer.h"
#include "tests/support/error_of.h"
#include "tests/support/rank_threads.h"

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

using namespace meshddp;
using meshddp::test::error_of;
using ::testing::HasSubstr;

namespace {

constexpr int64_t kLayers = 4, kDim = 32;

// Layer k's weight: the same on every rank, different per layer and element, small (tanh stays linear-ish).
std::vector<NamedParam> make_layers() {
  std::vector<NamedParam> params;
  for (int64_t k = 0; k < kLayers; ++k) {
    at::Tensor w = (at::arange(kDim * kDim, at::kFloat).reshape({kDim, kDim}).sin() * 0.1 + 0.01 * k).contiguous();
    params.push_back({"layer" + std::to_string(k) + ".weight", w.requires_grad_(true)});
  }
  return params;
}

GradBufferConfig strategy(const char* name) {
  GradBufferConfig config;
  config.data_parallel_sharding_strategy = name;
  config.bucket_bytes = kDim * kDim * 4;  // one layer a bucket: the same layout under every strategy
  return config;
}

// y = tanh(... tanh(x W0) ... W3); calls `after_layer(k)` after layer k's forward.
at::Tensor forward(const std::vector<NamedParam>& params, int rank, const std::function<void(int64_t)>& after_layer) {
  at::Tensor y = at::full({2, kDim}, 0.5 + 0.25 * rank);
  for (int64_t k = 0; k < kLayers; ++k) {
    y = at::tanh(at::mm(y, params[k].param));
    after_layer(k);
  }
  return y.sum();
}

struct StepRecord {
  std::vector<at::Tensor> grad_shards;
  int64_t forward_peak = 0;  // the most param storage held at the end of a layer's forward
  int64_t step_peak = 0;     // over forward and backward (ShardedParams' own peak)
  int64_t after_step = 0;    // after start_param_sync(): what the optimizer leaves resident
};

// One forward + backward + sync under `name`, then the step's param sync; what the rank held.
StepRecord one_step(DeviceMesh& mesh, const char* name) {
  auto params = make_layers();
  GradBuffer buffer(params, mesh["dp"], strategy(name));
  ShardedParams* sharded = buffer.param_buffer()->sharded();
  StepRecord record;
  {
    ShardedParams::UseScope scope(sharded);
    const at::Tensor loss = forward(params, mesh.rank(), [&](int64_t) {
      if (sharded) record.forward_peak = std::max(record.forward_peak, sharded->resident_bytes());
    });
    torch::autograd::backward({loss});
  }
  buffer.finish_grad_sync();
  for (int64_t b = 0; b < static_cast<int64_t>(buffer.layout().buckets.size()); ++b) {
    record.grad_shards.push_back(buffer.bucket_shard(b).clone());
  }
  buffer.param_buffer()->start_param_sync(/*async=*/false);
  if (sharded) {
    record.step_peak = sharded->peak_resident_bytes();
    record.after_step = sharded->resident_bytes();
  }
  return record;
}

}  // namespace

// Four units of one 32 x 32 fp32 bucket each (4 KiB; whole params 16 KiB), dp 2: shards of 8 KiB. While
// a layer runs, the rank holds its unit and the next one's prefetch: 8 + 2 x 4 KiB, never the 8 + 16 KiB
// of whole params kept resident; after the step only the shards.
TEST(ShardedParams, HoldsItsShardsAndAtMostTwoUnitsAtATime) {
  test::run_on_mesh({2}, {"dp"}, [](DeviceMesh& mesh) {
    const int64_t unit = kDim * kDim * 4, shards = kLayers * unit / 2;
    const StepRecord r = one_step(mesh, kShardOptimGradsParams);
    EXPECT_EQ(r.after_step, shards) << "after the step no whole param stays resident";
    EXPECT_GE(r.forward_peak, shards + unit) << "a layer's forward holds its unit";
    EXPECT_LE(r.forward_peak, shards + 2 * unit) << "its unit and the next one's prefetch, no more";
    EXPECT_LE(r.step_peak, shards + 2 * unit) << "backward too: a unit is released once its grads are in";
  });
}

// The backward's ops read the saved params of released units: they are gathered again, so the
// gradients equal "optim"'s (whole params resident) bit for bit, bucket by bucket.
TEST(ShardedParams, BackwardRegathersReleasedUnitsAndGradientsEqualTheOptimStrategys) {
  test::run_on_mesh({2}, {"dp"}, [](DeviceMesh& mesh) {
    const StepRecord want = one_step(mesh, kShardOptim);
    const StepRecord got = one_step(mesh, kShardOptimGradsParams);
    ASSERT_EQ(got.grad_shards.size(), want.grad_shards.size());
    for (size_t b = 0; b < want.grad_shards.size(); ++b) {
      EXPECT_TRUE(at::equal(got.grad_shards[b], want.grad_shards[b])) << "bucket " << b;
    }
  });
}

// What the optimizer writes into the shards is what the next forward's ops read.
TEST(ShardedParams, WrittenShardsReachTheNextForward) {
  test::run_on_mesh({2}, {"dp"}, [](DeviceMesh& mesh) {
    auto params = make_layers();
    std::vector<at::Tensor> expected;
    for (const NamedParam& p : params) expected.push_back(p.param.detach().clone() + 1);
    GradBuffer buffer(params, mesh["dp"], strategy(kShardOptimGradsParams));
    ShardedParams* sharded = buffer.param_buffer()->sharded();
    ASSERT_NE(sharded, nullptr);
    for (int64_t b = 0; b < static_cast<int64_t>(buffer.layout().buckets.size()); ++b) {
      sharded->bucket_shard(b).add_(1);  // padding too: it is never read
    }
    buffer.param_buffer()->start_param_sync(/*async=*/false);
    ShardedParams::UseScope scope(sharded);
    for (int64_t k = 0; k < kLayers; ++k) {
      EXPECT_TRUE(at::equal(params[k].param.detach().clone(), expected[k])) << params[k].name;
    }
  });
}

// Between steps every unit is released. Rank 0 reading layer 0 while rank 1 reads layer 2 (logging)
// would launch all-gathers the other rank pairs with its own: shards of two layers mixed, silently.
// Refused, naming the param and its unit; after gather_all() on every rank the read is the values.
TEST(ShardedParams, AReadOfAReleasedUnitBetweenStepsIsRefusedNamingTheParamAndItsUnit) {
  test::run_on_mesh({2}, {"dp"}, [](DeviceMesh& mesh) {
    auto params = make_layers();
    std::vector<at::Tensor> initial;
    for (const NamedParam& p : params) initial.push_back(p.param.detach().clone());
    GradBuffer buffer(params, mesh["dp"], strategy(kShardOptimGradsParams));
    ShardedParams* sharded = buffer.param_buffer()->sharded();
    {
      ShardedParams::UseScope scope(sharded);  // the mode is on in this thread from here on
      torch::autograd::backward({forward(params, mesh.rank(), [](int64_t) {})});
    }
    buffer.finish_grad_sync();
    buffer.param_buffer()->start_param_sync(/*async=*/false);
    const int64_t k = 2 * mesh.rank();
    EXPECT_EQ(error_of([&] { (void)params[k].param.detach(); }), "(no error)") << "a view reads no values";
    EXPECT_THAT(error_of([&] { (void)params[k].param.sum(); }),
                HasSubstr("aten::sum reads parameter 'layer" + std::to_string(k) + ".weight' (FSDP unit 'layer" +
                          std::to_string(k) + "') outside a forward through DistributedDataParallel"));
    sharded->gather_all();
    EXPECT_TRUE(at::equal(params[k].param.detach().clone(), initial[k])) << "after gather_all() on every rank";
  });
}

// A gathered unit is a copy of the shards: a param written in place inside forward (or between steps)
// would lose the write at the release, and backward would use the old values. Refused, naming it.
TEST(ShardedParams, AnInPlaceWriteToAParamIsRefusedNamingIt) {
  test::run_on_mesh({2}, {"dp"}, [](DeviceMesh& mesh) {
    auto params = make_layers();
    GradBuffer buffer(params, mesh["dp"], strategy(kShardOptimGradsParams));
    ShardedParams::UseScope scope(buffer.param_buffer()->sharded());
    const std::string msg = error_of([&] {
      forward(params, mesh.rank(), [&](int64_t k) {
        if (k != 1) return;
        c10::NoGradGuard no_grad;
        params[1].param.mul_(2);  // e.g. a weight clamp inside forward
      });
    });
    EXPECT_THAT(msg, HasSubstr("aten::mul_ writes parameter 'layer1.weight' (FSDP unit 'layer1') in place"));
    EXPECT_THAT(msg, HasSubstr("Change params through the DistributedOptimizer or a checkpoint load"));
  });
}

// What a user may do around the steps, with the "optim" strategy's gradients bit for bit: an eval
// forward under NoGradGuard, a forward with no backward, two forwards before one backward, and a
// weight read again by a later unit (layer 0's, tied: gathered again in forward and in backward).
TEST(ShardedParams, EvalForwardsTwoForwardsBeforeABackwardAndATiedWeightGiveTheOptimStrategysGradients) {
  test::run_on_mesh({2}, {"dp"}, [](DeviceMesh& mesh) {
    auto run = [&](const char* name) {
      auto params = make_layers();
      GradBuffer buffer(params, mesh["dp"], strategy(name));
      ShardedParams* sharded = buffer.param_buffer()->sharded();
      auto tied_forward = [&] {
        ShardedParams::UseScope scope(sharded);
        return at::tanh(at::mm(at::tanh(at::mm(at::full({2, kDim}, 0.5), params[0].param)), params[1].param)).sum() +
               forward(params, mesh.rank(), [](int64_t) {}) * at::mm(params[0].param, params[0].param).mean();
      };
      {
        c10::NoGradGuard no_grad;
        (void)tied_forward();  // eval
      }
      (void)tied_forward();  // a forward without backward
      const at::Tensor first = tied_forward(), second = tied_forward();
      torch::autograd::backward({first + 2 * second});
      buffer.finish_grad_sync();
      std::vector<at::Tensor> shards;
      for (int64_t b = 0; b < static_cast<int64_t>(buffer.layout().buckets.size()); ++b) {
        shards.push_back(buffer.bucket_shard(b).clone());
      }
      return shards;
    };
    const std::vector<at::Tensor> want = run(kShardOptim), got = run(kShardOptimGradsParams);
    ASSERT_EQ(got.size(), want.size());
    for (size_t b = 0; b < want.size(); ++b) EXPECT_TRUE(at::equal(got[b], want[b])) << "bucket " << b;
  });
}

// torch::autograd::grad (a gradient penalty, a Hessian-vector product) reads the saved params of
// released units in backward too: the same gradients as under "optim", bit for bit.
TEST(ShardedParams, AutogradGradGivesTheOptimStrategysGradients) {
  test::run_on_mesh({2}, {"dp"}, [](DeviceMesh& mesh) {
    auto run = [&](const char* name) {
      auto params = make_layers();
      GradBuffer buffer(params, mesh["dp"], strategy(name));
      at::Tensor loss;
      {
        ShardedParams::UseScope scope(buffer.param_buffer()->sharded());
        loss = forward(params, mesh.rank(), [](int64_t) {});
      }
      std::vector<at::Tensor> inputs;
      for (const NamedParam& p : params) inputs.push_back(p.param);
      return torch::autograd::grad({loss}, inputs);
    };
    const auto want = run(kShardOptim), got = run(kShardOptimGradsParams);
    for (size_t k = 0; k < want.size(); ++k) EXPECT_TRUE(at::equal(got[k], want[k])) << "layer " << k;
  });
}

TEST(FsdpUnits, DefaultIsEachTopLevelModuleAndEachElementOfATopLevelList) {
  const FsdpUnits units = assign_fsdp_units(
      {"wte.weight", "blocks.0.attn.q.weight", "blocks.0.ln1.weight", "blocks.1.attn.q.weight", "ln_f.weight", "scale"},
      "");
  EXPECT_EQ(units.names, (std::vector<std::string>{"wte", "blocks.0", "blocks.1", "ln_f", kRootFsdpUnit}));
  EXPECT_EQ(units.unit_of, (std::vector<int64_t>{0, 1, 1, 2, 3, 4}));
}

TEST(FsdpUnits, PatternsPickTheShortestMatchingModulePathAndTheRestIsTheRoot) {
  const FsdpUnits units = assign_fsdp_units(
      {"wte.weight", "blocks.0.attn.q.weight", "blocks.0.mlp.fc.weight", "blocks.1.attn.q.weight", "ln_f.weight"},
      "blocks.*.attn, blocks.1");
  EXPECT_EQ(units.names, (std::vector<std::string>{kRootFsdpUnit, "blocks.0.attn", "blocks.1"}));
  EXPECT_EQ(units.unit_of, (std::vector<int64_t>{0, 1, 0, 2, 0}));
  EXPECT_THAT(error_of([] { assign_fsdp_units({"a.w"}, "blocks.*,,wte"); }),
              HasSubstr("fsdp_unit_modules = 'blocks.*,,wte' has an empty pattern"));
}

// A pattern that matches no module path is warned about, naming it (the units are made without it).
TEST(FsdpUnits, APatternMatchingNoModuleIsWarnedAboutByName) {
  struct Captured : c10::WarningHandler {
    std::vector<std::string> messages;
    void process(const c10::Warning& warning) override { messages.push_back(warning.msg()); }
  } captured;
  const c10::WarningUtils::WarningHandlerGuard guard(&captured);
  const FsdpUnits units = assign_fsdp_units({"wte.weight", "blocks.0.fc.weight", "blocks.1.fc.weight"}, "blocks.*,wtx");
  EXPECT_EQ(units.names, (std::vector<std::string>{kRootFsdpUnit, "blocks.0", "blocks.1"}));
  ASSERT_EQ(captured.messages.size(), 1u);
  EXPECT_THAT(captured.messages[0], HasSubstr("pattern 'wtx' matches no module path"));
  EXPECT_THAT(captured.messages[0], HasSubstr("e.g. 'wte'"));
  // Patterns that all match warn nothing, nor does the config's own check, which has no model to match against.
  captured.messages.clear();
  assign_fsdp_units({"wte.weight", "blocks.0.fc.weight"}, "blocks.*,wte");
  GradBufferConfig config = strategy(kShardOptimGradsParams);
  config.fsdp_unit_modules = "blocks.*,wte";
  config.validate();
  EXPECT_EQ(captured.messages, std::vector<std::string>{});
}

// shard_policy "whole_param" (Muon): every param lies whole inside one rank's shard of its bucket, and the
// rank that owns it keeps its values in its param shard (the shard the optimizer steps: no gather).
TEST(ShardedParams, WholeParamShardsKeepEveryParamWholeInItsOwnersShard) {
  test::run_on_mesh({2}, {"dp"}, [](DeviceMesh& mesh) {
    auto params = make_layers();
    std::vector<at::Tensor> initial;
    for (const NamedParam& p : params) initial.push_back(p.param.detach().clone());
    GradBufferConfig config = strategy(kShardOptimGradsParams);
    // Three layers a bucket (a byte range would cut the middle one in two), then one: each rank owns two.
    config.bucket_bytes = 3 * kDim * kDim * 4;
    config.fsdp_unit_modules = "model";  // matches no module (a warning): one (root) unit, buckets of several layers
    config.shard_policy = kWholeParamShards;
    GradBuffer buffer(params, mesh["dp"], config);
    ShardedParams* sharded = buffer.param_buffer()->sharded();
    ASSERT_NE(sharded, nullptr);
    const BucketLayout& layout = buffer.layout();
    int64_t owned = 0;
    for (size_t i = 0; i < params.size(); ++i) {
      const ParamSlot& slot = layout.slots[i];
      const BucketSpan& span = layout.buckets[slot.bucket];
      const int64_t shard = span.numel() / 2, begin = slot.offset - span.begin;
      const int64_t owner = begin / shard;
      EXPECT_EQ((begin + slot.numel - 1) / shard, owner) << params[i].name << " straddles two ranks' shards";
      if (owner != mesh.rank()) continue;
      ++owned;
      const at::Tensor in_shard = sharded->bucket_shard(slot.bucket).narrow(0, begin - owner * shard, slot.numel);
      EXPECT_TRUE(at::equal(in_shard.view(initial[i].sizes()), initial[i])) << params[i].name;
    }
    EXPECT_EQ(owned, kLayers / 2) << "rank " << mesh.rank() << " owns half the layers";
  });
}
