#include "stages.h"

#include <algorithm>

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
