"""torch.compile with meshddp's wrapper (docs/guide/compile.md): the compiled graph is split at the
bucket boundaries so bucket reductions overlap the compiled backward (as torch's DDP under its
DDPOptimizer), per-block compile keeps the overlap, the results are torch's DDP's under the same
compilation, meshddp adds no graph break of its own (ZeRO-1's param-gather waits included), nothing
recompiles after warm-up, and compiled autograd is refused naming per-block compile (at the forward, or at
the gradient hooks when it is turned on for the backward only). Two ranks, Gloo,
CPU, backend="aot_eager" (the split and the autograd structure are what inductor would get too)."""

import pathlib
import re

import pytest
import torch

import multiprocess


@pytest.fixture(scope="module")
def overlap():
    """Per rank and setting: all-reduces launched before the backward's last compute op ended, of all."""
    return multiprocess.run(2, "compile_workers.overlaps")


def test_compiling_the_wrapper_overlaps_as_many_bucket_launches_as_torch_ddp_compiled(overlap):
    for rank in range(2):
        ours, theirs = overlap[rank]["compiled"], overlap[rank]["torch_compiled"]
        assert ours["launches"] == ours["buckets"] >= 6, ours
        # Only the last bucket (the first block's LayerNorm) fills in the last section's backward.
        assert ours["before_end"] >= max(theirs["before_end"], ours["buckets"] - 1), (ours, theirs)


def test_without_the_split_the_compiled_backward_overlaps_nothing(overlap):
    # optimize_ddp=False: one graph, one backward, every bucket launched after it (what the split fixes).
    for r in overlap:
        assert r["compiled_unsplit"]["before_end"] == 0, r["compiled_unsplit"]


def test_compiling_each_block_before_wrapping_keeps_the_overlap(overlap):
    # A compiled block's gradients all arrive at the end of its backward: the buckets holding the first
    # block's params (3 of them) launch after the last compute op, the others before.
    for r in overlap:
        assert r["per_block"]["before_end"] >= r["per_block"]["buckets"] - 3, r["per_block"]


def _identical(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def _max_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b))


@pytest.fixture(scope="module")
def trained():
    return multiprocess.run(2, "compile_workers.exactness_cases", cases=["plain", "no_sync", "bf16", "zero1"])


@pytest.mark.parametrize("case", ["plain", "no_sync", "bf16"])
def test_compiled_training_is_torch_ddps_compiled_and_eager_within_torchs_own_compile_noise(trained, case):
    for rank, runs in enumerate(trained):
        r = runs[case]
        # meshddp compiled == torch's DDP compiled (aot_eager: the same aten ops in the same order).
        assert _identical(r["compiled"], r["torch_compiled"]), (case, rank, _max_diff(r["compiled"], r["torch_compiled"]))
        assert _identical(r["eager"], r["torch_eager"]), (case, rank)
        # Against eager: no further from it than torch's own compiled DDP is.
        noise = _max_diff(r["torch_compiled"], r["torch_eager"])
        assert _max_diff(r["compiled"], r["eager"]) <= noise, (case, rank, noise)
        # No recompiles after warm-up: the graph count after step 2 is the count after the last step.
        assert r["frames"][0] == r["frames"][1] >= 1, (case, rank, r["frames"])


def test_compiled_zero1_with_overlapped_param_gather_is_eager_zero1(trained):
    # AdamW on the ranks' shards; the forward waits for the param all-gathers before compiled code runs.
    for rank, runs in enumerate(trained):
        r = runs["zero1"]
        assert _identical(r["compiled"], r["eager"]), (rank, _max_diff(r["compiled"], r["eager"]))
        assert r["frames"][0] == r["frames"][1] >= 1, (rank, r["frames"])
        # Steps 1.. start with gathers pending: compiled code (inductor's kernels read params without the
        # per-op waits) starts after all of them, every section of every step.
        assert len(r["pending"]) >= 4 and not any(r["pending"]), (rank, r["pending"])


def test_a_compiled_function_in_the_forward_starts_after_every_param_gather():
    # ZeRO-1 with overlap_param_gather, the wrapper eager, its forward calling a torch.compile'd function (not a
    # compiled submodule) on the head's params: inductor's kernels would read them without meshddp's per-op
    # waits, so that compiled code must start with no gather pending, as a compiled submodule does.
    for rank, r in enumerate(multiprocess.run(2, "compile_workers.compiled_function_in_forward")):
        assert len(r["pending"]) >= 4 and not any(r["pending"]), (rank, r["pending"])
        assert _identical(r["compiled"], r["eager"]), (rank, _max_diff(r["compiled"], r["eager"]))


