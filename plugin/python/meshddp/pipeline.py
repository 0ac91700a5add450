"""The data-parallel side of a pipeline schedule (docs/pipeline.md), for a Python schedule: the
per-chunk controls are methods of meshddp.DistributedDataParallel (start_grad_sync,
set_requires_gradient_sync / no_sync, finish_grad_sync, scale_gradients, broadcast_params); these are
the functions over all of a rank's chunks."""

from meshddp import _C


def finalize_model_grads(chunks, num_tokens=None, pp_group=None):
    """Finishes the gradient sync of every chunk this rank holds (meshddp.DistributedDataParallel, in
    chunk order 0..V-1: DdpConfig.virtual_pipeline_chunk), the sum of weights tied across stages
    included. num_tokens (int): this rank's count of valid tokens, the loss being a sum over them: the
    buffers are then divided by the global count (summed over the DP group; with pp_group, the count
    of its last rank, the stage that computes the loss). Returns that count (-1 without num_tokens)."""
    for c in chunks:  # a meshddp.pipelining stage's sync, scaled, if its schedule did not start it
        before = c._before_finish() if getattr(c, "_before_finish", None) is not None else None
        if before is not None:
            before()
    engines = [c._engine for c in chunks]
    count = _C.finalize_model_grads(engines, _token_count(num_tokens), pp_group)
    for c in chunks:
        c._after_grad_sync()  # synced (and scaled) by meshddp: what DistributedOptimizer.step() may read
    return count


def _token_count(num_tokens):
    """num_tokens as an int (a Python number or a one-element tensor, as torchtitan counts it); a count
    that is not a whole number is refused rather than truncated."""
    if num_tokens is None:
        return None
    value = num_tokens.item() if hasattr(num_tokens, "item") else num_tokens
    if isinstance(value, bool) or float(value) != int(value):
        raise ValueError(f"finalize_model_grads: num_tokens = {num_tokens!r} is not a whole number of tokens; pass "
                         "this rank's count of valid (loss-bearing) tokens, e.g. (labels != ignore_index).sum()")
    return int(value)


def declare_tied_across_stages(param):
    """Declares `param` one copy of a weight tied across pipeline stages (the embedding on the first
    stage, the LM head on the last; declare each on its own stage before wrapping its chunk)."""
    _C.declare_tied_across_stages(param)


def embedding_groups(sizes, names, pp_dim="pp"):
    """Per pipeline of a mesh of `sizes` and dim `names` (row-major ranks): [first stage, last stage]
    (the embedding group: make each with torch.distributed.new_group on every rank); middle stages
    alone."""
    return _C.embedding_groups(list(sizes), list(names), pp_dim)
