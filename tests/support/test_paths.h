// Paths of this checkout and this build that tests run: PyTorch reference scripts and the Python
// interpreters to run them with. Each test executable that uses them gets one small generated
// source defining them (ddp_test_paths, tests/CMakeLists.txt); a name used by an executable that
// did not define it fails to link.
//
// Why not -D macros: a macro holding an absolute path of the checkout is part of every translation
// unit of its executable, and ccache, whose CCACHE_BASEDIR rewrites include paths but not macro
// values, then misses all of them (tests/torch's unity batches: minutes) in a clone at another
// path, as a fresh CI clone is; here only the generated source differs.
#pragma once

namespace ddp::test::paths {

extern const char* const pytorch_python;             // scripts/pytorch-python (PyTorch 2.x)
extern const char* const join_reference_script;      // tests/torch/api/pytorch_join_reference.py
extern const char* const torchscript_export_script;  // tests/torch/ddp/export_torchscript_model.py
extern const char* const zero_reference_script;      // tests/torch/zero/pytorch_zero_reference.py
extern const char* const powersgd_reference_script;  // .../hooks/pytorch_powersgd_reference.py
extern const char* const pytorch_dcp_load_script;    // tests/torch/checkpoint/pytorch_dcp_load.py
extern const char* const pytorch_dcp_model_state_script;  // .../pytorch_dcp_model_state.py
extern const char* const state_dict_python;          // the Python of this build's libtorch
extern const char* const state_dict_other_python;    // the other libtorch's Python
extern const char* const state_dict_reference_script;  // .../formats/state_dict_reference.py
extern const char* const sampler_reference_script;     // .../samplers/pytorch_sampler_reference.py
extern const char* const run_under_mpirun;  // tests/mpi/run_under_mpirun.sh
extern const char* const dcp_fixtures;  // tests/data/dcp: PyTorch-written distributed checkpoints

}  // namespace ddp::test::paths
