"""cProfile of a ViT-S/16 bk step's compile with compiler="eager" (no Inductor): where DPPartitioner's time goes."""
import cProfile, os, pstats, sys, time
import torch
import torch.nn.functional as F
sys.path.insert(0, "benchmarks")
import dpcompile
from vision_models import ViT

torch.manual_seed(0)
depth = int(os.environ.get("DEPTH", 12))
model = ViT(num_classes=1000, depth=depth)
B = int(os.environ.get("B", 4))
x, y = torch.randn(B, 3, 224, 224), torch.randint(0, 1000, (B,))
mode = sys.argv[1] if len(sys.argv) > 1 else "bk"

def train_step(x, y):
    loss = F.cross_entropy(model(x), y, reduction="none").mean()
    loss.backward()
    return loss.detach()

if mode == "nonprivate":
    fn = torch.compile(train_step, backend="aot_eager_decomp_partition")
else:
    fn = dpcompile.private_step(train_step, max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=B,
                                schedule=mode, compiler="eager")
pr = cProfile.Profile()
t = time.time(); pr.enable(); fn(x, y); pr.disable(); print("first step", time.time() - t)
st = pstats.Stats(pr); st.sort_stats("cumulative")
st.print_stats(r"(dpcompile|passes)/", 50)
st.sort_stats("tottime").print_stats(25)
st.sort_stats("cumulative").print_callees(r"backend.py:315\(__call__\)")
st.print_callers(r"joint_graph.py:649")
st.print_callers(r"debug.py:31")
st.print_callers(r"_recursive_joint_graph_passes")
st.print_callees(r"joint_graph.py:649")
st.print_callees(r"partitioners.py:3725")
