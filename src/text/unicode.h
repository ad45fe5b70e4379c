// Unicode for the tokenizers: UTF-8 in and out, and the few operations of Python's str that the
// reference tokenizers apply (open_clip's and transformers'), each on ICU (Debian's libicu) rather
// than tables of our own. Text is held as UTF-32 (std::u32string: one element per code point, as a
// Python str indexes it) while it is cleaned, and as UTF-8 bytes when it is split and merged.
//
// Unicode versions: Python 3.11's str (Unicode 14), ICU 72 (Unicode 15) and PCRE2 10.42 agree on
// every code point assigned by Unicode 14; characters assigned later may be classed differently.
#pragma once
#include <string>
#include <string_view>

#include "core/utf8.h"

namespace ddm::text {

// UTF-8 in and out: core/utf8.h's.
using ddm::append_utf8;
using ddm::u32_to_utf8;
using ddm::utf8_to_u32;

// unicodedata.normalize("NFC" / "NFD", text).
std::u32string nfc(std::u32string_view text);
std::u32string nfd(std::u32string_view text);
// str.lower(): full lower-case mappings (U+0130 becomes two code points) and the final-sigma rule.
std::u32string lower(std::u32string_view text);

// str.isspace() of one character: general category Zs, or bidirectional class WS, B or S.
bool is_space(char32_t c);
// " ".join(text.split()): runs of is_space characters become one space; none at either end.
std::u32string collapse_whitespace(std::u32string_view text);
// text.strip(): is_space characters removed from both ends.
std::u32string strip(std::u32string_view text);

// Unicode's White_Space property (what \s means to Python's regex module and to Rust's
// char::is_whitespace): unlike is_space, not U+001C..U+001F.
bool is_white_space(char32_t c);

}  // namespace ddm::text
