// A BERT WordPiece encoder for ASCII text, on every core: the same ids as Hugging Face
// `tokenizers` gives with a BertNormalizer (clean_text on), a BertPreTokenizer and a WordPiece
// model, for texts that hold only ASCII and none of the tokenizer's added tokens. Every other text
// is handed back (length -1) for the reference tokenizer to encode: Unicode normalisation,
// accents and CJK splitting stay its job. fabric_gpu/wordpiece.py decides which tokenizers qualify.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace fabric::wordpiece {

// Strings to ids: open addressing over one arena of bytes, looked up by string_view so that a
// lookup never allocates.
class PieceTable {
 public:
  void build(const std::vector<std::pair<std::string, std::int32_t>>& pieces);
  // The id of `piece`, or -1.
  std::int32_t find(std::string_view piece) const;
  std::size_t longest() const { return longest_; }

 private:
  struct Slot {
    std::uint64_t hash = 0;
    std::uint32_t at = 0;
    std::uint32_t length = 0;
    std::int32_t id = -1;  // -1: empty
  };
  std::string arena_;
  std::vector<Slot> slots_;
  std::size_t mask_ = 0;
  std::size_t longest_ = 0;
};

struct Config {
  std::vector<std::pair<std::string, std::int32_t>> vocab;
  std::string continuing_prefix;      // "##"
  std::int32_t unk_id = 0;            // a word with no split into pieces becomes this
  std::size_t max_chars_per_word = 100;  // a longer word becomes unk_id
  bool lowercase = true;
  std::vector<std::int32_t> prefix_ids;  // the post-processor's ids before the text ([CLS])
  std::vector<std::int32_t> suffix_ids;  // and after it ([SEP])
  std::vector<std::string> added_tokens;  // a text holding one of these is handed back
};

// Texts i of an Arrow (large) string array: bytes data[offsets[i], offsets[i + 1]).
struct Encoded {
  std::vector<std::int64_t> lengths;  // per text; -1: handed back
  std::vector<std::int32_t> tokens;   // the encoded texts' ids back to back
};

class Encoder {
 public:
  explicit Encoder(Config config);
  // Encodes n texts on `threads` threads; the result is in text order.
  Encoded encode(const std::int64_t* offsets, const std::uint8_t* data, std::size_t n,
                 unsigned threads) const;

 private:
  // Appends the text's ids to `out`; false (and `out` as it was) if it is handed back.
  bool encode_text(std::string_view text, std::vector<std::int32_t>& out, std::string& word) const;
  void encode_word(std::string_view word, std::vector<std::int32_t>& out) const;
  // One thread's share: blocks of texts taken from `next` until none is left.
  void encode_blocks(const std::int64_t* offsets, const std::uint8_t* data, std::size_t n,
                     std::atomic<std::size_t>& next, std::vector<Encoded>& parts) const;

  Config config_;
  PieceTable first_;         // pieces that start a word
  PieceTable continuation_;  // pieces after the first, without the prefix
};

}  // namespace fabric::wordpiece
