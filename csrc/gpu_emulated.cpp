// The emulated GPU: each stream is a host thread executing its operations in order. A wait
// spins on host memory exactly as cuStreamWaitValue64 polls it; a write is a release store; a
// kernel runs its host twin. The protocol code above cannot tell the difference, which is the
// point: CI exercises the same doorbell, publication and drain logic as the GPU.
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <stdexcept>
#include <thread>

#include "allocations.h"
#include "atomics.h"
#include "gpu.h"
#include "kernels_host.h"

namespace fabric {
namespace {

struct Op {
  enum class Kind { kWait, kWrite, kLaunch, kHost, kCopy, kRecord };
  Op() = default;
  explicit Op(Kind k) : kind(k) {}
  Kind kind = Kind::kHost;
  DevPtr address = 0;
  std::uint64_t value = 0;
  kernels::KernelId kernel = kernels::KernelId::kCount;
  alignas(16) unsigned char args[64] = {};
  HostCall fn;  // inline: queueing a host function allocates nothing
  void* dst = nullptr;
  std::size_t bytes = 0;
  int event = 0;
};

class EmulatedStream {
 public:
  explicit EmulatedStream(std::atomic<std::uint64_t>* done_gen)
      : done_gen_(done_gen), worker_([this] { run(); }) {}
  ~EmulatedStream() { stop(); }

  void push(Op op) {
    UncountedAllocations driver_stand_in;  // the queue grows as a driver's would, unseen
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (stopping_) throw std::runtime_error("emulated GPU stopped");
      queue_.push_back(std::move(op));
      ++enqueued_;
    }
    cv_.notify_all();
  }

  void synchronize() {
    std::unique_lock<std::mutex> lock(mutex_);
    idle_cv_.wait(lock, [&] { return executed_ == enqueued_ || stopping_; });
  }

  // Refuses further work and waits for the worker to exit: once this returns, none of the
  // stream's operations runs, so the memory they touch may be freed (the runtime frees its rings
  // right after stopping the GPU). The operation under way finishes first; a doorbell wait gives
  // up within its back-off (at most 500 us).
  void stop() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    cv_.notify_all();
    idle_cv_.notify_all();
    std::lock_guard<std::mutex> lock(join_mutex_);  // stop() may be called from two threads
    if (worker_.joinable() && worker_.get_id() != std::this_thread::get_id()) worker_.join();
  }

  std::string error() {
    std::lock_guard<std::mutex> lock(mutex_);
    return error_;
  }

 private:
  bool stopping() {
    std::lock_guard<std::mutex> lock(mutex_);
    return stopping_;
  }

  void run() {
    UncountedAllocations device_side;  // this thread is the GPU: its work is not the host's
    for (;;) {
      Op op;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (stopping_) return;
        op = std::move(queue_.front());
        queue_.pop_front();
      }
      try {
        if (!execute(op)) return;
      } catch (const std::exception& e) {
        std::lock_guard<std::mutex> lock(mutex_);
        if (error_.empty()) error_ = e.what();
      }
      {
        std::lock_guard<std::mutex> lock(mutex_);
        ++executed_;
      }
      idle_cv_.notify_all();
    }
  }

  // Returns false when a wait was abandoned because the GPU is stopping.
  bool execute(Op& op) {
    switch (op.kind) {
      case Op::Kind::kWait: {
        auto* word = reinterpret_cast<volatile std::uint64_t*>(op.address);
        // Acquire: once the value is seen, the payload stored before it is visible too.
        // Spin briefly, then sleep with a growing back-off: an idle emulated GPU must not eat
        // the CPU that the host threads (and the CPU engine) need.
        std::uint64_t sleep_us = 10;
        for (std::uint64_t spins = 0; load_acquire(word) < op.value; ++spins) {
          if (spins < 1024) {
            cpu_relax();
          } else {
            if (stopping()) return false;
            std::this_thread::sleep_for(std::chrono::microseconds(sleep_us));
            sleep_us = std::min<std::uint64_t>(sleep_us * 2, 500);
          }
        }
        return true;
      }
      case Op::Kind::kWrite:
        // Release: the stream's earlier work is visible before the value.
        store_release(reinterpret_cast<volatile std::uint64_t*>(op.address), op.value);
        return true;
      case Op::Kind::kLaunch:
        kernels::run_on_host(op.kernel, op.args);
        return true;
      case Op::Kind::kHost:
        op.fn();
        return true;
      case Op::Kind::kCopy:
        std::memcpy(op.dst, reinterpret_cast<const void*>(op.address), op.bytes);
        return true;
      case Op::Kind::kRecord:
        // Release: order the stream's earlier work (the copy) before the event reads done.
        store_release(done_gen_[op.event], op.value);
        return true;
    }
    return true;
  }

  std::atomic<std::uint64_t>* done_gen_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::condition_variable idle_cv_;
  std::deque<Op> queue_;
  std::uint64_t enqueued_ = 0;
  std::uint64_t executed_ = 0;
  bool stopping_ = false;
  std::string error_;
  std::mutex join_mutex_;
  std::thread worker_;  // last: starts after every other member is ready
};

