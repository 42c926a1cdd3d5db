/* mpi_allreduce: OpenMPI's own MPI_Allreduce (float32, sum), timed exactly as ddp-bench times
 * ddp's allreduce, so that bench/compare/compare_allreduce.py can put them side by side.
 *
 *   mpirun -np 2 mpi_allreduce --sizes 1K,64K,1M --iters 20 --warmup 5 --label openmpi
 *   mpirun -np 2 mpi_allreduce --thread-multiple --label openmpi-mt   # MPI_THREAD_MULTIPLE
 *
 * --thread-multiple initialises MPI at MPI_THREAD_MULTIPLE, as a library with threads of its own
 * (ddp's mpi backend) must: OpenMPI's blocking calls then wait through its multi-threaded
 * synchronisation objects, which is what that costs (docs/benchmarks.md, "mpi backend").
 *
 * Timing: every iteration starts with MPI_Barrier (not timed); each rank times its own
 * out-of-place MPI_Allreduce; afterwards the per-iteration times are reduced with MAX over ranks,
 * and rank 0 prints the median of those, one JSON object per size (the fields of ddp-bench
 * --json). Buffers are allocated and touched once, for the largest size, before any timing. The
 * result of the last iteration of every size is checked ("wrong" counts differing elements).
 * Exit codes: 0 success, 2 bad arguments (MPI errors abort the job, MPI's default). */
#include <mpi.h>

#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_SIZES 64

static int usage(int rank, const char* message, const char* value) {
  if (rank == 0) {
    fprintf(stderr,
            "mpi_allreduce: error: %s '%s'\n"
            "usage: mpi_allreduce [--sizes 1K,64K,1M] [--iters N>=1] [--warmup N>=0] "
            "[--label NAME] [--thread-multiple]\n",
            message, value);
  }
  MPI_Finalize();
  return 2;
}

/* "64K" -> 65536; 0 on a malformed size. */
static size_t parse_size(const char* text) {
  char* end = NULL;
  unsigned long long value = strtoull(text, &end, 10);
  if (end == text || value == 0) return 0;
  switch (tolower((unsigned char)*end)) {
    case '\0':
      return (size_t)value;
    case 'k':
      value <<= 10;
      break;
    case 'm':
      value <<= 20;
      break;
    case 'g':
      value <<= 30;
      break;
    default:
      return 0;
  }
  ++end;
  if (*end == 'i' || *end == 'I') ++end;
  if (*end == 'b' || *end == 'B') ++end;
  return *end == '\0' ? (size_t)value : 0;
}

static int compare_doubles(const void* a, const void* b) {
  const double x = *(const double*)a, y = *(const double*)b;
  return (x > y) - (x < y);
}

/* Input element i of rank r: small whole numbers, so sums are exact (as ddp-bench's check). */
static float input_value(int r, size_t i) {
  return (float)((i % 8 * 5 + (size_t)r * 3) % 8);
}

int main(int argc, char** argv) {
  int thread_multiple = 0;
  for (int i = 1; i < argc; ++i) {
    if (strcmp(argv[i], "--thread-multiple") == 0) thread_multiple = 1;
  }
  if (thread_multiple) {
    int provided = MPI_THREAD_SINGLE;
    MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  } else {
    MPI_Init(&argc, &argv);
  }
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);

  size_t sizes[MAX_SIZES];
  int n_sizes = 0;
  int iters = 20, warmup = 5;
  const char* label = "openmpi";
  const char* size_list = "1K,64K,1M,16M,64M";
  for (int i = 1; i < argc; ++i) {
    const char* value = i + 1 < argc ? argv[i + 1] : "";
    if (strcmp(argv[i], "--sizes") == 0) {
      size_list = value, ++i;
    } else if (strcmp(argv[i], "--iters") == 0) {
      iters = atoi(value), ++i;
      if (iters < 1) return usage(rank, "--iters must be at least 1, got", value);
    } else if (strcmp(argv[i], "--warmup") == 0) {
      char* end = NULL;
      warmup = (int)strtol(value, &end, 10), ++i;
      if (end == value || *end != '\0' || warmup < 0)
        return usage(rank, "--warmup must be 0 or more, got", value);
    } else if (strcmp(argv[i], "--label") == 0) {
      label = value, ++i;
    } else if (strcmp(argv[i], "--thread-multiple") == 0) {
      /* read before MPI_Init */
    } else {
      return usage(rank, "unknown argument", argv[i]);
    }
  }
  char list[1024];
  snprintf(list, sizeof list, "%s", size_list);
  for (char* word = strtok(list, ","); word != NULL; word = strtok(NULL, ",")) {
    if (n_sizes == MAX_SIZES) return usage(rank, "too many sizes in", size_list);
    sizes[n_sizes] = parse_size(word);
    if (sizes[n_sizes] == 0) return usage(rank, "--sizes has a bad size", word);
    ++n_sizes;
  }

  size_t max_count = 1;
  for (int s = 0; s < n_sizes; ++s) {
    if (sizes[s] / sizeof(float) > max_count) max_count = sizes[s] / sizeof(float);
  }
  float* send = malloc(max_count * sizeof(float));
  float* recv = malloc(max_count * sizeof(float));
  double* times = malloc((size_t)iters * sizeof(double));
  if (send == NULL || recv == NULL || times == NULL) {
    fprintf(stderr, "mpi_allreduce: rank %d: out of memory\n", rank);
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  for (size_t i = 0; i < max_count; ++i)
    send[i] = input_value(rank, i);
  memset(recv, 0, max_count * sizeof(float));

  for (int s = 0; s < n_sizes; ++s) {
    size_t count = sizes[s] / sizeof(float);
    if (count == 0) count = 1;
    for (int it = 0; it < warmup + iters; ++it) {
      MPI_Barrier(MPI_COMM_WORLD);
      const double start = MPI_Wtime();
      MPI_Allreduce(send, recv, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      const double stop = MPI_Wtime();
      if (it >= warmup) times[it - warmup] = (stop - start) * 1e6;
    }
    long long wrong = 0;
    for (size_t i = 0; i < count; ++i) {
      float expect = 0;
      for (int r = 0; r < size; ++r)
        expect += input_value(r, i);
      if (recv[i] != expect) ++wrong;
    }
    MPI_Allreduce(MPI_IN_PLACE, times, iters, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    MPI_Allreduce(MPI_IN_PLACE, &wrong, 1, MPI_LONG_LONG, MPI_SUM, MPI_COMM_WORLD);
    if (rank == 0) {
      qsort(times, (size_t)iters, sizeof(double), compare_doubles);
      const double median =
          iters % 2 ? times[iters / 2] : (times[iters / 2 - 1] + times[iters / 2]) / 2.0;
      const size_t bytes = count * sizeof(float);
      const double algbw = (double)bytes / (median * 1e-6) / 1e9;
      printf(
          "{\"op\":\"allreduce\",\"bytes\":%zu,\"count\":%zu,\"dtype\":\"float32\","
          "\"reduce_op\":\"sum\",\"time_us\":%.3f,\"time_min_us\":%.3f,\"time_max_us\":%.3f,"
          "\"algbw_gbps\":%.6f,\"busbw_gbps\":%.6f,\"wrong\":%lld,\"iters\":%d,\"warmup\":%d,"
          "\"world_size\":%d,\"backend\":\"%s\"}\n",
          bytes, count, median, times[0], times[iters - 1], algbw, algbw * 2.0 * (size - 1) / size,
          wrong, iters, warmup, size, label);
      fflush(stdout);
    }
  }
  free(send);
  free(recv);
  free(times);
  MPI_Finalize();
  return 0;
}
