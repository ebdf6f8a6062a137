// Python face of the runtime: fabric_gpu._runtime. Bindings only; the logic lives in the other
// files of csrc/. Every call that can block releases the GIL; callbacks into Python (stages in
// emulation, result sinks) take it back on the runtime's threads.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstring>
#include <map>
#include <mutex>

#include "byte_ring.h"
#include "cuda_driver.h"
#include "kernel_image.h"
#include "protocol.h"
#include "runtime.h"
#include "selftest.h"
#include "sources.h"
#include "stages.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

using fabric::BatchDescriptor;

// The descriptor's fields as Python sees them (one dict entry each), listed once for both
// directions so that packing and unpacking cannot drift apart.
#define FABRIC_DESCRIPTOR_FIELDS(X)                                                           \
  X(batch_id) X(publish_seq) X(real_tokens) X(padded_tokens) X(output_limit) X(offsets_at) \
  X(tokens_at) X(lane) X(batch_class) X(bucket_max) X(item_count) X(shape_epoch) X(payload_bytes)

nb::dict descriptor_to_dict(const BatchDescriptor& d) {
  nb::dict out;
#define FABRIC_TO_DICT(field) out[#field] = d.field;
  FABRIC_DESCRIPTOR_FIELDS(FABRIC_TO_DICT)
#undef FABRIC_TO_DICT
  return out;
}

nb::bytes pack_descriptor(nb::dict f) {
  BatchDescriptor d{};
#define FABRIC_FROM_DICT(field) d.field = nb::cast<decltype(d.field)>(f[#field]);
  FABRIC_DESCRIPTOR_FIELDS(FABRIC_FROM_DICT)
#undef FABRIC_FROM_DICT
  return nb::bytes(reinterpret_cast<const char*>(&d), sizeof(d));
}

nb::dict unpack_descriptor(nb::bytes data) {
  if (data.size() != sizeof(BatchDescriptor)) {
    throw std::invalid_argument("a descriptor is exactly " + std::to_string(sizeof(BatchDescriptor)) +
                                " bytes, got " + std::to_string(data.size()));
  }
  BatchDescriptor d;
  std::memcpy(&d, data.c_str(), sizeof(d));
  return descriptor_to_dict(d);
}

nb::dict stats_to_dict(const fabric::RuntimeStats& s) {
  nb::dict out;
  out["submitted"] = s.submitted;
  out["drained"] = s.drained;
  out["bytes_in"] = s.bytes_in;
  out["bytes_out"] = s.bytes_out;
  out["ring_retries"] = s.ring_retries;
  out["ring_blocked"] = s.ring_blocked;
  out["payload_waits"] = s.payload_waits;
  out["payload_blocked"] = s.payload_blocked;
  out["publications"] = s.publications;
  out["allocations"] = s.allocations;
  out["allocations_at_start"] = s.allocations_at_start;
  out["drain_copy_seconds"] = s.drain_copy_seconds;
  out["gpu_busy_seconds"] = s.gpu_busy_seconds;
  out["gpu_span_seconds"] = s.gpu_span_seconds;
  return out;
}

// The keys make_config() reads; any other key is refused (a misspelt key would otherwise
// leave its setting at the default without a word).
constexpr const char* kConfigKeys[] = {
    "ring_bytes",     "payload_ring_bytes", "max_output_bytes", "max_items",
    "max_in_flight",  "staging_buffers",    "publish_every",    "write_combined",
    "poison_byte",    "measure_gpu_time",   "input_location"};

fabric::RuntimeConfig make_config(nb::dict c) {
  for (auto [key, value] : c) {
    const std::string name = nb::cast<std::string>(nb::str(key));
    bool known = false;
    for (const char* k : kConfigKeys) known = known || name == k;
    if (!known) {
      std::string all;
      for (const char* k : kConfigKeys) all += std::string(all.empty() ? "" : ", ") + k;
      throw std::invalid_argument("unknown runtime config key '" + name + "'; the keys are: " + all);
    }
  }
  fabric::RuntimeConfig rc;
  auto get = [&](const char* key, auto& field) {
    if (c.contains(key)) field = nb::cast<std::decay_t<decltype(field)>>(c[key]);
  };
  get("ring_bytes", rc.ring_bytes);
  get("payload_ring_bytes", rc.payload_ring_bytes);
  get("max_output_bytes", rc.max_output_bytes);
  get("max_items", rc.max_items);
  get("max_in_flight", rc.max_in_flight);
  get("staging_buffers", rc.staging_buffers);
  get("publish_every", rc.publish_every);
  get("write_combined", rc.write_combined);
  get("poison_byte", rc.poison_byte);
  get("measure_gpu_time", rc.measure_gpu_time);
  if (c.contains("input_location")) {
    const std::string where = nb::cast<std::string>(c["input_location"]);
    if (where == "host") {
      rc.input_location = fabric::InputLocation::kHost;
    } else if (where == "device") {
      rc.input_location = fabric::InputLocation::kDevice;
    } else {
      throw std::invalid_argument("input_location must be 'host' or 'device', got '" + where + "'");
    }
  }
  return rc;
}

