"""dpcompile.bucket_collectives: validated, and it sets (and unsets) Inductor's bucketing for every graph."""
import pickle

import pytest
from torch._inductor import config

import dpcompile


@pytest.mark.parametrize("bad", [0, -1, float("inf"), float("nan"), True, "64"])
def test_bad_bucket_size_is_refused(bad):
    with pytest.raises(ValueError, match="bucket_mb must be a positive number"):
        dpcompile.bucket_collectives(bad)
    assert config.bucket_all_gathers_fx == "none"


def test_bucketing_on_and_off():
    try:
        dpcompile.bucket_collectives(16)
        assert (config.bucket_all_gathers_fx, config.bucket_reduce_scatters_fx, config.bucket_all_reduces_fx) == (
            "all", "all", "all")
        cap = config.bucket_reduce_scatters_fx_bucket_size_determinator
        assert cap(0) == cap(7) == 16.0
        assert pickle.loads(pickle.dumps(cap)) == cap  # part of Inductor's cache key
        assert config.reorder_for_compute_comm_overlap is False
        dpcompile.bucket_collectives(16, overlap=True)
        assert config.reorder_for_compute_comm_overlap is True
        with pytest.raises(ValueError, match="overlap must be True or False"):
            dpcompile.bucket_collectives(16, overlap="yes")
    finally:
        dpcompile.bucket_collectives(None)
    assert (config.bucket_all_gathers_fx, config.bucket_reduce_scatters_fx, config.bucket_all_reduces_fx) == (
        "none", "none", "none")
    assert config.reorder_for_compute_comm_overlap is False
