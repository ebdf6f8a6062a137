#include "runtime.h"

#include <chrono>
#include <cstddef>
#include <cstring>
#include <stdexcept>

#include "allocations.h"
#include "atomics.h"

namespace fabric {
namespace {

constexpr std::uint64_t kAlignment = 256;  // every slot and output starts 256-byte aligned

std::uint64_t elapsed_ns(std::chrono::steady_clock::time_point since) {
  return static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                        std::chrono::steady_clock::now() - since)
                                        .count());
}

}  // namespace

Runtime::Runtime(std::unique_ptr<Gpu> gpu, RuntimeConfig config,
                 std::unique_ptr<PayloadSource> source, std::unique_ptr<Stage> stage, Sink sink)
    : gpu_(std::move(gpu)),
      config_(config),
      source_(std::move(source)),
      stage_(std::move(stage)),
      sink_(std::move(sink)) {
  if (config_.input_location == InputLocation::kHost && config_.write_combined) {
    throw std::invalid_argument(
        "refusing a write-combined ring for an engine that reads its inputs on the CPU: CPU "
        "reads of write-combined memory are very slow; use write_combined=false");
  }
  if (config_.staging_buffers == 0 || config_.staging_buffers > Gpu::kEvents) {
    throw std::invalid_argument("staging_buffers must be 1.." + std::to_string(Gpu::kEvents));
  }
  if (config_.measure_gpu_time && config_.max_in_flight >= (Gpu::kMarks - 1) / 2) {
    throw std::invalid_argument("measure_gpu_time needs max_in_flight below " +
                                std::to_string((Gpu::kMarks - 1) / 2));
  }
  if (config_.max_in_flight == 0 || config_.publish_every == 0 || config_.max_items == 0) {
    throw std::invalid_argument("max_in_flight, publish_every and max_items must be positive");
  }
}

Runtime::~Runtime() {
  shutdown();
  try {
    for (auto& region : staging_) gpu_->free_host(region);
    if (payload_mem_) gpu_->free_device(payload_mem_);
    gpu_->free_host(counters_mem_);
    gpu_->free_host(sizes_mem_);
    gpu_->free_host(bell_mem_);
    gpu_->free_host(ring_mem_);
  } catch (...) {
    // never throw from a destructor
  }
}

void Runtime::start() {
  if (running_.load()) throw std::logic_error("runtime already started");
  heap_allocations_at_start_ = allocations();
  gpu_->bind_thread();
  HostMemoryKind ring_kind = HostMemoryKind::kMappedWriteCombined;
  if (!config_.write_combined) ring_kind = HostMemoryKind::kMapped;
  if (gpu_->emulated()) ring_kind = HostMemoryKind::kOrdinary;
  ring_mem_ = gpu_->alloc_host(config_.ring_bytes, ring_kind);
  bell_mem_ = gpu_->alloc_host(4096, HostMemoryKind::kMapped);
  counters_mem_ = gpu_->alloc_host(4096, HostMemoryKind::kMapped);
  // One cache line per in-flight batch for sizes resolved on the GPU.
  sizes_mem_ = gpu_->alloc_host(64ull * config_.max_in_flight, HostMemoryKind::kMapped);
  payload_mem_ = gpu_->alloc_device(config_.payload_ring_bytes);
  for (std::uint32_t i = 0; i < config_.staging_buffers; ++i) {
    staging_.push_back(gpu_->alloc_host(config_.max_output_bytes, HostMemoryKind::kOrdinary));
  }
  if (config_.poison_byte >= 0) {
    const auto poison = static_cast<unsigned char>(config_.poison_byte);
    gpu_->fill_device(payload_mem_, poison, config_.payload_ring_bytes);
    for (auto& region : staging_) std::memset(region.host, poison, region.bytes);
  }
  bell_ = static_cast<Doorbell*>(bell_mem_.host);
  counters_ = static_cast<DeviceCounters*>(counters_mem_.host);
  ring_ = std::make_unique<ByteRing>(config_.ring_bytes, kAlignment, "pinned ring");
  payload_ring_ = std::make_unique<ByteRing>(config_.payload_ring_bytes, kAlignment, "payload ring");
  slots_.resize(config_.max_in_flight);
  outputs_.resize(config_.max_in_flight);
  fill_jobs_.resize(config_.max_in_flight);
  for (auto& job : fill_jobs_.entries()) job.rows.reserve(config_.max_items);
  stage_->warm_up(*gpu_);
  // How often a blocked thread re-checks memory the GPU writes: often on a GPU (latency), less
  // on the emulated GPU, whose idle polling would take CPU from the engine it emulates.
  poll_ = std::chrono::microseconds(gpu_->emulated() ? 500 : 50);
  device_allocations_at_start_ = gpu_->allocations();
  running_.store(true);
  filler_ = std::thread([this] { filler_loop(); });
  drain_ = std::thread([this] { drain_loop(); });
  gpu_->set_hot(true);
}

