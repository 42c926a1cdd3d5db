// PowerSGD's passes over a bucket as plain loops (powersgd_reduce.cc): no libtorch, so that the
// file is compiled with -O3 for the vectoriser and without the library's precompiled torch header.
// Pure functions on raw row-major buffers; any thread; they do not throw.
#pragma once

#include <cstdint>

namespace ddp::powersgd_detail {

// Decompression of one n x m matrix from its factors, fused with the error feedback:
//   approx[i][j] = sum_k p[i * rank + k] * qt[k * m + j]   (P is n x rank, Q^T is rank x m),
//   error[i * m + j] = matrix[i * m + j] - approx[i][j]    (when error is not null),
//   matrix[i * m + j] = approx[i][j].
// One pass over the matrix where PyTorch's hook makes three (P Q^T, a clone of the input before,
// and the difference after). The sum runs over k in order; for rank 1 it is the single product
// that a matrix product computes too.
template <class T>
void decompress(T* matrix, T* error, const T* p, const T* qt, std::int64_t n, std::int64_t m,
                std::int64_t rank);

extern template void decompress<float>(float*, float*, const float*, const float*, std::int64_t,
                                       std::int64_t, std::int64_t);
extern template void decompress<double>(double*, double*, const double*, const double*,
                                        std::int64_t, std::int64_t, std::int64_t);

}  // namespace ddp::powersgd_detail
