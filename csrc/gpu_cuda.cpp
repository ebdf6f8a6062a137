// The real GPU through the CUDA driver API. Every call is checked (FABRIC_CU_CHECK names it).
//
// At start: the device must support 64-bit stream memory operations and mapped host memory;
// the kernels' fatbin is loaded as a library (one load serves every device's context) and every
// kernel is launched once: with lazy loading, a kernel is loaded into a context at its first
// launch, and a first launch queued behind a pending doorbell wait deadlocks (docs/runtime.md).
// Then a real write-then-wait self test proves the stream holds on a doorbell and resumes when
// it rings.
#include <chrono>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>

#include "atomics.h"
#include "cuda_driver.h"
#include "gpu.h"
#include "kernel_image.h"
#include "protocol.h"

namespace fabric {
namespace {

using kernels::KernelId;

class CudaGpu final : public Gpu {
 public:
  CudaGpu(int ordinal, bool eager_warmup) : drv_(CudaDriver::get()) {
    FABRIC_CU_CHECK(drv_, cuDeviceGet(&objects_.device, ordinal));
    char name[256] = {0};
    FABRIC_CU_CHECK(drv_, cuDeviceGetName(name, sizeof(name) - 1, objects_.device));
    name_ = name;
    ordinal_ = ordinal;
    require(cu::CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS,
            "64-bit stream memory operations (cuStreamWaitValue64), which the doorbell needs");
    require(cu::CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY, "mapped pinned host memory");
    FABRIC_CU_CHECK(drv_, cuDevicePrimaryCtxRetain(&objects_.context, objects_.device));
    bind_thread();
    if (kKernelImage.size == 0) {
      throw std::runtime_error(
          "this build of fabric_gpu carries no CUDA kernels (nvcc was not found when it was "
          "built); rebuild where nvcc is installed");
    }
    FABRIC_CU_CHECK(drv_, cuLibraryLoadData(&objects_.library, kKernelImage.data, nullptr, nullptr, 0,
                                            nullptr, nullptr, 0));
    for (int k = 0; k < static_cast<int>(KernelId::kCount); ++k) {
      FABRIC_CU_CHECK(drv_, cuLibraryGetKernel(&kernels_[k], objects_.library, kernels::kNames[k]));
    }
    FABRIC_CU_CHECK(drv_, cuStreamCreate(&objects_.streams[0], cu::CU_STREAM_NON_BLOCKING));
    FABRIC_CU_CHECK(drv_, cuStreamCreate(&objects_.streams[1], cu::CU_STREAM_NON_BLOCKING));
    for (auto& event : objects_.events) {
      FABRIC_CU_CHECK(drv_, cuEventCreate(&event, cu::CU_EVENT_DISABLE_TIMING));
    }
    for (auto& mark : objects_.marks) FABRIC_CU_CHECK(drv_, cuEventCreate(&mark, 0));
    scratch_ = alloc_host(4096, HostMemoryKind::kMapped);
    objects_.scratch_host = scratch_.host;
    if (eager_warmup) warm_up();
    self_test();
  }

  bool emulated() const override { return false; }
  std::string describe() const override {
    return "cuda:" + std::to_string(ordinal_) + " (" + name_ + ")";
  }
  void bind_thread() override { FABRIC_CU_CHECK(drv_, cuCtxSetCurrent(objects_.context)); }

