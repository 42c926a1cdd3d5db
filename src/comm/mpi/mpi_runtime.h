// The process-wide MPI state of the mpi backend (internal): initialisation and finalisation, the
// thread-level contract, and the MPI datatypes and operations of each DType and ReduceOp.
//
// MpiRuntime::instance() initialises MPI on first use (MPI_Init_thread asking for
// MPI_THREAD_MULTIPLE) unless the program already did, and then finalises it at process exit.
// It also makes a failing rank end the whole job at once (docs/mpi.md, "Failing fast"): a
// std::terminate handler and an exit hook that sees a non-zero exit status call MPI_Abort with a
// message naming the rank and the reason, instead of letting the rank reach MPI_Finalize, whose
// exit handshake would wait for peers that wait for it in turn.
// Any thread may call it; it throws ConfigError when MPI was finalised already or was initialised
// by the program with less than MPI_THREAD_SERIALIZED. Every MPI call of the backend holds lock():
// a no-op under MPI_THREAD_MULTIPLE, one process-wide mutex under MPI_THREAD_SERIALIZED.
#pragma once

// The C API only: OpenMPI's (deprecated) C++ bindings would need libmpi_cxx at link time.
#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "ddp/comm/types.h"

namespace ddp::comm::mpi {

// Told when the process exits normally (status 0) with MPI still up, before MPI_Finalize: a
// group tells its peers that this rank will issue no more calls on it.
class ExitListener {
 public:
  virtual void on_process_exit() = 0;

 protected:
  ~ExitListener() = default;
};

class MpiRuntime {
 public:
  static MpiRuntime& instance();

  // Keeps `buffer` alive until the process exits: memory that MPI may still read or write after
  // ddp is done with it (the text of a notice sent with a freed request, the fingerprint buffers
  // of a failed group's abandoned request). Bounded: a few per group. Any thread.
  void keep_until_exit(std::shared_ptr<void> buffer);

  // Prints "ddp (mpi backend): rank R of N: <reason>" to stderr and ends every rank of the job
  // (MPI_Abort on MPI_COMM_WORLD with `code`). Any thread; the first caller wins, later ones wait
  // to be killed.
  [[noreturn]] static void abort_job(const std::string& reason, int code = 1);

  // Notices between ranks: short texts about a group (a rank failed, or left it), read by the
  // peers' calls that stall. They travel on one duplicate of MPI_COMM_WORLD that is never freed,
  // since a message on a group's own communicator could reach a peer that freed it already (and
  // reused its context id for a new communicator). make_mpi_process_group creates it with the
  // first group (set_notice_comm); before that, notices are not sent.
  // 0, 1, 2, ...: how many world groups this process created before (make_mpi_process_group).
  int next_world_group() { return world_groups_.fetch_add(1); }
  bool has_notice_comm();
  MPI_Comm notice_comm();
  void set_notice_comm(MPI_Comm comm);
  // Sends `text` about `group` to these ranks of MPI_COMM_WORLD without waiting.
  void send_notice(const std::string& group, const std::vector<int>& world_ranks,
                   const std::string& text);
  // The first notice received about `group`, else empty. Reads every pending notice.
  std::string find_notice(const std::string& group);
  // Every notice received about `group` so far, oldest first. Reads every pending notice.
  std::vector<std::string> notices(const std::string& group);

  void add_exit_listener(ExitListener* listener);
  void remove_exit_listener(ExitListener* listener);
  // Runs at process exit (on_exit): aborts on a non-zero status, else tells the listeners and
  // finalises MPI when ddp initialised it.
  void on_exit(int status);

  // Hold while calling MPI (see the top of this file).
  std::unique_lock<std::mutex> lock();

  MPI_Datatype datatype(DType dtype) const;
  // kAvg maps to the sum: the caller divides afterwards.
  MPI_Op reduce_op(DType dtype, ReduceOp op) const;
  // The largest tag MPI accepts (MPI_TAG_UB, at least 32767).
  int max_tag() const { return max_tag_; }
  int thread_level() const { return thread_level_; }

 private:
  MpiRuntime();

  bool serialize_ = false;
  bool finalize_at_exit_ = false;  // ddp initialised MPI, so ddp finalises it
  std::atomic<int> world_groups_{0};
  std::mutex kept_mutex_;
  std::vector<std::shared_ptr<void>> kept_;  // keep_until_exit
  std::mutex notices_mutex_;
  MPI_Comm notice_comm_ = MPI_COMM_NULL;
  std::vector<std::pair<std::string, std::string>> notices_;  // (group, text), oldest first
  std::mutex listeners_mutex_;
  std::vector<ExitListener*> listeners_;
  int thread_level_ = MPI_THREAD_SINGLE;
  int max_tag_ = 32767;
  std::mutex mutex_;
  MPI_Datatype half_ = MPI_DATATYPE_NULL;
  MPI_Datatype bfloat16_ = MPI_DATATYPE_NULL;
  // User operations for float16/bfloat16, indexed by [sum, min, max, product].
  MPI_Op half_ops_[4] = {MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL};
  MPI_Op bfloat16_ops_[4] = {MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL};
};

// The text of an MPI error code ("MPI_ERR_TRUNCATE: message truncated").
std::string mpi_error_text(int code);

}  // namespace ddp::comm::mpi
