// UTF-8 <-> UTF-32 (std::u32string: one element per code point, as a Python str indexes it), strict
// as Python's bytes.decode: for the tokenizers (text/unicode.h) and for captions read from data.
#pragma once
#include <string>
#include <string_view>

namespace ddm {

// UTF-8 -> code points. Throws ddm::Error "<what>: not UTF-8 at byte N" on an invalid sequence
// (overlong forms, surrogates and values past U+10FFFF included), as Python's bytes.decode does.
std::u32string utf8_to_u32(std::string_view utf8, std::string_view what);
std::string u32_to_utf8(std::u32string_view text);
// Appends one code point's UTF-8 bytes.
void append_utf8(std::string& out, char32_t c);

}  // namespace ddm