  HostRegion alloc_host(std::size_t bytes, HostMemoryKind kind) override {
    HostRegion r;
    r.bytes = bytes;
    r.kind = kind;
    unsigned flags = cu::CU_MEMHOSTALLOC_PORTABLE;
    if (kind != HostMemoryKind::kOrdinary) flags |= cu::CU_MEMHOSTALLOC_DEVICEMAP;
    if (kind == HostMemoryKind::kMappedWriteCombined) flags |= cu::CU_MEMHOSTALLOC_WRITECOMBINED;
    FABRIC_CU_CHECK(drv_, cuMemHostAlloc(&r.host, bytes, flags));
    if (kind != HostMemoryKind::kOrdinary) {
      // The block is ours until we return it: a failure here frees it before reporting.
      const cu::CUresult rc = drv_.api().cuMemHostGetDevicePointer(&r.device, r.host, 0);
      if (rc != cu::CUDA_SUCCESS) {
        const cu::CUresult freed = drv_.api().cuMemFreeHost(r.host);
        if (freed != cu::CUDA_SUCCESS) {  // the first error is the one reported; say both
          drv_.fail(("cuMemHostGetDevicePointer(&r.device, r.host, 0) [then cuMemFreeHost(r.host) "
                     "failed too, code " + std::to_string(freed) + ": the block leaked]").c_str(),
                    rc);
        }
        drv_.fail("cuMemHostGetDevicePointer(&r.device, r.host, 0)", rc);
      }
    }
    count_allocation();
    std::memset(r.host, 0, bytes);  // pre-fault every page at warm-up, never in the hot loop
    return r;
  }
  void free_host(HostRegion& region) override {
    if (region.host) FABRIC_CU_CHECK(drv_, cuMemFreeHost(region.host));
    region = HostRegion{};
  }
  DevPtr alloc_device(std::size_t bytes) override {
    cu::CUdeviceptr p = 0;
    FABRIC_CU_CHECK(drv_, cuMemAlloc(&p, bytes));
    count_allocation();
    FABRIC_CU_CHECK(drv_, cuMemsetD8(p, 0, bytes));
    return p;
  }
  void free_device(DevPtr ptr) override { FABRIC_CU_CHECK(drv_, cuMemFree(ptr)); }
  void fill_device(DevPtr ptr, unsigned char value, std::size_t bytes) override {
    FABRIC_CU_CHECK(drv_, cuMemsetD8(ptr, value, bytes));
  }
  void* host_view(DevPtr) override { return nullptr; }

  void wait_geq(Stream s, DevPtr address, std::uint64_t value) override {
    FABRIC_CU_CHECK(drv_, cuStreamWaitValue64(stream(s), address, value,
                                              cu::CU_STREAM_WAIT_VALUE_GEQ));
  }
  void write_value(Stream s, DevPtr address, std::uint64_t value) override {
    // DEFAULT flags keep the memory barrier: the stream's earlier writes are visible
    // system-wide before this value (the batched system-scope release of published_head).
    FABRIC_CU_CHECK(drv_, cuStreamWriteValue64(stream(s), address, value,
                                               cu::CU_STREAM_WRITE_VALUE_DEFAULT));
  }
  void launch(Stream s, KernelId kernel, const LaunchShape& shape, const void* args,
              std::size_t) override {
    void* params[] = {const_cast<void*>(args)};  // one by-value struct parameter
    // A CUkernel launches as a CUfunction in the current context (loaded there on first launch).
    auto* function = reinterpret_cast<cu::CUfunction>(kernels_[static_cast<int>(kernel)]);
    FABRIC_CU_CHECK(drv_, cuLaunchKernel(function, shape.grid_x,
                                         shape.grid_y, shape.grid_z, shape.block_x, shape.block_y,
                                         shape.block_z, 0, stream(s), params, nullptr));
  }
  void launch_graph(Stream s, std::uint64_t graph_exec) override {
    FABRIC_CU_CHECK(drv_, cuGraphLaunch(reinterpret_cast<cu::CUgraphExec>(graph_exec), stream(s)));
  }
  void host_call(Stream, const HostCall&) override {
    throw std::logic_error(
        "host-call stages run only on the emulated GPU; on a GPU use a graph or kernel stage");
  }
  void copy_to_host(Stream s, void* dst, DevPtr src, std::size_t bytes) override {
    FABRIC_CU_CHECK(drv_, cuMemcpyDtoHAsync(dst, src, bytes, stream(s)));
  }
  void record_event(Stream s, int event) override {
    FABRIC_CU_CHECK(drv_, cuEventRecord(objects_.events[event], stream(s)));
  }
  bool event_done(int event) override {
    const cu::CUresult rc = drv_.api().cuEventQuery(objects_.events[event]);
    if (rc == cu::CUDA_SUCCESS) return true;
    if (rc == cu::CUDA_ERROR_NOT_READY) return false;
    drv_.fail("cuEventQuery", rc);
  }
  void wait_event(int event) override { FABRIC_CU_CHECK(drv_, cuEventSynchronize(objects_.events[event])); }
  void record_mark(Stream s, int mark) override {
    FABRIC_CU_CHECK(drv_, cuEventRecord(objects_.marks[mark], stream(s)));
  }
  double mark_elapsed_ms(int from, int to) override {
    FABRIC_CU_CHECK(drv_, cuEventSynchronize(objects_.marks[to]));
    float ms = 0;
    FABRIC_CU_CHECK(drv_, cuEventElapsedTime(&ms, objects_.marks[from], objects_.marks[to]));
    return ms;
  }
  void synchronize(Stream s) override {
    check_not_hot(s, "cuStreamSynchronize");
    FABRIC_CU_CHECK(drv_, cuStreamSynchronize(stream(s)));
  }
  void stop() override {}

