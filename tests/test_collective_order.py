"""collective_order.issue_order_edges: every rank's graph waits for its gradient collectives in the order it issues
them. Inductor's bucketing fills a bucket in the order of the waits, so a wait that rank-dependent code placed
later on one rank (an uneven shard's padding) put a gradient at another offset of the bucket there, and the
bucket's reduce-scatter summed two parameters' gradients (torch.nn.Transformer sharded, ghost, 34th session)."""
import torch
import torch.fx as fx

from dpcompile.passes.cleanup import stable_topological_sort
from dpcompile.passes.collective_order import issue_order_edges

_C10D = torch.ops._c10d_functional


def _graph(wait_order):
    """Reduce-scatters a, b, c issued in that order, their waits placed in ``wait_order``; no process group is
    needed to build the graph."""
    g = fx.Graph()
    xs = {k: g.placeholder(k) for k in "abc"}
    rs = {k: g.call_function(_C10D.reduce_scatter_tensor.default, (xs[k], "sum", 2, "0")) for k in "abc"}
    waits = {k: g.call_function(_C10D.wait_tensor.default, (rs[k],)) for k in wait_order}
    g.output(tuple(waits[k] for k in "abc"))
    return g, [rs[k] for k in "abc"]


def _waited(g):
    return [n.args[0].args[0].name for n in g.nodes if n.target is _C10D.wait_tensor.default]


def test_waits_follow_the_order_of_issue():
    g, order = _graph("cab")
    assert _waited(g) == ["c", "a", "b"]  # as rank-dependent code left them
    stable_topological_sort(g, after=issue_order_edges(order))
    g.lint()
    assert _waited(g) == ["a", "b", "c"]


def test_issue_order_edges_already_stay_where_they_are():
    g, order = _graph("abc")
    before = [n.name for n in g.nodes]
    stable_topological_sort(g, after=issue_order_edges(order))
    assert [n.name for n in g.nodes] == before


def test_a_collective_without_a_wait_is_skipped_and_the_next_waits_after_the_last_wait():
    g, (a, b, c) = _graph("cab")
    (wait_b,) = b.users
    wait_b.replace_all_uses_with(b)
    g.erase_node(wait_b)
    after = issue_order_edges([a, b, c])
    (wait_a,), (wait_c,) = a.users, c.users
    assert after == {b: [a], c: [b], wait_a: [], wait_c: [wait_a]}
