// The runtime: three threads around one GPU, no Python on the hot path.
//
//   caller ("decode")  submit(batch n): reserve a ring slot and payload-ring space, enqueue on the
//                      compute stream: wait(doorbell.seq >= n) -> stage (gather, engine, hooks,
//                      with a publish point every K hooks) -> consumed_seq = n -> published_head.
//                      It runs ahead of the filler: the GPU starts the instant n is published.
//   filler thread      writes batch n's payload into its slot, store fence, doorbell.seq = n.
//   drain thread       acquires published_head, copies finished outputs to pinned staging
//                      buffers on the drain stream, hands them to the sink, then frees their
//                      payload-ring bytes; it also watches consumed_seq to wake a blocked caller.
//
// Nothing is dropped: a full ring makes submit retry 10 x 1 ms and then block; a full payload
// ring makes it back off (spin, yield, sleep, block) until the drain frees space. shutdown()
// wakes everything that blocks.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "blocking.h"
#include "byte_ring.h"
#include "function_ref.h"
#include "gpu.h"
#include "protocol.h"
#include "spsc_queue.h"

namespace fabric {

// Where the engine reads its inputs, which decides the ring's memory.
enum class InputLocation { kDevice, kHost };

struct RuntimeConfig {
  std::uint64_t ring_bytes = 64ull << 20;          // pinned payload ring (host -> GPU)
  std::uint64_t payload_ring_bytes = 256ull << 20;  // device outputs ring (GPU -> host)
  std::uint64_t max_output_bytes = 32ull << 20;     // largest output of one batch
  std::uint32_t max_items = 4096;                   // items per batch
  std::uint32_t max_in_flight = 64;                 // batches submitted but not drained
  std::uint32_t staging_buffers = 3;                // D2H copies in flight
  std::uint32_t publish_every = 4;                  // K: hook outputs per publication
  InputLocation input_location = InputLocation::kDevice;
  bool write_combined = true;  // the ring is write-combined mapped memory (device readers only)
  // Tests: fill the payload ring and the staging buffers with this byte at start (0xFF makes
  // every float NaN), so an output element the stages never wrote shows up. -1: off.
  int poison_byte = -1;
  // Measure GPU busy time: a timing mark when each batch's work starts (after its doorbell
  // wait) and one when it ends; the drain adds them up. Costs two event records per batch.
  bool measure_gpu_time = false;
};

// One batch as the caller describes it. Its payload comes from the PayloadSource.
struct BatchSpec {
  std::uint64_t batch_id = 0;
  std::uint32_t lane = 0;
  std::uint32_t batch_class = 0;
  std::uint32_t bucket_max = 0;
  std::uint32_t item_count = 0;
  std::uint64_t real_tokens = 0;
  std::uint32_t shape_epoch = 0;
  // Sizes known to the CPU: the exact output size. Sizes resolved on the GPU
  // (output_size_on_gpu): the reservation, an upper bound; the stage writes the real size into
  // the batch's size slot and the drain copies that many bytes, refusing more than reserved.
  std::uint64_t output_bytes = 0;
  bool output_size_on_gpu = false;
  std::uint32_t hooks = 1;  // output pieces the stage writes (publication granularity)
};

// A batch whose outputs reached the host. `data` is valid only during the sink call.
struct DrainedBatch {
  std::uint64_t publish_seq;
  std::uint64_t batch_id;
  const std::uint8_t* data;
  std::uint64_t bytes;
  std::string error;  // non-empty when the stage reported a failure for this batch
};

// Writes a batch's slot: descriptor fields are set by the runtime; the source writes the item
// offsets and token ids (`rows` are the caller's item references, e.g. task-set rows).
class PayloadSource {
 public:
  virtual ~PayloadSource() = default;
  virtual void write(const BatchSpec& spec, const std::int64_t* rows, std::int64_t* offsets,
                     std::int32_t* tokens) = 0;
};

// The work the GPU does on a batch between its doorbell and its publication.
class Stage {
 public:
  struct Context {
    Gpu& gpu;
    const BatchSpec& spec;
    std::uint64_t publish_seq;
    DevPtr slot;        // the batch's slot in the pinned ring, as the GPU addresses it
    void* slot_host;    // the same slot, as the host addresses it
    DevPtr out;         // the batch's output region in the payload ring
    void* out_host;     // host view of it (emulation only; nullptr on a GPU)
    DevPtr size_slot;   // where to write the output size when spec.output_size_on_gpu
    // Call once the enqueued work no longer reads the slot (after the last kernel that reads it):
    // the slot's bytes go back to the ring as soon as the GPU gets there. Called by the runtime
    // after enqueue() if the stage did not.
    FunctionRef<void()> slot_done;
    // Call after each hook output is enqueued with the bytes of output complete so far;
    // the runtime publishes every K calls, and at the end of the batch.
    FunctionRef<void(std::uint64_t)> hook_done;
  };
  virtual ~Stage() = default;
  virtual void warm_up(Gpu&) {}
  // Throws std::invalid_argument if the stage cannot run `spec`. Called by submit() before it
  // reserves anything, so a refused batch leaves no sequence number the GPU would wait for.
  virtual void check(const BatchSpec&) const {}
  virtual void enqueue(Context& ctx) = 0;
  // A failure the stage recorded for `publish_seq` (stages that run host code); "" if none.
  virtual std::string take_error(std::uint64_t) { return {}; }
};

struct RuntimeStats {
  std::uint64_t submitted = 0;
  std::uint64_t drained = 0;
  std::uint64_t bytes_in = 0;      // payload bytes written into the ring
  std::uint64_t bytes_out = 0;     // output bytes drained to the host
  std::uint64_t ring_retries = 0;  // 1 ms retries on a full ring
  std::uint64_t ring_blocked = 0;  // times the caller blocked on a full ring
  std::uint64_t payload_waits = 0;    // submits that waited for payload-ring space
  std::uint64_t payload_blocked = 0;  // ... and reached the blocking end of the ladder
  std::uint64_t publications = 0;  // system-scope releases of published_head
  std::uint64_t device_allocations = 0;           // device and pinned blocks the GPU allocated
  std::uint64_t device_allocations_at_start = 0;  // ... of which before the hot loop was armed
  // Heap allocations (operator new, fabric::allocations()) since start() began: the runtime's
  // own at start, then none per batch. The counter is the module's, so another runtime running
  // at the same time, or another call into the module, is counted too.
  std::uint64_t heap_allocations = 0;
  double drain_copy_seconds = 0;  // time the drain had copies in flight
  double gpu_busy_seconds = 0;    // sum over batches of (end - start) on the compute stream
  double gpu_span_seconds = 0;    // first batch's start to the last drained batch's end
};

class Runtime {
 public:
  using Sink = std::function<void(const DrainedBatch&)>;

