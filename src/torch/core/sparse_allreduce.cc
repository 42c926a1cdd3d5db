#include "torch/core/sparse_allreduce.h"

#include <vector>

#include "ddp/torch/core/tensor_collectives.h"

namespace ddp::detail {

torch::Tensor sparse_all_reduce_sum(const torch::Tensor& sparse, ProcessGroup& group,
                                    std::size_t& bytes_sent) {
  torch::NoGradGuard no_grad;
  const torch::Tensor input = sparse.coalesce();
  const torch::Tensor indices = input._indices().contiguous();  // [sparse_dim, nnz], int64
  const torch::Tensor values = input._values().contiguous();    // [nnz, dense dims...]
  const DType value_type = to_dtype(values.scalar_type());
  const std::int64_t sparse_dim = indices.size(0);
  std::int64_t per_value = 1;  // elements per entry: the product of the dense dims
  for (std::int64_t d = 1; d < values.dim(); ++d)
    per_value *= values.size(d);
  const int size = group.size();
  std::int64_t mine = input._nnz();
  std::vector<std::int64_t> nnz(static_cast<std::size_t>(size));
  group.allgather(&mine, nnz.data(), 1, DType::kInt64)->wait();
  std::vector<std::size_t> index_counts(nnz.size()), value_counts(nnz.size());
  std::int64_t total = 0;
  for (std::size_t r = 0; r < nnz.size(); ++r) {
    index_counts[r] = static_cast<std::size_t>(sparse_dim * nnz[r]);
    value_counts[r] = static_cast<std::size_t>(per_value * nnz[r]);
    total += nnz[r];
  }
  torch::Tensor all_indices = torch::empty({sparse_dim * total}, indices.options());
  std::vector<std::int64_t> value_shape = values.sizes().vec();
  value_shape[0] = total;
  torch::Tensor all_values = torch::empty(value_shape, values.options());
  const auto rank = static_cast<std::size_t>(group.rank());
  auto index_work = group.allgather_v(indices.data_ptr(), index_counts[rank],
                                      all_indices.data_ptr(), index_counts, DType::kInt64);
  auto value_work = group.allgather_v(values.data_ptr(), value_counts[rank], all_values.data_ptr(),
                                      value_counts, value_type);
  index_work->wait();
  value_work->wait();
  bytes_sent += sizeof(mine) + static_cast<std::size_t>(indices.nbytes()) +
                static_cast<std::size_t>(values.nbytes());
  // Rank r's indices are a [sparse_dim, nnz_r] block: side by side, they index all_values.
  std::vector<torch::Tensor> index_blocks;
  std::int64_t offset = 0;
  for (const auto n : nnz) {
    index_blocks.push_back(
        all_indices.narrow(0, offset * sparse_dim, n * sparse_dim).view({sparse_dim, n}));
    offset += n;
  }
  return torch::sparse_coo_tensor(torch::cat(index_blocks, 1), all_values, input.sizes())
      .coalesce();
}

}  // namespace ddp::detail