volatile std::uint64_t* Runtime::size_slot(std::uint64_t seq) const {
  return reinterpret_cast<volatile std::uint64_t*>(static_cast<char*>(sizes_mem_.host) +
                                                   64 * (seq % config_.max_in_flight));
}

void Runtime::reclaim_slots() {
  // Acquire: the GPU finished reading these slots before it wrote consumed_seq.
  const std::uint64_t consumed = load_acquire(&counters_->consumed_seq);
  while (slots_tail_ < slots_head_) {
    const SlotRecord& record = slots_[slots_tail_ % slots_.size()];
    if (record.seq > consumed) break;
    ring_->release(record.slot);
    ++slots_tail_;
  }
}

void Runtime::submit(const BatchSpec& spec, const std::int64_t* rows) {
  rethrow_failure();
  if (!running_.load() || stopped_.load()) stopped("submitting");
  if (spec.item_count == 0 || spec.item_count > config_.max_items) {
    throw std::invalid_argument("batch " + std::to_string(spec.batch_id) + " has " +
                                std::to_string(spec.item_count) + " items; allowed 1.." +
                                std::to_string(config_.max_items));
  }
  if (spec.output_bytes == 0 || spec.output_bytes > config_.max_output_bytes) {
    throw std::invalid_argument("batch " + std::to_string(spec.batch_id) + " outputs " +
                                std::to_string(spec.output_bytes) + " bytes; allowed 1.." +
                                std::to_string(config_.max_output_bytes));
  }
  stage_->check(spec);  // before any reservation: a refused batch must leave nothing to wait for
  gpu_->bind_thread();  // the caller's thread enqueues on the device's context
  const std::uint64_t seq = next_seq_;
  // At most max_in_flight batches between submit and drain (the queues are that deep).
  // Acquire: pairs with the drain's release of drained_: the drained batch's queue entries and
  // payload-ring bytes are free before we count on them.
  auto room = [&] { return seq - 1 - load_acquire(drained_) < config_.max_in_flight; };
  std::uint64_t ignored = 0;
  if (!wait_ladder(done_gate_, room, ignored, poll_)) stopped("waiting for a batch to drain");

  std::optional<Reservation> slot;
  auto slot_ready = [&] {
    reclaim_slots();
    if (slots_head_ - slots_tail_ >= slots_.size()) return false;  // every slot record in use
    if (!slot) slot = ring_->try_reserve(slot_bytes(spec.item_count, spec.real_tokens));
    return slot.has_value();
  };
  if (!wait_retry_then_block(ring_gate_, slot_ready, ring_retries_, ring_blocked_)) {
    stopped("waiting for ring space");
  }
  std::optional<Reservation> out = payload_ring_->try_reserve(spec.output_bytes);
  if (!out) ++payload_waits_;
  auto out_ready = [&] {
    if (!out) out = payload_ring_->try_reserve(spec.output_bytes);
    return out.has_value();
  };
  if (!wait_ladder(payload_gate_, out_ready, payload_blocked_, poll_)) {
    stopped("waiting for payload-ring space");
  }
  ++next_seq_;
  slots_[slots_head_++ % slots_.size()] = SlotRecord{seq, *slot};
  // From here on `seq` is taken: finish() waits for it. A call below that throws (a driver error,
  // a stopped GPU) leaves it without an output record or a payload, so the runtime is failed:
  // finish() then raises instead of waiting forever, and shutdown() releases what the GPU holds.
  try {
    commit(spec, rows, seq, *slot, *out);
  } catch (const std::exception& e) {
    // A shutdown meanwhile stopped the GPU under this batch: report the shutdown, not the GPU's
    // refusal that followed from it.
    if (stopped_.load()) stopped("committing a batch");
    fail("submit: batch " + std::to_string(spec.batch_id) + ": " + e.what());
    throw;
  } catch (...) {
    fail("submit: batch " + std::to_string(spec.batch_id) + ": unknown error");
    throw;
  }
}