using U8View = nb::ndarray<nb::numpy, std::uint8_t, nb::ndim<1>>;

// A numpy array over runtime memory, without a copy: valid only during the callback it is
// passed to (rv_policy::reference; an owner-less ndarray would otherwise be copied).
nb::object view(void* data, std::size_t bytes) {
  std::size_t shape[1] = {bytes};
  return nb::cast(U8View(data, 1, shape, nb::handle()), nb::rv_policy::reference);
}

// A stage that runs a Python function in stream order on the emulated GPU: how the CPU engine
// runs inside the runtime. fn(publish_seq, batch_id, slot: uint8[], out: uint8[]) writes the
// batch's outputs into `out`; an exception fails that batch (reported with its outputs).
class PythonStage final : public fabric::Stage {
 public:
  explicit PythonStage(PyObject* fn) : fn_(fn) {}  // borrowed: the PyRuntime owns it

  void enqueue(Context& ctx) override {
    const std::uint64_t seq = ctx.publish_seq;
    const std::uint64_t batch_id = ctx.spec.batch_id;
    void* slot = ctx.slot_host;
    const std::size_t slot_bytes = fabric::slot_bytes(ctx.spec.item_count, ctx.spec.real_tokens);
    void* out = ctx.out_host;
    const std::size_t out_bytes = ctx.spec.output_bytes;
    ctx.gpu.host_call(fabric::Stream::kCompute, [this, seq, batch_id, slot, slot_bytes, out, out_bytes] {
      nb::gil_scoped_acquire gil;
      try {
        nb::handle fn(fn_);
        fn(seq, batch_id, view(slot, slot_bytes), view(out, out_bytes));
      } catch (nb::python_error& e) {
        std::lock_guard<std::mutex> lock(mutex_);
        errors_[seq] = e.what();
      }
    });
    ctx.hook_done(out_bytes);
  }

  std::string take_error(std::uint64_t seq) override {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = errors_.find(seq);
    if (it == errors_.end()) return {};
    std::string error = it->second;
    errors_.erase(it);
    return error;
  }

 private:
  PyObject* fn_;
  std::mutex mutex_;
  std::map<std::uint64_t, std::string> errors_;
};

// The Python-facing runtime. Owns the Python callables so that the C++ runtime (and its
// threads) can be torn down with the GIL released.
class PyRuntime {
 public:
  PyRuntime(bool emulated, int device, nb::dict config) : emulated_(emulated), device_(device) {
    config_ = make_config(config);
  }
  ~PyRuntime() {
    nb::gil_scoped_release release;
    runtime_.reset();
  }