 private:
  cu::CUstream stream(Stream s) const { return objects_.streams[static_cast<int>(s)]; }

  void require(int attribute, const char* what) {
    int value = 0;
    FABRIC_CU_CHECK(drv_, cuDeviceGetAttribute(&value, attribute, objects_.device));
    if (value == 0) {
      throw std::runtime_error(describe() + " does not support " + what);
    }
  }

  // A zeroed descriptor at the start of the scratch page is a valid empty batch: every kernel
  // can run on it and do nothing.
  DevPtr scratch_slot() {
    auto* d = static_cast<BatchDescriptor*>(scratch_.host);
    std::memset(d, 0, sizeof(*d));
    d->offsets_at = sizeof(BatchDescriptor);
    d->tokens_at = sizeof(BatchDescriptor) + 8;
    return scratch_.device;
  }

  // Launch every kernel once, with nothing pending on the stream: this loads each one.
  void warm_up() {
    const DevPtr slot = scratch_slot();
    const DevPtr word = scratch_.device + 1024;  // 1024..1279 is scratch for the warm-up
    const LaunchShape one{1, 1, 1, 32, 1, 1};
    kernels::SelfTestWriteArgs w{word, 0};
    launch(Stream::kCompute, KernelId::kSelfTestWrite, one, &w, sizeof(w));
    kernels::SelfTestChecksumArgs c{slot, word};
    launch(Stream::kCompute, KernelId::kSelfTestChecksum, one, &c, sizeof(c));
    kernels::SelfTestFillArgs f{word, 0, 0, word};
    launch(Stream::kCompute, KernelId::kSelfTestFill, one, &f, sizeof(f));
    kernels::GatherPaddedArgs g{slot, word, word, 0, 0, 0};
    launch(Stream::kCompute, KernelId::kGatherPadded, one, &g, sizeof(g));
    kernels::HookCopyArgs h{slot, word, word, 0, 0, 16, 0};
    launch(Stream::kCompute, KernelId::kHookCopy, one, &h, sizeof(h));
    // capacity 0, max_items 0: writes only cu_seqlens[0..1] (two int32 in the scratch page)
    kernels::GatherPackedArgs p{slot, word, word, word, word + 64, 0, 0, 0};
    launch(Stream::kCompute, KernelId::kGatherPacked, LaunchShape{1, 1, 1, 32, 1, 1}, &p, sizeof(p));
    kernels::CopyBytesArgs b{word, word + 128, 0};
    launch(Stream::kCompute, KernelId::kCopyBytes, one, &b, sizeof(b));
    FABRIC_CU_CHECK(drv_, cuStreamSynchronize(stream(Stream::kCompute)));
  }

