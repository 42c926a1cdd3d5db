// libc10's std::string entry point, built with the pre-C++11 ABI (_GLIBCXX_USE_CXX11_ABI=0) as
// some libtorch archives are: ddp's configure must refuse to link against it.
#include <c10/core/Device.h>

namespace c10 {
Device::Device(const std::string& /*device_string*/) : type_(DeviceType::CPU), index_(-1) {}
}  // namespace c10
