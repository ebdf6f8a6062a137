// The CUDA driver, loaded with dlopen at run time and resolved through cuGetProcAddress.
//
// Every call goes through FABRIC_CU_CHECK, which throws CudaError naming the call and the
// driver's error name and text. Nothing here links against libcuda, so a machine without a GPU
// imports the module and gets a reason instead of an ImportError.
#pragma once

#include <stdexcept>
#include <string>
#include <vector>

#include "cuda_abi.h"

namespace fabric {

// A failed driver call: which call, the driver's code, its name and text.
class CudaError : public std::runtime_error {
 public:
  CudaError(const std::string& call, cu::CUresult code, const std::string& detail)
      : std::runtime_error(call + " failed: " + detail), call_(call), code_(code) {}
  const std::string& call() const { return call_; }
  cu::CUresult code() const { return code_; }

 private:
  std::string call_;
  cu::CUresult code_;
};

// The driver entry points the runtime uses; filled once by CudaDriver::load().
struct DriverApi {
  cu::CUresult (*cuInit)(unsigned int);
  cu::CUresult (*cuDriverGetVersion)(int*);
  cu::CUresult (*cuDeviceGetCount)(int*);
  cu::CUresult (*cuDeviceGet)(cu::CUdevice*, int);
  cu::CUresult (*cuDeviceGetName)(char*, int, cu::CUdevice);
  cu::CUresult (*cuDeviceGetAttribute)(int*, int, cu::CUdevice);
  cu::CUresult (*cuGetErrorName)(cu::CUresult, const char**);
  cu::CUresult (*cuGetErrorString)(cu::CUresult, const char**);
  // contexts
  cu::CUresult (*cuDevicePrimaryCtxRetain)(cu::CUcontext*, cu::CUdevice);
  cu::CUresult (*cuDevicePrimaryCtxRelease)(cu::CUdevice);
  cu::CUresult (*cuCtxSetCurrent)(cu::CUcontext);
  // memory
  cu::CUresult (*cuMemHostAlloc)(void**, std::size_t, unsigned);
  cu::CUresult (*cuMemHostGetDevicePointer)(cu::CUdeviceptr*, void*, unsigned);
  cu::CUresult (*cuMemFreeHost)(void*);
  cu::CUresult (*cuMemAlloc)(cu::CUdeviceptr*, std::size_t);
  cu::CUresult (*cuMemFree)(cu::CUdeviceptr);
  cu::CUresult (*cuMemsetD8)(cu::CUdeviceptr, unsigned char, std::size_t);
  cu::CUresult (*cuMemcpyDtoHAsync)(void*, cu::CUdeviceptr, std::size_t, cu::CUstream);
  // streams and stream memory operations
  cu::CUresult (*cuStreamCreate)(cu::CUstream*, unsigned);
  cu::CUresult (*cuStreamDestroy)(cu::CUstream);
  cu::CUresult (*cuStreamSynchronize)(cu::CUstream);
  cu::CUresult (*cuStreamQuery)(cu::CUstream);
  cu::CUresult (*cuStreamWaitValue64)(cu::CUstream, cu::CUdeviceptr, cu::cuuint64_t, unsigned);
  cu::CUresult (*cuStreamWriteValue64)(cu::CUstream, cu::CUdeviceptr, cu::cuuint64_t, unsigned);
  // libraries (context-independent modules), launches, graphs
  cu::CUresult (*cuLibraryLoadData)(cu::CUlibrary*, const void*, void*, void**, unsigned, void*,
                                    void**, unsigned);
  cu::CUresult (*cuLibraryUnload)(cu::CUlibrary);
  cu::CUresult (*cuLibraryGetKernel)(cu::CUkernel*, cu::CUlibrary, const char*);
  cu::CUresult (*cuLaunchKernel)(cu::CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned,
                                 unsigned, unsigned, cu::CUstream, void**, void**);
  cu::CUresult (*cuGraphLaunch)(cu::CUgraphExec, cu::CUstream);
  // events
  cu::CUresult (*cuEventCreate)(cu::CUevent*, unsigned);
  cu::CUresult (*cuEventRecord)(cu::CUevent, cu::CUstream);
  cu::CUresult (*cuEventQuery)(cu::CUevent);
  cu::CUresult (*cuEventSynchronize)(cu::CUevent);
  cu::CUresult (*cuEventDestroy)(cu::CUevent);
  cu::CUresult (*cuEventElapsedTime)(float*, cu::CUevent, cu::CUevent);
};

struct DeviceInfo {
  int ordinal;
  std::string name;
  int cc_major;
  int cc_minor;
  bool stream_mem_ops_64;    // cuStreamWaitValue64 / cuStreamWriteValue64 supported
  bool can_map_host_memory;  // mapped pinned memory (the ring and the doorbell) supported
  bool unified_addressing;
};

// What the process can see of the GPU: either devices, or the reason there are none.
struct DriverProbe {
  bool available = false;
  std::string reason;  // empty when available
  int driver_version = 0;
  std::vector<DeviceInfo> devices;
};

class CudaDriver {
 public:
  // Loads libcuda and initialises the driver once per process. Throws CudaError on failure.
  static const CudaDriver& get();
  // Never throws: reports the devices, or why there are none.
  static DriverProbe probe();

  const DriverApi& api() const { return api_; }
  // Throws CudaError(call, code) with the driver's name and description of `code`.
  [[noreturn]] void fail(const char* call, cu::CUresult code) const;

 private:
  CudaDriver();
  void* library_ = nullptr;
  DriverApi api_{};
};

}  // namespace fabric

// Checks one driver call; the error names the call as written.
#define FABRIC_CU_CHECK(driver, call)                                        \
  do {                                                                       \
    const ::fabric::cu::CUresult fabric_rc_ = (driver).api().call;           \
    if (fabric_rc_ != ::fabric::cu::CUDA_SUCCESS) (driver).fail(#call, fabric_rc_); \
  } while (0)
