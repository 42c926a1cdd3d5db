"""The Python side of tests/torch/formats/state_dict_test.cc: state dicts and optimizer state that cross
between PyTorch (1.13 or 2.x, whichever runs this) and ddp's C++.

  state_dict_reference.py exchange DIR

first checks what the C++ test saved in DIR: loads it (weights_only=True where this PyTorch can),
continues K steps, compares with C++'s own continuation, and exits 1 naming the first difference;
then writes what Python saves (model and optimizer state after N steps, the parameters after N+K
steps, files that are not state dicts) for the C++ test to load. One run per test, as importing
PyTorch 2.x takes seconds.

The model and the optimizers' settings here must match make_model()/make_optimizer() in the test.
"""
import collections
import os
import sys

import torch
import torch.nn.functional as F

N_STEPS, K_STEPS = 3, 3
TOLERANCE = 1e-5
OPTIMIZERS = ["sgd", "adam", "adamw"]
# PyTorch 1.13's weights_only unpickler has no BINFLOAT: optimizer state (floats) needs the full
# unpickler there (torch.load of a trusted file, as Python's own optimizer state needs).
OPTIMIZER_WEIGHTS_ONLY = not torch.__version__.startswith("1.")


def make_model():
    return torch.nn.Sequential(
        # ReLU before BatchNorm: a bias right before BatchNorm gets a gradient of rounding noise,
        # whose sign Adam's first steps follow, so the trajectory would not be comparable.
        torch.nn.Conv2d(1, 2, 3),
        torch.nn.ReLU(),
        torch.nn.BatchNorm2d(2),
        torch.nn.Flatten(),
        torch.nn.Linear(8, 3),
    )


def make_optimizer(name, params, other=False):
    """The settings both sides train with; other=True: different ones, which a load replaces."""
    if name == "sgd":
        if other:
            return torch.optim.SGD(params, lr=1.0, momentum=0.1)
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-3, nesterov=True)
    if name == "adam":
        if other:
            return torch.optim.Adam(params, lr=1.0, amsgrad=True)
        return torch.optim.Adam(params, lr=0.01, betas=(0.8, 0.95), eps=1e-7, weight_decay=1e-3,
                                amsgrad=True)
    if other:
        return torch.optim.AdamW(params, lr=1.0)
    return torch.optim.AdamW(params, lr=0.01, betas=(0.9, 0.98), weight_decay=0.05)


def train(model, optimizer, data, steps):
    model.train()
    for _ in range(steps):
        optimizer.zero_grad()
        F.cross_entropy(model(data["x"]), data["y"]).backward()
        optimizer.step()


def fail(message):
    print(f"state_dict_reference.py (torch {torch.__version__}): {message}")
    sys.exit(1)


class Evil:
    def __reduce__(self):
        return (os.system, ("echo this must never run",))


def prepare(d):
    data = torch.load(f"{d}/data.pt", weights_only=True)  # written by the C++ test
    torch.manual_seed(0)
    model = make_model()
    model(data["x"])  # moves the BatchNorm statistics off their initial values
    torch.save(model.state_dict(), f"{d}/py_model.pt")
    model.eval()
    torch.save({"input": data["x"], "output": model(data["x"]).detach()}, f"{d}/py_forward.pt")
    for name in OPTIMIZERS:
        torch.manual_seed(1)
        model = make_model()
        optimizer = make_optimizer(name, model.parameters())
        train(model, optimizer, data, N_STEPS)
        torch.save(model.state_dict(), f"{d}/py_{name}_model.pt")
        torch.save(optimizer.state_dict(), f"{d}/py_{name}_optim.pt")
        train(model, optimizer, data, K_STEPS)
        torch.save(model.state_dict(), f"{d}/py_{name}_after.pt")
    # Files that are not state dicts.
    model = make_model()
    torch.save(model, f"{d}/full_model.pt")
    torch.jit.save(torch.jit.script(model), f"{d}/scripted.pt")
    torch.save({"x": Evil()}, f"{d}/os_system.pt")
    torch.save(model.state_dict(), f"{d}/legacy.pt", _use_new_zipfile_serialization=False)
    print("prepared")


def check(d):
    forward = torch.load(f"{d}/cpp_forward.pt", weights_only=True)
    state = torch.load(f"{d}/cpp_model.pt", weights_only=True)
    model = make_model()
    if list(state.keys()) != list(model.state_dict().keys()):
        fail(f"C++ wrote keys {list(state.keys())}, Python's are {list(model.state_dict().keys())}")
    model.load_state_dict(state, strict=True)
    model.eval()
    diff = (model(forward["input"]) - forward["output"]).abs().max().item()
    if diff > TOLERANCE:
        fail(f"the C++ model's forward differs from Python's by {diff}")
    data = torch.load(f"{d}/data.pt", weights_only=True)
    for name in OPTIMIZERS:
        torch.manual_seed(5)
        model = make_model()
        optimizer = make_optimizer(name, model.parameters(), other=True)
        model.load_state_dict(torch.load(f"{d}/cpp_{name}_model.pt", weights_only=True))
        optimizer.load_state_dict(
            torch.load(f"{d}/cpp_{name}_optim.pt", weights_only=OPTIMIZER_WEIGHTS_ONLY))
        wanted = make_optimizer(name, make_model().parameters()).param_groups[0]
        for key in ["lr", "weight_decay"]:
            if optimizer.param_groups[0][key] != wanted[key]:
                fail(f"{name}: {key} {optimizer.param_groups[0][key]} after loading, want {wanted[key]}")
        train(model, optimizer, data, K_STEPS)
        after = torch.load(f"{d}/cpp_{name}_after.pt", weights_only=True)
        for key, value in model.state_dict().items():
            diff = (value.double() - after[key].double()).abs().max().item()
            if diff > TOLERANCE:
                fail(f"{name}: {key} differs from C++'s continuation by {diff}")
    print(f"checked with torch {torch.__version__}")


if __name__ == "__main__":
    assert sys.argv[1] == "exchange", sys.argv
    check(sys.argv[2])
    prepare(sys.argv[2])
