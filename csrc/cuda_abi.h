// The small part of the CUDA driver ABI the runtime uses, declared here so the runtime builds and
// imports without the CUDA toolkit or a driver. Values match cuda.h; abi_check.cpp asserts that
// at compile time wherever cuda.h is installed.
#pragma once

#include <cstddef>
#include <cstdint>

namespace fabric::cu {

using CUresult = int;
using CUdevice = int;
using CUdeviceptr = unsigned long long;
using cuuint64_t = std::uint64_t;
using cuuint32_t = std::uint32_t;
struct CUctx_st;
using CUcontext = CUctx_st*;
struct CUmod_st;
using CUmodule = CUmod_st*;
struct CUfunc_st;
using CUfunction = CUfunc_st*;
struct CUstream_st;
using CUstream = CUstream_st*;
struct CUevent_st;
using CUevent = CUevent_st*;
struct CUgraphExec_st;
using CUgraphExec = CUgraphExec_st*;
struct CUlib_st;
using CUlibrary = CUlib_st*;
struct CUkern_st;
using CUkernel = CUkern_st*;  // accepted by cuLaunchKernel in place of a CUfunction

constexpr CUresult CUDA_SUCCESS = 0;
constexpr CUresult CUDA_ERROR_NOT_READY = 600;

// CUdevice_attribute
constexpr int CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY = 19;
constexpr int CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING = 41;
constexpr int CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75;
constexpr int CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76;
constexpr int CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS = 122;

constexpr cuuint64_t CU_GET_PROC_ADDRESS_DEFAULT = 0;

// cuMemHostAlloc flags
constexpr unsigned CU_MEMHOSTALLOC_PORTABLE = 0x01;
constexpr unsigned CU_MEMHOSTALLOC_DEVICEMAP = 0x02;
constexpr unsigned CU_MEMHOSTALLOC_WRITECOMBINED = 0x04;
// stream, event and stream-memory-operation flags
constexpr unsigned CU_STREAM_NON_BLOCKING = 0x1;
constexpr unsigned CU_EVENT_DISABLE_TIMING = 0x2;
constexpr unsigned CU_STREAM_WAIT_VALUE_GEQ = 0x0;
constexpr unsigned CU_STREAM_WRITE_VALUE_DEFAULT = 0x0;

}  // namespace fabric::cu
