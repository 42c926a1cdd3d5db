// RefusingLargeAllocations: while one lives, libtorch's CPU allocator refuses every allocation of
// at least `refuse_from` bytes with a c10::Error, as an exhausted memory would, and serves the rest
// as before. For tests of what an out-of-memory leaves behind: the failure is deterministic,
// whatever glibc keeps mapped (an RLIMIT_AS cap is not).
//
//   { test::RefusingLargeAllocations refusing(8 << 20); model->forward(x); }  // throws
#pragma once

#include <cstddef>

#include <c10/core/Allocator.h>
#include <c10/util/Exception.h>
#include <torch/version.h>

namespace ddp::test {

// c10::Allocator's allocate lost its const, and copy_data came, in PyTorch 2.3.
#define DDP_TEST_ALLOCATOR_2_3 \
  (TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 3))

class RefusingLargeAllocations final : public c10::Allocator {
 public:
  explicit RefusingLargeAllocations(std::size_t refuse_from)
      : inner_(c10::GetAllocator(c10::DeviceType::CPU)), refuse_from_(refuse_from) {
    c10::SetAllocator(c10::DeviceType::CPU, this, /*priority=*/255);
  }
  ~RefusingLargeAllocations() override {
    c10::SetAllocator(c10::DeviceType::CPU, inner_, /*priority=*/255);
  }
  RefusingLargeAllocations(const RefusingLargeAllocations&) = delete;
  RefusingLargeAllocations& operator=(const RefusingLargeAllocations&) = delete;

#if DDP_TEST_ALLOCATOR_2_3
  c10::DataPtr allocate(std::size_t n) override {
#else
  c10::DataPtr allocate(std::size_t n) const override {
#endif
    TORCH_CHECK(n < refuse_from_, "RefusingLargeAllocations: ", n, " bytes refused");
    return inner_->allocate(n);
  }
  c10::DeleterFnPtr raw_deleter() const override {
    return inner_->raw_deleter();
  }
#if DDP_TEST_ALLOCATOR_2_3
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    inner_->copy_data(dest, src, count);
  }
#endif

 private:
  c10::Allocator* inner_;
  std::size_t refuse_from_;
};

}  // namespace ddp::test
