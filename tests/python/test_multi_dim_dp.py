"""meshddp.DistributedDataParallel over several DP dims of a torch DeviceMesh (dp_dim=("dp", "cp"),
context parallel), against one process on the same global batch; and meshddp's group arithmetic
(mesh/reduction_groups.h) from Python.

Tolerance 5e-7 on gradients and on params after 5 steps, as test_tensor_parallel.py (fp32 sums split
four ways in another order; the DP x CP mean is a pre-divided Gloo sum; measured <= 3e-8 on
gradients, <= 6e-8 on params). Averaging over DP only leaves differences of order 0.1.

What the cases check:
- dp_dim=("dp", "cp") on 4 ranks vs one process on the global batch (each rank its rows and sequence slice):
  dp 2 x cp 2 with torch SGD and with ZeRO-1 AdamW, and cp 2 x tp 2 (a dp 1 x cp 2 x tp 2 mesh, torch TP
  DTensor params): gradients and params after 5 steps within 5e-7 (measured <= 3e-8 / 6e-8; averaged over DP
  only they differ by 0.04-0.19); the engine's DP ranks are the flattened group's; dims out of mesh order,
  unknown, or not names are refused naming them; the group functions give the C++ results
"""

import pytest

import meshddp
import multiprocess

TOL = 5e-7


def suite():
    return multiprocess.run_once(4, "multi_dim_workers.multi_dim_suite")


@pytest.mark.parametrize("optimizer", ["sgd", "zero1"])
def test_dp2_x_cp2_gradients_and_params_match_one_process(optimizer):
    for rank, results in enumerate(suite()):
        r = results[("dp_x_cp", optimizer)]
        if r["grad_diff"] is not None:
            assert r["grad_diff"] <= TOL, f"rank {rank}: gradients differ from one process by {r['grad_diff']}"
        assert r["param_diff"] <= TOL, f"rank {rank}: params after 5 steps differ from one process by {r['param_diff']}"
        assert r["dp_ranks"] == [0, 1, 2, 3], (rank, r["dp_ranks"])  # every rank of the 2 x 2 mesh
        assert r["tp_dim"] is None, r["tp_dim"]


def test_cp2_x_tp2_with_torch_tp_matches_one_process():
    # A dp 1 x cp 2 x tp 2 mesh: DTensor params sharded over "tp", gradients averaged over the
    # flattened ("dp", "cp") group, which holds the 2 ranks at this rank's TP coordinate.
    for rank, results in enumerate(suite()):
        r = results["cp_x_tp"]
        assert r["grad_diff"] <= TOL, f"rank {rank}: gradients differ from one process by {r['grad_diff']}"
        assert r["param_diff"] <= TOL, f"rank {rank}: params after 5 steps differ from one process by {r['param_diff']}"
        assert r["tp_dim"] == "tp", r["tp_dim"]
        assert r["dp_ranks"] == [rank % 2, rank % 2 + 2], (rank, r["dp_ranks"])
        assert r["dtensor_params"] == ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"], r["dtensor_params"]


def test_dp_dims_out_of_mesh_order_or_unknown_are_errors_naming_them():
    for results in suite():
        text = results["wrong_order"]
        assert "meshddp.DistributedDataParallel: dp_dim ('cp', 'dp')" in text, text
        assert "not in mesh order ('dp', 'cp'); give them as 'dp', 'cp'" in text, text
        text = results["unknown_dim"]
        assert "the mesh has no dim named 'sp' (dp_dim); its dims are ('dp', 'cp')" in text, text
        text = results["not_names"]
        assert "dp_dim must be a mesh dim name or a tuple of them" in text and "('dp', 1)" in text, text


def test_flattened_groups_are_cxx_arithmetic():
    sizes, names = [2, 2, 2], ["dp", "cp", "tp"]
    assert meshddp.groups.flattened_groups(sizes, names, ["dp", "cp"]) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert meshddp.groups.flattened_groups(sizes, names, ["cp", "tp"]) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert meshddp.groups.flattened_group_ranks(5, sizes, names, ["dp", "cp"]) == [1, 3, 5, 7]
    with pytest.raises(RuntimeError, match="not in mesh order"):
        meshddp.groups.flattened_groups(sizes, names, ["cp", "dp"])


def test_expert_and_optimizer_instance_groups_are_cxx_arithmetic():
    # dp 4 x tp 2: EP 2 takes consecutive DP ranks, expert DP every 2nd (Megatron-core's layout).
    sizes, names = [4, 2], ["dp", "tp"]
    assert meshddp.groups.expert_parallel_groups(sizes, names, ["dp"], 2) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert meshddp.groups.expert_data_parallel_groups(sizes, names, ["dp"], 2) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    dense = meshddp.groups.flattened_groups(sizes, names, ["dp"])
    assert meshddp.groups.optimizer_instance_groups(dense, 2, "dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert meshddp.groups.cross_instance_groups(dense, 2, "dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    with pytest.raises(RuntimeError, match="EP size 3 does not divide the 4 ranks"):
        meshddp.groups.expert_parallel_groups(sizes, names, ["dp"], 3)
    with pytest.raises(RuntimeError, match="3 optimizer instances do not divide"):
        meshddp.groups.optimizer_instance_groups(dense, 3, "dp")
