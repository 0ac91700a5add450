"""torch.compile(fullgraph=True) of a function that calls meshddp's wrapper cannot hold the wrapper's
forward (it runs eagerly: docs/guide/compile.md, Limits): Dynamo's error names why and what to compile
instead, not only "remove the torch.compiler.disable call". One process."""

import pytest
import torch

import meshddp


def test_fullgraph_through_the_wrapper_names_the_reason(mesh):
    ddp = meshddp.DistributedDataParallel(torch.nn.Linear(4, 2), mesh)

    @torch.compile(backend="eager", fullgraph=True)
    def loss(x):
        return ddp(x).sum()

    with pytest.raises(Exception, match=r"meshddp.DistributedDataParallel.forward runs eagerly.*torch.compile\(ddp\)"):
        loss(torch.ones(3, 4))
