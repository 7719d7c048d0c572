// Units of work [0, count) shared by an atomic counter among the calling thread and
// tasks on XLA's intra-op thread pool, so that an FFI call uses the threads XLA was
// given and no more (the attention kernel, attention_cpu.cc, and the bfloat16 dense
// products, gemm_cpu.cc). Each thread makes one State (default-constructed; the
// attention kernel's scratch buffers) and passes it to every unit it runs.
//
// The work is held by shared_ptr: a task that starts only after the caller has
// finished every unit (the pool was busy) finds none left and touches nothing else.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace jax_dilated {

template <class State>
struct SharedUnits {
  std::function<void(int64_t, State&)> unit;
  int64_t count;
  std::atomic<int64_t> next{0}, done{0};
};

template <class State>
void drain(SharedUnits<State>& w) {
  State state;
  for (;;) {
    const int64_t u = w.next.fetch_add(1);
    if (u >= w.count) return;
    w.unit(u, state);
    w.done.fetch_add(1, std::memory_order_release);
  }
}

template <class State>
void parallel_for(xla::ffi::ThreadPool& pool, int64_t count,
                  std::function<void(int64_t, State&)> unit) {
  if (count <= 0) return;
  auto w = std::make_shared<SharedUnits<State>>();
  w->unit = std::move(unit);
  w->count = count;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t helpers = std::min<int64_t>(threads, count) - 1;
  for (int64_t i = 0; i < helpers; i++) pool.Schedule([w]() { drain(*w); });
  drain(*w);
  // every unit claimed; wait for those still running on other threads
  while (w->done.load(std::memory_order_acquire) < w->count) std::this_thread::yield();
}

}  // namespace jax_dilated
