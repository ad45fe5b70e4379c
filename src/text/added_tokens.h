// What transformers' tokenizer directories share, whatever the model: the special ("added") tokens
// and how they are found. Added tokens are cut out of the raw text before it is normalized or split
// (leftmost first, the longest where several start at one place), as the tokenizers library does;
// the text between them goes on to the model's own normalization.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace ddm::text {

using AddedTokens = std::vector<std::pair<std::u32string, int64_t>>;  // content -> id

// tokenizer.json's "added_tokens" (`source` names the file in errors).
AddedTokens read_added_tokens(const nlohmann::json& tokenizer_json, const std::string& source);

// A token named in tokenizer_config.json under `key`: a string, or an object with "content"
// (transformers' AddedToken); `fallback` where the key is missing or null.
std::string config_token(const nlohmann::json& config, const std::string& key, const std::string& fallback,
                         const std::string& file);

// Appends the ids of `raw`: each added token's id where it occurs, `encode_text` for the text between.
void split_on_added(std::u32string_view raw, const AddedTokens& added, std::vector<int64_t>& ids,
                    const std::function<void(std::u32string_view)>& encode_text);

}  // namespace ddm::text
