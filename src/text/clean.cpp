// html.unescape, ftfy.fix_text's character fixes and open_clip's cleaning, over the tables in
// text_tables.inc (generated from Python's html module and ftfy by scripts/gen-text-tables.py).
#include "text/clean.h"

#include <unicode/uchar.h>

#include <algorithm>
#include <cstring>

#include "text/unicode.h"

namespace ddm::text {
namespace {

struct EntityEntry {
  const char* name;
  const char* text;
};
struct CharrefEntry {
  char32_t code;
  const char* text;
};

#include "text/text_tables.inc"

// The entry named `name` (ASCII) in a table sorted by name, or nullptr.
template <size_t N>
const char* find_entity(const EntityEntry (&table)[N], const std::string& name) {
  const auto* end = table + N;
  const auto* it = std::lower_bound(table, end, name, [](const EntityEntry& e, const std::string& n) {
    return std::strcmp(e.name, n.c_str()) < 0;
  });
  return it != end && name == it->name ? it->text : nullptr;
}

template <size_t N>
const char* find_code(const CharrefEntry (&table)[N], char32_t c) {
  const auto* end = table + N;
  const auto* it = std::lower_bound(table, end, c, [](const CharrefEntry& e, char32_t v) { return e.code < v; });
  return it != end && it->code == c ? it->text : nullptr;
}

template <size_t N>
bool contains(const char32_t (&table)[N], char32_t c) {
  return std::find(table, table + N, c) != table + N;
}

void append(std::u32string& out, const char* utf8) { out += utf8_to_u32(utf8, "a generated table"); }

bool is_ascii_digit(char32_t c) { return c >= U'0' && c <= U'9'; }
bool is_hex_digit(char32_t c) { return is_ascii_digit(c) || (c >= U'a' && c <= U'f') || (c >= U'A' && c <= U'F'); }
bool is_ascii_alnum(char32_t c) { return is_ascii_digit(c) || (c >= U'a' && c <= U'z') || (c >= U'A' && c <= U'Z'); }

// What html.unescape makes of the numeric reference to `num` (kTooBig: any number past U+10FFFF).
constexpr uint64_t kTooBig = 0x110000;
void append_charref(std::u32string& out, uint64_t num) {
  if (num < kTooBig) {
    if (const char* fixed = find_code(kHtmlInvalidCharrefs, static_cast<char32_t>(num))) return append(out, fixed);
  }
  if ((num >= 0xD800 && num <= 0xDFFF) || num >= kTooBig) {
    out.push_back(0xFFFD);
  } else if (!contains(kHtmlInvalidCodepoints, static_cast<char32_t>(num))) {
    out.push_back(static_cast<char32_t>(num));
  }
}

// html.unescape's pattern at text[i] == '&': the length of the reference matched (0: none), its
// replacement appended to `out`.
size_t unescape_one(std::u32string_view text, size_t i, std::u32string& out) {
  size_t j = i + 1;
  if (j < text.size() && text[j] == U'#') {
    const bool hex = j + 1 < text.size() && (text[j + 1] == U'x' || text[j + 1] == U'X');
    size_t k = j + 1 + (hex ? 1 : 0);
    uint64_t num = 0;
    const size_t first = k;
    while (k < text.size() && (hex ? is_hex_digit(text[k]) : is_ascii_digit(text[k]))) {
      const char32_t c = text[k];
      const uint64_t digit = is_ascii_digit(c) ? c - U'0' : (c | 0x20) - U'a' + 10;
      num = std::min<uint64_t>(num * (hex ? 16 : 10) + digit, kTooBig);
      ++k;
    }
    if (k == first) return 0;  // "&#" or "&#x" without digits: no reference ('#' cannot start a name)
    if (k < text.size() && text[k] == U';') ++k;
    append_charref(out, num);
    return k - i;
  }
  // A name: 1 to 32 characters that are none of \t \n \f space < & # ;, then an optional ';'.
  size_t k = j;
  constexpr std::u32string_view kEndsName = U"\t\n\f <&#;";
  while (k < text.size() && k - j < 32 && kEndsName.find(text[k]) == std::u32string_view::npos) ++k;
  if (k == j) return 0;
  if (k < text.size() && text[k] == U';') ++k;
  const std::u32string_view s = text.substr(j, k - j);
  // Entity names are ASCII: a name holding anything else matches no entry.
  std::string ascii;
  for (char32_t c : s) ascii.push_back(c < 0x80 ? static_cast<char>(c) : '\x01');
  if (const char* t = find_entity(kHtml5Entities, ascii)) {
    append(out, t);
    return k - i;
  }
  // The longest entry the name starts with (at least 2 characters), the rest kept as it is.
  for (size_t x = s.size() - 1; x >= 2 && x < s.size(); --x) {
    if (const char* t = find_entity(kHtml5Entities, ascii.substr(0, x))) {
      append(out, t);
      out.append(s.substr(x));
      return k - i;
    }
  }
  out.push_back(U'&');
  out.append(s);
  return k - i;
}

// ftfy.fixes.unescape_html: "&#?[0-9A-Za-z]{1,24};" looked up in ftfy's own table; a numeric one
// through html.unescape unless that leaves a ';'.
std::u32string ftfy_unescape_html(std::u32string_view text) {
  std::u32string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size();) {
    size_t end = 0;
    if (text[i] == U'&') {
      const size_t start = i + 1 + (i + 1 < text.size() && text[i + 1] == U'#' ? 1 : 0);
      size_t k = start;
      while (k < text.size() && k - start < 24 && is_ascii_alnum(text[k])) ++k;
      if (k > start && k < text.size() && text[k] == U';') end = k + 1;
    }
    if (end == 0) {
      out.push_back(text[i++]);
      continue;
    }
    const std::u32string_view match = text.substr(i, end - i);
    std::string ascii(match.begin(), match.end());  // ASCII by construction
    if (const char* t = find_entity(kFtfyEntities, ascii)) {
      append(out, t);
    } else if (match.size() > 1 && match[1] == U'#') {
      const std::u32string unescaped = html_unescape(match);
      out += unescaped.find(U';') == std::u32string::npos ? unescaped : std::u32string(match);
    } else {
      out += match;
    }
    i = end;
  }
  return out;
}

// ftfy.fixes.remove_terminal_escapes: ESC '[' (digits | ';')* letter.
std::u32string remove_terminal_escapes(std::u32string_view text) {
  std::u32string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size();) {
    if (text[i] == 0x1B && i + 1 < text.size() && text[i + 1] == U'[') {
      size_t k = i + 2;
      while (k < text.size() && (text[k] == U';' || u_charType(static_cast<UChar32>(text[k])) == U_DECIMAL_DIGIT_NUMBER))
        ++k;
      if (k < text.size() && ((text[k] >= U'a' && text[k] <= U'z') || (text[k] >= U'A' && text[k] <= U'Z'))) {
        i = k + 1;
        continue;
      }
    }
    out.push_back(text[i++]);
  }
  return out;
}

