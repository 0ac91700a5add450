// Expert parallelism: the route arithmetic (pure), the autograd all-to-all against a local golden
// (every rank's rows are a known function of (source, destination, row), so each rank can build what
// it must receive and which gradient each of its rows must get back), and the example's MoE layer
// with its experts spread over 2 EP ranks against the same layer with all experts in one process.
//
// Tolerance: the all-to-all moves bits, so it must be exact. The MoE layer on EP ranks computes each
// token's output from the same rows in the same order as one process, but its matmuls see fewer rows,
// which may change how BLAS blocks them: outputs and gradients asserted within 1e-6 (measured max
// |diff| 1.2e-7, printed).
#include "tp/expert_parallel.h"

#include "examples/02_dp_x_tp_gpt/moe.h"
#include "mesh/all_to_all.h"
#include "mesh/switches.h"
#include "tests/support/error_of.h"
#include "tests/support/rank_threads.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <mutex>

using namespace meshddp;
using namespace meshddp::test;
using ::testing::HasSubstr;

namespace {

constexpr int64_t kWidth = 3;

int64_t rows_between(int64_t src, int64_t dst) { return (src + 2 * dst) % 3; }  // some are 0

// The rows rank `src` sends to rank `dst`: [rows_between, kWidth], each a distinct value.
torch::Tensor rows_from(int64_t src, int64_t dst) {
  const int64_t n = rows_between(src, dst);
  return (torch::arange(n * kWidth, torch::kFloat).view({n, kWidth}) + 100 * src + 1000 * dst);
}

// The weights rank `dst` applies to what it received (so the gradient of each received row is known).
torch::Tensor weights_on(int64_t dst, int64_t rows) {
  return torch::arange(rows * kWidth, torch::kFloat).view({rows, kWidth}) * 0.5 + 7 * dst;
}

}  // namespace

TEST(ExpertTokenExchange, RouteCountsSplitsAndOrdersReceivedRowsExpertMajor) {
  // 4 experts over 2 EP ranks; this rank holds experts 0 and 1. It sends 1 row to expert 0, 2 to
  // expert 2 and 3 to expert 3; it receives 1 + 2 rows (experts 0, 1) from rank 0, 2 + 1 from rank 1.
  const tp::ExpertRoute route = tp::route_to_experts({1, 0, 2, 3}, {1, 2, 2, 1}, 2);
  EXPECT_EQ(route.input_splits, (std::vector<int64_t>{1, 5}));
  EXPECT_EQ(route.output_splits, (std::vector<int64_t>{3, 3}));
  EXPECT_EQ(route.rows_per_local_expert, (std::vector<int64_t>{3, 3}));
  // Received: row 0 (rank 0, expert 0), rows 1-2 (rank 0, expert 1), rows 3-4 (rank 1, expert 0), row 5.
  EXPECT_EQ(route.expert_major, (std::vector<int64_t>{0, 3, 4, 1, 2, 5}));
}

TEST(ExpertTokenExchange, RouteRefusesExpertsThatDoNotDivideOverEp) {
  EXPECT_THAT(error_of([] { tp::route_to_experts({1, 2, 3}, {1, 2, 3}, 2); }),
              HasSubstr("3 experts do not divide over an EP group of 2 ranks"));
  EXPECT_THAT(error_of([] { tp::route_to_experts({1, 2, 3, 4}, {1, 2, 3}, 2); }),
              HasSubstr("received counts have 3 entries, expected EP size 2 x experts per rank 2"));
}

TEST(ExpertTokenExchange, AllToAllMatchesLocalGoldenForwardAndBackwardOnFourRanks) {
  constexpr int64_t kRanks = 4;
  run_on_mesh({kRanks}, {"ep"}, [](DeviceMesh& mesh) {
    const int64_t me = mesh.rank();
    std::vector<torch::Tensor> sent, expected;
    std::vector<int64_t> input_splits, output_splits;
    for (int64_t r = 0; r < kRanks; ++r) {
      sent.push_back(rows_from(me, r));
      input_splits.push_back(rows_between(me, r));
      expected.push_back(rows_from(r, me));
      output_splits.push_back(rows_between(r, me));
    }
    const auto x = torch::cat(sent).requires_grad_();
    const auto out = tp::all_to_all(x, output_splits, input_splits, mesh["ep"].get());
    EXPECT_TRUE(torch::equal(out, torch::cat(expected))) << "rank " << me;
    (out * weights_on(me, out.size(0))).sum().backward();
    // Row i of what this rank sent to rank r sits on r after the rows of ranks < me.
    std::vector<torch::Tensor> grads;
    for (int64_t r = 0; r < kRanks; ++r) {
      int64_t before = 0, total = 0;
      for (int64_t s = 0; s < kRanks; ++s) {
        before += s < me ? rows_between(s, r) : 0;
        total += rows_between(s, r);
      }
      grads.push_back(weights_on(r, total).narrow(0, before, rows_between(me, r)));
    }
    EXPECT_TRUE(torch::equal(x.grad(), torch::cat(grads))) << "rank " << me;
  });
}

