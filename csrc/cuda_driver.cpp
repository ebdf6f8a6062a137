#include "cuda_driver.h"

#include <dlfcn.h>

#include <mutex>

namespace fabric {
namespace {

// The driver API version whose entry-point semantics the runtime was written against.
constexpr int kApiVersion = 12000;

using GetProcAddress = cu::CUresult (*)(const char*, void**, int, cu::cuuint64_t, int*);

template <typename Fn>
void resolve(GetProcAddress get_proc, const char* symbol, Fn& out) {
  void* fn = nullptr;
  int status = 0;
  const cu::CUresult rc = get_proc(symbol, &fn, kApiVersion, cu::CU_GET_PROC_ADDRESS_DEFAULT, &status);
  if (rc != cu::CUDA_SUCCESS || fn == nullptr) {
    throw CudaError(std::string("cuGetProcAddress(") + symbol + ")", rc,
                    "symbol not provided by this driver (status " + std::to_string(status) + ")");
  }
  out = reinterpret_cast<Fn>(fn);
}

}  // namespace

CudaDriver::CudaDriver() {
  library_ = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (library_ == nullptr) {
    const char* why = dlerror();
    throw CudaError("dlopen(libcuda.so.1)", -1,
                    std::string("no NVIDIA driver library: ") + (why ? why : "unknown reason"));
  }
  auto get_proc = reinterpret_cast<GetProcAddress>(dlsym(library_, "cuGetProcAddress_v2"));
  if (get_proc == nullptr) {
    throw CudaError("dlsym(cuGetProcAddress_v2)", -1,
                    "driver too old: CUDA 12 or newer is required");
  }
  resolve(get_proc, "cuGetErrorName", api_.cuGetErrorName);
  resolve(get_proc, "cuGetErrorString", api_.cuGetErrorString);
  resolve(get_proc, "cuInit", api_.cuInit);
  resolve(get_proc, "cuDriverGetVersion", api_.cuDriverGetVersion);
  resolve(get_proc, "cuDeviceGetCount", api_.cuDeviceGetCount);
  resolve(get_proc, "cuDeviceGet", api_.cuDeviceGet);
  resolve(get_proc, "cuDeviceGetName", api_.cuDeviceGetName);
  resolve(get_proc, "cuDeviceGetAttribute", api_.cuDeviceGetAttribute);
  resolve(get_proc, "cuDevicePrimaryCtxRetain", api_.cuDevicePrimaryCtxRetain);
  resolve(get_proc, "cuDevicePrimaryCtxRelease", api_.cuDevicePrimaryCtxRelease);
  resolve(get_proc, "cuCtxSetCurrent", api_.cuCtxSetCurrent);
  resolve(get_proc, "cuMemHostAlloc", api_.cuMemHostAlloc);
  resolve(get_proc, "cuMemHostGetDevicePointer", api_.cuMemHostGetDevicePointer);
  resolve(get_proc, "cuMemFreeHost", api_.cuMemFreeHost);
  resolve(get_proc, "cuMemAlloc", api_.cuMemAlloc);
  resolve(get_proc, "cuMemFree", api_.cuMemFree);
  resolve(get_proc, "cuMemsetD8", api_.cuMemsetD8);
  resolve(get_proc, "cuMemcpyDtoHAsync", api_.cuMemcpyDtoHAsync);
  resolve(get_proc, "cuStreamCreate", api_.cuStreamCreate);
  resolve(get_proc, "cuStreamDestroy", api_.cuStreamDestroy);
  resolve(get_proc, "cuStreamSynchronize", api_.cuStreamSynchronize);
  resolve(get_proc, "cuStreamQuery", api_.cuStreamQuery);
  resolve(get_proc, "cuStreamWaitValue64", api_.cuStreamWaitValue64);
  resolve(get_proc, "cuStreamWriteValue64", api_.cuStreamWriteValue64);
  resolve(get_proc, "cuLibraryLoadData", api_.cuLibraryLoadData);
  resolve(get_proc, "cuLibraryUnload", api_.cuLibraryUnload);
  resolve(get_proc, "cuLibraryGetKernel", api_.cuLibraryGetKernel);
  resolve(get_proc, "cuLaunchKernel", api_.cuLaunchKernel);
  resolve(get_proc, "cuGraphLaunch", api_.cuGraphLaunch);
  resolve(get_proc, "cuEventCreate", api_.cuEventCreate);
  resolve(get_proc, "cuEventRecord", api_.cuEventRecord);
  resolve(get_proc, "cuEventQuery", api_.cuEventQuery);
  resolve(get_proc, "cuEventSynchronize", api_.cuEventSynchronize);
  resolve(get_proc, "cuEventDestroy", api_.cuEventDestroy);
  resolve(get_proc, "cuEventElapsedTime", api_.cuEventElapsedTime);
  FABRIC_CU_CHECK(*this, cuInit(0));
}

void CudaDriver::fail(const char* call, cu::CUresult code) const {
  const char* name = nullptr;
  const char* text = nullptr;
  if (api_.cuGetErrorName == nullptr || api_.cuGetErrorName(code, &name) != cu::CUDA_SUCCESS) {
    name = nullptr;
  }
  if (api_.cuGetErrorString == nullptr || api_.cuGetErrorString(code, &text) != cu::CUDA_SUCCESS) {
    text = nullptr;
  }
  std::string detail = name ? name : ("CUresult " + std::to_string(code));
  if (text) detail += std::string(" (") + text + ")";
  throw CudaError(call, code, detail);
}

const CudaDriver& CudaDriver::get() {
  // Loaded once; a failed load is retried by the next caller (e.g. after a driver appears).
  static std::mutex mutex;
  static const CudaDriver* driver = nullptr;
  std::lock_guard<std::mutex> lock(mutex);
  if (driver == nullptr) driver = new CudaDriver();  // lives for the process
  return *driver;
}

DriverProbe CudaDriver::probe() {
  DriverProbe out;
  try {
    const CudaDriver& d = get();
    FABRIC_CU_CHECK(d, cuDriverGetVersion(&out.driver_version));
    int count = 0;
    FABRIC_CU_CHECK(d, cuDeviceGetCount(&count));
    for (int i = 0; i < count; ++i) {
      cu::CUdevice dev = 0;
      FABRIC_CU_CHECK(d, cuDeviceGet(&dev, i));
      char name[256] = {0};
      FABRIC_CU_CHECK(d, cuDeviceGetName(name, sizeof(name) - 1, dev));
      auto attr = [&](int which) {
        int value = 0;
        FABRIC_CU_CHECK(d, cuDeviceGetAttribute(&value, which, dev));
        return value;
      };
      out.devices.push_back(DeviceInfo{
          i, name, attr(cu::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
          attr(cu::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR),
          attr(cu::CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS) != 0,
          attr(cu::CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY) != 0,
          attr(cu::CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING) != 0});
    }
    out.available = count > 0;
    if (!out.available) out.reason = "the driver reports no CUDA devices";
  } catch (const CudaError& e) {
    out.available = false;
    out.reason = e.what();
  }
  return out;
}

}  // namespace fabric
