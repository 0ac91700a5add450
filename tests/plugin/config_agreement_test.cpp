// A config value invalid on one rank only (Note [Agree first, then validate], mesh/config_fields.h):
// every rank fails, at the same check, naming the field and each rank's value, instead of that rank
// failing alone and its peers meeting the hole at their next collective. DdpConfig over a mesh (with
// and without optimizer instances) and over a DP group, and DistributedOptimizerConfig.
#include "grad_buffer/grad_buffer.h"
#include "optimizer/distributed_optimizer.h"
#include "plugin/distributed_data_parallel.h"
#include "tests/support/error_of.h"
#include "tests/support/mlp.h"
#include "tests/support/rank_threads.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

using namespace meshddp;
using namespace meshddp::test;
using ::testing::HasSubstr;

TEST(ConfigAgreement, ACommHookInvalidOnOneRankFailsEveryRankNamingTheFieldAndEachRanksValue) {
  for (const int64_t instances : {1, 2}) {
    run_on_mesh({4, 1}, {"dp", "tp"}, [&](DeviceMesh& mesh) {
      Mlp model = make_mlp(1, 4, 8, 2);
      DdpConfig config;
      config.use_distributed_optimizer = true;
      config.num_distributed_optimizer_instances = instances;
      if (mesh.rank() == 1) config.comm_hook = "bogus";
      EXPECT_THAT(error_of([&] { DistributedDataParallel ddp(model.ptr(), mesh, "dp", config); }),
                  HasSubstr("DistributedDataParallel: the DdpConfig settings differ across the ranks of group "
                            "'meshddp/world/ranks=0,1,2,3' (rank " +
                            std::to_string(mesh.rank()) +
                            " of 4): 'comm_hook' is rank 0: none, rank 1: bogus, rank 2: none, rank 3: none"))
          << "with " << instances << " optimizer instance(s)";
    });
  }
  // Over a DP process group instead of a mesh.
  run_on_mesh({2}, {"dp"}, [](DeviceMesh& mesh) {
    Mlp model = make_mlp(1, 4, 8, 2);
    DdpConfig config;
    config.tp_replica_check_interval = mesh.rank() == 1 ? -5 : 100;  // >= 0
    EXPECT_THAT(error_of([&] { DistributedDataParallel ddp(model.ptr(), mesh["dp"], config); }),
                HasSubstr("'tp_replica_check_interval' is rank 0: 100, rank 1: -5"));
  });
}

TEST(ConfigAgreement, AValueInvalidOnEveryRankFailsEachRanksValidation) {
  run_on_mesh({2}, {"dp"}, [](DeviceMesh& mesh) {
    Mlp model = make_mlp(1, 4, 8, 2);
    DdpConfig config;
    config.comm_hook = "bogus";
    EXPECT_THAT(error_of([&] { DistributedDataParallel ddp(model.ptr(), mesh, "dp", config); }),
                HasSubstr("comm_hook"));
  });
}

TEST(ConfigAgreement, AnOptimizerValueInvalidOnOneRankFailsEveryRankNamingTheFieldAndEachRanksValue) {
  run_on_mesh({2}, {"dp"}, [](DeviceMesh& mesh) {
    Mlp model = make_mlp(1, 4, 8, 2);
    DdpConfig config;
    config.use_distributed_optimizer = true;
    DistributedDataParallel ddp(model.ptr(), mesh, "dp", config);
    DistributedOptimizerConfig oc;
    if (mesh.rank() == 1) oc.lr = -1;
    const std::string error = error_of([&] { DistributedOptimizer opt(ddp.grad_buffer(), oc); });
    EXPECT_THAT(error, HasSubstr("DistributedOptimizer: the DistributedOptimizerConfig settings differ across the "
                                 "ranks of "));
    EXPECT_THAT(error, HasSubstr("'lr' is rank 0: 0.001, rank 1: -1"));
  });
}
