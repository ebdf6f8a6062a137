// Stages: the GPU work of one batch between its doorbell and its publication.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <variant>
#include <vector>

#include "runtime.h"

namespace fabric {

// The protocol tests' engine: a checksum kernel reads the whole slot (proving the GPU saw every
// published byte), then `spec.hooks` fill kernels write the batch's output in pieces of random
// size derived from that checksum, each piece a hook output with its publish point. For batches
// whose output size is resolved on the GPU it writes selftest_output_words() words and reports
// that size; `oversize_batch` (a batch id) reports more than its reservation instead.
class SelfTestStage final : public Stage {
 public:
  explicit SelfTestStage(std::uint64_t oversize_batch = 0) : oversize_batch_(oversize_batch) {}
  void warm_up(Gpu& gpu) override;
  void enqueue(Context& ctx) override;
  ~SelfTestStage() override;

 private:
  static constexpr std::uint64_t kScratchSlots = 4096;  // > max_in_flight
  std::uint64_t oversize_batch_;
  Gpu* gpu_ = nullptr;
  DevPtr scratch_ = 0;  // one checksum per in-flight batch
};

// An engine's static input buffers, by how it takes its input.
struct PaddedInputs {
  DevPtr input_ids = 0;       // int64 [items, seq_len]
  DevPtr attention_mask = 0;  // int64 [items, seq_len]
};
struct PackedInputs {
  DevPtr input_ids = 0;   // int64 [capacity]: every item's tokens back to back
  DevPtr positions = 0;   // int64 [capacity]: each token's position in its item
  DevPtr seq_ids = 0;     // int64 [capacity]: each token's item
  DevPtr cu_seqlens = 0;  // int32 [items + 2]: where each item starts
};

// One captured shape of an engine: its graph (or, on the emulated GPU, a host function) and the
// static buffers the graph reads and writes. Registered before start; keyed by shape epoch.
struct ShapeGraph {
  std::uint32_t epoch = 0;
  std::uint32_t items = 0;     // padded: rows; packed: most sequences (cu_seqlens holds items + 2)
  std::uint32_t seq_len = 0;   // padded: columns; packed: token capacity of the shape
  std::int64_t pad_id = 0;
  std::uint64_t graph_exec = 0;  // CUgraphExec on a GPU
  // Emulated GPU: runs the engine on the static buffers for a batch of `items` items; returns ""
  // or an error message.
  std::function<std::string(std::uint64_t publish_seq, std::uint32_t items)> host_graph;
  std::variant<PaddedInputs, PackedInputs> inputs;  // the layout is which one it holds
  DevPtr pooled = 0;     // [rows, pooled_row_bytes], row i = item i
  std::uint32_t pooled_row_bytes = 0;
  std::vector<DevPtr> hooks;  // per hook layer: padded [items, seq_len, row]; packed [capacity, row]
  std::uint32_t hook_row_bytes = 0;

  bool packed() const { return std::holds_alternative<PackedInputs>(inputs); }
};

// The production stage: gather the slot into the shape's static inputs, release the slot,
// launch the shape's graph, then copy the pooled rows and each hook layer's real-token rows into
// the batch's output region, in the layout [pooled items x pooled_row][hook 1: real x row]...
class GraphStage final : public Stage {
 public:
  void add_shape(ShapeGraph shape);
  void check(const BatchSpec& spec) const override;
  void enqueue(Context& ctx) override;
  std::string take_error(std::uint64_t publish_seq) override;
  // Bytes of a batch's output for `items` items and `real_tokens` tokens in shape `epoch`.
  std::uint64_t output_bytes(std::uint32_t epoch, std::uint32_t items, std::uint64_t real_tokens) const;

 private:
  const ShapeGraph& shape(std::uint32_t epoch) const;
  std::map<std::uint32_t, ShapeGraph> shapes_;
  std::mutex errors_mutex_;
  std::map<std::uint64_t, std::string> errors_;
};

// Words the self-test stage writes for a batch whose size the GPU resolves: fewer than reserved.
inline std::uint64_t selftest_output_words(std::uint64_t batch_id, std::uint64_t reserved_words) {
  return reserved_words - (batch_id * 2654435761ull) % (reserved_words / 2 + 1);
}

}  // namespace fabric
