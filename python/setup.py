"""torch_ddp: ddp's collective engine as a torch.distributed backend.

    scripts/pytorch-python -m pip install ./python

builds the extension with CMake against the PyTorch of the Python that runs pip (the project's
own build, configured with DDP_BUILD_PYTHON=ON: ../build-python/, or TORCH_DDP_BUILD_DIR to reuse
a build folder configured that way, as the test command does; a relative path is taken from
the repository root) and installs the package with
libddp_comm beside the extension. Needs cmake, ninja and a C++20 compiler
(scripts/install-deps.sh installs them).
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        try:
            import torch
        except ImportError as e:  # pip's build isolation, or a Python without PyTorch
            raise RuntimeError(
                "torch_ddp builds against the PyTorch of the Python that installs it, and this "
                f"one ({sys.executable}) cannot import torch: install PyTorch first, and if pip "
                "isolates the build, pass --no-build-isolation"
            ) from e
        build_dir = os.environ.get("TORCH_DDP_BUILD_DIR") or os.path.join(ROOT, "build-python")
        # pip runs this from a copy or from python/, not from where it was called: a relative
        # folder is taken from the repository root (scripts/test.sh passes build-pytorch).
        build_dir = os.path.abspath(os.path.join(ROOT, build_dir))
        configure = [
            "cmake", "-S", ROOT, "-B", build_dir, "-G", "Ninja",
            "-DDDP_LIBTORCH=pytorch", f"-DDDP_PYTORCH_VENV={sys.prefix}",
            f"-DTorch_DIR={os.path.join(torch.utils.cmake_prefix_path, 'Torch')}",
            f"-DPython3_EXECUTABLE={sys.executable}", "-DDDP_BUILD_PYTHON=ON",
        ]
        if not os.path.exists(os.path.join(build_dir, "CMakeCache.txt")):
            # A folder of its own builds only what the package needs.
            configure += ["-DCMAKE_BUILD_TYPE=RelWithDebInfo", "-DDDP_BUILD_TESTS=OFF",
                          "-DDDP_BUILD_BENCH=OFF"]
        subprocess.check_call(configure)
        subprocess.check_call(["cmake", "--build", build_dir, "--target", "torch_ddp_c"])

        built = glob.glob(os.path.join(build_dir, "python", "torch_ddp", "_C*.so"))
        if len(built) != 1:
            raise RuntimeError(f"torch_ddp: expected one _C module in {build_dir}/python/torch_ddp, "
                               f"found {built}")
        target = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copy2(built[0], target)
        # The engine's library under its soname (libddp_comm.so.0), which _C's RUNPATH ($ORIGIN)
        # finds beside it.
        sonames = [lib for lib in glob.glob(os.path.join(build_dir, "lib", "libddp_comm.so.*"))
                   if re.fullmatch(r"libddp_comm\.so\.\d+", os.path.basename(lib))]
        if len(sonames) != 1:
            raise RuntimeError(f"torch_ddp: expected one libddp_comm.so.N in {build_dir}/lib, "
                               f"found {sonames}")
        shutil.copy2(sonames[0], os.path.join(os.path.dirname(target),
                                              os.path.basename(sonames[0])))


setup(
    name="torch_ddp",
    version="0.1.0",
    description="ddp's collective engine (shared memory and TCP) as a torch.distributed backend",
    packages=["torch_ddp"],
    ext_modules=[Extension("torch_ddp._C", sources=[])],
    cmdclass={"build_ext": CMakeBuild},
    # PyTorch loads the registrar on the first init_process_group("ddp") of a process that never
    # imported torch_ddp (a spawned rank, a torchrun script).
    entry_points={"torch.distributed.backends": ["ddp = torch_ddp:_register"]},
    python_requires=">=3.9",
    zip_safe=False,
)
