"""The names the Python package renamed keep working for one release, each with a FutureWarning that
names its replacement, and return the very object the new name does; the primary names warn nothing.

  meshddp.<rank arithmetic>            -> meshddp.groups.<same name>
  meshddp.pipeline (module)            -> meshddp.pipelining (embedding_groups: meshddp.groups)
  meshddp.pipelining.finish_grad_sync  -> meshddp.pipelining.finalize_model_grads
  DistributedDataParallel.set_is_last_microbatch -> set_requires_gradient_sync (or no_sync())
  meshddp.OptimizerConfig: an alias of meshddp.DistributedOptimizerConfig, kept without a warning."""

import importlib
import sys
import warnings

import pytest
import torch

import meshddp
import meshddp.pipelining

RANK_ARITHMETIC = ["cross_instance_groups", "embedding_groups", "expert_data_parallel_groups",
                   "expert_parallel_groups", "flattened_group_ranks", "flattened_groups", "optimizer_instance_groups"]


@pytest.mark.parametrize("name", RANK_ARITHMETIC)
def test_top_level_rank_arithmetic_warns_naming_meshddp_groups(name):
    with pytest.warns(FutureWarning, match=rf"meshddp\.{name} is deprecated.*use meshddp\.groups\.{name}"):
        old = getattr(meshddp, name)
    assert old is getattr(meshddp.groups, name)


def test_top_level_warnings_point_at_the_callers_line():
    # The warning names the line that used the old name (not meshddp/__init__.py), so that the
    # default filter shows it once per calling line and -W filters by module match the caller.
    with pytest.warns(FutureWarning) as caught:
        meshddp.flattened_groups
    assert caught[0].filename == __file__


def test_rank_arithmetic_answers_the_same_under_meshddp_groups():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new spelling warns nothing
        assert meshddp.groups.flattened_groups([2, 2], ["dp", "tp"], ["dp"]) == [[0, 2], [1, 3]]
        assert meshddp.groups.embedding_groups([2, 3], ["dp", "pp"]) == [[0, 2], [1], [3, 5], [4]]


def test_the_pipeline_module_warns_at_import_naming_meshddp_pipelining():
    sys.modules.pop("meshddp.pipeline", None)
    with pytest.warns(FutureWarning, match=r"meshddp\.pipeline is deprecated.*use meshddp\.pipelining"):
        old = importlib.import_module("meshddp.pipeline")
    assert old.finalize_model_grads is meshddp.pipelining.finalize_model_grads
    assert old.declare_tied_across_stages is meshddp.pipelining.declare_tied_across_stages
    assert old.embedding_groups is meshddp.groups.embedding_groups


def test_finish_grad_sync_of_stages_warns_naming_finalize_model_grads():
    with pytest.warns(FutureWarning, match=r"finish_grad_sync is deprecated.*use meshddp\.pipelining\.finalize_model_grads"):
        meshddp.pipelining.finish_grad_sync([])  # no stage: nothing to finish, as before
    with pytest.warns(FutureWarning, match=r"use meshddp\.pipelining\.finalize_model_grads"):
        with pytest.raises(RuntimeError, match="expected meshddp.pipelining.PipelineStage, got int"):
            meshddp.pipelining.finish_grad_sync([3])


def test_top_level_pipeline_functions_are_the_pipelining_ones_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert meshddp.finalize_model_grads is meshddp.pipelining.finalize_model_grads
        assert meshddp.declare_tied_across_stages is meshddp.pipelining.declare_tied_across_stages


def test_dir_lists_the_names_loaded_on_first_use_and_not_the_deprecated_ones():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        names = dir(meshddp)
    assert {"pipelining", "groups", "finalize_model_grads", "declare_tied_across_stages"} <= set(names)
    assert set(meshddp.__all__) <= set(names)
    assert not set(RANK_ARITHMETIC) & set(names)


def test_optimizer_config_is_an_alias_of_distributed_optimizer_config():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert meshddp.OptimizerConfig is meshddp.DistributedOptimizerConfig
        assert meshddp.DistributedOptimizerConfig(lr=0.5).lr == 0.5


def test_set_is_last_microbatch_warns_and_holds_the_sync_as_set_requires_gradient_sync(mesh):
    ddp = meshddp.DistributedDataParallel(torch.nn.Linear(3, 2), mesh, "dp")
    x = torch.ones(4, 3)
    ddp.zero_grad_buffer()
    with pytest.warns(FutureWarning, match=r"set_is_last_microbatch is deprecated.*use "
                                           r"DistributedDataParallel\.set_requires_gradient_sync"):
        ddp.set_is_last_microbatch(False)
    ddp(x).sum().backward()
    assert ddp._engine.unsynced_grads_accumulated()  # held: backward only accumulated
    ddp.set_requires_gradient_sync(True)
    ddp(x).sum().backward()
    ddp.finish_grad_sync()
    assert torch.equal(ddp.main_grad("bias"), torch.full((2,), 8.0))  # two backwards of 4 rows each
