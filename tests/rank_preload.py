"""What the fork server (ranks.py) loads once, so that every rank forked from it starts with it: the test bodies
(dist_worker), and the work each rank would otherwise repeat on its first compile.

CI time (py-spy of the default tier, 31 forked ranks): a rank spent about 5 s of CPU on its first compile before
tracing anything: hashing torch's and Triton's sources for the cache keys (``torch_key``, ``triton_key``), building
Inductor's joint-graph patterns (``joint_graph.lazy_init``), importing transformers' models and Opacus. Each is
cached per process, and none depends on a setting a test changes: done in the server, the ranks inherit it.

The patterns are built only by a torch without CUDA: on a CUDA build they are traced on the GPU, and a process
forked after CUDA started cannot use it (the ranks of a GPU machine's run fork from this server too)."""
import gc

import torch
from torch._inductor.codecache import torch_key
from torch._inductor.fx_passes import joint_graph, post_grad

import dist_worker  # noqa: F401 - the test bodies, with torch and dpcompile

torch_key()
try:
    from torch._inductor.runtime.triton_compat import triton_key

    triton_key()
except ImportError:  # no Triton: the cache keys do without it
    pass
if not torch.backends.cuda.is_built():
    joint_graph.lazy_init()
    post_grad.lazy_init()

import opacus  # noqa: E402,F401 - dpcompile's accountant
import transformers.models.gpt2.modeling_gpt2  # noqa: E402,F401 - the third-party cases (cases.py)
import transformers.models.llama.modeling_llama  # noqa: E402,F401

# what the server holds stays out of the ranks' garbage collections: they would walk every object loaded above (and
# touch, so copy, their forked pages) at each full collection
gc.freeze()