TEST(ExpertTokenExchange, AllToAllNamesSplitsThatDoNotFitTheTensor) {
  run_on_mesh({2}, {"ep"}, [](DeviceMesh& mesh) {
    const auto x = torch::zeros({3, kWidth});
    EXPECT_THAT(error_of([&] { tp::all_to_all(x, {1, 1}, {1, 1}, mesh["ep"].get()); }),
                HasSubstr("all-to-all of expert-parallel tokens on group"));
    EXPECT_THAT(error_of([&] { tp::all_to_all(x, {1, 1}, {1, 1}, mesh["ep"].get()); }),
                HasSubstr("input splits [1, 1] sum to 2 rows, but the input tensor has sizes [3, 3]"));
    EXPECT_THAT(error_of([&] { tp::all_to_all(x, {3}, {3}, mesh["ep"].get()); }),
                HasSubstr("splits have 1 entries, expected one per group rank (2)"));
  });
}

namespace {

constexpr int64_t kDim = 8, kHidden = 16, kExperts = 4, kTopK = 2, kTokens = 12;

gpt::Moe build_moe() {
  static std::mutex mutex;  // the default generator is process-global; ranks are threads
  std::lock_guard<std::mutex> lock(mutex);
  torch::manual_seed(3);
  return gpt::Moe(kDim, kHidden, kExperts, kTopK);
}

torch::Tensor tokens_of(int64_t rank) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(50 + rank);
  return torch::randn({kTokens, kDim}, gen);
}

torch::Tensor output_weights_of(int64_t rank) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(90 + rank);
  return torch::randn({kTokens, kDim}, gen);
}

}  // namespace

TEST(ExpertTokenExchange, MoeOnTwoEpRanksMatchesAllExpertsInOneProcess) {
  // The golden: both ranks' tokens through one layer holding all 4 experts.
  gpt::Moe golden = build_moe();
  const auto out = golden->forward(torch::cat({tokens_of(0), tokens_of(1)}));
  (out * torch::cat({output_weights_of(0), output_weights_of(1)})).sum().backward();
  std::map<std::string, torch::Tensor> golden_grads;
  for (const auto& p : golden->named_parameters()) golden_grads[p.key()] = p.value().grad();

  std::mutex mutex;
  double worst = 0;
  run_on_mesh({2}, {"ep"}, [&](DeviceMesh& mesh) {
    const int64_t me = mesh.rank();
    gpt::Moe moe = build_moe();
    moe->set_expert_parallel(mesh["ep"].get());
    const auto mine = moe->forward(tokens_of(me));
    (mine * output_weights_of(me)).sum().backward();
    auto router = moe->router->weight.grad().clone();
    all_reduce_sum_now(*mesh["ep"], router, "the test's router gradient");
    std::lock_guard<std::mutex> lock(mutex);  // after the collective: ranks are threads
    const auto expected = out.detach().narrow(0, me * kTokens, kTokens);
    worst = std::max(worst, (mine - expected).abs().max().item<double>());
    EXPECT_TRUE(torch::allclose(mine, expected, 0, 1e-6)) << "rank " << me;
    // Experts 2 me and 2 me + 1 live here, under their global names; each got the gradient of every
    // token routed to it from both ranks. The router is local to each rank's tokens: its gradient is
    // this rank's share (DDP sums the shares).
    std::vector<std::string> names;
    for (const auto& p : moe->named_parameters()) {
      names.push_back(p.key());
      if (p.key() == "router.weight") continue;
      const auto g = golden_grads.at(p.key());
      worst = std::max(worst, (p.value().grad() - g).abs().max().item<double>());
      EXPECT_TRUE(torch::allclose(p.value().grad(), g, 0, 1e-6)) << "rank " << me << " " << p.key();
    }
    const std::string e0 = "experts." + std::to_string(2 * me), e1 = "experts." + std::to_string(2 * me + 1);
    EXPECT_EQ(names, (std::vector<std::string>{"router.weight", e0 + ".fc1.weight", e0 + ".fc1.bias",
                                               e0 + ".fc2.weight", e0 + ".fc2.bias", e1 + ".fc1.weight",
                                               e1 + ".fc1.bias", e1 + ".fc2.weight", e1 + ".fc2.bias"}));
    worst = std::max(worst, (router - golden_grads.at("router.weight")).abs().max().item<double>());
    EXPECT_TRUE(torch::allclose(router, golden_grads.at("router.weight"), 0, 1e-6)) << "rank " << me;
  });
  std::cout << "[ MoE on 2 EP ranks vs one process: max |diff| " << worst << " ]" << std::endl;
}

// Splits that fit each rank's tensors but disagree across ranks: rank 0 sends 2 rows to rank 1, which
// expects 1. Without a check Gloo aborts rank 1's process from its own thread (std::terminate,
// "Received data size doesn't match expected size"); MESHDDP_DEBUG_SYNC=1 names both ranks' splits
// on every rank, before the exchange.
TEST(ExpertTokenExchange, AllToAllWithSplitsThatDisagreeAcrossRanksIsNamedOnEveryRankUnderDebugSync) {
  override_switch_for_testing(Switch::kDebugSync, true);
  run_on_mesh({2}, {"ep"}, [](DeviceMesh& mesh) {
    const auto x = torch::ones({3, kWidth});
    const std::vector<int64_t> out = mesh.rank() == 0 ? std::vector<int64_t>{1, 1} : std::vector<int64_t>{1, 2};
    EXPECT_THAT(error_of([&] { tp::all_to_all(x, out, {1, 2}, mesh["ep"].get()); }),
                HasSubstr("group rank 0 sends 2 rows to group rank 1 (its input splits [1, 2]), but rank 1 expects 1 "
                          "from it (its output splits [1, 2])"))
        << "rank " << mesh.rank();
  });
  override_switch_for_testing(Switch::kDebugSync, std::nullopt);
}
