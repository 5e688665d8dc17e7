"""compat.integer_equalities_decided: an equality of unbacked sizes that no integers satisfy is answered, not a
data-dependent guard; every other question of an unbacked size is left to torch as before."""
import pytest
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode, ShapeEnv

import dpcompile  # noqa: F401  (installs the fix)


def test_equalities_without_integer_solutions_are_decided():
    env = ShapeEnv()
    u, v = env.create_unbacked_symint(), env.create_unbacked_symint()
    assert bool(3 * u == 1) is False and bool(3 * u != 1) is True  # Inductor's CPU bmm: is [3*B, ...]'s dim 1?
    assert bool(2 * u + 4 * v == 7) is False  # gcd 2 does not divide 7
    assert bool(6 * u * v == 9) is False  # a product of sizes: gcd 6 does not divide 9


@pytest.mark.parametrize("question", ["u == 1", "2 * u == 4", "3 * u == 0", "2 * u + 3 * v == 7", "u * u == 4"])
def test_equalities_that_some_size_satisfies_still_raise(question):
    env = ShapeEnv()
    u, v = env.create_unbacked_symint(), env.create_unbacked_symint()  # noqa: F841 (used by eval)
    with pytest.raises(GuardOnDataDependentSymNode):
        bool(eval(question))
