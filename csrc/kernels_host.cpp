#include "kernels_host.h"

#include <cstring>
#include <stdexcept>

#include "atomics.h"
#include "protocol.h"

namespace fabric::kernels {
namespace {

template <typename T>
T* at(std::uint64_t address) {
  return reinterpret_cast<T*>(address);
}

const BatchDescriptor& descriptor_of(std::uint64_t slot) { return *at<const BatchDescriptor>(slot); }

void selftest_write(const SelfTestWriteArgs& a) {
  // Release: the emulated kernel's earlier writes happen before the flag.
  store_release(at<std::uint64_t>(a.flag), a.value);
}

void selftest_checksum(const SelfTestChecksumArgs& a) {
  const BatchDescriptor& d = descriptor_of(a.slot);
  const auto* tokens = at<const std::int32_t>(a.slot + d.tokens_at);
  const auto* offsets = at<const std::int64_t>(a.slot + d.offsets_at);
  std::uint64_t sum = mix64(d.batch_id) + mix64(d.publish_seq << 1);
  for (std::uint64_t i = 0; i < d.real_tokens; ++i) {
    sum += token_term(i, static_cast<std::uint32_t>(tokens[i]));
  }
  for (std::uint32_t i = 0; i <= d.item_count; ++i) {
    sum += token_term((1ull << 40) + i, static_cast<std::uint32_t>(offsets[i]));
  }
  *at<std::uint64_t>(a.checksum) = sum;
}

void selftest_fill(const SelfTestFillArgs& a) {
  const std::uint64_t checksum = *at<const std::uint64_t>(a.checksum);
  auto* out = at<std::uint64_t>(a.out);
  for (std::uint64_t w = 0; w < a.words; ++w) out[w] = fill_word(checksum, a.first_word + w);
}

void gather_padded(const GatherPaddedArgs& a) {
  const BatchDescriptor& d = descriptor_of(a.slot);
  const auto* offsets = at<const std::int64_t>(a.slot + d.offsets_at);
  const auto* tokens = at<const std::int32_t>(a.slot + d.tokens_at);
  auto* ids = at<std::int64_t>(a.ids);
  auto* mask = at<std::int64_t>(a.mask);
  for (std::uint32_t item = 0; item < a.items && item < d.item_count; ++item) {
    const std::int64_t begin = offsets[item];
    const std::int64_t length = offsets[item + 1] - begin;
    for (std::uint32_t pos = 0; pos < a.seq_len; ++pos) {
      const bool real = pos < length;
      const std::uint64_t out = static_cast<std::uint64_t>(item) * a.seq_len + pos;
      ids[out] = real ? static_cast<std::int64_t>(tokens[begin + pos]) : a.pad_id;
      mask[out] = real ? 1 : 0;
    }
  }
}

void hook_copy(const HookCopyArgs& a) {
  const BatchDescriptor& d = descriptor_of(a.slot);
  const auto* offsets = at<const std::int64_t>(a.slot + d.offsets_at);
  for (std::uint32_t item = 0; item < a.items && item < d.item_count; ++item) {
    const std::uint64_t first = static_cast<std::uint64_t>(offsets[item]);
    const std::uint64_t length = static_cast<std::uint64_t>(offsets[item + 1]) - first;
    std::memcpy(at<char>(a.out + first * a.row_bytes),
                at<const char>(a.src + static_cast<std::uint64_t>(item) * a.seq_len * a.row_bytes),
                length * a.row_bytes);
  }
}

void gather_packed(const GatherPackedArgs& a) {
  const BatchDescriptor& d = descriptor_of(a.slot);
  if (d.item_count > a.max_items) return;
  const auto* offsets = at<const std::int64_t>(a.slot + d.offsets_at);
  const auto* tokens = at<const std::int32_t>(a.slot + d.tokens_at);
  auto* ids = at<std::int64_t>(a.ids);
  auto* positions = at<std::int64_t>(a.positions);
  auto* seq_ids = at<std::int64_t>(a.seq_ids);
  auto* cu = at<std::int32_t>(a.cu_seqlens);
  for (std::uint32_t item = 0; item < d.item_count; ++item) {
    cu[item] = static_cast<std::int32_t>(offsets[item]);
    for (std::int64_t t = offsets[item]; t < offsets[item + 1]; ++t) {
      ids[t] = tokens[t];
      positions[t] = t - offsets[item];
      seq_ids[t] = item;
    }
  }
  for (std::uint64_t t = d.real_tokens; t < a.capacity; ++t) {
    ids[t] = a.pad_id;
    positions[t] = 0;
    seq_ids[t] = a.max_items;
  }
  for (std::uint64_t i = d.item_count; i <= a.max_items + 1ull; ++i) {
    cu[i] = static_cast<std::int32_t>(i == d.item_count ? d.real_tokens : a.capacity);
  }
}

void copy_bytes(const CopyBytesArgs& a) {
  std::memcpy(at<char>(a.out), at<const char>(a.src), a.bytes);
}

}  // namespace

void run_on_host(KernelId id, const void* args) {
  switch (id) {
    case KernelId::kSelfTestWrite:
      return selftest_write(*static_cast<const SelfTestWriteArgs*>(args));
    case KernelId::kSelfTestChecksum:
      return selftest_checksum(*static_cast<const SelfTestChecksumArgs*>(args));
    case KernelId::kSelfTestFill:
      return selftest_fill(*static_cast<const SelfTestFillArgs*>(args));
    case KernelId::kGatherPadded:
      return gather_padded(*static_cast<const GatherPaddedArgs*>(args));
    case KernelId::kHookCopy:
      return hook_copy(*static_cast<const HookCopyArgs*>(args));
    case KernelId::kGatherPacked:
      return gather_packed(*static_cast<const GatherPackedArgs*>(args));
    case KernelId::kCopyBytes:
      return copy_bytes(*static_cast<const CopyBytesArgs*>(args));
    case KernelId::kCount:
      break;
  }
  throw std::invalid_argument("unknown kernel id");
}

}  // namespace fabric::kernels
