"""Weights tied across stages and torchtitan's per-token loss through meshddp.pipelining.PipelineStage
(pipelining_tied_workers.py): a toy language model, the embedding on the first stage tied to the LM
head on the last, torch's Schedule1F1B over dp 2 x pp 2 (4 ranks, Gloo, CPU), 3 SGD steps, against the
tied model in one process on the global batch; the two copies bit-identical after every step
(check_tied_params_identical). Tolerance 2e-6 (fp32; measured below 3e-7).

What the cases check:
- an embedding on the first stage tied to the LM head on the last through the stage, mean loss and
  torchtitan's per-token loss (grad_reduction="sum", scale_grads=False), plain and ZeRO-1: params within 2e-6
  of one process (1.2e-7 measured), copies bit-identical after every step; ZeRO-1 with the bf16 hook within
  3e-3
"""

import pytest

import multiprocess

TOL = 2e-6


@pytest.mark.parametrize("zero1", [False, True])
@pytest.mark.parametrize("per_token", [False, True])
def test_tied_embedding_matches_one_process(zero1, per_token):
    """The tied pair summed over the embedding group by the stage's reduce-grad (start_grad_sync), before
    the DP all-reduce or ZeRO-1's reduce-scatter. per_token: the loss a sum over valid tokens divided by
    their global count (scale_grads=False, grad_reduction="sum"); else a mean loss, scale_grads=True."""
    diffs = multiprocess.run(4, "pipelining_tied_workers.tied_pipeline", zero1=zero1, per_token=per_token)
    assert max(d for d, _ in diffs) < TOL and all(same for _, same in diffs), diffs


def test_tied_embedding_zero1_shards_with_a_compressing_hook():
    """ZeRO-1 with the bf16 hook, where a rank keeps only its shard of the reduce-scatter (Gloo otherwise
    all-reduces the whole bucket, hiding a shard summed in the wrong order): the copies stay
    bit-identical; params within 3e-3 of fp32 (bf16 rounding of the reduced gradients)."""
    diffs = multiprocess.run(4, "pipelining_tied_workers.tied_pipeline", zero1=True, comm_hook="bf16_compress")
    assert max(d for d, _ in diffs) < 3e-3 and all(same for _, same in diffs), diffs


def test_tied_embedding_with_the_group_made_from_the_mesh_matches_one_process():
    """No embedding_group= given: the DDP makes it from the mesh's "pp" dim (each pipeline's first and
    last stage), as the C++ mesh does. Broken on purpose (main's DDP, which made none): the construction is
    refused, "'lm_head.weight' is declared tied across pipeline stages ... but this buffer has no embedding
    group"."""
    diffs = multiprocess.run(4, "pipelining_tied_workers.tied_pipeline", zero1=True, group_from_mesh=True)
    assert max(d for d, _ in diffs) < TOL and all(same for _, same in diffs), diffs
