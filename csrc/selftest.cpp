#include "selftest.h"

#include <chrono>
#include <cstring>
#include <random>
#include <thread>

#include "allocations.h"
#include "atomics.h"
#include "kernel_abi.h"
#include "sources.h"
#include "stages.h"

namespace fabric {
namespace {

using Clock = std::chrono::steady_clock;

double micros(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::micro>(b - a).count();
}

}  // namespace

SelfTestResult run_selftest(const SelfTestConfig& config) {
  SelfTestResult result;
  auto source = std::make_unique<SelfTestSource>(config.seed);
  std::vector<std::uint64_t> reserved(1 << 16, 0);  // reservation per seq (mod), for the verifier
  SelfTestSource* source_view = source.get();
  std::uint64_t expected_seq = 1;
  auto sink = [&](const DrainedBatch& batch) {
    if (batch.publish_seq != expected_seq || batch.batch_id != batch.publish_seq * 7 + 3) {
      if (result.order_errors++ == 0) {
        result.first_error = "expected batch seq " + std::to_string(expected_seq) + ", got " +
                             std::to_string(batch.publish_seq);
      }
    }
    expected_seq = batch.publish_seq + 1;
    // The checksum the GPU must have computed, from what the filler published.
    const std::uint64_t checksum =
        source_view->expected(batch.batch_id) + kernels::mix64(batch.publish_seq << 1);
    const auto* words = reinterpret_cast<const std::uint64_t*>(batch.data);
    const std::uint64_t n = batch.bytes / 8;
    const std::uint64_t reserved_words = reserved[batch.publish_seq % reserved.size()] / 8;
    const bool sized_on_gpu = config.gpu_sized && batch.publish_seq % 2 == 0;
    const std::uint64_t expected_words =
        sized_on_gpu ? selftest_output_words(batch.batch_id, reserved_words) : reserved_words;
    if (n != expected_words && result.output_mismatches++ == 0 && result.first_error.empty()) {
      result.first_error = "batch " + std::to_string(batch.publish_seq) + ": drained " +
                           std::to_string(n) + " words, expected " + std::to_string(expected_words);
    }
    // Word 0 tells whether the GPU read the right payload; the rest whether outputs arrived whole.
    if (n > 0 && words[0] != kernels::fill_word(checksum, 0)) {
      if (result.checksum_mismatches++ == 0 && result.first_error.empty()) {
        result.first_error = "batch " + std::to_string(batch.publish_seq) +
                             ": the GPU's checksum of the payload differs from the filler's";
      }
    } else if (batch.publish_seq % config.verify_every == 0) {
      for (std::uint64_t w = 1; w < n; ++w) {
        if (words[w] != kernels::fill_word(checksum, w)) {
          if (result.output_mismatches++ == 0 && result.first_error.empty()) {
            result.first_error = "batch " + std::to_string(batch.publish_seq) + ": output word " +
                                 std::to_string(w) + " of " + std::to_string(n) + " is wrong";
          }
          break;
        }
      }
    }
    ++result.verified;
    if (config.slow_drain_every && batch.publish_seq % config.slow_drain_every == 0) {
      std::this_thread::sleep_for(std::chrono::microseconds(config.slow_drain_us));
    }
  };
  const std::uint64_t allocations_at_start = allocations();
  std::unique_ptr<Gpu> gpu = config.emulated ? make_emulated_gpu() : make_cuda_gpu(config.device);
  RuntimeConfig rc = config.runtime;
  rc.max_items = std::max(rc.max_items, config.max_items);
  rc.max_output_bytes = std::max(rc.max_output_bytes, config.max_output_bytes);
  Runtime runtime(std::move(gpu), rc, std::move(source),
                  std::make_unique<SelfTestStage>(config.oversize_batch), sink);
  runtime.start();
  std::mt19937_64 rng(config.seed);
  std::vector<std::int64_t> rows(rc.max_items, 0);
  const auto start = Clock::now();
  // Warm-up: the first batches, a full turn of the in-flight queues and then some.
  result.warmup_batches = std::min<std::uint64_t>(config.batches, 2ull * rc.max_in_flight + 16);
  std::uint64_t allocations_warm = allocations();
  for (std::uint64_t i = 1; i <= config.batches; ++i) {
    if (i == result.warmup_batches + 1) allocations_warm = allocations();
    BatchSpec spec;
    spec.batch_id = i * 7 + 3;
    spec.real_tokens = 1 + rng() % config.max_tokens;
    spec.item_count = static_cast<std::uint32_t>(
        1 + rng() % std::min<std::uint64_t>(config.max_items, spec.real_tokens));
    spec.bucket_max = static_cast<std::uint32_t>(spec.real_tokens);
    spec.output_bytes = 8 * (1 + rng() % (config.max_output_bytes / 8));
    spec.hooks = static_cast<std::uint32_t>(1 + rng() % config.max_hooks);
    spec.lane = static_cast<std::uint32_t>(i % 4);
    spec.output_size_on_gpu = config.gpu_sized && i % 2 == 0;
    reserved[i % reserved.size()] = spec.output_bytes;
    runtime.submit(spec, rows.data());
  }
  runtime.finish();
  const std::uint64_t allocations_end = allocations();
  if (config.batches <= result.warmup_batches) allocations_warm = allocations_end;
  result.allocations_warming_up = allocations_warm - allocations_at_start;
  result.allocations_after_warmup = allocations_end - allocations_warm;
  result.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  result.stats = runtime.stats();
  result.batches = config.batches;
  runtime.shutdown();
  return result;
}

HandoffResult measure_handoff(int device, std::uint64_t iterations) {
  HandoffResult r;
  std::unique_ptr<Gpu> gpu = make_cuda_gpu(device);
  r.device = gpu->describe();
  HostRegion mem = gpu->alloc_host(4096, HostMemoryKind::kMapped);
  auto* base = static_cast<unsigned char*>(mem.host);
  auto* bell = reinterpret_cast<volatile std::uint64_t*>(base);
  auto* ack = reinterpret_cast<volatile std::uint64_t*>(base + 64);
  const DevPtr bell_dev = mem.device, ack_dev = mem.device + 64;
  const LaunchShape one{1, 1, 1, 32, 1, 1};
  const std::uint64_t warmup = 200;
  const std::uint64_t total = iterations + warmup;
  constexpr std::uint64_t kAhead = 8;  // the decode loop runs ahead of the doorbell

  // Doorbell: work for batch i is enqueued before i is published; the clock runs from the
  // publish to the host seeing the kernel's system-scope ack.
  auto enqueue = [&](std::uint64_t i) {
    gpu->wait_geq(Stream::kCompute, bell_dev, i);
    kernels::SelfTestWriteArgs a{ack_dev, i};
    gpu->launch(Stream::kCompute, kernels::KernelId::kSelfTestWrite, one, &a, sizeof(a));
  };
  for (std::uint64_t i = 1; i <= std::min(kAhead, total); ++i) enqueue(i);
  for (std::uint64_t i = 1; i <= total; ++i) {
    std::this_thread::sleep_for(std::chrono::microseconds(20));  // let the stream settle on the wait
    const auto t0 = Clock::now();
    store_release(bell, i);  // Release: publish batch i (nothing else to order: a timing loop)
    while (load_acquire(ack) != i) cpu_relax();  // Acquire: batch i's kernel ran
    const auto t1 = Clock::now();
    if (i > warmup) r.doorbell_us.push_back(micros(t0, t1));
    if (i + kAhead <= total) enqueue(i + kAhead);
  }
  gpu->synchronize(Stream::kCompute);

  // Host launch + poll, and host launch + stream synchronise.
  for (std::uint64_t i = 1; i <= total; ++i) {
    std::this_thread::sleep_for(std::chrono::microseconds(20));
    const std::uint64_t value = (1ull << 40) + i;
    kernels::SelfTestWriteArgs a{ack_dev, value};
    const auto t0 = Clock::now();
    gpu->launch(Stream::kCompute, kernels::KernelId::kSelfTestWrite, one, &a, sizeof(a));
    while (load_acquire(ack) != value) cpu_relax();  // Acquire: the launched kernel ran
    const auto t1 = Clock::now();
    if (i > warmup) r.launch_poll_us.push_back(micros(t0, t1));
  }
  gpu->synchronize(Stream::kCompute);
  for (std::uint64_t i = 1; i <= total; ++i) {
    std::this_thread::sleep_for(std::chrono::microseconds(20));
    kernels::SelfTestWriteArgs a{ack_dev, (2ull << 40) + i};
    const auto t0 = Clock::now();
    gpu->launch(Stream::kCompute, kernels::KernelId::kSelfTestWrite, one, &a, sizeof(a));
    gpu->synchronize(Stream::kCompute);
    const auto t1 = Clock::now();
    if (i > warmup) r.launch_sync_us.push_back(micros(t0, t1));
  }
  gpu->free_host(mem);
  return r;
}

double measure_d2h_gbps(int device, std::uint64_t bytes, int repeats) {
  std::unique_ptr<Gpu> gpu = make_cuda_gpu(device);
  const DevPtr src = gpu->alloc_device(bytes);
  HostRegion dst = gpu->alloc_host(bytes, HostMemoryKind::kOrdinary);
  double best = 0;
  for (int r = 0; r < repeats + 1; ++r) {
    const auto t0 = Clock::now();
    gpu->copy_to_host(Stream::kDrain, dst.host, src, bytes);
    gpu->record_event(Stream::kDrain, 0);
    gpu->wait_event(0);
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    if (r > 0) best = std::max(best, static_cast<double>(bytes) / s / 1e9);
  }
  gpu->free_host(dst);
  gpu->free_device(src);
  return best;
}

std::string cuda_self_test(int device, bool eager_warmup) {
  return make_cuda_gpu(device, eager_warmup)->describe();
}

}  // namespace fabric
