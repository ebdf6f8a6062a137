// Python face of the runtime: fabric_gpu._runtime. Bindings only; the logic lives in the other
// files of csrc/. Every call that can block releases the GIL; callbacks into Python (stages in
// emulation, result sinks) take it back on the runtime's threads.
//
// What only the tests use (Python stages, the self-test source and stage, descriptor packing, the
// ring on its own, fault injection) is bound in the submodule fabric_gpu._runtime.testing.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include <cstddef>
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

// RuntimeStats' fields, listed once: the Python class's attributes, as_dict() and the self
// test's report all come from this list.
#define FABRIC_STATS_FIELDS(X)                                                                 \
  X(submitted) X(drained) X(bytes_in) X(bytes_out) X(ring_retries) X(ring_blocked)            \
  X(payload_waits) X(payload_blocked) X(publications) X(device_allocations)                   \
  X(device_allocations_at_start) X(heap_allocations) X(drain_copy_seconds) X(gpu_busy_seconds) \
  X(gpu_span_seconds)

nb::dict stats_to_dict(const fabric::RuntimeStats& s) {
  nb::dict out;
#define FABRIC_STAT_TO_DICT(field) out[#field] = s.field;
  FABRIC_STATS_FIELDS(FABRIC_STAT_TO_DICT)
#undef FABRIC_STAT_TO_DICT
  return out;
}

// RuntimeConfig's plain fields, listed once (input_location, an enum, is bound beside them).
#define FABRIC_CONFIG_FIELDS(X)                                                         \
  X(ring_bytes) X(payload_ring_bytes) X(max_output_bytes) X(max_items) X(max_in_flight) \
  X(staging_buffers) X(publish_every) X(write_combined) X(poison_byte) X(measure_gpu_time)

fabric::InputLocation input_location(const std::string& where) {
  if (where == "host") return fabric::InputLocation::kHost;
  if (where == "device") return fabric::InputLocation::kDevice;
  throw std::invalid_argument("input_location must be 'host' or 'device', got '" + where + "'");
}

