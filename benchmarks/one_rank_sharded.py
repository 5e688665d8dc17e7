"""A one-rank sharded DP step on a GPU (NCCL, dpcompile.fully_shard on a 1-rank mesh, a small transformers Llama)
against the same step unsharded, through Inductor, both schedules; exit status 1 if they differ:

    torchrun --nproc-per-node 1 benchmarks/one_rank_sharded.py [bk] [ghost]
"""
import copy
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from transformers import LlamaConfig, LlamaForCausalLM

import dpcompile

dist.init_process_group("nccl")
torch.cuda.set_device(0)
cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, use_cache=False)
torch.manual_seed(0)
plain = LlamaForCausalLM(cfg).cuda()
sharded = copy.deepcopy(plain)
mesh = init_device_mesh("cuda", (1,))
for layer in sharded.model.layers:
    dpcompile.fully_shard(layer, mesh=mesh)
dpcompile.fully_shard(sharded, mesh=mesh)
ids = torch.randint(0, 128, (6, 16), device="cuda")
failed = False
for schedule in sys.argv[1:] or ["bk", "ghost"]:
    grads = []
    for model in (plain, sharded):
        model.zero_grad(set_to_none=True)

        def step(ids, model=model):
            logits = model(input_ids=ids).logits
            per = F.cross_entropy(logits.flatten(0, 1).float(), ids.flatten(), reduction="none").view(ids.shape)
            per.mean(1).mean().backward()

        torch._dynamo.reset()
        try:
            dpcompile.private_step(step, max_grad_norm=0.05, noise_multiplier=0.0, expected_batch_size=6,
                                   schedule=schedule)(ids)
        except Exception as exc:  # noqa: BLE001
            import traceback
            traceback.print_exc()
            print(f"world1 {schedule} {'sharded' if model is sharded else 'plain'}: FAIL {type(exc).__name__}",
                  flush=True)
            failed = True
            break
        grads.append({n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).double()
                      for n, p in model.named_parameters()})
    if len(grads) == 2:
        worst = max(float((grads[0][n] - grads[1][n]).abs().max() / grads[0][n].abs().max().clamp_min(1e-12))
                    for n in grads[0])
        print(f"world1 {schedule}: sharded vs plain, worst relative difference {worst:.2e}", flush=True)
        failed |= worst > 1e-3
dist.destroy_process_group()
sys.exit(1 if failed else 0)
