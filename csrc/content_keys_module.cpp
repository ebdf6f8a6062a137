// Python face of the content-key hasher: fabric_gpu._content_keys. Bindings only (sha256.cpp
// holds the logic). digest_runs releases the GIL for the whole set.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>

#include <stdexcept>
#include <string>
#include <thread>

#include "sha256.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

using Offsets = nb::ndarray<const std::int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using Bytes = nb::ndarray<const std::uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

fabric::sha256::Implementation implementation_named(const std::string& name) {
  if (name == "auto") return fabric::sha256::Implementation::kAuto;
  if (name == "portable") return fabric::sha256::Implementation::kPortable;
  if (name == "sha-extensions") return fabric::sha256::Implementation::kShaExtensions;
  throw std::invalid_argument("digest_runs: implementation '" + name +
                              "': choose 'auto', 'portable' or 'sha-extensions'");
}

nb::bytes digest_runs(nb::bytes prefix, Bytes data, Offsets offsets, unsigned threads,
                      const std::string& implementation) {
  const fabric::sha256::Implementation chosen = implementation_named(implementation);
  if (chosen == fabric::sha256::Implementation::kShaExtensions && !fabric::sha256::has_sha_extensions()) {
    throw std::invalid_argument("digest_runs: this CPU has no SHA extensions; use 'auto' or 'portable'");
  }
  if (offsets.shape(0) == 0) throw std::invalid_argument("digest_runs: offsets needs n + 1 entries");
  const std::size_t n = offsets.shape(0) - 1;
  const std::int64_t* at = offsets.data();
  // Checked here, once, so the threads can trust every offset.
  if (at[0] < 0) throw std::invalid_argument("digest_runs: offsets must not be negative");
  for (std::size_t i = 0; i < n; ++i) {
    if (at[i] > at[i + 1]) {
      throw std::invalid_argument("digest_runs: offsets must not decrease (run " + std::to_string(i) + ")");
    }
  }
  if (static_cast<std::size_t>(at[n]) > data.shape(0)) {
    throw std::invalid_argument("digest_runs: the offsets run past the end of the data");
  }
  std::string out(32 * n, '\0');
  {
    nb::gil_scoped_release release;
    fabric::sha256::digest_runs(reinterpret_cast<const std::uint8_t*>(prefix.c_str()), prefix.size(),
                                data.data(), at, n, reinterpret_cast<std::uint8_t*>(out.data()),
                                threads == 0 ? std::thread::hardware_concurrency() : threads, chosen);
  }
  return nb::bytes(out.data(), out.size());
}

}  // namespace

NB_MODULE(_content_keys, m) {
  m.doc() = "SHA-256 of many byte runs on every core (see fabric_pipelines/lib/broker/reuse.py).";
  m.def("digest_runs", &digest_runs, "prefix"_a, "data"_a, "offsets"_a, "threads"_a = 0,
        "implementation"_a = "auto",
        "The 32-byte sha256 of prefix + data[offsets[i]:offsets[i+1]] for each i, joined. "
        "implementation: 'auto' (the CPU's SHA extensions where it has them), 'portable' or "
        "'sha-extensions'.");
  m.def("sha_extensions", &fabric::sha256::has_sha_extensions,
        "Whether this CPU has the SHA extensions digest_runs uses where it can.");
}