// The Gpu calls a test can make fail (inject_emulated_fault), in the order of kFaultCalls.
enum class Call : int { kWaitGeq, kWriteValue, kLaunch, kHostCall, kCopyToHost, kRecordEvent,
                        kRecordMark, kCount };
constexpr const char* kFaultCalls[] = {"wait_geq",     "write_value",  "launch",     "host_call",
                                       "copy_to_host", "record_event", "record_mark"};
static_assert(sizeof(kFaultCalls) / sizeof(kFaultCalls[0]) == static_cast<int>(Call::kCount));

class EmulatedGpu final : public Gpu {
 public:
  EmulatedGpu() {
    for (int i = 0; i < kEvents; ++i) {
      recorded_gen_[i].store(0);
      done_gen_[i].store(0);
    }
    streams_[0] = std::make_unique<EmulatedStream>(done_gen_);
    streams_[1] = std::make_unique<EmulatedStream>(done_gen_);
  }
  ~EmulatedGpu() override { stop(); }

  bool emulated() const override { return true; }
  std::string describe() const override { return "emulated GPU (host threads)"; }
  void bind_thread() override {}

  HostRegion alloc_host(std::size_t bytes, HostMemoryKind kind) override {
    HostRegion r;
    r.bytes = bytes;
    r.kind = kind;
    r.host = allocate(bytes);
    r.device = reinterpret_cast<DevPtr>(r.host);
    return r;
  }
  void free_host(HostRegion& region) override {
    std::free(region.host);
    region = HostRegion{};
  }
  DevPtr alloc_device(std::size_t bytes) override {
    return reinterpret_cast<DevPtr>(allocate(bytes));
  }
  void free_device(DevPtr ptr) override { std::free(reinterpret_cast<void*>(ptr)); }
  void fill_device(DevPtr ptr, unsigned char value, std::size_t bytes) override {
    std::memset(reinterpret_cast<void*>(ptr), value, bytes);
  }
  void* host_view(DevPtr ptr) override { return reinterpret_cast<void*>(ptr); }

