#include "archive/crc32.h"

#include <libdeflate.h>

namespace ddp::archive {

std::uint32_t crc32(const void* data, std::size_t size, std::uint32_t crc) {
  return libdeflate_crc32(crc, data, size);
}

}  // namespace ddp::archive
