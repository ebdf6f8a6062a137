// The GPU as the runtime sees it: memory, two in-order streams (compute and drain), the stream
// memory operations of the doorbell protocol, kernel and graph launches, and events.
//
// Two implementations: CudaGpu (the driver API; gpu_cuda.cpp) and EmulatedGpu (host threads that
// honour the same protocol; gpu_emulated.cpp), so the protocol code above this interface is the
// same on a GPU and in CI.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>

#include "atomics.h"
#include "inline_function.h"
#include "kernel_abi.h"

namespace fabric {

using DevPtr = unsigned long long;  // a device address, as CUdeviceptr (in emulation: a host address)

enum class HostMemoryKind {
  kOrdinary,             // plain host memory (engines that read their inputs on the CPU)
  kMapped,               // pinned, mapped for the device, cached (the host reads it)
  kMappedWriteCombined,  // pinned, mapped, write-combined (the host only writes it)
};

struct HostRegion {
  void* host = nullptr;
  DevPtr device = 0;  // 0 for ordinary memory on a real GPU
  std::size_t bytes = 0;
  HostMemoryKind kind = HostMemoryKind::kOrdinary;
};

enum class Stream : int { kCompute = 0, kDrain = 1 };

// A host function run in stream order: its captures are held inline (nothing allocated per call).
using HostCall = InlineFunction<void(), 64>;

struct LaunchShape {
  unsigned grid_x = 1, grid_y = 1, grid_z = 1;
  unsigned block_x = 1, block_y = 1, block_z = 1;
};

// Thrown when the compute stream is synchronised inside the hot loop.
class HotLoopSyncError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class Gpu {
 public:
  static constexpr int kEvents = 16;  // events are made once, at start

  virtual ~Gpu() = default;
  virtual bool emulated() const = 0;
  virtual std::string describe() const = 0;
  // Makes the device's context current on the calling thread (each thread that calls in).
  virtual void bind_thread() = 0;

  // Memory. Every allocation is counted: after warm-up the count must not move.
  virtual HostRegion alloc_host(std::size_t bytes, HostMemoryKind kind) = 0;
  virtual void free_host(HostRegion& region) = 0;
  virtual DevPtr alloc_device(std::size_t bytes) = 0;
  virtual void free_device(DevPtr ptr) = 0;
  // Sets `bytes` bytes of device memory to `value` (synchronously; warm-up only).
  virtual void fill_device(DevPtr ptr, unsigned char value, std::size_t bytes) = 0;
  // Host address of device memory, in emulation only (0 on a real GPU).
  virtual void* host_view(DevPtr ptr) = 0;
  std::uint64_t allocations() const { return load_relaxed(allocations_); }  // a statistic

  // Stream operations, executed in order per stream.
  // The stream waits until the 64-bit value at `address` is >= `value`.
  virtual void wait_geq(Stream s, DevPtr address, std::uint64_t value) = 0;
  // The stream stores `value` at `address` after all its earlier work, with a system-scope
  // fence before the store (cuStreamWriteValue64 without NO_MEMORY_BARRIER).
  virtual void write_value(Stream s, DevPtr address, std::uint64_t value) = 0;
  virtual void launch(Stream s, kernels::KernelId kernel, const LaunchShape& shape,
                      const void* args, std::size_t args_bytes) = 0;
  virtual void launch_graph(Stream s, std::uint64_t graph_exec) = 0;
  // A host function run in stream order (emulation only: real GPUs refuse).
  virtual void host_call(Stream s, const HostCall& fn) = 0;
  virtual void copy_to_host(Stream s, void* dst, DevPtr src, std::size_t bytes) = 0;
  virtual void record_event(Stream s, int event) = 0;
  virtual bool event_done(int event) = 0;
  virtual void wait_event(int event) = 0;
  virtual void synchronize(Stream s) = 0;
  // Timing marks (measurement only): a timestamp the stream records when it gets there, and the
  // milliseconds between two recorded marks once both are done.
  static constexpr int kMarks = 512;
  virtual void record_mark(Stream s, int mark) = 0;
  virtual double mark_elapsed_ms(int from, int to) = 0;
  // Wakes any emulated wait and refuses further work (shutdown). On the emulated GPU it returns
  // once no stream operation runs any more, so the memory they touch may be freed after it.
  virtual void stop() = 0;

  // The synchronisation rule of the hot loop: while armed, synchronize(kCompute) throws.
  // Release: the start-up work done before arming is visible to a thread that sees it armed.
  void set_hot(bool hot) { store_release(hot_, hot); }
  void check_not_hot(Stream s, const char* what) const {
    // Acquire: pairs with set_hot's release (which side of start/shutdown this thread is on).
    if (s == Stream::kCompute && load_acquire(hot_)) {
      throw HotLoopSyncError(std::string(what) +
                             " on the compute stream inside the hot loop: the decode loop must "
                             "never wait for the GPU; wait on events of the drain stream instead");
    }
  }

 protected:
  void count_allocation() { add_relaxed(allocations_, 1); }  // a statistic: orders nothing

 private:
  std::atomic<std::uint64_t> allocations_{0};
  std::atomic<bool> hot_{false};
};

std::unique_ptr<Gpu> make_emulated_gpu();
// Test only (fabric_gpu._runtime.testing): make the emulated GPU's `nth` call of `call` (a Gpu
// method: wait_geq, write_value, launch, host_call, copy_to_host, record_event, record_mark),
// counted from now, throw as a failed driver call would. One fault at a time; throws
// std::invalid_argument for a real GPU or an unknown call.
void inject_emulated_fault(Gpu& gpu, const std::string& call, std::uint64_t nth);
// `eager_warmup`: launch every kernel once before any doorbell wait (always true in production;
// false only to demonstrate the lazy-loading deadlock in a test).
std::unique_ptr<Gpu> make_cuda_gpu(int ordinal, bool eager_warmup = true);

}  // namespace fabric