def test_dp_x_tp_with_dtensor_params_compiles_as_one_exact_graph_with_a_warning():
    # torch's section compiler cannot pass DTensors between sections: one graph, bit-identical to eager.
    results = multiprocess.run(4, "compile_workers.dp_x_tp")
    for rank, r in enumerate(results):
        assert _identical(r["compiled"], r["eager"]), (rank, _max_diff(r["compiled"], r["eager"]))
        assert r["graphs"] == 1 and r["warned"], (rank, r["graphs"], r["warned"])


@pytest.fixture(scope="module")
def explained():
    return multiprocess.run(2, "compile_workers.explains")[0]


@pytest.mark.parametrize("case", ["plain", "zero1", "zero1_overlap"])
def test_meshddp_adds_no_graph_break_but_the_bucket_splits(explained, case):
    split = explained[(case, True)]
    # One section per launchable bucket at most; every break is a bucket split, none is meshddp's forward
    # (its checks, its forward scope, ZeRO-1's param-gather waits).
    assert 2 <= split["graphs"] <= split["buckets"], split
    assert split["breaks"] == split["graphs"] - 1, split
    assert all(reason.startswith("meshddp bucket split") for reason in split["reasons"]), split
    whole = explained[(case, False)]
    assert whole["graphs"] == 1 and whole["breaks"] == 0, whole


def test_compiled_autograd_is_refused_naming_per_block_compile():
    for text in multiprocess.run(2, "compile_workers.compiled_autograd"):
        assert text is not None and "compiled autograd" in text and "block.compile()" in text, text


@pytest.mark.parametrize("way", ["context", "config"])
def test_compiled_autograd_turned_on_for_the_backward_only_is_refused_at_the_hooks_naming_per_block_compile(way):
    # context: the enable() context around loss.backward() of a compiled wrapper; config: the config set after
    # wrapping and after the forward, the backward in a compiled function. torch alone would fail inside
    # itself ("compiled_args nyi ... AccumulationPreHook"); meshddp's hooks refuse, naming the parameter.
    text = multiprocess.run(1, "compile_workers.compiled_autograd_in_backward", way=way)[0]
    assert text is not None and "GradBuffer: a backward under compiled autograd" in text, text
    assert "gradient hook of parameter '" in text and "block.compile()" in text and "nyi" not in text, text


def _code_lines(text):
    return [" ".join(line.split()) for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_the_guides_recipe_runs():
    root = pathlib.Path(__file__).resolve().parents[2]
    block = re.search(r"```python\n(.*?)```", (root / "docs" / "guide" / "compile.md").read_text(), re.S).group(1)
    have = _code_lines((root / "tests" / "python" / "compile_guide_snippet.py").read_text())
    at = 0
    for line in _code_lines(block):  # the guide's lines, in order, in the file run here
        assert line in have[at:], f"docs/guide/compile.md's line '{line}' is not in compile_guide_snippet.py"
        at = have.index(line, at) + 1
    multiprocess.run(2, "compile_guide_snippet.main")


def test_a_torch_internal_the_split_uses_that_changed_is_named_at_import():
    from torch._dynamo import convert_frame

    import meshddp.compile as compile_module

    compile_module._check_torch_internals()  # the running torch
    changed = {"torch._dynamo.convert_frame.catch_errors_wrapper": (convert_frame, "catch_errors_wrapper",
                                                                    "(callback, hooks, frame_state)")}
    with pytest.raises(ImportError, match=r"torch\._dynamo\.convert_frame\.catch_errors_wrapper in torch .* has the "
                                          r"signature \(callback, hooks\), but meshddp was written for "
                                          r"\(callback, hooks, frame_state\)"):
        compile_module._check_torch_internals(changed)
    gone = {"torch._dynamo.utils.get_optimize_ddp_mode": (object(), "get_optimize_ddp_mode", "()")}
    with pytest.raises(ImportError, match=r"has no torch\._dynamo\.utils\.get_optimize_ddp_mode"):
        compile_module._check_torch_internals(gone)
