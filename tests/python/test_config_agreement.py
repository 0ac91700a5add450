"""A config invalid on one rank only, from Python (Note [Agree first, then validate],
mesh/config_fields.h). Python validates a config where it is made, so that rank fails there, alone,
naming the field and value; its peers, waiting in DistributedDataParallel's settings check, fail
with an error that says a rank stopped before the check and where the cause is, not with Gloo's bare
"Connection closed". (The C++ engine agrees before it validates: tests/plugin/config_agreement_test.cpp.)"""
import multiprocess


def test_a_peer_whose_config_was_refused_is_named_as_the_cause_in_the_settings_check():
    error = multiprocess.run(2, "config_agreement_workers.error_of_peer_that_left")[0]
    assert error is not None
    # The first of DistributedDataParallel's settings checks the peers reach (the optimizer-instance
    # count, agreed before the groups are made, then the DdpConfig settings).
    assert "DistributedDataParallel: the " in error and " settings check over group" in error, error
    assert ("A rank that stopped before reaching this check (e.g. one whose config was refused where it was made) "
            "leaves its peers here: the job's first error, from that rank, names the cause") in error, error
