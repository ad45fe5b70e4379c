// Text cleaning before tokenization, as the reference tokenizers do it (their functions named).
// open_clip's SimpleTokenizer cleans with ftfy.fix_text, html.unescape twice, whitespace collapsed,
// lower-cased (clip_clean). ftfy is a Python library; ddm does what fix_text does to text that is
// not mojibake: its character tables are generated from ftfy itself (scripts/gen-text-tables.py).
// What it does not do is fix_text's mojibake repair (text that was UTF-8 decoded as another
// encoding, such as "cafÃ©"): that takes ftfy's heuristics, and such text is left as it is.
#pragma once
#include <string>
#include <string_view>

namespace ddm::text {

// Python's html.unescape: HTML5 named and numeric character references.
std::u32string html_unescape(std::u32string_view text);

// ftfy.fix_text with its default settings, less mojibake repair (above): HTML entities unless the
// line holds a '<', C1 controls read as Windows-1252, Latin ligatures and full-width forms
// replaced, curly quotes straightened, line breaks made '\n', terminal escapes and control
// characters removed, NFC; line by line, each line until nothing changes.
std::u32string ftfy_fix_text(std::u32string_view text);

// open_clip's clean='lower' (its default): whitespace_clean(basic_clean(text)).lower().
std::u32string clip_clean(std::u32string_view text);

}  // namespace ddm::text
