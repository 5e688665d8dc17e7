"""collective_order.issue_order_edges and passes.wait_order: every rank's graph waits for its collectives in the order it issues
them. Inductor's bucketing fills a bucket in the order of the waits, so a wait that rank-dependent code placed
later on one rank (an uneven shard's padding) put a gradient at another offset of the bucket there, and the
bucket's reduce-scatter summed two parameters' gradients (torch.nn.Transformer sharded, ghost, 34th session)."""
import collections
import types

import torch
import torch.fx as fx

from dpcompile.passes.cleanup import stable_topological_sort
from dpcompile.passes.collective_order import issue_order_edges
from dpcompile.passes.wait_order import wait_order_pass

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


def _mixed_graph():
    """All-gathers a, b (issued in that order) and reduce-scatters c, d, their waits placed d, b, c, a: each kind's
    waits out of order, and compute between them that reads the waits."""
    g = fx.Graph()
    xs = {k: g.placeholder(k) for k in "abcd"}
    ag = {k: g.call_function(_C10D.all_gather_into_tensor.default, (xs[k], 2, "0")) for k in "ab"}
    rs = {k: g.call_function(_C10D.reduce_scatter_tensor.default, (xs[k], "sum", 2, "0")) for k in "cd"}
    issued = {**ag, **rs}
    outs = []
    for k in "dbca":
        w = g.call_function(_C10D.wait_tensor.default, (issued[k],))
        outs.append(g.call_function(torch.ops.aten.mul.Tensor, (w, 2.0)))
    g.output(tuple(outs))
    return fx.GraphModule(torch.nn.Module(), g)


def test_wait_order_pass_orders_the_waits_of_every_kind_and_only_the_waits():
    gm = _mixed_graph()
    issues_before = [n.name for n in gm.graph.nodes if n.target is not _C10D.wait_tensor.default
                     and n.op == "call_function" and n.target.namespace == "_c10d_functional"]
    ctx = types.SimpleNamespace(counters=collections.Counter())
    wait_order_pass(gm, ctx)
    waited = _waited(gm.graph)
    assert [w for w in waited if w in "ab"] == ["a", "b"]  # all-gathers
    assert [w for w in waited if w in "cd"] == ["c", "d"]  # reduce-scatters
    assert ctx.counters["collective_waits_reordered"] >= 2
    issues_after = [n.name for n in gm.graph.nodes if n.target is not _C10D.wait_tensor.default
                    and n.op == "call_function" and n.target.namespace == "_c10d_functional"]
    assert issues_after == issues_before  # the collectives themselves stay where they were
    gm.graph.lint()


def test_wait_order_pass_leaves_an_ordered_graph_alone():
    g, _ = _graph("abc")
    gm = fx.GraphModule(torch.nn.Module(), g)
    before = [n.name for n in gm.graph.nodes]
    ctx = types.SimpleNamespace(counters=collections.Counter())
    wait_order_pass(gm, ctx)
    assert [n.name for n in gm.graph.nodes] == before
    assert ctx.counters["collective_waits_reordered"] == 0
