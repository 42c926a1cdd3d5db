#include "comm/mpi/mpi_runtime.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <thread>

#include <fmt/format.h>

#include "comm/reduce_kernels.h"
#include "comm/wire.h"
#include "ddp/error.h"

namespace ddp::comm::mpi {
namespace {

// MPI has no float16/bfloat16 in OpenMPI 4.1: they travel as 2-byte opaque elements and reduce
// through these, which widen to float32 and round back to nearest even (the engine's kernels).
// MPI asks for inoutvec = invec op inoutvec; every ReduceOp here is commutative.
template <DType kDType, ReduceOp kOp>
void reduce_16bit(void* invec, void* inoutvec, int* len, MPI_Datatype*) {
  comm::reduce(inoutvec, inoutvec, invec, static_cast<std::size_t>(*len), kDType, kOp);
}

int op_index(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      return 0;
    case ReduceOp::kMin:
      return 1;
    case ReduceOp::kMax:
      return 2;
    case ReduceOp::kProduct:
      return 3;
    case ReduceOp::kBand:
    case ReduceOp::kBor:
    case ReduceOp::kBxor:
      break;  // integers only (argument_checks.cc): never a 16-bit float
  }
  return 0;
}

bool mpi_is_up() {
  int initialized = 0;
  int finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  return initialized && !finalized;
}

std::terminate_handler previous_terminate = nullptr;

// An uncaught exception (in any thread) or an explicit std::terminate: without this, the rank
// dies and mpirun ends the job only after noticing, or (when the program catches and exits
// "cleanly") the peers wait for it until their deadlines. The reason names the exception.
[[noreturn]] void terminate_handler() {
  std::string reason = "std::terminate was called";
  if (auto error = std::current_exception()) {
    try {
      std::rethrow_exception(error);
    } catch (const std::exception& e) {
      reason = fmt::format("std::terminate after an uncaught exception: {}", e.what());
    } catch (...) {
      reason = "std::terminate after an uncaught exception that is not a std::exception";
    }
  }
  if (mpi_is_up()) MpiRuntime::abort_job(reason, 1);
  if (previous_terminate) previous_terminate();
  std::abort();
}

void exit_hook(int status, void*) {
  MpiRuntime::instance().on_exit(status);
}

void check(int rc, const char* what) {
  if (rc != MPI_SUCCESS) {
    throw ConfigError(fmt::format("mpi backend: {} failed: {}", what, mpi_error_text(rc)));
  }
}

}  // namespace

std::string mpi_error_text(int code) {
  // A failed non-blocking collective may carry an internal (negative) OpenMPI code, which
  // MPI_Error_string would reject through MPI_COMM_WORLD's error handler.
  if (code < 0 || code > MPI_ERR_LASTCODE) return fmt::format("MPI error code {}", code);
  char text[MPI_MAX_ERROR_STRING] = {};
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS) {
    return fmt::format("MPI error code {}", code);
  }
  return fmt::format("{} (MPI error code {})", std::string(text, static_cast<std::size_t>(length)),
                     code);
}

MpiRuntime& MpiRuntime::instance() {
  // Never destroyed: groups may outlive static destructors, and MPI_Finalize runs from atexit.
  static MpiRuntime* runtime = new MpiRuntime();
  return *runtime;
}