  void set_token_table(nb::ndarray<const std::int32_t, nb::ndim<1>, nb::c_contig> tokens,
                       nb::ndarray<const std::int64_t, nb::ndim<1>, nb::c_contig> offsets) {
    if (offsets.shape(0) < 1) throw std::invalid_argument("offsets must hold at least one value");
    tokens_ = nb::cast(tokens);
    offsets_ = nb::cast(offsets);
    source_ = std::make_unique<fabric::TokenTableSource>(tokens.data(), tokens.shape(0),
                                                         offsets.data(), offsets.shape(0) - 1);
  }
  void set_selftest_source(std::uint64_t seed) {
    source_ = std::make_unique<fabric::SelfTestSource>(seed);
  }
  void set_python_stage(nb::callable fn) {
    if (!emulated_) {
      throw std::invalid_argument("Python stages run on the emulated GPU only");
    }
    stage_fn_ = fn;
    stage_ = std::make_unique<PythonStage>(stage_fn_.ptr());
  }
  void set_selftest_stage() { stage_ = std::make_unique<fabric::SelfTestStage>(); }
  void set_graph_stage() {
    auto stage = std::make_unique<fabric::GraphStage>();
    graph_stage_ = stage.get();
    stage_ = std::move(stage);
  }
  // Registers one shape of the engine (see fabric::ShapeGraph). `host_fn(publish_seq, items)`
  // runs the engine on the emulated GPU; on a GPU, `graph_exec` is a CUgraphExec handle.
  void add_shape(std::uint32_t epoch, const std::string& layout, std::uint32_t items,
                 std::uint32_t seq_len, std::int64_t pad_id, std::uint64_t graph_exec,
                 nb::object host_fn, std::uint64_t input_ids, std::uint64_t aux0,
                 std::uint64_t aux1, std::uint64_t aux2, std::uint64_t pooled,
                 std::uint32_t pooled_row_bytes, std::vector<fabric::DevPtr> hooks,
                 std::uint32_t hook_row_bytes) {
    if (graph_stage_ == nullptr || runtime_) {
      throw std::logic_error("add_shape() goes between set_graph_stage() and start()");
    }
    fabric::ShapeGraph s;
    s.epoch = epoch;
    if (layout == "padded") {
      s.layout = fabric::InputLayout::kPadded;
    } else if (layout == "packed") {
      s.layout = fabric::InputLayout::kPacked;
    } else {
      throw std::invalid_argument("layout must be 'padded' or 'packed', got '" + layout + "'");
    }
    s.items = items;
    s.seq_len = seq_len;
    s.pad_id = pad_id;
    s.graph_exec = graph_exec;
    if (!host_fn.is_none()) {
      host_fns_.push_back(host_fn);
      PyObject* fn = host_fn.ptr();
      s.host_graph = [fn](std::uint64_t seq, std::uint32_t n) -> std::string {
        nb::gil_scoped_acquire gil;
        try {
          nb::handle h(fn);
          h(seq, n);
          return {};
        } catch (nb::python_error& e) {
          return e.what();
        }
      };
    } else if (emulated_) {
      throw std::invalid_argument("shape epoch " + std::to_string(epoch) +
                                  ": the emulated GPU needs a host_fn for each shape");
    } else if (graph_exec == 0) {
      throw std::invalid_argument("shape epoch " + std::to_string(epoch) + " needs a graph_exec");
    }
    s.input_ids = input_ids;
    s.aux0 = aux0;
    s.aux1 = aux1;
    s.aux2 = aux2;
    s.pooled = pooled;
    s.pooled_row_bytes = pooled_row_bytes;
    s.hooks = std::move(hooks);
    s.hook_row_bytes = hook_row_bytes;
    graph_stage_->add_shape(std::move(s));
  }
  void set_sink(nb::callable fn) { sink_fn_ = fn; }

  void start() {
    if (!source_ || !stage_ || !sink_fn_.is_valid()) {
      throw std::logic_error("set a payload source, a stage and a sink before start()");
    }
    PyObject* sink = sink_fn_.ptr();
    auto call_sink = [sink](const fabric::DrainedBatch& b) {
      nb::gil_scoped_acquire gil;
      nb::handle fn(sink);
      fn(b.publish_seq, b.batch_id, view(const_cast<std::uint8_t*>(b.data), b.bytes), b.error);
    };
    std::unique_ptr<fabric::Gpu> gpu;
    {
      nb::gil_scoped_release release;
      gpu = emulated_ ? fabric::make_emulated_gpu() : fabric::make_cuda_gpu(device_);
    }
    runtime_ = std::make_unique<fabric::Runtime>(std::move(gpu), config_, std::move(source_),
                                                 std::move(stage_), call_sink);
    nb::gil_scoped_release release;
    runtime_->start();
  }

