// Python's pickle format written opcode by opcode, torch-free: what ddp's writers of PyTorch's
// files build their pickles from (torch.save's data.pkl, torch/formats/pytorch_archive_writer.cc;
// a distributed checkpoint's `.metadata`, archive/dcp_metadata_writer.cc). The caller composes
// the value; this class only emits each opcode in its canonical encoding (the smallest integer
// form, BINUNICODE strings, big-endian BINFLOAT), with no memo: each object is written where it
// is used. What it writes is protocol 2 plus nothing newer, which every Python 3 and PyTorch's
// weights_only unpickler read.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace ddp::archive {

class PickleWriter {
 public:
  PickleWriter() { bytes_ += "\x80\x02"; }  // PROTO 2

  void none() { bytes_ += 'N'; }
  void boolean(bool value) { bytes_ += value ? '\x88' : '\x89'; }
  void integer(std::int64_t value);
  void floating(double value);
  void string(std::string_view value);
  // GLOBAL: the object `module`.`name`, as the unpickler finds it.
  void global(std::string_view module, std::string_view name);

  void mark() { bytes_ += '('; }
  void tuple() { bytes_ += 't'; }  // the items since the mark
  void empty_tuple() { bytes_ += ')'; }
  void tuple1() { bytes_ += '\x85'; }
  void empty_list() { bytes_ += ']'; }
  void appends() { bytes_ += 'e'; }  // the items since the mark, onto the list below it
  void empty_dict() { bytes_ += '}'; }
  void setitems() { bytes_ += 'u'; }   // key, value pairs since the mark, into the dict below it
  void reduce() { bytes_ += 'R'; }     // callable(*args)
  void newobj() { bytes_ += '\x81'; }  // cls.__new__(cls, *args)
  void build() { bytes_ += 'b'; }      // __setstate__(state), or the object's __dict__ updated
  void binpersid() { bytes_ += 'Q'; }

  // Ends the pickle (STOP) and returns it; the writer is empty afterwards.
  std::string finish();

 private:
  std::string bytes_;
};

}  // namespace ddp::archive