MpiRuntime::MpiRuntime() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) {
    throw ConfigError(
        "mpi backend: MPI was already finalised in this process; create the group "
        "before MPI_Finalize");
  }
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (initialized) {
    MPI_Query_thread(&thread_level_);
    if (thread_level_ < MPI_THREAD_SERIALIZED) {
      throw ConfigError(fmt::format(
          "mpi backend: the program initialised MPI with thread level {} but ddp calls MPI from "
          "its worker threads; initialise it with MPI_Init_thread(..., MPI_THREAD_MULTIPLE, ...) "
          "(or MPI_THREAD_SERIALIZED), or let ddp initialise it",
          thread_level_));
    }
  } else {
    check(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &thread_level_),
          "MPI_Init_thread");
    // We initialised it, so we finalise it (exit_hook, below).
    finalize_at_exit_ = true;
    // OpenMPI 4.1 reports the failure of an abandoned non-blocking collective (a mismatched call
    // of a poisoned group, MPI_ERR_TRUNCATE) from a later MPI_Test through MPI_COMM_WORLD's error
    // handler; the default, MPI_ERRORS_ARE_FATAL, would end the rank before the mismatch is named
    // (and the peers are told). ddp owns this MPI, so its errors come back as codes.
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    if (thread_level_ < MPI_THREAD_SERIALIZED) {
      throw ConfigError(fmt::format(
          "mpi backend: this MPI library offers thread level {} only; ddp needs "
          "MPI_THREAD_SERIALIZED or MPI_THREAD_MULTIPLE (rebuild MPI with thread support)",
          thread_level_));
    }
  }
  serialize_ = thread_level_ < MPI_THREAD_MULTIPLE;
  // Registered after MPI_Init so that it runs before MPI's own exit handlers. on_exit (glibc)
  // rather than atexit: it sees the exit status, and a failing rank must not reach MPI_Finalize.
  ::on_exit(exit_hook, nullptr);
  previous_terminate = std::set_terminate(terminate_handler);

  void* tag_ub = nullptr;
  int found = 0;
  if (MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &tag_ub, &found) == MPI_SUCCESS && found) {
    max_tag_ = *static_cast<int*>(tag_ub);
  }

  check(MPI_Type_contiguous(2, MPI_BYTE, &half_), "MPI_Type_contiguous (float16)");
  check(MPI_Type_commit(&half_), "MPI_Type_commit (float16)");
  check(MPI_Type_contiguous(2, MPI_BYTE, &bfloat16_), "MPI_Type_contiguous (bfloat16)");
  check(MPI_Type_commit(&bfloat16_), "MPI_Type_commit (bfloat16)");
  constexpr int kCommutes = 1;
  check(MPI_Op_create(reduce_16bit<DType::kFloat16, ReduceOp::kSum>, kCommutes, &half_ops_[0]),
        "MPI_Op_create");
  check(MPI_Op_create(reduce_16bit<DType::kFloat16, ReduceOp::kMin>, kCommutes, &half_ops_[1]),
        "MPI_Op_create");
  check(MPI_Op_create(reduce_16bit<DType::kFloat16, ReduceOp::kMax>, kCommutes, &half_ops_[2]),
        "MPI_Op_create");
  check(MPI_Op_create(reduce_16bit<DType::kFloat16, ReduceOp::kProduct>, kCommutes, &half_ops_[3]),
        "MPI_Op_create");
  check(MPI_Op_create(reduce_16bit<DType::kBFloat16, ReduceOp::kSum>, kCommutes, &bfloat16_ops_[0]),
        "MPI_Op_create");
  check(MPI_Op_create(reduce_16bit<DType::kBFloat16, ReduceOp::kMin>, kCommutes, &bfloat16_ops_[1]),
        "MPI_Op_create");
  check(MPI_Op_create(reduce_16bit<DType::kBFloat16, ReduceOp::kMax>, kCommutes, &bfloat16_ops_[2]),
        "MPI_Op_create");
  check(MPI_Op_create(reduce_16bit<DType::kBFloat16, ReduceOp::kProduct>, kCommutes,
                      &bfloat16_ops_[3]),
        "MPI_Op_create");
}

void MpiRuntime::abort_job(const std::string& reason, int code) {
  static std::atomic<bool> aborting{false};
  if (aborting.exchange(true)) {
    for (;;)
      std::this_thread::sleep_for(std::chrono::seconds(1));  // the first caller aborts
  }
  int rank = -1;
  int size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  std::fflush(stdout);
  std::fprintf(stderr,
               "ddp (mpi backend): rank %d of %d: %s; ending every rank of the job (MPI_Abort, "
               "code %d)\n",
               rank, size, reason.c_str(), code);
  std::fflush(stderr);
  MPI_Abort(MPI_COMM_WORLD, code);
  std::_Exit(code != 0 ? code : 1);  // MPI_Abort does not return; in case it does
}

namespace {
constexpr int kNoticeTag = 1;
// Kept of the notices no call has asked for (e.g. "left" notices of groups destroyed everywhere).
constexpr std::size_t kMaxNotices = 256;
}  // namespace

std::vector<std::string> MpiRuntime::notices(const std::string& group) {
  static_cast<void>(find_notice(group));  // reads what is pending
  std::lock_guard guard(notices_mutex_);
  std::vector<std::string> result;
  for (const auto& [name, text] : notices_) {
    if (name == group) result.push_back(text);
  }
  return result;
}

bool MpiRuntime::has_notice_comm() {
  std::lock_guard lock(notices_mutex_);
  return notice_comm_ != MPI_COMM_NULL;
}

MPI_Comm MpiRuntime::notice_comm() {
  std::lock_guard lock(notices_mutex_);
  return notice_comm_;
}

void MpiRuntime::set_notice_comm(MPI_Comm comm) {
  std::lock_guard lock(notices_mutex_);
  notice_comm_ = comm;
}

