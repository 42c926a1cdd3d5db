# Sourced by scripts/train.sh and scripts/test.sh: reads DDP_LIBTORCH (debian, the default, or
# pytorch) and sets ddp_libtorch, ddp_build_dir (build/ or build-pytorch/), ddp_cmake_libtorch
# (the configure arguments) and ddp_libtorch_line (which libtorch, in words).
# shellcheck source=scripts/pytorch-env.sh
source "$(dirname "${BASH_SOURCE[0]}")/pytorch-env.sh"
ddp_libtorch=${DDP_LIBTORCH:-debian}
case $ddp_libtorch in
  debian)
    ddp_build_dir=build
    ddp_cmake_libtorch=(-DDDP_LIBTORCH=debian)
    ddp_libtorch_line="Debian's libtorch-dev $(dpkg-query -W -f='${Version}' libtorch-dev 2>/dev/null ||
      echo '(not installed yet)')"
    ;;
  pytorch)
    ddp_build_dir=build-pytorch
    ddp_cmake_libtorch=(-DDDP_LIBTORCH=pytorch "-DDDP_PYTORCH_VENV=$DDP_PYTORCH_VENV")
    ddp_libtorch_line="PyTorch $DDP_PYTORCH_VERSION from PyPI ($DDP_PYTORCH_VENV)"
    ;;
  *)
    echo "DDP_LIBTORCH is '$ddp_libtorch'; use 'debian' (Debian's libtorch-dev 1.13, the default)" \
         "or 'pytorch' (PyTorch $DDP_PYTORCH_VERSION from PyPI, installed by scripts/install-deps.sh)" >&2
    exit 2
    ;;
esac
