"""PyTorch's side of dcp_model_state's crossing (dcp_save_multiprocess_test.cc): the model and
Adam state a C++ job saved with dcp_model_state, loaded through get_state_dict / dcp.load /
set_state_dict, must equal the reference files the C++ job wrote beside it (save_state_dict,
save_optimizer_state_dict); then one more Adam step here, saved with dcp.save of get_state_dict's
dicts and the same kind of reference files, for the C++ side to load.

Usage: pytorch_dcp_model_state.py CPP_FOLDER CPP_REFS PY_FOLDER PY_REFS [flattened] [qkv]
"flattened": CPP_FOLDER holds the optimizer's options per parameter, as FullyShardedDataParallel's
dcp_state saves them (and PyTorch's StateDictOptions(flatten_optimizer_state_dict=True) loads
them); PY_FOLDER is saved in get_state_dict's default layout either way.
"qkv": the model is a fused q|k|v held as one nn.Linear(6, 12) ("qkv") and a head
nn.Linear(12, 2), float64, as the C++ side's tensor-parallel model is as a whole; its output on
the batch must also equal CPP_REFS/output.pt's "output" (what the split model computed).
Prints "pytorch resumed ddp's model and optimizer, and saved its own" and exits 0; a mismatch
raises.
"""

import os
import sys

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                     set_state_dict)


class FusedQkv(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(6, 12, dtype=torch.float64)
        self.head = torch.nn.Linear(12, 2, dtype=torch.float64)

    def forward(self, x):
        return self.head(self.qkv(x).tanh())


def model_and_optimizer(qkv):
    if qkv:
        model = FusedQkv()
    else:
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def batch_of(qkv):
    if qkv:
        return torch.arange(18, dtype=torch.float64).reshape(3, 6) / 10
    return torch.arange(12, dtype=torch.float32).reshape(3, 4) / 10


def same_optimizer_state(got, want):
    assert len(got["state"]) == len(want["state"]), (got["state"].keys(), want["state"].keys())
    for index, state in want["state"].items():
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(got["state"][index][key]), torch.as_tensor(value)), \
                (index, key)
    for g, w in zip(got["param_groups"], want["param_groups"]):
        assert g["lr"] == w["lr"] and tuple(g["betas"]) == tuple(w["betas"]), (g, w)


def main():
    cpp_folder, cpp_refs, py_folder, py_refs = sys.argv[1:5]
    flattened = "flattened" in sys.argv[5:]
    qkv = "qkv" in sys.argv[5:]
    options = StateDictOptions(flatten_optimizer_state_dict=flattened)
    torch.manual_seed(7)  # another initialisation than the saved one: the load must replace it
    model, optimizer = model_and_optimizer(qkv)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=cpp_folder, no_dist=True)
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd,
                   options=options)
    want_model = torch.load(os.path.join(cpp_refs, "model.pt"), weights_only=True)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, want_model[name]), name
    want_optim = torch.load(os.path.join(cpp_refs, "optim.pt"), weights_only=True)
    same_optimizer_state(optimizer.state_dict(), want_optim)

    batch = batch_of(qkv)
    if qkv:
        with torch.no_grad():
            want_output = torch.load(os.path.join(cpp_refs, "output.pt"),
                                     weights_only=True)["output"]
            assert torch.allclose(model(batch), want_output, rtol=0, atol=1e-12), \
                (model(batch), want_output)
    optimizer.zero_grad()
    model(batch).square().sum().backward()
    optimizer.step()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=py_folder, no_dist=True)
    os.makedirs(py_refs, exist_ok=True)
    torch.save(model.state_dict(), os.path.join(py_refs, "model.pt"))
    torch.save(optimizer.state_dict(), os.path.join(py_refs, "optim.pt"))
    print("pytorch resumed ddp's model and optimizer, and saved its own")


if __name__ == "__main__":
    main()