// RuntimeConfig(**fields): a key that is not a field is refused (a misspelt key would otherwise
// leave its setting at the default without a word).
fabric::RuntimeConfig make_config(nb::dict c) {
  fabric::RuntimeConfig rc;
  for (auto [key, value] : c) {
    const std::string name = nb::cast<std::string>(nb::str(key));
    bool known = name == "input_location";
#define FABRIC_CONFIG_KNOWN(field) known = known || name == #field;
    FABRIC_CONFIG_FIELDS(FABRIC_CONFIG_KNOWN)
#undef FABRIC_CONFIG_KNOWN
    if (!known) {
      std::string all = "input_location";
#define FABRIC_CONFIG_NAME(field) all += ", " #field;
      FABRIC_CONFIG_FIELDS(FABRIC_CONFIG_NAME)
#undef FABRIC_CONFIG_NAME
      throw std::invalid_argument("unknown runtime config key '" + name + "'; the keys are: " + all);
    }
  }
#define FABRIC_CONFIG_FROM_DICT(field) \
  if (c.contains(#field)) rc.field = nb::cast<decltype(rc.field)>(c[#field]);
  FABRIC_CONFIG_FIELDS(FABRIC_CONFIG_FROM_DICT)
#undef FABRIC_CONFIG_FROM_DICT
  if (c.contains("input_location")) {
    nb::handle where = c["input_location"];
    rc.input_location = nb::isinstance<nb::str>(where) ? input_location(nb::cast<std::string>(where))
                                                       : nb::cast<fabric::InputLocation>(where);
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

// The Python-facing runtime. Owns the Python callables so that the C++ runtime (and its
// threads) can be torn down with the GIL released.
class PyRuntime {
 public:
  PyRuntime(bool emulated, int device, const fabric::RuntimeConfig& config)
      : emulated_(emulated), device_(device), config_(config) {}
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
  // For the testing submodule's stages and sources (set before start()). `owner` keeps a Python
  // object the stage refers to alive until shutdown().
  void set_source(std::unique_ptr<fabric::PayloadSource> source) { source_ = std::move(source); }
  void set_stage(std::unique_ptr<fabric::Stage> stage, nb::object owner = nb::object()) {
    stage_fn_ = std::move(owner);
    graph_stage_ = nullptr;
    stage_ = std::move(stage);
  }
  bool emulated() const { return emulated_; }
  fabric::Gpu& gpu() { return running().gpu(); }

  void set_graph_stage() {
    auto stage = std::make_unique<fabric::GraphStage>();
    graph_stage_ = stage.get();
    stage_ = std::move(stage);
  }
  // Registers one shape of the engine (see fabric::ShapeGraph). `host_fn(publish_seq, items)`
  // runs the engine on the emulated GPU; on a GPU, the shape's `graph_exec` is a CUgraphExec.
  void add_shape(const fabric::ShapeGraph& shape, nb::object host_fn) {
    if (graph_stage_ == nullptr || runtime_) {
      throw std::logic_error("add_shape() goes between set_graph_stage() and start()");
    }
    fabric::ShapeGraph s = shape;
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
      throw std::invalid_argument("shape epoch " + std::to_string(s.epoch) +
                                  ": the emulated GPU needs a host_fn for each shape");
    } else if (s.graph_exec == 0) {
      throw std::invalid_argument("shape epoch " + std::to_string(s.epoch) + " needs a graph_exec");
    }
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
  fabric::RuntimeStats stats() { return running().stats(); }
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
                      const fabric::RuntimeConfig& runtime_config) {
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
  c.runtime = runtime_config;
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

// ---- test only: bound in fabric_gpu._runtime.testing ---------------------------------------

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

// A stage that runs a Python function in stream order on the emulated GPU, for the protocol
// tests (the CPU engine runs behind the graph stage instead). fn(publish_seq, batch_id,
// slot: uint8[], out: uint8[]) writes the batch's outputs into `out`; an exception fails that
// batch (reported with its outputs).
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

void bind_testing(nb::module_& t) {
  t.def("pack_descriptor", &pack_descriptor, "fields"_a,
        "The descriptor's bytes (csrc/protocol.h) from a dict of every field.");
  t.def("unpack_descriptor", &unpack_descriptor, "data"_a,
        "A descriptor's fields from its bytes (the inverse of pack_descriptor).");
  nb::class_<fabric::ByteRing>(t, "ByteRing")
      .def(nb::init<std::uint64_t, std::uint64_t>(), "capacity"_a, "alignment"_a)
      .def(
          "try_reserve",
          [](fabric::ByteRing& r, std::uint64_t length) -> nb::object {
            auto res = r.try_reserve(length);
            if (!res) return nb::none();
            return nb::make_tuple(res->begin, res->span, res->offset, res->length);
          },
          "length"_a, nb::sig("def try_reserve(self, length: int) -> tuple[int, int, int, int] | None"),
          "(begin, span, offset, length) of a reservation, or None while it does not fit.")
      .def(
          "release",
          [](fabric::ByteRing& r, std::uint64_t begin, std::uint64_t span, std::uint64_t offset,
             std::uint64_t length) { r.release(fabric::Reservation{begin, span, offset, length}); },
          "begin"_a, "span"_a, "offset"_a, "length"_a)
      .def_prop_ro("used", &fabric::ByteRing::used)
      .def_prop_ro("head", &fabric::ByteRing::head)
      .def_prop_ro("tail", &fabric::ByteRing::tail)
      .def_prop_ro("capacity", &fabric::ByteRing::capacity);
  t.def(
      "set_python_stage",
      [](PyRuntime& rt, nb::callable fn) {
        if (!rt.emulated()) {
          throw std::invalid_argument("Python stages run on the emulated GPU only");
        }
        rt.set_stage(std::make_unique<PythonStage>(fn.ptr()), fn);
      },
      "runtime"_a, "fn"_a,
      "Before start(): the stage is fn(publish_seq, batch_id, slot: uint8[], out: uint8[]), run in "
      "stream order on the emulated GPU; an exception fails that batch.");
  t.def(
      "set_selftest_source",
      [](PyRuntime& rt, std::uint64_t seed) {
        rt.set_source(std::make_unique<fabric::SelfTestSource>(seed));
      },
      "runtime"_a, "seed"_a, "Before start(): seeded random items and tokens (csrc/sources.h).");
  t.def(
      "set_selftest_stage",
      [](PyRuntime& rt) { rt.set_stage(std::make_unique<fabric::SelfTestStage>()); },
      "runtime"_a, "Before start(): the protocol tests' checksum-and-fill stage (csrc/stages.h).");
  t.def(
      "inject_gpu_fault",
      [](PyRuntime& rt, const std::string& call, std::uint64_t nth) {
        fabric::inject_emulated_fault(rt.gpu(), call, nth);
      },
      "runtime"_a, "call"_a, "nth"_a = 1,
      "After start(), on the emulated GPU: the nth call of `call` (wait_geq, write_value, launch, "
      "host_call, copy_to_host, record_event, record_mark) from now fails as a driver call would.");
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
  // (name, byte offset, bytes) of each descriptor field: Python builds its dtype from these.
  nb::list descriptor_fields;
#define FABRIC_FIELD_LAYOUT(field)                                                           \
  descriptor_fields.append(nb::make_tuple(#field, offsetof(BatchDescriptor, field), \
                                          sizeof(BatchDescriptor::field)));
  FABRIC_DESCRIPTOR_FIELDS(FABRIC_FIELD_LAYOUT)
#undef FABRIC_FIELD_LAYOUT
  m.attr("DESCRIPTOR_FIELDS") = descriptor_fields;
  m.attr("DOORBELL_BYTES") = sizeof(fabric::Doorbell);
  m.def("slot_bytes", &fabric::slot_bytes, "item_count"_a, "real_tokens"_a);

  nb::enum_<fabric::InputLocation>(m, "InputLocation")
      .value("device", fabric::InputLocation::kDevice)
      .value("host", fabric::InputLocation::kHost);

  auto config = nb::class_<fabric::RuntimeConfig>(m, "RuntimeConfig");
  config.def(
      "__init__",
      [](fabric::RuntimeConfig* self, nb::kwargs fields) { new (self) fabric::RuntimeConfig(make_config(fields)); },
      nb::sig("def __init__(self, **fields: int | bool | str | InputLocation) -> None"),
      "Runtime settings; each keyword is a field (an unknown one is an error).");
#define FABRIC_CONFIG_BIND(field) config.def_rw(#field, &fabric::RuntimeConfig::field);
  FABRIC_CONFIG_FIELDS(FABRIC_CONFIG_BIND)
#undef FABRIC_CONFIG_BIND
  config.def_rw("input_location", &fabric::RuntimeConfig::input_location);

  auto stats = nb::class_<fabric::RuntimeStats>(m, "RuntimeStats");
#define FABRIC_STATS_BIND(field) stats.def_ro(#field, &fabric::RuntimeStats::field);
  FABRIC_STATS_FIELDS(FABRIC_STATS_BIND)
#undef FABRIC_STATS_BIND
  stats.def("as_dict", &stats_to_dict, "Every field by name, for reports.");

  nb::class_<fabric::PaddedInputs>(m, "PaddedInputs")
      .def(nb::init<>())
      .def(
          "__init__",
          [](fabric::PaddedInputs* self, fabric::DevPtr input_ids, fabric::DevPtr attention_mask) {
            new (self) fabric::PaddedInputs{input_ids, attention_mask};
          },
          "input_ids"_a, "attention_mask"_a)
      .def_rw("input_ids", &fabric::PaddedInputs::input_ids)
      .def_rw("attention_mask", &fabric::PaddedInputs::attention_mask);
  nb::class_<fabric::PackedInputs>(m, "PackedInputs")
      .def(nb::init<>())
      .def(
          "__init__",
          [](fabric::PackedInputs* self, fabric::DevPtr input_ids, fabric::DevPtr positions,
             fabric::DevPtr seq_ids, fabric::DevPtr cu_seqlens) {
            new (self) fabric::PackedInputs{input_ids, positions, seq_ids, cu_seqlens};
          },
          "input_ids"_a, "positions"_a, "seq_ids"_a, "cu_seqlens"_a)
      .def_rw("input_ids", &fabric::PackedInputs::input_ids)
      .def_rw("positions", &fabric::PackedInputs::positions)
      .def_rw("seq_ids", &fabric::PackedInputs::seq_ids)
      .def_rw("cu_seqlens", &fabric::PackedInputs::cu_seqlens);
  nb::class_<fabric::ShapeGraph>(m, "ShapeGraph")
      .def(
          "__init__",
          [](fabric::ShapeGraph* self, std::uint32_t epoch, std::uint32_t items,
             std::uint32_t seq_len, std::variant<fabric::PaddedInputs, fabric::PackedInputs> inputs,
             fabric::DevPtr pooled, std::uint32_t pooled_row_bytes, std::vector<fabric::DevPtr> hooks,
             std::uint32_t hook_row_bytes, std::int64_t pad_id, std::uint64_t graph_exec) {
            auto* s = new (self) fabric::ShapeGraph();
            s->epoch = epoch;
            s->items = items;
            s->seq_len = seq_len;
            s->inputs = inputs;
            s->pooled = pooled;
            s->pooled_row_bytes = pooled_row_bytes;
            s->hooks = std::move(hooks);
            s->hook_row_bytes = hook_row_bytes;
            s->pad_id = pad_id;
            s->graph_exec = graph_exec;
          },
          "epoch"_a, "items"_a, "seq_len"_a, "inputs"_a, "pooled"_a, "pooled_row_bytes"_a,
          "hooks"_a, "hook_row_bytes"_a, "pad_id"_a = 0, "graph_exec"_a = 0,
          "One captured shape of an engine and its static buffers (csrc/stages.h).")
      .def_ro("epoch", &fabric::ShapeGraph::epoch)
      .def_ro("items", &fabric::ShapeGraph::items)
      .def_ro("seq_len", &fabric::ShapeGraph::seq_len)
      .def_ro("inputs", &fabric::ShapeGraph::inputs)
      .def_ro("pooled", &fabric::ShapeGraph::pooled)
      .def_ro("pooled_row_bytes", &fabric::ShapeGraph::pooled_row_bytes)
      .def_ro("hooks", &fabric::ShapeGraph::hooks)
      .def_ro("hook_row_bytes", &fabric::ShapeGraph::hook_row_bytes)
      .def_ro("pad_id", &fabric::ShapeGraph::pad_id)
      .def_ro("graph_exec", &fabric::ShapeGraph::graph_exec);

  nb::class_<PyRuntime>(m, "Runtime")
      .def(nb::init<bool, int, const fabric::RuntimeConfig&>(), "emulated"_a, "device"_a,
           "config"_a = fabric::RuntimeConfig())
      .def("set_token_table", &PyRuntime::set_token_table, "tokens"_a, "offsets"_a)
      .def("set_graph_stage", &PyRuntime::set_graph_stage)
      .def("add_shape", &PyRuntime::add_shape, "shape"_a, "host_fn"_a.none() = nb::none())
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
        "runtime_config"_a = fabric::RuntimeConfig(),
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

  nb::module_ testing = m.def_submodule(
      "testing", "Test-only bindings: Python stages, the self-test source and stage, descriptor "
                 "packing, the ring on its own, and fault injection on the emulated GPU.");
  bind_testing(testing);
}