void Runtime::commit(const BatchSpec& spec, const std::int64_t* rows, std::uint64_t seq,
                     const Reservation& slot, const Reservation& out) {
  // Mark the size slot unwritten; the hand-off to the filler orders this before the doorbell,
  // so the GPU's write of the real size comes after it.
  if (spec.output_size_on_gpu) *size_slot(seq) = kNoSize;

  // Enqueue the batch's GPU work now, ahead of its payload: the stream holds on the doorbell.
  Gpu& gpu = *gpu_;
  gpu.wait_geq(Stream::kCompute, bell_mem_.device + offsetof(Doorbell, seq), seq);
  if (config_.measure_gpu_time) {
    if (seq == 1) gpu.record_mark(Stream::kCompute, 0);
    gpu.record_mark(Stream::kCompute, start_mark(seq));
  }
  const DevPtr published_head = counters_mem_.device + offsetof(DeviceCounters, published_head);
  const DevPtr consumed_seq = counters_mem_.device + offsetof(DeviceCounters, consumed_seq);
  const std::uint64_t out_start = out.begin + (out.span - payload_ring_->rounded(out.length));
  bool slot_released = false;
  bool end_published = false;
  auto publish = [&](std::uint64_t value) {
    // System-scope release (cuStreamWriteValue64's barrier): outputs up to `value` are complete.
    gpu.write_value(Stream::kCompute, published_head, value);
    ++publications_;
  };
  auto release_slot = [&] {
    if (slot_released) return;
    // The slot is no longer read: hand its bytes back to the caller's ring.
    gpu.write_value(Stream::kCompute, consumed_seq, seq);
    slot_released = true;
  };
  auto hook_done = [&](std::uint64_t bytes_done) {
    const bool last = bytes_done >= spec.output_bytes;
    // Batched publication: one release per K hook outputs, and the batch end.
    if (++hooks_since_publish_ % config_.publish_every == 0 || last) {
      publish(last ? out.end() : out_start + bytes_done);
      hooks_since_publish_ = 0;
      end_published = last;
    }
  };
  // The callbacks are referenced, not copied: nothing is allocated per batch.
  Stage::Context ctx{gpu,
                     spec,
                     seq,
                     ring_mem_.device + slot.offset,
                     static_cast<char*>(ring_mem_.host) + slot.offset,
                     payload_mem_ + out.offset,
                     gpu.host_view(payload_mem_ + out.offset),
                     sizes_mem_.device + 64 * (seq % config_.max_in_flight),
                     release_slot,
                     hook_done};
  stage_->enqueue(ctx);
  release_slot();
  // Forward boundary: the batch's end is always published.
  if (!end_published) publish(out.end());
  if (config_.measure_gpu_time) gpu.record_mark(Stream::kCompute, end_mark(seq));

  outputs_.next() = OutputRecord{seq, spec.batch_id, out, spec.output_size_on_gpu};
  outputs_.push();
  drain_gate_.notify();

  FillJob& job = fill_jobs_.next();
  job.seq = seq;
  job.slot = slot;
  job.spec = spec;
  job.rows.assign(rows, rows + spec.item_count);  // within the reserved capacity: no allocation
  fill_jobs_.push();
  fill_gate_.notify();
}

void Runtime::filler_loop() {
  try {
    std::uint64_t tail = 0;
    std::uint64_t ignored = 0;
    for (;;) {
      auto has_job = [&] { return fill_jobs_.published() > tail; };
      if (!wait_ladder(fill_gate_, has_job, ignored, poll_)) return;
      FillJob& job = fill_jobs_.at(tail);
      const BatchSpec& spec = job.spec;
      auto* slot = static_cast<char*>(ring_mem_.host) + job.slot.offset;
      BatchDescriptor d{};
      d.batch_id = spec.batch_id;
      d.publish_seq = job.seq;
      d.real_tokens = spec.real_tokens;
      d.padded_tokens = static_cast<std::uint64_t>(spec.item_count) * spec.bucket_max;
      d.output_limit = spec.output_bytes;
      d.offsets_at = sizeof(BatchDescriptor);
      d.tokens_at = static_cast<std::uint32_t>(sizeof(BatchDescriptor) + 8ull * (spec.item_count + 1));
      d.lane = spec.lane;
      d.batch_class = spec.batch_class;
      d.bucket_max = spec.bucket_max;
      d.item_count = spec.item_count;
      d.shape_epoch = spec.shape_epoch;
      d.payload_bytes = static_cast<std::uint32_t>(job.slot.length);
      source_->write(spec, job.rows.data(), reinterpret_cast<std::int64_t*>(slot + d.offsets_at),
                     reinterpret_cast<std::int32_t*>(slot + d.tokens_at));
      std::memcpy(slot, &d, sizeof(d));
      store_fence();  // order the payload stores (write-combined on a GPU) before the doorbell
      // Release: order the slot's descriptor and payload before the doorbell (job.seq may run).
      store_release(&bell_->seq, job.seq);
      // Not for ordering (the doorbell is cached mapped memory): the store leaves this core's
      // store buffer before the filler turns to the next slot, so the waiting stream sees it now.
      store_fence();
      add_relaxed(bytes_in_, job.slot.length);  // a statistic
      // Release: order the descriptor written above before the seq shutdown() reads as published.
      store_release(published_seq_, job.seq);
      ++tail;
    }
  } catch (const std::exception& e) {
    fail(std::string("filler: ") + e.what());
  }
}

