#include "wordpiece.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <exception>
#include <mutex>
#include <stdexcept>
#include <thread>

namespace fabric::wordpiece {

namespace {

// Texts per unit of work a thread takes: big enough that taking one is rare, small enough that
// threads finish together.
constexpr std::size_t kTextsPerBlock = 1024;

std::uint64_t hash_of(std::string_view s) {
  std::uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (unsigned char c : s) {
    h = (h ^ c) * 1099511628211ull;
  }
  return h;
}

// Hugging Face's BertNormalizer with clean_text drops NUL and every control character but tab,
// newline and carriage return (Unicode category C*: for ASCII, 0-31 and 127).
bool dropped(unsigned char c) { return (c < 32 && c != '\t' && c != '\n' && c != '\r') || c == 127; }

bool whitespace(unsigned char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

// BertPreTokenizer isolates each punctuation character; for ASCII, Rust's is_ascii_punctuation.
bool punctuation(unsigned char c) {
  return (c >= 33 && c <= 47) || (c >= 58 && c <= 64) || (c >= 91 && c <= 96) ||
         (c >= 123 && c <= 126);
}

}  // namespace

void PieceTable::build(const std::vector<std::pair<std::string, std::int32_t>>& pieces) {
  std::size_t capacity = 16;
  while (capacity < pieces.size() * 2) capacity *= 2;
  slots_.assign(capacity, Slot{});
  mask_ = capacity - 1;
  arena_.clear();
  longest_ = 0;
  for (const auto& [piece, id] : pieces) {
    if (id < 0) throw std::invalid_argument("wordpiece: negative id for piece '" + piece + "'");
    if (find(piece) >= 0) continue;  // the first id of a repeated piece wins
    const std::uint64_t h = hash_of(piece);
    std::size_t i = h & mask_;
    while (slots_[i].id >= 0) i = (i + 1) & mask_;
    slots_[i] = Slot{h, static_cast<std::uint32_t>(arena_.size()),
                     static_cast<std::uint32_t>(piece.size()), id};
    arena_ += piece;
    longest_ = std::max(longest_, piece.size());
  }
}

std::int32_t PieceTable::find(std::string_view piece) const {
  if (slots_.empty()) return -1;
  const std::uint64_t h = hash_of(piece);
  for (std::size_t i = h & mask_;; i = (i + 1) & mask_) {
    const Slot& s = slots_[i];
    if (s.id < 0) return -1;
    if (s.hash == h && s.length == piece.size() &&
        std::memcmp(arena_.data() + s.at, piece.data(), piece.size()) == 0) {
      return s.id;
    }
  }
}

Encoder::Encoder(Config config) : config_(std::move(config)) {
  std::vector<std::pair<std::string, std::int32_t>> first, continuation;
  const std::string& prefix = config_.continuing_prefix;
  for (const auto& entry : config_.vocab) {
    first.push_back(entry);
    if (prefix.empty()) {
      continuation.push_back(entry);  // no prefix: a later piece is looked up as it is
    } else if (entry.first.size() > prefix.size() &&
               entry.first.compare(0, prefix.size(), prefix) == 0) {
      continuation.emplace_back(entry.first.substr(prefix.size()), entry.second);
    }
  }
  first_.build(first);
  continuation_.build(continuation);
  config_.vocab.clear();  // the tables hold it now
  config_.vocab.shrink_to_fit();
}

void Encoder::encode_word(std::string_view word, std::vector<std::int32_t>& out) const {
  if (word.size() > config_.max_chars_per_word) {
    out.push_back(config_.unk_id);
    return;
  }
  // Greedy longest match first, as Hugging Face's WordPiece: a word with any part that matches
  // no piece is one unk as a whole.
  const std::size_t before = out.size();
  std::size_t start = 0;
  while (start < word.size()) {
    const PieceTable& table = start == 0 ? first_ : continuation_;
    std::size_t end = std::min(word.size(), start + table.longest());
    std::int32_t id = -1;
    for (; end > start; --end) {
      id = table.find(word.substr(start, end - start));
      if (id >= 0) break;
    }
    if (id < 0) {
      out.resize(before);
      out.push_back(config_.unk_id);
      return;
    }
    out.push_back(id);
    start = end;
  }
}

bool Encoder::encode_text(std::string_view text, std::vector<std::int32_t>& out,
                          std::string& word) const {
  for (unsigned char c : text) {
    if (c >= 0x80) return false;  // Unicode: the reference tokenizer's job
  }
  for (const std::string& added : config_.added_tokens) {
    if (text.find(added) != std::string_view::npos) return false;
  }
  out.insert(out.end(), config_.prefix_ids.begin(), config_.prefix_ids.end());
  word.clear();
  auto flush = [&] {
    if (!word.empty()) encode_word(word, out);
    word.clear();
  };
  for (unsigned char c : text) {
    if (dropped(c)) continue;  // dropped before splitting: "ab\x01cd" is one word
    if (whitespace(c)) {
      flush();
    } else if (punctuation(c)) {
      flush();
      word.push_back(static_cast<char>(c));
      flush();
    } else {
      word.push_back(static_cast<char>(config_.lowercase && c >= 'A' && c <= 'Z' ? c + 32 : c));
    }
  }
  flush();
  out.insert(out.end(), config_.suffix_ids.begin(), config_.suffix_ids.end());
  return true;
}

Encoded Encoder::encode(const std::int64_t* offsets, const std::uint8_t* data, std::size_t n,
                        unsigned threads) const {
  const std::size_t blocks = (n + kTextsPerBlock - 1) / kTextsPerBlock;
  std::vector<Encoded> parts(blocks);
  std::atomic<std::size_t> next{0};
  std::mutex failed_lock;
  std::exception_ptr failed;  // the first error of any thread, raised once all have stopped
  auto work = [&]() noexcept {
    try {
      encode_blocks(offsets, data, n, next, parts);
    } catch (...) {
      std::lock_guard<std::mutex> hold(failed_lock);
      if (!failed) failed = std::current_exception();
      next.store(blocks);  // the others stop at their next block
    }
  };
  threads = std::max(1u, std::min<unsigned>(threads, static_cast<unsigned>(blocks)));
  std::vector<std::thread> pool;
  try {
    for (unsigned t = 1; t < threads; ++t) pool.emplace_back(work);
  } catch (...) {  // fewer threads than asked for: those started still run
  }
  work();
  for (std::thread& t : pool) t.join();
  if (failed) std::rethrow_exception(failed);

  Encoded all;
  std::size_t total = 0;
  for (const Encoded& part : parts) total += part.tokens.size();
  all.lengths.reserve(std::max<std::size_t>(n, 1));  // never a null data pointer
  all.tokens.reserve(std::max<std::size_t>(total, 1));  // never a null data pointer
  for (const Encoded& part : parts) {
    all.lengths.insert(all.lengths.end(), part.lengths.begin(), part.lengths.end());
    all.tokens.insert(all.tokens.end(), part.tokens.begin(), part.tokens.end());
  }
  return all;
}

void Encoder::encode_blocks(const std::int64_t* offsets, const std::uint8_t* data, std::size_t n,
                            std::atomic<std::size_t>& next, std::vector<Encoded>& parts) const {
  const std::size_t blocks = parts.size();
  std::string word;
  for (std::size_t b = next.fetch_add(1); b < blocks; b = next.fetch_add(1)) {
    Encoded& part = parts[b];
    const std::size_t first = b * kTextsPerBlock, last = std::min(n, first + kTextsPerBlock);
    part.lengths.reserve(last - first);
    for (std::size_t i = first; i < last; ++i) {
      const std::string_view text(reinterpret_cast<const char*>(data) + offsets[i],
                                  static_cast<std::size_t>(offsets[i + 1] - offsets[i]));
      const std::size_t before = part.tokens.size();
      const bool encoded = encode_text(text, part.tokens, word);
      part.lengths.push_back(encoded ? static_cast<std::int64_t>(part.tokens.size() - before)
                                     : -1);
    }
  }
}

}  // namespace fabric::wordpiece
