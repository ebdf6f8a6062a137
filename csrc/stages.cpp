#include "stages.h"

#include <algorithm>
#include <stdexcept>

namespace fabric {

using kernels::KernelId;

void SelfTestStage::warm_up(Gpu& gpu) {
  gpu_ = &gpu;
  scratch_ = gpu.alloc_device(kScratchSlots * sizeof(std::uint64_t));
}

SelfTestStage::~SelfTestStage() {
  if (gpu_ != nullptr && scratch_ != 0) {
    try {
      gpu_->free_device(scratch_);
    } catch (...) {
    }
  }
}

void SelfTestStage::enqueue(Context& ctx) {
  const DevPtr checksum = scratch_ + (ctx.publish_seq % kScratchSlots) * sizeof(std::uint64_t);
  kernels::SelfTestChecksumArgs c{ctx.slot, checksum};
  ctx.gpu.launch(Stream::kCompute, KernelId::kSelfTestChecksum, LaunchShape{1, 1, 1, 256, 1, 1},
                 &c, sizeof(c));
  ctx.slot_done();  // the checksum was the only reader of the slot
  const std::uint64_t reserved_words = ctx.spec.output_bytes / 8;
  const std::uint64_t words = ctx.spec.output_size_on_gpu
                                  ? selftest_output_words(ctx.spec.batch_id, reserved_words)
                                  : reserved_words;
  const std::uint64_t hooks = std::max<std::uint64_t>(1, std::min<std::uint64_t>(ctx.spec.hooks, words));
  std::uint64_t done = 0;
  for (std::uint64_t h = 0; h < hooks; ++h) {
    // Uneven pieces: hook h ends at words * (h + 1)^2 / hooks^2.
    const std::uint64_t end = h + 1 == hooks ? words : words * (h + 1) * (h + 1) / (hooks * hooks);
    if (end <= done) continue;
    kernels::SelfTestFillArgs f{ctx.out + done * 8, end - done, done, checksum};
    const auto blocks = static_cast<unsigned>(std::min<std::uint64_t>((end - done + 255) / 256, 1024));
    ctx.gpu.launch(Stream::kCompute, KernelId::kSelfTestFill, LaunchShape{blocks, 1, 1, 256, 1, 1},
                   &f, sizeof(f));
    done = end;
    if (h + 1 == hooks && ctx.spec.output_size_on_gpu) {
      // The size is known on the GPU only: written (system-scope) before the batch is published.
      const std::uint64_t size = ctx.spec.batch_id == oversize_batch_ ? ctx.spec.output_bytes + 8
                                                                       : words * 8;
      kernels::SelfTestWriteArgs w{ctx.size_slot, size};
      ctx.gpu.launch(Stream::kCompute, KernelId::kSelfTestWrite, LaunchShape{1, 1, 1, 32, 1, 1}, &w,
                     sizeof(w));
      ctx.hook_done(ctx.spec.output_bytes);  // the whole reservation is settled
    } else {
      ctx.hook_done(done * 8);
    }
  }
}

}  // namespace fabric

