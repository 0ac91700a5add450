"""A config invalid on one rank only, from Python (Note [Agree first, then validate],
mesh/config_fields.h): a config takes any value of the right type where it is made; the wrapper that
takes it compares it across the ranks first and validates it after, so every rank fails alike, naming
the field and each rank's value, instead of that rank failing alone and its peers meeting a closed
connection. (The C++ engine does the same: tests/plugin/config_agreement_test.cpp.)"""
import pytest

import multiprocess


@pytest.mark.parametrize("which,who,field", [
    ("ddp", "DistributedDataParallel: the DdpConfig settings", "'comm_hook' is rank 0: none, rank 1: bogus"),
    ("optimizer", "DistributedOptimizer: the DistributedOptimizerConfig settings", "'lr' is rank 0: 0.001, rank 1: -1")])
def test_a_value_invalid_on_one_rank_fails_every_rank_naming_the_field_and_each_ranks_value(which, who, field):
    errors = multiprocess.run(2, "config_agreement_workers.invalid_on_one_rank", which=which)
    for rank, error in enumerate(errors):
        assert error is not None and f"{who} differ across the ranks" in error and field in error, (rank, error)
