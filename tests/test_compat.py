"""The zero-size grid guard dpcompile adds to older torch releases."""
import pytest

from dpcompile.compat import guard_empty_y_grid

th = pytest.importorskip("torch._inductor.runtime.triton_heuristics")


@pytest.mark.skipif(not hasattr(th, "Grid2DWithYZOverflow"), reason="this torch has no y-grid overflow grid")
@pytest.mark.parametrize("ynumel", [0, 5, 200_000])
def test_y_overflow_grid_of_an_empty_dim_is_zero(ynumel):
    guard_empty_y_grid()
    grid = th.Grid2DWithYZOverflow(inductor_meta={"grid_type": "Grid2DWithYZOverflow"}, mode="python")
    grid.generate({"XBLOCK": 16, "YBLOCK": 2})
    g0, g1, g2 = grid.eval_slow({"xnumel": 64, "ynumel": ynumel, "XBLOCK": 16, "YBLOCK": 2})
    assert g0 == 4
    assert g1 * g2 >= (ynumel + 1) // 2 and (g1 == 0) == (ynumel == 0)
    assert g1 <= 65535
