// ddp_c10d_wrap_check: a Python extension built for the tests only (python/CMakeLists.txt), so
// that ddp::wrap_c10d is checked over the c10d gloo group PyTorch's own Python builds. PyPI's
// libtorch ships ProcessGroupGloo.hpp but not the gloo headers it includes, so C++ cannot build a
// ProcessGroupGloo against it; torch.distributed can, and hands the C++ object over through
// pybind11 (test_wrap_c10d_gloo.py). The checks are c10d_process_group_test.cc's
// (tests/support/torch/c10d_wrap_checks.h).
#include <torch/extension.h>

#include <pybind11/chrono.h>
#include <pybind11/stl.h>

#include <chrono>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "ddp/torch/c10d/c10d_process_group.h"
#include "support/torch/c10d_wrap_checks.h"
#include "support/torch/ddp_test_util.h"

namespace {

using namespace std::chrono_literals;
using ddp::test::C10dTraining;

C10dTraining training_named(const std::string& name) {
  if (name == "ddp") return C10dTraining::kDdp;
  if (name == "zero") return C10dTraining::kZero;
  if (name == "sync_batch_norm") return C10dTraining::kSyncBatchNorm;
  if (name == "join") return C10dTraining::kJoin;
  throw std::invalid_argument("unknown training '" + name +
                              "' (ddp, zero, sync_batch_norm or join)");
}

}  // namespace

PYBIND11_MODULE(ddp_c10d_wrap_check, m) {
  m.doc() = "ddp::wrap_c10d over c10d groups built by torch.distributed (tests only)";
  // A ddp process group: what wrap_c10d returns, or ddp's own ring group.
  py::class_<ddp::ProcessGroup, std::shared_ptr<ddp::ProcessGroup>>(m, "ProcessGroup")
      .def("rank", &ddp::ProcessGroup::rank)
      .def("size", &ddp::ProcessGroup::size);
  // The two kinds of c10d object wrap_c10d takes: the ProcessGroup torch.distributed returns and
  // the Backend inside it (pg._get_backend(device)).
  m.def(
      "wrap_group",
      [](const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
        return ddp::wrap_c10d(group, {.name = "c10d-group", .timeout = 60s});
      },
      py::arg("group"));
  m.def(
      "wrap_backend",
      [](const c10::intrusive_ptr<c10d::Backend>& backend) {
        return ddp::wrap_c10d(backend, {.name = "c10d-backend", .timeout = 60s});
      },
      py::arg("backend"));
  // ddp's ring group of `size` ranks, rank 0 serving the rendezvous store on 127.0.0.1:port.
  m.def("ring_group", &ddp::test::join_group, py::arg("rank"), py::arg("size"), py::arg("port"),
        py::arg("timeout") = std::chrono::milliseconds(60s),
        py::call_guard<py::gil_scoped_release>());
  m.def(
      "check_every_operation",
      [](const std::shared_ptr<ddp::ProcessGroup>& pg) { ddp::test::check_every_operation(*pg); },
      py::arg("group"), py::call_guard<py::gil_scoped_release>());
  // Trains the check model on this rank (world 2) and returns its parameters then buffers.
  m.def(
      "train",
      [](const std::shared_ptr<ddp::ProcessGroup>& pg, const std::string& training) {
        return ddp::test::train_c10d_check_model(pg, training_named(training));
      },
      py::arg("group"), py::arg("training"), py::call_guard<py::gil_scoped_release>());
  m.def(
      "initial_parameters",
      [](bool batch_norm) { return ddp::test::make_c10d_check_model(batch_norm)->parameters(); },
      py::arg("batch_norm"));
}
