// Did-you-mean for a mistyped name (a subcommand, a config key): the candidate nearest to `word` by
// edit distance (Damerau-Levenshtein: insert, delete, substitute, swap two neighbours), if it is near
// enough to be a typo: at most a third of the word's length, and at least one edit. Hand-written:
// a few lines that none of the libraries ddm uses offers (CLI11 does not suggest).
#pragma once
#include <string>
#include <vector>

namespace ddm {

// The nearest candidate, or "" when none is near enough (ties: the first listed).
std::string nearest_name(const std::string& word, const std::vector<std::string>& candidates);
// " (did you mean 'X'?)" for nearest_name's X, or "".
std::string did_you_mean(const std::string& word, const std::vector<std::string>& candidates);

}  // namespace ddm
