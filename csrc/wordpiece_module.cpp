// Python face of the WordPiece encoder: fabric_gpu._wordpiece. Bindings only (wordpiece.cpp
// holds the logic). encode releases the GIL for the whole batch.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <stdexcept>
#include <string>
#include <thread>

#include "wordpiece.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

using fabric::wordpiece::Config;
using fabric::wordpiece::Encoded;
using fabric::wordpiece::Encoder;

template <typename T>
nb::ndarray<nb::numpy, T, nb::ndim<1>> to_numpy(std::vector<T>&& values) {
  auto* owned = new std::vector<T>(std::move(values));
  nb::capsule free_when_done(owned, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
  return nb::ndarray<nb::numpy, T, nb::ndim<1>>(owned->data(), {owned->size()}, free_when_done);
}

using Offsets = nb::ndarray<const std::int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using Bytes = nb::ndarray<const std::uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

nb::tuple encode(const Encoder& encoder, Offsets offsets, Bytes data, unsigned threads) {
  if (offsets.shape(0) == 0) throw std::invalid_argument("encode: offsets needs n + 1 entries");
  const std::size_t n = offsets.shape(0) - 1;
  const std::int64_t* at = offsets.data();
  // Checked here, once, so the threads can trust every offset.
  for (std::size_t i = 0; i < n; ++i) {
    if (at[i] < 0 || at[i] > at[i + 1]) {
      throw std::invalid_argument("encode: offsets must not decrease (text " + std::to_string(i) + ")");
    }
  }
  if (n > 0 && static_cast<std::size_t>(at[n]) > data.shape(0)) {
    throw std::invalid_argument("encode: the offsets run past the end of the data");
  }
  Encoded result;
  {
    nb::gil_scoped_release release;
    result = encoder.encode(at, data.data(), n, threads == 0 ? std::thread::hardware_concurrency() : threads);
  }
  return nb::make_tuple(to_numpy(std::move(result.lengths)), to_numpy(std::move(result.tokens)));
}

}  // namespace

NB_MODULE(_wordpiece, m) {
  m.doc() = "BERT WordPiece for ASCII text on every core (see fabric_gpu/wordpiece.py).";
  nb::class_<Encoder>(m, "Encoder")
      .def(
          "__init__",
          [](Encoder* self, std::vector<std::pair<std::string, std::int32_t>> vocab,
             std::string continuing_prefix, std::int32_t unk_id, std::size_t max_chars_per_word,
             bool lowercase, std::vector<std::int32_t> prefix_ids,
             std::vector<std::int32_t> suffix_ids, std::vector<std::string> added_tokens) {
            Config config;
            config.vocab = std::move(vocab);
            config.continuing_prefix = std::move(continuing_prefix);
            config.unk_id = unk_id;
            config.max_chars_per_word = max_chars_per_word;
            config.lowercase = lowercase;
            config.prefix_ids = std::move(prefix_ids);
            config.suffix_ids = std::move(suffix_ids);
            config.added_tokens = std::move(added_tokens);
            new (self) Encoder(std::move(config));
          },
          "vocab"_a, "continuing_prefix"_a, "unk_id"_a, "max_chars_per_word"_a, "lowercase"_a,
          "prefix_ids"_a, "suffix_ids"_a, "added_tokens"_a)
      .def("encode", &encode, "offsets"_a, "data"_a, "threads"_a = 0,
           "(lengths int64, tokens int32) of the texts data[offsets[i]:offsets[i+1]]; "
           "length -1: handed back to the reference tokenizer");
}
