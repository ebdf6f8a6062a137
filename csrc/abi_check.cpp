// Compile-time proof that cuda_abi.h agrees with the toolkit's cuda.h (built only where the
// toolkit's headers are found; otherwise this file is empty).
#include "cuda_abi.h"

#if defined(FABRIC_HAVE_CUDA_H)
// cuda.h defines the host-allocation flags as macros: keep our values under other names first.
namespace ours {
constexpr unsigned kPortable = fabric::cu::CU_MEMHOSTALLOC_PORTABLE;
constexpr unsigned kDeviceMap = fabric::cu::CU_MEMHOSTALLOC_DEVICEMAP;
constexpr unsigned kWriteCombined = fabric::cu::CU_MEMHOSTALLOC_WRITECOMBINED;
}  // namespace ours

#include <cuda.h>

#include <type_traits>

namespace c = fabric::cu;
static_assert(c::CUDA_SUCCESS == CUDA_SUCCESS);
static_assert(c::CUDA_ERROR_NOT_READY == CUDA_ERROR_NOT_READY);
static_assert(c::CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY == CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY);
static_assert(c::CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING == CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING);
static_assert(c::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR ==
              CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR);
static_assert(c::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR ==
              CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR);
static_assert(c::CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS ==
              CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS);
static_assert(c::CU_GET_PROC_ADDRESS_DEFAULT == CU_GET_PROC_ADDRESS_DEFAULT);
static_assert(ours::kPortable == CU_MEMHOSTALLOC_PORTABLE);
static_assert(ours::kDeviceMap == CU_MEMHOSTALLOC_DEVICEMAP);
static_assert(ours::kWriteCombined == CU_MEMHOSTALLOC_WRITECOMBINED);
static_assert(c::CU_STREAM_NON_BLOCKING == CU_STREAM_NON_BLOCKING);
static_assert(c::CU_EVENT_DISABLE_TIMING == CU_EVENT_DISABLE_TIMING);
static_assert(c::CU_STREAM_WAIT_VALUE_GEQ == CU_STREAM_WAIT_VALUE_GEQ);
static_assert(c::CU_STREAM_WRITE_VALUE_DEFAULT == CU_STREAM_WRITE_VALUE_DEFAULT);
static_assert(sizeof(c::CUdeviceptr) == sizeof(CUdeviceptr));
// The library loader is declared with void* for its option arrays; the real ones are pointers.
static_assert(sizeof(CUjit_option*) == sizeof(void*) && sizeof(CUlibraryOption*) == sizeof(void*));
static_assert(sizeof(c::CUdevice) == sizeof(CUdevice));
static_assert(std::is_same_v<c::CUresult, std::underlying_type_t<CUresult>> ||
              sizeof(c::CUresult) == sizeof(CUresult));
#endif