  // The doorbell protocol once, for real: a kernel queued behind a wait must not run until the
  // host writes the awaited value, and must run promptly after.
  void self_test() {
    auto* base = static_cast<unsigned char*>(scratch_.host);
    auto* bell = reinterpret_cast<volatile std::uint64_t*>(base + 2048);
    auto* ack = reinterpret_cast<volatile std::uint64_t*>(base + 2112);
    *bell = 0;
    *ack = 0;
    wait_geq(Stream::kCompute, scratch_.device + 2048, 1);
    kernels::SelfTestWriteArgs w{scratch_.device + 2112, 0xD00DBE11ull};
    launch(Stream::kCompute, KernelId::kSelfTestWrite, LaunchShape{1, 1, 1, 32, 1, 1}, &w,
           sizeof(w));
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    // Acquire: the kernel's system-scope write of the ack, if it ran (it must not have yet).
    if (load_acquire(ack) != 0) {
      throw std::runtime_error(describe() +
                               ": stream self test failed: a kernel behind cuStreamWaitValue64 ran "
                               "before the awaited value was written");
    }
    // Release: order the zeroed ack above before the doorbell that lets the stream go on.
    store_release(bell, 1);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    // Acquire: the kernel behind the wait ran once its ack is seen.
    while (load_acquire(ack) != 0xD00DBE11ull) {
      if (std::chrono::steady_clock::now() > deadline) {
        throw std::runtime_error(
            describe() +
            ": stream self test timed out: the kernel behind the doorbell wait never ran. This is "
            "the lazy-loading deadlock (a kernel's first launch queued behind a pending wait); the "
            "runtime prevents it by launching every kernel at warm-up");
      }
      cpu_relax();
    }
    FABRIC_CU_CHECK(drv_, cuStreamSynchronize(stream(Stream::kCompute)));
  }

  // Every driver object this GPU creates, released by one destructor. A member, so it also runs
  // when the constructor throws halfway (a throwing constructor runs its members' destructors,
  // not its own class's): nothing created before the failure leaks.
  struct DriverObjects {
    explicit DriverObjects(const CudaDriver& driver) : drv(driver) {}
    DriverObjects(const DriverObjects&) = delete;
    DriverObjects& operator=(const DriverObjects&) = delete;
    ~DriverObjects() {
      // Destructors never throw: results are ignored, the process is tearing the runtime down.
      if (context == nullptr) return;
      drv.api().cuCtxSetCurrent(context);
      for (auto s : streams) {
        if (s) drv.api().cuStreamSynchronize(s);
      }
      for (auto event : events) {
        if (event) drv.api().cuEventDestroy(event);
      }
      for (auto mark : marks) {
        if (mark) drv.api().cuEventDestroy(mark);
      }
      for (auto s : streams) {
        if (s) drv.api().cuStreamDestroy(s);
      }
      if (scratch_host) drv.api().cuMemFreeHost(scratch_host);
      if (library) drv.api().cuLibraryUnload(library);
      drv.api().cuDevicePrimaryCtxRelease(device);
    }
    const CudaDriver& drv;
    cu::CUdevice device = 0;
    cu::CUcontext context = nullptr;  // the device's primary context, retained
    cu::CUlibrary library = nullptr;
    cu::CUstream streams[2] = {nullptr, nullptr};
    cu::CUevent events[kEvents] = {};
    cu::CUevent marks[kMarks] = {};
    void* scratch_host = nullptr;
  };

  const CudaDriver& drv_;
  DriverObjects objects_{drv_};
  int ordinal_ = 0;
  std::string name_;
  cu::CUkernel kernels_[static_cast<int>(KernelId::kCount)] = {};  // owned by the library
  HostRegion scratch_;
};

}  // namespace

std::unique_ptr<Gpu> make_cuda_gpu(int ordinal, bool eager_warmup) {
  return std::make_unique<CudaGpu>(ordinal, eager_warmup);
}

}  // namespace fabric
