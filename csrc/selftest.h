// Protocol self tests and the handoff measurements, callable from Python tests and benchmarks.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "runtime.h"

namespace fabric {

struct SelfTestConfig {
  bool emulated = true;
  int device = 0;
  std::uint64_t batches = 10000;
  std::uint64_t seed = 1;
  std::uint64_t max_tokens = 4096;   // per batch, uniform in 1..max_tokens
  std::uint32_t max_items = 256;
  std::uint64_t max_output_bytes = 1 << 16;  // uniform in 8..max, a multiple of 8
  std::uint32_t max_hooks = 8;
  std::uint64_t slow_drain_every = 0;  // sleep in the sink every N batches (0: never)
  std::uint64_t slow_drain_us = 0;
  // Check every output word of every Nth batch (1: all); the other batches are checked by
  // their first word (payload checksum) and their order. Bandwidth runs verify sparsely so the
  // check does not become the drain's bottleneck.
  std::uint64_t verify_every = 1;
  bool gpu_sized = false;            // every other batch's output size is resolved on the GPU
  std::uint64_t oversize_batch = 0;  // that batch id reports more than its reservation
  RuntimeConfig runtime;
};

struct SelfTestResult {
  std::uint64_t batches = 0;
  std::uint64_t verified = 0;
  std::uint64_t checksum_mismatches = 0;  // the GPU read bytes other than those published
  std::uint64_t output_mismatches = 0;    // outputs torn or corrupted on the way back
  std::uint64_t order_errors = 0;         // a batch lost, repeated or out of order
  std::string first_error;
  double seconds = 0;
  RuntimeStats stats;
  // operator new calls by the host side (see allocations.h): from creating the runtime to the
  // end of the warm-up batches, then over every batch after them (the hot loop: should be 0).
  std::uint64_t warmup_batches = 0;
  std::uint64_t allocations_warming_up = 0;
  std::uint64_t allocations_after_warmup = 0;
};

SelfTestResult run_selftest(const SelfTestConfig& config);

// Handoff latencies (microseconds) on a real GPU: doorbell publish -> kernel ack seen by the
// host, against host launch + poll and host launch + stream synchronise.
struct HandoffResult {
  std::vector<double> doorbell_us, launch_poll_us, launch_sync_us;
  std::string device;
};
HandoffResult measure_handoff(int device, std::uint64_t iterations);

// Plain pinned D2H copy bandwidth in GB/s (the peer of the drain's copies).
double measure_d2h_gbps(int device, std::uint64_t bytes, int repeats);

// Creates the CUDA GPU (which runs the warm-up and the doorbell self test) and returns its name.
std::string cuda_self_test(int device, bool eager_warmup);

}  // namespace fabric