void Runtime::drain_loop() {
  struct InFlight {
    OutputRecord record;
    std::uint32_t staging;
    std::uint64_t bytes;  // what was copied: the reservation, or the size the GPU reported
  };
  try {
    gpu_->bind_thread();
    std::vector<InFlight> flight(config_.staging_buffers);
    std::uint64_t started = 0, completed = 0;  // indices into outputs_
    std::uint64_t last_consumed = 0;
    std::uint64_t ignored = 0;
    auto copy_clock = std::chrono::steady_clock::now();
    std::uint64_t copy_ns = 0;
    for (;;) {
      bool progress = false;
      // Acquire: wake a caller blocked on a full ring once the GPU consumed slots.
      const std::uint64_t consumed = load_acquire(&counters_->consumed_seq);
      if (consumed != last_consumed) {
        last_consumed = consumed;
        ring_gate_.notify();
      }
      // Acquire: outputs up to published_head are complete in device memory.
      const std::uint64_t head = load_acquire(&counters_->published_head);
      while (started - completed < flight.size() &&
             started < outputs_.published()) {
        const OutputRecord& record = outputs_.at(started);
        if (record.out.end() > head) break;
        const auto k = static_cast<std::uint32_t>(started % flight.size());
        std::uint64_t bytes = record.out.length;
        if (record.size_on_gpu) {
          // Acquire (through published_head above): the stage wrote the size before publishing.
          bytes = load_acquire(size_slot(record.seq));
          if (bytes == kNoSize) {
            throw std::runtime_error("batch " + std::to_string(record.batch_id) +
                                     ": the stage published without writing its output size");
          }
          if (bytes > record.out.length) {
            throw std::runtime_error("batch " + std::to_string(record.batch_id) + ": the stage "
                                     "reported " + std::to_string(bytes) + " output bytes, more "
                                     "than the " + std::to_string(record.out.length) + " reserved");
          }
        }
        if (started == completed) copy_clock = std::chrono::steady_clock::now();
        gpu_->copy_to_host(Stream::kDrain, staging_[k].host, payload_mem_ + record.out.offset,
                           bytes);
        gpu_->record_event(Stream::kDrain, static_cast<int>(k));
        flight[k] = InFlight{record, k, bytes};
        ++started;
        progress = true;
      }
      while (completed < started) {
        const InFlight& f = flight[completed % flight.size()];
        if (!gpu_->event_done(static_cast<int>(f.staging))) break;
        DrainedBatch batch{f.record.seq, f.record.batch_id,
                           static_cast<const std::uint8_t*>(staging_[f.staging].host), f.bytes,
                           stage_->take_error(f.record.seq)};
        if (config_.measure_gpu_time) {
          // The batch's end mark follows its publication on the compute stream: wait for it.
          const std::uint64_t s = f.record.seq;
          gpu_busy_seconds_.store(gpu_busy_seconds_.load() +
                                  gpu_->mark_elapsed_ms(start_mark(s), end_mark(s)) * 1e-3);
          gpu_span_seconds_.store(gpu_->mark_elapsed_ms(0, end_mark(s)) * 1e-3);
        }
        sink_(batch);
        // Free the payload-ring bytes only now: the copy is complete and the sink is done.
        payload_ring_->release(f.record.out);
        add_relaxed(bytes_out_, f.bytes);  // a statistic
        ++completed;
        if (completed == started) copy_ns += elapsed_ns(copy_clock);
        // Release: order the sink's end and the freed payload bytes before the count of drained
        // batches, which submit() and finish() acquire.
        store_release(drained_, load_relaxed(drained_) + 1);
        payload_gate_.notify();
        done_gate_.notify();
        progress = true;
      }
      store_relaxed(drain_copy_seconds_, static_cast<double>(copy_ns) * 1e-9);  // a statistic
      // Acquire: a stop (fail() or shutdown()) and what was recorded before it are seen together.
      if (load_acquire(stopped_)) return;
      if (progress) continue;
      auto work = [&] {
        if (completed < started && gpu_->event_done(static_cast<int>(flight[completed % flight.size()].staging))) return true;
        // Acquire: as above, the GPU's reads of consumed slots are done.
        if (load_acquire(&counters_->consumed_seq) != last_consumed) return true;
        if (started < outputs_.published() && started - completed < flight.size()) {
          // Acquire: as above, outputs up to published_head are complete.
          return outputs_.at(started).out.end() <=
                 load_acquire(&counters_->published_head);
        }
        return false;
      };
      if (!wait_ladder(drain_gate_, work, ignored, poll_)) return;
    }
  } catch (const std::exception& e) {
    fail(std::string("drain: ") + e.what());
  }
}

