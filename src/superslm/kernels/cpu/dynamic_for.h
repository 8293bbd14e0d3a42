// Work split by chunks taken in turn rather than fixed halves: at::parallel_for gives each thread one equal range,
// so a GEMV waits for its slowest thread; on a shared machine a thread the OS parks for a time slice (several ms:
// a whole head GEMV) leaves the other idle at the join. Here each thread takes the next chunk until none is left.
// Every chunk is computed as it would be in any split (the callers' outputs are per row), so the bits do not
// depend on which thread took it.
#pragma once
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace superslm_dyn {

// `chunk` (a multiple of `unit`) capped at about half a thread's share of [0, n): the callers' ~128 KiB minimum
// left a small matrix's GEMV mostly to the thread that took the first chunk (SmolLM2's [576, 576]: 14 of 18)
inline int64_t shared_chunk(int64_t n, int64_t chunk, int64_t unit = 1) {
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t c = std::max<int64_t>(1, std::min(chunk, (n + 2 * threads - 1) / (2 * threads)));
  return (c + unit - 1) / unit * unit;
}

// f(begin, end) over [0, n) in chunks of `chunk` (the last one shorter), taken in turn by the threads; inline in
// the caller where one thread runs (or inside another parallel region)
template <typename F>
void dynamic_for(int64_t n, int64_t chunk, const F& f) {
  if (n <= 0) return;
  chunk = std::max<int64_t>(1, chunk);
  const int64_t chunks = (n + chunk - 1) / chunk;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), chunks);
  if (threads <= 1 || at::in_parallel_region()) {
    f(0, n);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t c = next.fetch_add(1, std::memory_order_relaxed); c < chunks;
         c = next.fetch_add(1, std::memory_order_relaxed))
      f(c * chunk, std::min(n, (c + 1) * chunk));
  });
}

}  // namespace superslm_dyn
