#!/usr/bin/env python3
"""Whether PyTorch's context_parallel (torch.distributed.tensor.experimental) runs on CPU: a
causal scaled_dot_product_attention over a sequence sharded by context_parallel over a 1-D gloo
mesh, forward and backward. Each rank prints one line: "context_parallel ran on CPU" or why it
failed. PyTorch 2.15 fails ("aten._scaled_dot_product_flash_attention_for_cpu.default does not
have a sharding strategy registered"): its ring attention is CUDA's only (docs/benchmarks.md,
"Context parallelism").

  scripts/pytorch-python -m torch.distributed.run --standalone --nproc-per-node 2 \
      bench/probes/pytorch_context_parallel_probe.py
"""
import os, sys, torch, torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))
try:
    from torch.distributed.tensor.experimental import context_parallel
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 24)
    x = torch.randn(1, 16, 8)
    with context_parallel(mesh, buffers=[x], buffer_seq_dims=[1]):
        q, k, v = lin(x).view(1, x.shape[1], 3, 2, 4).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.sum().backward()
    print(f"rank {dist.get_rank()}: context_parallel ran on CPU, local x {tuple(x.shape)}", flush=True)
except Exception as e:
    print(f"rank {dist.get_rank()}: context_parallel failed on CPU: {type(e).__name__}: {str(e)[:300]}", flush=True)
sys.stdout.flush(); os._exit(0)