  void submit(std::uint64_t batch_id, nb::ndarray<const std::int64_t, nb::ndim<1>, nb::c_contig> rows,
              std::uint32_t bucket_max, std::uint64_t real_tokens, std::uint64_t output_bytes,
              std::uint32_t shape_epoch, std::uint32_t hooks, std::uint32_t lane,
              std::uint32_t batch_class) {
    fabric::BatchSpec spec;
    spec.batch_id = batch_id;
    spec.item_count = static_cast<std::uint32_t>(rows.shape(0));
    spec.bucket_max = bucket_max;
    spec.real_tokens = real_tokens;
    spec.output_bytes = output_bytes;
    spec.shape_epoch = shape_epoch;
    spec.hooks = hooks;
    spec.lane = lane;
    spec.batch_class = batch_class;
    const std::int64_t* data = rows.data();
    nb::gil_scoped_release release;
    running().submit(spec, data);
  }
  void finish() {
    nb::gil_scoped_release release;
    running().finish();
  }
  // Stops the threads, then lets go of the Python callables: they often refer back to the
  // object that owns this runtime, a cycle the garbage collector cannot see through C++.
  void shutdown() {
    {
      nb::gil_scoped_release release;
      if (runtime_) runtime_->shutdown();
    }
    if (runtime_) {
      stage_fn_ = nb::object();
      sink_fn_ = nb::object();
      host_fns_.clear();
    }
  }
  void synchronize_compute() {
    nb::gil_scoped_release release;
    running().synchronize_compute();
  }
  nb::dict stats() { return stats_to_dict(running().stats()); }
  std::string device() { return running().gpu().describe(); }

 private:
  fabric::Runtime& running() {
    if (!runtime_) throw std::logic_error("runtime not started");
    return *runtime_;
  }

  bool emulated_;
  int device_;
  fabric::RuntimeConfig config_;
  std::unique_ptr<fabric::PayloadSource> source_;
  std::unique_ptr<fabric::Stage> stage_;
  nb::object tokens_, offsets_, stage_fn_, sink_fn_;
  std::vector<nb::object> host_fns_;
  fabric::GraphStage* graph_stage_ = nullptr;  // owned by stage_, then by the runtime
  std::unique_ptr<fabric::Runtime> runtime_;  // last: destroyed first
};

nb::dict run_selftest(bool emulated, int device, std::uint64_t batches, std::uint64_t seed,
                      std::uint64_t max_tokens, std::uint32_t max_items,
                      std::uint64_t max_output_bytes, std::uint32_t max_hooks,
                      std::uint64_t slow_drain_every, std::uint64_t slow_drain_us,
                      std::uint64_t verify_every, bool gpu_sized, std::uint64_t oversize_batch,
                      nb::dict runtime_config) {
  fabric::SelfTestConfig c;
  c.emulated = emulated;
  c.device = device;
  c.batches = batches;
  c.seed = seed;
  c.max_tokens = max_tokens;
  c.max_items = max_items;
  c.max_output_bytes = max_output_bytes;
  c.max_hooks = max_hooks;
  c.slow_drain_every = slow_drain_every;
  c.slow_drain_us = slow_drain_us;
  c.verify_every = verify_every == 0 ? 1 : verify_every;
  c.gpu_sized = gpu_sized;
  c.oversize_batch = oversize_batch;
  c.runtime = make_config(runtime_config);
  fabric::SelfTestResult r;
  {
    nb::gil_scoped_release release;
    r = fabric::run_selftest(c);
  }
  nb::dict out = stats_to_dict(r.stats);
  out["batches"] = r.batches;
  out["verified"] = r.verified;
  out["warmup_batches"] = r.warmup_batches;
  out["heap_allocations_warming_up"] = r.allocations_warming_up;
  out["heap_allocations_after_warmup"] = r.allocations_after_warmup;
  out["checksum_mismatches"] = r.checksum_mismatches;
  out["output_mismatches"] = r.output_mismatches;
  out["order_errors"] = r.order_errors;
  out["first_error"] = r.first_error;
  out["seconds"] = r.seconds;
  return out;
}

}  // namespace

