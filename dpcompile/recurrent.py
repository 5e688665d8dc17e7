"""nn.LSTM in a DP step: always as its cells.

torch's decomposition of ``aten.lstm`` (torch/_decomp/decompositions.py) runs a CPU layer as one
``mkldnn_rnn_layer`` op when it takes the layer for inference, which it decides from the input alone: an LSTM
that reads the batch itself (the first layer of a model, its input needing no gradient) is "inference" even
though its weights need gradients. That op is opaque to the per-sample analysis (no rule can say how its
weight gradient splits by sample), so such a step was refused. In a DP step's trace the layer is decomposed
into its cells instead, as for every other LSTM: the same function, of matmuls and pointwise ops that have
rules. Outside DP compiles (stock torch.compile, eager) torch's choice stands.
"""
from __future__ import annotations

from dpcompile.batching import in_dp_trace
from dpcompile.compat import wrap_method_once


def lstm_cells_in_dp_steps() -> None:
    from torch._decomp import decompositions

    cells = getattr(decompositions, "one_layer_lstm", None)
    fused = getattr(decompositions, "mkldnn_one_layer_lstm", None)
    if cells is None or fused is None:  # a torch without the choice
        return

    def wrap(original):
        def select_one_layer_lstm_function(input, hx, params):
            chosen = original(input, hx, params)
            if chosen is fused and _training(params) and in_dp_trace():
                return cells
            return chosen
        return select_one_layer_lstm_function

    wrap_method_once(decompositions, "select_one_layer_lstm_function", wrap)


def _training(params) -> bool:
    return any(getattr(p, "requires_grad", False) for layer in params for p in layer)
