// torch_ddp._C: the creator torch_ddp/__init__.py registers with torch.distributed, and what the
// tests ask of a live backend.
#include <torch/extension.h>

#include <pybind11/chrono.h>

#include <chrono>
#include <string>

#include "ddp/comm/ring_process_group.h"
#include "ddp_backend.h"

namespace {

c10::intrusive_ptr<c10d::Backend> create_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                                 int rank, int size,
                                                 std::chrono::milliseconds timeout,
                                                 const std::string& group_name) {
  return torch_ddp::DdpBackend::create(store, rank, size, timeout, group_name);
}

const torch_ddp::DdpBackend& as_ddp(const c10::intrusive_ptr<c10d::Backend>& backend) {
  const auto* ddp = dynamic_cast<const torch_ddp::DdpBackend*>(backend.get());
  TORCH_CHECK(ddp != nullptr, "torch_ddp: this backend is ",
              backend ? backend->getBackendName() : std::string("None"), ", not ddp");
  return *ddp;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "ddp's collective engine as a torch.distributed backend (docs/pytorch-backend.md)";
  // Releases the GIL: creating the group waits for the other ranks to connect.
  m.def("_create_backend", torch::wrap_pybind_function_no_gil(create_backend), py::arg("store"),
        py::arg("rank"), py::arg("size"), py::arg("timeout"), py::arg("group_name"));
  m.def("_transport",
        torch::wrap_pybind_function([](const c10::intrusive_ptr<c10d::Backend>& backend) {
          return ddp::ring_transport_of(*as_ddp(backend).group());
        }),
        "How a ddp backend's group moves data: 'shm', 'tcp' or 'hierarchical(...)'");
}
