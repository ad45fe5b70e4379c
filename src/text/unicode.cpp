// Normalization, case and character classes through ICU's C API, which works in UTF-16 (UTF-8 <->
// UTF-32 is core/utf8's).
#include "text/unicode.h"

#include <unicode/uchar.h>
#include <unicode/unorm2.h>
#include <unicode/ustring.h>

#include <vector>

#include "core/error.h"

namespace ddm::text {
namespace {

std::u16string to_u16(std::u32string_view text) {
  std::u16string out;
  out.reserve(text.size());
  for (char32_t c : text) {
    if (c < 0x10000) {
      out.push_back(static_cast<char16_t>(c));
    } else {
      c -= 0x10000;
      out.push_back(static_cast<char16_t>(0xD800 + (c >> 10)));
      out.push_back(static_cast<char16_t>(0xDC00 + (c & 0x3FF)));
    }
  }
  return out;
}

std::u32string from_u16(const std::u16string& text) {
  std::u32string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size(); ++i) {
    char32_t c = text[i];
    if (c >= 0xD800 && c < 0xDC00 && i + 1 < text.size() && text[i + 1] >= 0xDC00 && text[i + 1] < 0xE000) {
      c = 0x10000 + ((c - 0xD800) << 10) + (text[i + 1] - 0xDC00);
      ++i;
    }
    out.push_back(c);
  }
  return out;
}

// Runs an ICU function of the form f(dest, capacity, src, length, &status) -> length, growing the
// destination once if the first guess was short.
template <class F>
std::u32string icu_transform(std::u32string_view text, const char* what, F f) {
  const std::u16string in = to_u16(text);
  std::u16string out(in.size() + 16, u'\0');
  UErrorCode status = U_ZERO_ERROR;
  int32_t n = f(reinterpret_cast<UChar*>(out.data()), static_cast<int32_t>(out.size()),
                reinterpret_cast<const UChar*>(in.data()), static_cast<int32_t>(in.size()), &status);
  if (status == U_BUFFER_OVERFLOW_ERROR) {
    out.assign(static_cast<size_t>(n), u'\0');
    status = U_ZERO_ERROR;
    n = f(reinterpret_cast<UChar*>(out.data()), static_cast<int32_t>(out.size()),
          reinterpret_cast<const UChar*>(in.data()), static_cast<int32_t>(in.size()), &status);
  }
  DDM_CHECK(U_SUCCESS(status), "ICU's " << what << " failed: " << u_errorName(status));
  out.resize(static_cast<size_t>(n));
  return from_u16(out);
}

std::u32string normalize(std::u32string_view text, const UNormalizer2* form, const char* what) {
  return icu_transform(text, what, [form](UChar* d, int32_t cap, const UChar* s, int32_t len, UErrorCode* st) {
    return unorm2_normalize(form, s, len, d, cap, st);
  });
}

const UNormalizer2* instance(const UNormalizer2* (*get)(UErrorCode*), const char* what) {
  UErrorCode status = U_ZERO_ERROR;
  const UNormalizer2* form = get(&status);
  DDM_CHECK(U_SUCCESS(status), "ICU has no " << what << " normalizer: " << u_errorName(status));
  return form;
}

}  // namespace

std::u32string nfc(std::u32string_view text) {
  static const UNormalizer2* form = instance(unorm2_getNFCInstance, "NFC");
  return normalize(text, form, "NFC normalization");
}

std::u32string nfd(std::u32string_view text) {
  static const UNormalizer2* form = instance(unorm2_getNFDInstance, "NFD");
  return normalize(text, form, "NFD normalization");
}

std::u32string lower(std::u32string_view text) {
  // The root locale: no language's special rules (Turkish dotless i, ...), as Python's str.lower.
  return icu_transform(text, "lower-casing", [](UChar* d, int32_t cap, const UChar* s, int32_t len, UErrorCode* st) {
    return u_strToLower(d, cap, s, len, "", st);
  });
}

bool is_space(char32_t c) {
  if (u_charType(static_cast<UChar32>(c)) == U_SPACE_SEPARATOR) return true;
  const UCharDirection d = u_charDirection(static_cast<UChar32>(c));
  return d == U_WHITE_SPACE_NEUTRAL || d == U_BLOCK_SEPARATOR || d == U_SEGMENT_SEPARATOR;
}

bool is_white_space(char32_t c) { return u_isUWhiteSpace(static_cast<UChar32>(c)); }

std::u32string collapse_whitespace(std::u32string_view text) {
  std::u32string out;
  out.reserve(text.size());
  bool gap = false;
  for (char32_t c : text) {
    if (is_space(c)) {
      gap = !out.empty();
    } else {
      if (gap) out.push_back(U' ');
      gap = false;
      out.push_back(c);
    }
  }
  return out;
}

std::u32string strip(std::u32string_view text) {
  size_t a = 0, b = text.size();
  while (a < b && is_space(text[a])) ++a;
  while (b > a && is_space(text[b - 1])) --b;
  return std::u32string(text.substr(a, b - a));
}

}  // namespace ddm::text
