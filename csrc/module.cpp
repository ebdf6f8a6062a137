// Python face of the runtime: fabric_gpu._runtime. Kept to bindings; the logic lives in the
// other files of csrc/.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "cuda_driver.h"
#include "kernel_image.h"

namespace nb = nanobind;
using namespace nb::literals;

NB_MODULE(_runtime, m) {
  m.doc() = "Inference Fabric runtime: CUDA driver loading, kernels, and (later) the ring.";

  nb::exception<fabric::CudaError>(m, "CudaDriverError", PyExc_RuntimeError);

  nb::class_<fabric::DeviceInfo>(m, "DeviceInfo")
      .def_ro("ordinal", &fabric::DeviceInfo::ordinal)
      .def_ro("name", &fabric::DeviceInfo::name)
      .def_ro("cc_major", &fabric::DeviceInfo::cc_major)
      .def_ro("cc_minor", &fabric::DeviceInfo::cc_minor)
      .def_ro("stream_mem_ops_64", &fabric::DeviceInfo::stream_mem_ops_64)
      .def_ro("can_map_host_memory", &fabric::DeviceInfo::can_map_host_memory)
      .def_ro("unified_addressing", &fabric::DeviceInfo::unified_addressing);

  nb::class_<fabric::DriverProbe>(m, "DriverProbe")
      .def_ro("available", &fabric::DriverProbe::available)
      .def_ro("reason", &fabric::DriverProbe::reason)
      .def_ro("driver_version", &fabric::DriverProbe::driver_version)
      .def_ro("devices", &fabric::DriverProbe::devices);

  m.def("probe_driver", &fabric::CudaDriver::probe, nb::call_guard<nb::gil_scoped_release>(),
        "Load the CUDA driver (dlopen) and list devices; never raises: `reason` says why not.");

  m.def("kernel_image_size", [] { return fabric::kKernelImage.size; },
        "Bytes of the embedded kernel fatbin; 0 when built without nvcc.");
  m.def("kernel_archs", [] { return std::string(fabric::kKernelImage.archs); },
        "Architectures in the embedded fatbin, e.g. 'sm_80,sm_90,compute_90'.");
}