// One pass of fix_and_explain's fixers (fix_encoding aside), in ftfy's order, then NFC.
std::u32string fix_once(std::u32string_view text, bool unescape) {
  std::u32string t = unescape ? ftfy_unescape_html(text) : std::u32string(text);
  std::u32string out;
  auto translate = [&](auto&& map_one) {
    out.clear();
    for (char32_t c : t) map_one(c);
    t.swap(out);
  };
  translate([&](char32_t c) {  // fix_c1_controls
    if (const char* r = find_code(kFtfyC1, c)) append(out, r); else out.push_back(c);
  });
  translate([&](char32_t c) {  // fix_latin_ligatures
    if (const char* r = find_code(kFtfyLigatures, c)) append(out, r); else out.push_back(c);
  });
  translate([&](char32_t c) {  // fix_character_width
    if (const char* r = find_code(kFtfyWidth, c)) append(out, r); else out.push_back(c);
  });
  translate([&](char32_t c) {  // uncurl_quotes
    out.push_back(contains(kFtfySingleQuotes, c) ? U'\'' : contains(kFtfyDoubleQuotes, c) ? U'"' : c);
  });
  out.clear();  // fix_line_breaks: \r\n, \r, U+2028, U+2029, U+0085 -> \n
  for (size_t i = 0; i < t.size(); ++i) {
    const char32_t c = t[i];
    if (c == U'\r' && i + 1 < t.size() && t[i + 1] == U'\n') continue;
    out.push_back(c == U'\r' || c == 0x2028 || c == 0x2029 || c == 0x85 ? U'\n' : c);
  }
  t.swap(out);
  // fix_surrogates: none can reach here (UTF-8 input holds no surrogates).
  t = remove_terminal_escapes(t);
  translate([&](char32_t c) {  // remove_control_chars
    if (!contains(kFtfyControlChars, c)) out.push_back(c);
  });
  return nfc(t);
}

}  // namespace

std::u32string html_unescape(std::u32string_view text) {
  if (text.find(U'&') == std::u32string_view::npos) return std::u32string(text);
  std::u32string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size();) {
    if (text[i] == U'&') {
      if (const size_t n = unescape_one(text, i, out)) {
        i += n;
        continue;
      }
    }
    out.push_back(text[i++]);
  }
  return out;
}

std::u32string ftfy_fix_text(std::u32string_view text) {
  constexpr size_t kMaxSegment = 1000000;  // ftfy's max_decode_length
  std::u32string out;
  bool unescape = true;  // "auto": off from the first line that holds a '<' on (as ftfy keeps it)
  for (size_t pos = 0; pos < text.size();) {
    size_t end = text.find(U'\n', pos);
    end = end == std::u32string_view::npos ? text.size() : end + 1;
    end = std::min(end, pos + kMaxSegment);
    std::u32string segment(text.substr(pos, end - pos));
    if (segment.find(U'<') != std::u32string::npos) unescape = false;
    for (;;) {
      std::u32string fixed = fix_once(segment, unescape);
      if (fixed == segment) break;
      segment.swap(fixed);
    }
    out += segment;
    pos = end;
  }
  return out;
}

std::u32string clip_clean(std::u32string_view text) {
  // basic_clean: ftfy, html.unescape twice, strip; whitespace_clean; lower.
  std::u32string t = strip(html_unescape(html_unescape(ftfy_fix_text(text))));
  return lower(collapse_whitespace(t));
}

}  // namespace ddm::text