namespace fabric {

namespace {

unsigned blocks_for(std::uint64_t work, unsigned per_block, unsigned cap) {
  return static_cast<unsigned>(std::max<std::uint64_t>(
      1, std::min<std::uint64_t>((work + per_block - 1) / per_block, cap)));
}

}  // namespace

void GraphStage::add_shape(ShapeGraph shape) {
  if (shape.hook_row_bytes % 16 != 0 || shape.pooled_row_bytes % 16 != 0) {
    throw std::invalid_argument("shape epoch " + std::to_string(shape.epoch) +
                                ": row sizes must be multiples of 16 bytes");
  }
  if (shapes_.count(shape.epoch) != 0) {
    throw std::invalid_argument("shape epoch " + std::to_string(shape.epoch) + " registered twice");
  }
  shapes_.emplace(shape.epoch, std::move(shape));
}

const ShapeGraph& GraphStage::shape(std::uint32_t epoch) const {
  auto it = shapes_.find(epoch);
  if (it == shapes_.end()) {
    throw std::invalid_argument("no graph registered for shape epoch " + std::to_string(epoch));
  }
  return it->second;
}

std::uint64_t GraphStage::output_bytes(std::uint32_t epoch, std::uint32_t items,
                                       std::uint64_t real_tokens) const {
  const ShapeGraph& s = shape(epoch);
  return static_cast<std::uint64_t>(items) * s.pooled_row_bytes +
         s.hooks.size() * real_tokens * s.hook_row_bytes;
}

void GraphStage::check(const BatchSpec& spec) const {
  const ShapeGraph& s = shape(spec.shape_epoch);
  const bool packed = s.packed();
  if (spec.item_count > s.items || (packed ? spec.real_tokens > s.seq_len : spec.bucket_max > s.seq_len)) {
    throw std::invalid_argument("batch " + std::to_string(spec.batch_id) +
                                " does not fit shape epoch " + std::to_string(s.epoch));
  }
  if (output_bytes(s.epoch, spec.item_count, spec.real_tokens) != spec.output_bytes) {
    throw std::invalid_argument("batch " + std::to_string(spec.batch_id) +
                                ": output_bytes does not match the shape's output layout");
  }
}

void GraphStage::enqueue(Context& ctx) {
  const ShapeGraph& s = shape(ctx.spec.shape_epoch);  // check() passed in submit()
  const BatchSpec& spec = ctx.spec;
  const bool packed = s.packed();
  // 1. gather: ring slot -> the shape's static inputs
  if (packed) {
    const PackedInputs& in = std::get<PackedInputs>(s.inputs);
    kernels::GatherPackedArgs g{ctx.slot,      in.input_ids, in.positions, in.seq_ids,
                                in.cu_seqlens, s.seq_len,    s.items,      s.pad_id};
    ctx.gpu.launch(Stream::kCompute, kernels::KernelId::kGatherPacked,
                   LaunchShape{blocks_for(s.seq_len, 256, 16), spec.item_count + 1, 1, 256, 1, 1},
                   &g, sizeof(g));
  } else {
    const PaddedInputs& in = std::get<PaddedInputs>(s.inputs);
    kernels::GatherPaddedArgs g{ctx.slot, in.input_ids, in.attention_mask, s.seq_len, s.items, s.pad_id};
    ctx.gpu.launch(Stream::kCompute, kernels::KernelId::kGatherPadded,
                   LaunchShape{blocks_for(s.seq_len, 256, 8), s.items, 1, 256, 1, 1}, &g, sizeof(g));
  }
  // Packed: the slot is in the static inputs now. Padded: the hook copies still read its offsets.
  if (packed) ctx.slot_done();
  // 2. the engine
  if (ctx.gpu.emulated()) {
    const ShapeGraph* shape_ptr = &s;
    const std::uint64_t seq = ctx.publish_seq;
    const std::uint32_t items = spec.item_count;
    ctx.gpu.host_call(Stream::kCompute, [this, shape_ptr, seq, items] {
      std::string error = shape_ptr->host_graph ? shape_ptr->host_graph(seq, items)
                                                : "shape has no host function on the emulated GPU";
      if (!error.empty()) {
        std::lock_guard<std::mutex> lock(errors_mutex_);
        errors_[seq] = std::move(error);
      }
    });
  } else {
    ctx.gpu.launch_graph(Stream::kCompute, s.graph_exec);
  }
  // 3. outputs: pooled rows, then each hook layer's real tokens
  const std::uint64_t pooled_bytes = static_cast<std::uint64_t>(spec.item_count) * s.pooled_row_bytes;
  kernels::CopyBytesArgs p{s.pooled, ctx.out, pooled_bytes};
  ctx.gpu.launch(Stream::kCompute, kernels::KernelId::kCopyBytes,
                 LaunchShape{blocks_for(pooled_bytes / 16, 256, 64), 1, 1, 256, 1, 1}, &p, sizeof(p));
  ctx.hook_done(pooled_bytes);
  const std::uint64_t hook_bytes = spec.real_tokens * s.hook_row_bytes;
  for (std::size_t h = 0; h < s.hooks.size(); ++h) {
    const DevPtr out = ctx.out + pooled_bytes + h * hook_bytes;
    if (packed) {
      // Real tokens are the first rows of a packed hidden state: one contiguous copy.
      kernels::CopyBytesArgs c{s.hooks[h], out, hook_bytes};
      ctx.gpu.launch(Stream::kCompute, kernels::KernelId::kCopyBytes,
                     LaunchShape{blocks_for(hook_bytes / 16, 256, 1024), 1, 1, 256, 1, 1}, &c, sizeof(c));
    } else {
      kernels::HookCopyArgs c{ctx.slot, s.hooks[h], out, s.seq_len, spec.item_count, s.hook_row_bytes, 0};
      ctx.gpu.launch(Stream::kCompute, kernels::KernelId::kHookCopy,
                     LaunchShape{blocks_for(static_cast<std::uint64_t>(s.seq_len) * s.hook_row_bytes / 16, 256, 8),
                                 spec.item_count, 1, 256, 1, 1},
                     &c, sizeof(c));
    }
    ctx.hook_done(pooled_bytes + (h + 1) * hook_bytes);
  }
  ctx.slot_done();
}

std::string GraphStage::take_error(std::uint64_t publish_seq) {
  std::lock_guard<std::mutex> lock(errors_mutex_);
  auto it = errors_.find(publish_seq);
  if (it == errors_.end()) return {};
  std::string error = std::move(it->second);
  errors_.erase(it);
  return error;
}

}  // namespace fabric
