#include "ddprun/line_assembler.h"

namespace ddp::ddprun {

void LineAssembler::emit(std::string_view line, bool whole, std::string& out) const {
  out.append(prefix_);
  out.append(line);
  if (whole || ending_ == Ending::kAddNewline) out.push_back('\n');
}

void LineAssembler::feed(std::string_view data, std::string& out) {
  while (!data.empty()) {
    const std::size_t newline = data.find('\n');
    const std::size_t take = newline == std::string_view::npos ? data.size() : newline;
    const std::size_t room = max_line_ - partial_.size();
    if (take > room) {
      // The line is longer than max_line_: emit what fits as a line of its own.
      partial_.append(data.substr(0, room));
      emit(partial_, false, out);
      partial_.clear();
      data.remove_prefix(room);
      continue;
    }
    if (newline == std::string_view::npos) {
      partial_.append(data);
      return;
    }
    if (partial_.empty()) {
      emit(data.substr(0, newline), true, out);  // the common case: no copy into partial_
    } else {
      partial_.append(data.substr(0, newline));
      emit(partial_, true, out);
      partial_.clear();
    }
    data.remove_prefix(newline + 1);
  }
}

void LineAssembler::finish(std::string& out) {
  if (partial_.empty()) return;
  emit(partial_, false, out);
  partial_.clear();
}

}  // namespace ddp::ddprun
