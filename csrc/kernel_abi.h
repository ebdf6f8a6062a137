// Names and argument layouts shared by the kernels (kernels.cu) and the host code that launches
// them through the driver API. Kernels are extern "C" so their names are stable in the fatbin.
#pragma once

namespace fabric::kernels {

// Writes `value` to `*flag` with a system-scope release: the warm-up self test of mapped memory
// and of the publication protocol.
constexpr const char* kSelfTestWrite = "fabric_selftest_write";

// Scatters a packed batch (flat token ids + per-item offsets) into the engine's static padded
// input: ids[items, seq_len] and mask[items, seq_len]; positions past an item's length get
// pad_id and mask 0.
constexpr const char* kGatherPadded = "fabric_gather_padded";

}  // namespace fabric::kernels