  Runtime(std::unique_ptr<Gpu> gpu, RuntimeConfig config, std::unique_ptr<PayloadSource> source,
          std::unique_ptr<Stage> stage, Sink sink);
  ~Runtime();
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  // Allocates everything, warms up, starts the filler and drain threads, arms the hot loop.
  void start();
  // Queues one batch; blocks while the rings are full. Throws after shutdown or a failure. A
  // refused batch leaves nothing behind; an error once the batch holds its sequence number (a
  // driver call that fails while it is enqueued) fails the runtime, so finish() raises it.
  void submit(const BatchSpec& spec, const std::int64_t* rows);
  // Blocks until every submitted batch is drained; rethrows a failure of any thread.
  void finish();
  // Stops everything; wakes every blocked thread. Safe to call twice, and from another thread.
  void shutdown();
  // Synchronises the compute stream: an error while the hot loop runs.
  void synchronize_compute();

  RuntimeStats stats() const;
  Gpu& gpu() { return *gpu_; }
  const RuntimeConfig& config() const { return config_; }

 private:
  struct SlotRecord {  // the caller's view of a batch in the pinned ring
    std::uint64_t seq;
    Reservation slot;
  };
  struct FillJob {  // caller -> filler
    std::uint64_t seq;
    Reservation slot;
    BatchSpec spec;
    std::vector<std::int64_t> rows;  // capacity max_items, reused
  };
  struct OutputRecord {  // caller -> drain
    std::uint64_t seq;
    std::uint64_t batch_id;
    Reservation out;
    bool size_on_gpu;
  };
  static constexpr std::uint64_t kNoSize = ~0ull;  // a size slot the stage has not written
  volatile std::uint64_t* size_slot(std::uint64_t seq) const;

  // submit() after its reservations: enqueue the batch's GPU work, hand it to drain and filler.
  void commit(const BatchSpec& spec, const std::int64_t* rows, std::uint64_t seq,
              const Reservation& slot, const Reservation& out);
  void filler_loop();
  void drain_loop();
  void reclaim_slots();
  void fail(const std::string& what);
  void rethrow_failure();
  [[noreturn]] void stopped(const char* while_doing);
  void release_unpublished();

  std::unique_ptr<Gpu> gpu_;
  RuntimeConfig config_;
  std::unique_ptr<PayloadSource> source_;
  std::unique_ptr<Stage> stage_;
  Sink sink_;

  HostRegion ring_mem_, bell_mem_, counters_mem_, sizes_mem_;
  DevPtr payload_mem_ = 0;
  std::vector<HostRegion> staging_;
  std::unique_ptr<ByteRing> ring_, payload_ring_;
  Doorbell* bell_ = nullptr;
  DeviceCounters* counters_ = nullptr;

  // caller-only state
  std::vector<SlotRecord> slots_;  // circular, max_in_flight entries
  std::uint64_t slots_head_ = 0, slots_tail_ = 0;
  std::uint64_t next_seq_ = 1;
  std::uint64_t hooks_since_publish_ = 0;

  // caller -> filler and caller -> drain hand-offs, max_in_flight entries each
  SpscQueue<FillJob> fill_jobs_;
  SpscQueue<OutputRecord> outputs_;

  Gate ring_gate_, payload_gate_, fill_gate_, drain_gate_, done_gate_;
  std::thread filler_, drain_;
  std::chrono::microseconds poll_{50};
  std::atomic<bool> running_{false}, stopped_{false};
  std::atomic<std::uint64_t> published_seq_{0};  // doorbell value the filler last wrote
  std::atomic<std::uint64_t> drained_{0};

  // statistics, each written by one thread
  std::uint64_t ring_retries_ = 0, ring_blocked_ = 0, payload_waits_ = 0, payload_blocked_ = 0;
  std::uint64_t publications_ = 0;
  std::atomic<std::uint64_t> bytes_in_{0}, bytes_out_{0};
  std::atomic<double> drain_copy_seconds_{0};
  std::atomic<double> gpu_busy_seconds_{0}, gpu_span_seconds_{0};
  // marks: 0 = the first batch's start; then two per batch slot (start, end)
  static int start_mark(std::uint64_t seq) { return 1 + 2 * static_cast<int>(seq % ((Gpu::kMarks - 1) / 2)); }
  static int end_mark(std::uint64_t seq) { return start_mark(seq) + 1; }
  std::uint64_t device_allocations_at_start_ = 0;
  std::uint64_t heap_allocations_at_start_ = 0;
  std::mutex failure_mutex_;
  std::string failure_;
};

}  // namespace fabric
