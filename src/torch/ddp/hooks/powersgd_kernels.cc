#include "torch/ddp/hooks/powersgd_kernels.h"

namespace ddp::powersgd_detail {

namespace {

// One row: out[j] = sum_k p[k] * qt[k][j]; the loops over j are unit-stride and vectorise.
template <class T>
void approximate_row(T* __restrict out, const T* __restrict p, const T* __restrict qt,
                     std::int64_t m, std::int64_t rank) {
  const T p0 = p[0];
  for (std::int64_t j = 0; j < m; ++j)
    out[j] = p0 * qt[j];
  for (std::int64_t k = 1; k < rank; ++k) {
    const T pk = p[k];
    const T* __restrict row = qt + k * m;
    for (std::int64_t j = 0; j < m; ++j)
      out[j] += pk * row[j];
  }
}

}  // namespace

template <class T>
void decompress(T* matrix, T* error, const T* p, const T* qt, std::int64_t n, std::int64_t m,
                std::int64_t rank) {
  if (error == nullptr) {
    for (std::int64_t i = 0; i < n; ++i)
      approximate_row(matrix + i * m, p + i * rank, qt, m, rank);
    return;
  }
  if (rank == 1) {
    for (std::int64_t i = 0; i < n; ++i) {
      T* __restrict row = matrix + i * m;
      T* __restrict err = error + i * m;
      const T* __restrict q = qt;
      const T pi = p[i];
      for (std::int64_t j = 0; j < m; ++j) {
        const T approx = pi * q[j];
        err[j] = row[j] - approx;
        row[j] = approx;
      }
    }
    return;
  }
  // Higher ranks: the row's approximation goes to the error row first, then both are finished in
  // one more pass over the (cached) row.
  for (std::int64_t i = 0; i < n; ++i) {
    T* __restrict row = matrix + i * m;
    T* __restrict err = error + i * m;
    approximate_row(err, p + i * rank, qt, m, rank);
    for (std::int64_t j = 0; j < m; ++j) {
      const T approx = err[j];
      err[j] = row[j] - approx;
      row[j] = approx;
    }
  }
}

template void decompress<float>(float*, float*, const float*, const float*, std::int64_t,
                                std::int64_t, std::int64_t);
template void decompress<double>(double*, double*, const double*, const double*, std::int64_t,
                                 std::int64_t, std::int64_t);

}  // namespace ddp::powersgd_detail
