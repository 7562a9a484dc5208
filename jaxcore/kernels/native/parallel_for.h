// The work loop the native kernels share: items handed to XLA's intra-op thread pool (the FFI's
// ThreadPool context). Each kernel's library is its own translation unit, so it is internal (an
// anonymous namespace).

#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Calls fn(i) for every i in [0, items) on the calling thread and on helpers from XLA's
// intra-op pool, each index claimed once from a shared counter; returns when all are done. The
// caller works too, so it returns even when no helper ever runs (a pool busy elsewhere).
template <typename Fn>
void ParallelFor(ffi::ThreadPool& pool, int64_t items, Fn fn) {
  struct State {
    std::atomic<int64_t> next{0}, done{0};
    std::mutex mu;
    std::condition_variable finished;
  };
  auto state = std::make_shared<State>();
  auto work = [state, items, fn] {
    for (int64_t i; (i = state->next.fetch_add(1)) < items;) {
      fn(i);
      if (state->done.fetch_add(1) + 1 == items) {
        std::lock_guard<std::mutex> lock(state->mu);
        state->finished.notify_all();
      }
    }
  };
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  for (int64_t i = 1; i < std::min(threads, items); ++i) {
    auto helper = work;
    pool.Schedule(std::move(helper));
  }
  work();
  std::unique_lock<std::mutex> lock(state->mu);
  state->finished.wait(lock, [&] { return state->done.load() == items; });
}

}  // namespace