  void wait_geq(Stream s, DevPtr address, std::uint64_t value) override {
    fault_point(Call::kWaitGeq);
    Op op(Op::Kind::kWait);
    op.address = address;
    op.value = value;
    stream(s).push(std::move(op));
  }
  void write_value(Stream s, DevPtr address, std::uint64_t value) override {
    fault_point(Call::kWriteValue);
    Op op(Op::Kind::kWrite);
    op.address = address;
    op.value = value;
    stream(s).push(std::move(op));
  }
  void launch(Stream s, kernels::KernelId kernel, const LaunchShape&, const void* args,
              std::size_t args_bytes) override {
    fault_point(Call::kLaunch);
    Op op(Op::Kind::kLaunch);
    if (args_bytes > sizeof(op.args)) throw std::length_error("kernel arguments too large");
    op.kernel = kernel;
    std::memcpy(op.args, args, args_bytes);
    stream(s).push(std::move(op));
  }
  void launch_graph(Stream, std::uint64_t) override {
    throw std::logic_error("CUDA graphs need a real GPU; emulated engines run as host calls");
  }
  void host_call(Stream s, const HostCall& fn) override {
    fault_point(Call::kHostCall);
    Op op(Op::Kind::kHost);
    op.fn = fn;
    stream(s).push(std::move(op));
  }
  void copy_to_host(Stream s, void* dst, DevPtr src, std::size_t bytes) override {
    fault_point(Call::kCopyToHost);
    Op op(Op::Kind::kCopy);
    op.dst = dst;
    op.address = src;
    op.bytes = bytes;
    stream(s).push(std::move(op));
  }
  void record_event(Stream s, int event) override {
    fault_point(Call::kRecordEvent);
    Op op(Op::Kind::kRecord);
    op.event = event;
    op.value = recorded_gen_[event].fetch_add(1) + 1;
    stream(s).push(std::move(op));
  }
  bool event_done(int event) override {
    // Acquire: pairs with the event's release: the copy before it is complete once it reads done.
    return load_acquire(done_gen_[event]) >= recorded_gen_[event].load();
  }
  void wait_event(int event) override {
    std::uint64_t sleep_us = 10;
    for (int spins = 0; !event_done(event); ++spins) {
      check();
      if (spins < 1024) {
        cpu_relax();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(sleep_us));
        sleep_us = std::min<std::uint64_t>(sleep_us * 2, 500);
      }
    }
  }
  void record_mark(Stream s, int mark) override {
    fault_point(Call::kRecordMark);
    const std::uint64_t gen = mark_asked_[mark].fetch_add(1) + 1;
    push_host(s, [this, mark, gen] {
      store_relaxed(marks_[mark], std::chrono::duration<double, std::milli>(
                                      std::chrono::steady_clock::now().time_since_epoch())
                                      .count());  // published by mark_done_ below
      // Release: order the time's store before the generation that says it is written.
      store_release(mark_done_[mark], gen);
    });
  }
  double mark_elapsed_ms(int from, int to) override {
    for (int mark : {from, to}) {
      // Acquire: pairs with the mark's release: its time is written once its generation is seen.
      while (load_acquire(mark_done_[mark]) < mark_asked_[mark].load()) {
        check();
        std::this_thread::yield();
      }
    }
    return load_relaxed(marks_[to]) - load_relaxed(marks_[from]);  // ordered by the acquire above
  }
  void synchronize(Stream s) override {
    check_not_hot(s, "synchronize");
    stream(s).synchronize();
  }
  void stop() override {
    for (auto& s : streams_) {
      if (s) s->stop();
    }
  }
  // Arms the test fault: the `nth` call of `call` from now throws.
  void inject_fault(Call call, std::uint64_t nth) {
    store_relaxed(fault_left_, nth);
    // Release: order the countdown's store before the armed call that fault_point acquires.
    store_release(fault_call_, static_cast<int>(call));
  }

  // Throws the first error a stream hit asynchronously, if any.
  void check() {
    for (auto& s : streams_) {
      const std::string error = s->error();
      if (!error.empty()) throw std::runtime_error("emulated GPU stream failed: " + error);
    }
  }

 private:
  EmulatedStream& stream(Stream s) { return *streams_[static_cast<int>(s)]; }

  void push_host(Stream s, const HostCall& fn) {
    Op op(Op::Kind::kHost);
    op.fn = fn;
    stream(s).push(std::move(op));
  }

  // Where an injected fault fires: the call fails before it enqueues anything, as a driver call
  // that returns an error does.
  void fault_point(Call call) {
    // Acquire: pairs with inject_fault's release: the countdown is set once the call is seen.
    if (load_acquire(fault_call_) != static_cast<int>(call)) return;
    if (fault_left_.fetch_sub(1) != 1) return;
    store_relaxed(fault_call_, -1);  // one fault: the calls after it succeed (a flag only)
    const char* name = kFaultCalls[static_cast<int>(call)];
    throw std::runtime_error(std::string("emulated GPU: ") + name +
                             " failed: injected fault (fabric_gpu._runtime.testing)");
  }

  void* allocate(std::size_t bytes) {
    const std::size_t rounded = (bytes + 4095) / 4096 * 4096;
    void* p = std::aligned_alloc(4096, rounded == 0 ? 4096 : rounded);
    if (p == nullptr) throw std::bad_alloc();
    std::memset(p, 0, rounded);  // pre-fault every page now, not in the hot loop
    count_allocation();
    return p;
  }

  std::atomic<double> marks_[kMarks] = {};
  std::atomic<std::uint64_t> mark_asked_[kMarks] = {};
  std::atomic<std::uint64_t> mark_done_[kMarks] = {};
  std::atomic<std::uint64_t> recorded_gen_[kEvents];
  std::atomic<std::uint64_t> done_gen_[kEvents];
  std::atomic<int> fault_call_{-1};  // the armed Call, or -1
  std::atomic<std::uint64_t> fault_left_{0};
  std::unique_ptr<EmulatedStream> streams_[2];
};

}  // namespace

std::unique_ptr<Gpu> make_emulated_gpu() { return std::make_unique<EmulatedGpu>(); }

void inject_emulated_fault(Gpu& gpu, const std::string& call, std::uint64_t nth) {
  auto* emulated = dynamic_cast<EmulatedGpu*>(&gpu);
  if (emulated == nullptr) {
    throw std::invalid_argument("faults are injected on the emulated GPU only");
  }
  if (nth == 0) throw std::invalid_argument("nth counts from 1");
  std::string known;
  for (int c = 0; c < static_cast<int>(Call::kCount); ++c) {
    if (call == kFaultCalls[c]) return emulated->inject_fault(static_cast<Call>(c), nth);
    known += (c == 0 ? "" : ", ") + std::string(kFaultCalls[c]);
  }
  throw std::invalid_argument("no emulated GPU call '" + call + "'; the calls are: " + known);
}

}  // namespace fabric
