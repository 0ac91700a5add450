"""torch.compile(ddp) under data_parallel_sharding_strategy='optim_grads_params' (ZeRO-3) at dp 2 (Gloo, CPU,
inductor; docs/guide/compile.md): each compiled section gathers its FSDP units before its forward and its backward
(Note [Compiled sections under optim_grads_params], meshddp/_compiled_sections.py).

Tolerances. Against 'optim' compiled the same way: the same sections (each block is one bucket under both
strategies), the same kernels, and a reduce-scatter at dp 2 sums the same two values in either layout: bit for bit
(0). Against the same strategy run eagerly: inductor's fused kernels round differently from eager ops (as for any
compiled model), amplified by AdamW (its division by sqrt(v) where gradients are tiny) over 3 steps: EAGER_ATOL (measured 1.3e-6).

Memory: after every step the rank holds exactly its param shards; at its peak, its shards plus at most two units
(a section's block and the next one prefetched, or in backward the one before), the same peak as eager, well below
the whole params (6 units)."""

import multiprocess

EAGER_ATOL = 3e-6
UNITS_IN_USE = 2


def test_compiled_equals_optim_compiled_and_eager_and_releases_units_between_sections():
    results = multiprocess.run_once(2, "compile_sharded_params_workers.against_eager_and_optim")
    for rank, r in enumerate(results):
        largest_unit = r["whole"] // r["buckets"]  # one block, one unit, one bucket
        print(f"[rank {rank}: vs optim compiled {r['vs_optim']:.3g}, vs eager {r['vs_eager']:.3g}; sections "
              f"{r['sections']}, unique graphs {r['graphs']}; param storage after each step {r['storage_after_steps']}, "
              f"shards {r['shards']}, peak {r['peak']} (eager {r['eager_peak']}), whole {r['whole']}]")
        assert r["sections"] and min(r["sections"]) > 1, f"rank {rank}: the graph was not split: {r['sections']}"
        assert r["same_layout"] and r["buckets"] == 6, "each block must be one bucket under both strategies"
        assert r["vs_optim"] == 0.0, f"rank {rank}: compiled optim_grads_params differs from compiled optim by {r['vs_optim']}"
        assert r["losses"]["compiled"] == r["losses"]["optim"], r["losses"]
        assert r["vs_eager"] <= EAGER_ATOL, f"rank {rank}: compiled differs from eager by {r['vs_eager']}"
        assert r["graphs"][0] == r["graphs"][-1], f"rank {rank}: recompiled after the first step: {r['graphs']}"
        assert r["storage_after_steps"] == [r["shards"]] * 3, (
            f"rank {rank}: param storage after the steps {r['storage_after_steps']} is not just the shards "
            f"({r['shards']} bytes): a unit stayed gathered")
        assert r["peak"] <= r["shards"] + UNITS_IN_USE * largest_unit < r["shards"] + r["whole"], (
            f"rank {rank}: peak param storage {r['peak']} above shards + {UNITS_IN_USE} units of {largest_unit}")


def test_an_unsplit_graph_and_per_block_compile_are_refused_naming_the_way_out():
    for r in multiprocess.run_once(2, "compile_sharded_params_workers.refusals"):
        assert r["unsplit"] is not None and "optimize_ddp" in r["unsplit"] and "optim_grads_params" in r["unsplit"], (
            r["unsplit"])
        assert r["per_block"] is not None and "per-block" in r["per_block"] and "torch.compile(ddp)" in r["per_block"], (
            r["per_block"])