void Runtime::finish() {
  auto all_drained = [&] {
    // Acquire: pairs with the drain's release: every sink call for these batches has returned.
    return load_acquire(drained_) == next_seq_ - 1 || stopped_.load();
  };
  done_gate_.block_until(all_drained, std::chrono::microseconds(500));
  rethrow_failure();
  if (stopped_.load() && drained_.load() != next_seq_ - 1) {
    throw std::runtime_error("runtime shut down before every batch was drained");
  }
}

void Runtime::synchronize_compute() { gpu_->synchronize(Stream::kCompute); }

void Runtime::fail(const std::string& what) {
  {
    std::lock_guard<std::mutex> lock(failure_mutex_);
    if (failure_.empty()) failure_ = what;
  }
  stopped_.store(true);
  for (Gate* gate : {&ring_gate_, &payload_gate_, &fill_gate_, &drain_gate_, &done_gate_}) {
    gate->close();
  }
}

void Runtime::stopped(const char* while_doing) {
  rethrow_failure();  // a thread's failure explains the stop better than the stop itself
  throw std::runtime_error(std::string("runtime shut down while ") + while_doing);
}

void Runtime::rethrow_failure() {
  std::lock_guard<std::mutex> lock(failure_mutex_);
  if (!failure_.empty()) throw std::runtime_error("runtime failed: " + failure_);
}

void Runtime::release_unpublished() {
  // Batches enqueued on the GPU whose payload never came hold the stream on the doorbell. Give
  // each an empty descriptor (no items, no tokens) and ring, so the stream drains harmlessly.
  const std::uint64_t last = next_seq_ - 1;
  for (std::uint64_t i = slots_tail_; i < slots_head_; ++i) {
    const SlotRecord& record = slots_[i % slots_.size()];
    if (record.seq <= published_seq_.load()) continue;
    BatchDescriptor d{};
    d.publish_seq = record.seq;
    d.offsets_at = sizeof(BatchDescriptor);
    d.tokens_at = sizeof(BatchDescriptor) + 8;
    char* slot = static_cast<char*>(ring_mem_.host) + record.slot.offset;
    std::memcpy(slot, &d, sizeof(d));
    std::memset(slot + sizeof(d), 0, 8);
  }
  store_fence();  // order the empty descriptors before the final doorbell
  store_release(&bell_->seq, last);  // Release: every held batch may run, on its empty descriptor
  store_fence();
}

void Runtime::shutdown() {
  if (stopped_.exchange(true) && !running_.load()) return;
  gpu_->set_hot(false);
  for (Gate* gate : {&ring_gate_, &payload_gate_, &fill_gate_, &drain_gate_, &done_gate_}) {
    gate->close();
  }
  if (filler_.joinable()) filler_.join();
  if (drain_.joinable()) drain_.join();
  if (running_.exchange(false)) {
    if (gpu_->emulated()) {
      gpu_->stop();
    } else {
      release_unpublished();
      try {
        gpu_->bind_thread();
        gpu_->synchronize(Stream::kCompute);
        gpu_->synchronize(Stream::kDrain);
      } catch (...) {
        // a failed device reports through the stream; shutdown itself must not throw
      }
    }
  }
}

RuntimeStats Runtime::stats() const {
  RuntimeStats s;
  s.submitted = next_seq_ - 1;
  s.drained = drained_.load();
  s.bytes_in = bytes_in_.load();
  s.bytes_out = bytes_out_.load();
  s.ring_retries = ring_retries_;
  s.ring_blocked = ring_blocked_;
  s.payload_waits = payload_waits_;
  s.payload_blocked = payload_blocked_;
  s.publications = publications_;
  s.device_allocations = gpu_->allocations();
  s.device_allocations_at_start = device_allocations_at_start_;
  s.heap_allocations = allocations() - heap_allocations_at_start_;
  s.drain_copy_seconds = drain_copy_seconds_.load();
  s.gpu_busy_seconds = gpu_busy_seconds_.load();
  s.gpu_span_seconds = gpu_span_seconds_.load();
  return s;
}

}  // namespace fabric
