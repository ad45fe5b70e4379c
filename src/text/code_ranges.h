// Sets of code points as sorted inclusive ranges, the form of the generated tables
// (text/split_tables.inc, scripts/gen-text-tables.py).
#pragma once
#include <algorithm>
#include <cstddef>

namespace ddm::text {

struct CodeRange {
  char32_t first, last;
};

// Whether c lies in one of the table's ranges (sorted, not overlapping).
template <size_t N>
bool in_ranges(const CodeRange (&table)[N], char32_t c) {
  const auto* it = std::upper_bound(table, table + N, c, [](char32_t v, const CodeRange& r) { return v < r.first; });
  return it != table && c <= (it - 1)->last;
}

}  // namespace ddm::text