void MpiRuntime::keep_until_exit(std::shared_ptr<void> buffer) {
  std::lock_guard lock(kept_mutex_);
  kept_.push_back(std::move(buffer));
}

void MpiRuntime::send_notice(const std::string& group, const std::vector<int>& world_ranks,
                             const std::string& text) {
  std::lock_guard guard(notices_mutex_);
  if (notice_comm_ == MPI_COMM_NULL || world_ranks.empty()) return;
  // Kept until exit: the sends may complete at any time (a few short texts per group at most).
  auto message = std::make_shared<std::string>(group);
  keep_until_exit(message);
  message->push_back('\0');
  message->append(text);
  auto lock = this->lock();
  for (int peer : world_ranks) {
    MPI_Request request = MPI_REQUEST_NULL;
    if (MPI_Isend(message->data(), static_cast<int>(message->size()), MPI_CHAR, peer, kNoticeTag,
                  notice_comm_, &request) == MPI_SUCCESS) {
      MPI_Request_free(&request);
    }
  }
}

std::string MpiRuntime::find_notice(const std::string& group) {
  std::lock_guard guard(notices_mutex_);
  if (notice_comm_ == MPI_COMM_NULL) return {};
  for (;;) {
    int found = 0;
    MPI_Message message;
    MPI_Status status;
    auto lock = this->lock();
    if (MPI_Improbe(MPI_ANY_SOURCE, kNoticeTag, notice_comm_, &found, &message, &status) !=
            MPI_SUCCESS ||
        !found) {
      break;
    }
    int length = 0;
    MPI_Get_count(&status, MPI_CHAR, &length);
    std::string bytes(static_cast<std::size_t>(std::max(length, 0)), '\0');
    MPI_Mrecv(bytes.data(), length, MPI_CHAR, &message, MPI_STATUS_IGNORE);
    const auto split = bytes.find('\0');
    if (split == std::string::npos) continue;
    if (notices_.size() >= kMaxNotices) notices_.erase(notices_.begin());
    notices_.emplace_back(bytes.substr(0, split), bytes.substr(split + 1));
  }
  for (const auto& [name, text] : notices_) {
    if (name == group) return text;
  }
  return {};
}

void MpiRuntime::add_exit_listener(ExitListener* listener) {
  std::lock_guard lock(listeners_mutex_);
  listeners_.push_back(listener);
}

void MpiRuntime::remove_exit_listener(ExitListener* listener) {
  std::lock_guard lock(listeners_mutex_);
  std::erase(listeners_, listener);
}

void MpiRuntime::on_exit(int status) {
  if (!mpi_is_up()) return;  // the program finalised MPI itself (or never had it)
  if (status != 0) {
    abort_job(fmt::format("the process is exiting with status {} without MPI_Finalize", status),
              status);
  }
  {
    std::lock_guard lock(listeners_mutex_);
    for (auto* listener : listeners_)
      listener->on_process_exit();
  }
  if (finalize_at_exit_) MPI_Finalize();
}

std::unique_lock<std::mutex> MpiRuntime::lock() {
  return serialize_ ? std::unique_lock<std::mutex>(mutex_) : std::unique_lock<std::mutex>();
}

MPI_Datatype MpiRuntime::datatype(DType dtype) const {
  switch (dtype) {
    case DType::kFloat32:
      return MPI_FLOAT;
    case DType::kFloat64:
      return MPI_DOUBLE;
    case DType::kFloat16:
      return half_;
    case DType::kBFloat16:
      return bfloat16_;
    case DType::kInt8:
      return MPI_INT8_T;
    case DType::kUInt8:
      return MPI_UINT8_T;
    case DType::kInt32:
      return MPI_INT32_T;
    case DType::kInt64:
      return MPI_INT64_T;
  }
  return MPI_DATATYPE_NULL;
}

MPI_Op MpiRuntime::reduce_op(DType dtype, ReduceOp op) const {
  if (dtype == DType::kFloat16) return half_ops_[op_index(op)];
  if (dtype == DType::kBFloat16) return bfloat16_ops_[op_index(op)];
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      return MPI_SUM;
    case ReduceOp::kMin:
      return MPI_MIN;
    case ReduceOp::kMax:
      return MPI_MAX;
    case ReduceOp::kProduct:
      return MPI_PROD;
    case ReduceOp::kBand:
      return MPI_BAND;
    case ReduceOp::kBor:
      return MPI_BOR;
    case ReduceOp::kBxor:
      return MPI_BXOR;
  }
  return MPI_OP_NULL;
}

}  // namespace ddp::comm::mpi
