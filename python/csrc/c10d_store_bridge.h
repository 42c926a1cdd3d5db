// C10dStoreBridge: a ddp::Store over the c10d::Store that torch.distributed hands a backend
// (torchrun's TCPStore, a FileStore, the PrefixStore of each group), so ddp's ring group meets
// its peers where PyTorch's rendezvous put them: `torchrun` works unchanged.
//
// Errors: a c10d timeout is a ddp::TimeoutError and any other store failure a ddp::StoreError,
// each carrying c10d's message, so the ring's set-up reports them as it reports its own store's.
#pragma once

#include <torch/extension.h>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "ddp/store/store.h"

namespace torch_ddp {

class C10dStoreBridge : public ddp::Store {
 public:
  explicit C10dStoreBridge(c10::intrusive_ptr<c10d::Store> store);

  void set(std::string_view key, std::span<const std::uint8_t> value) override;
  ddp::Bytes get(std::string_view key, ddp::Milliseconds timeout) override;
  std::int64_t add(std::string_view key, std::int64_t delta) override;
  ddp::Bytes compare_set(std::string_view key, std::span<const std::uint8_t> expected,
                         std::span<const std::uint8_t> desired) override;
  bool check(std::span<const std::string> keys) override;
  void wait(std::span<const std::string> keys, ddp::Milliseconds timeout) override;
  bool delete_key(std::string_view key) override;
  std::int64_t num_keys() override;

 private:
  c10::intrusive_ptr<c10d::Store> store_;
};

}  // namespace torch_ddp
