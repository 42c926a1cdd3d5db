#include "progress_bar.h"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

namespace fmnist {

std::string ProgressBar::render(int epoch, std::int64_t done, std::int64_t total, double loss,
                                double samples_per_s, double eta_s, int width) {
  const double fraction =
      total > 0 ? std::clamp(static_cast<double>(done) / static_cast<double>(total), 0.0, 1.0)
                : 0.0;
  const int filled = static_cast<int>(std::lround(fraction * width));
  const auto eta = static_cast<std::int64_t>(std::max(0.0, std::isfinite(eta_s) ? eta_s : 0.0));
  return fmt::format("epoch {} [{}{}] {:3.0f}%  {}/{}  loss {:.4f}  {:.0f} samples/s  ETA {}:{:02}",
                     epoch, std::string(static_cast<std::size_t>(filled), '#'),
                     std::string(static_cast<std::size_t>(width - filled), '.'), fraction * 100.0,
                     done, total, loss, samples_per_s, eta / 60, eta % 60);
}

void ProgressBar::start(int epoch, std::int64_t total) {
  epoch_ = epoch;
  total_ = total;
  drawn_ = false;
  started_ = std::chrono::steady_clock::now();
  last_draw_ = {};
}

void ProgressBar::update(std::int64_t done, double loss) {
  const auto now = std::chrono::steady_clock::now();
  if (drawn_ && done < total_ && now - last_draw_ < std::chrono::milliseconds(100)) return;
  last_draw_ = now;
  drawn_ = true;
  const double elapsed = std::chrono::duration<double>(now - started_).count();
  const double rate = elapsed > 0 ? static_cast<double>(done) / elapsed : 0.0;
  const double eta = rate > 0 ? static_cast<double>(total_ - done) / rate : 0.0;
  // \r and erase-to-end-of-line: the bar rewrites itself.
  std::fprintf(out_, "\r%s\x1b[K", render(epoch_, done, total_, loss, rate, eta).c_str());
  std::fflush(out_);
}

void ProgressBar::finish() {
  if (!drawn_) return;
  std::fputs("\r\x1b[K", out_);  // the epoch summary line replaces the bar
  std::fflush(out_);
  drawn_ = false;
}

}  // namespace fmnist
