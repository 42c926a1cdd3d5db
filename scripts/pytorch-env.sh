# Sourced by the scripts: where PyTorch's current release (from PyPI) lives.
# DDP_PYTORCH_VENV may be set to use another environment with the same version.
DDP_PYTORCH_VERSION=2.15.0
DDP_PYTORCH_VENV=${DDP_PYTORCH_VENV:-/opt/ddp/pytorch-$DDP_PYTORCH_VERSION-venv}