NB_MODULE(_runtime, m) {
  m.doc() = "Inference Fabric runtime: pinned ring, doorbell, payload ring, drain, engine loop.";

  nb::exception<fabric::CudaError>(m, "CudaDriverError", PyExc_RuntimeError);
  nb::exception<fabric::HotLoopSyncError>(m, "HotLoopSyncError", PyExc_RuntimeError);

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

  m.attr("DESCRIPTOR_BYTES") = sizeof(BatchDescriptor);
  m.attr("DOORBELL_BYTES") = sizeof(fabric::Doorbell);
  m.def("pack_descriptor", &pack_descriptor, "fields"_a);
  m.def("unpack_descriptor", &unpack_descriptor, "data"_a);
  m.def("slot_bytes", &fabric::slot_bytes, "item_count"_a, "real_tokens"_a);

  nb::class_<fabric::ByteRing>(m, "ByteRing")
      .def(nb::init<std::uint64_t, std::uint64_t>(), "capacity"_a, "alignment"_a)
      .def("try_reserve",
           [](fabric::ByteRing& r, std::uint64_t length) -> nb::object {
             auto res = r.try_reserve(length);
             if (!res) return nb::none();
             return nb::make_tuple(res->begin, res->span, res->offset, res->length);
           })
      .def("release",
           [](fabric::ByteRing& r, std::uint64_t begin, std::uint64_t span, std::uint64_t offset,
              std::uint64_t length) { r.release(fabric::Reservation{begin, span, offset, length}); })
      .def_prop_ro("used", &fabric::ByteRing::used)
      .def_prop_ro("head", &fabric::ByteRing::head)
      .def_prop_ro("tail", &fabric::ByteRing::tail)
      .def_prop_ro("capacity", &fabric::ByteRing::capacity);

  nb::class_<PyRuntime>(m, "Runtime")
      .def(nb::init<bool, int, nb::dict>(), "emulated"_a, "device"_a, "config"_a)
      .def("set_token_table", &PyRuntime::set_token_table, "tokens"_a, "offsets"_a)
      .def("set_selftest_source", &PyRuntime::set_selftest_source, "seed"_a)
      .def("set_python_stage", &PyRuntime::set_python_stage, "fn"_a)
      .def("set_selftest_stage", &PyRuntime::set_selftest_stage)
      .def("set_graph_stage", &PyRuntime::set_graph_stage)
      .def("add_shape", &PyRuntime::add_shape, "epoch"_a, "layout"_a, "items"_a, "seq_len"_a,
           "pad_id"_a, "graph_exec"_a, "host_fn"_a.none(), "input_ids"_a, "aux0"_a, "aux1"_a, "aux2"_a,
           "pooled"_a, "pooled_row_bytes"_a, "hooks"_a, "hook_row_bytes"_a)
      .def("set_sink", &PyRuntime::set_sink, "fn"_a)
      .def("start", &PyRuntime::start)
      .def("submit", &PyRuntime::submit, "batch_id"_a, "rows"_a, "bucket_max"_a, "real_tokens"_a,
           "output_bytes"_a, "shape_epoch"_a = 0, "hooks"_a = 1, "lane"_a = 0, "batch_class"_a = 0)
      .def("finish", &PyRuntime::finish)
      .def("shutdown", &PyRuntime::shutdown)
      .def("synchronize_compute", &PyRuntime::synchronize_compute)
      .def("stats", &PyRuntime::stats)
      .def("device", &PyRuntime::device);

  m.def("selftest", &run_selftest, "emulated"_a, "device"_a = 0, "batches"_a = 10000, "seed"_a = 1,
        "max_tokens"_a = 4096, "max_items"_a = 256, "max_output_bytes"_a = 1 << 16,
        "max_hooks"_a = 8, "slow_drain_every"_a = 0, "slow_drain_us"_a = 0,
        "verify_every"_a = 1, "gpu_sized"_a = false, "oversize_batch"_a = 0,
        "runtime_config"_a = nb::dict(),
        "Push batches of random size through filler -> doorbell -> stage -> payload ring -> "
        "drain, verifying every byte; returns counts of anything lost, reordered or torn.");
  m.def(
      "measure_handoff",
      [](int device, std::uint64_t iterations) {
        fabric::HandoffResult r;
        {
          nb::gil_scoped_release release;
          r = fabric::measure_handoff(device, iterations);
        }
        nb::dict out;
        out["device"] = r.device;
        out["doorbell_us"] = r.doorbell_us;
        out["launch_poll_us"] = r.launch_poll_us;
        out["launch_sync_us"] = r.launch_sync_us;
        return out;
      },
      "device"_a, "iterations"_a);
  m.def("measure_d2h_gbps", &fabric::measure_d2h_gbps, "device"_a, "bytes"_a, "repeats"_a,
        nb::call_guard<nb::gil_scoped_release>());
  m.def("cuda_self_test", &fabric::cuda_self_test, "device"_a = 0, "eager_warmup"_a = true,
        nb::call_guard<nb::gil_scoped_release>(),
        "Start the CUDA GPU: eager kernel load (unless disabled) and the doorbell self test.");
}
