// Added tokens: read from transformers' files, and cut out of text.
#include "text/added_tokens.h"

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/json.h"
#include "text/unicode.h"

namespace ddm::text {

AddedTokens read_added_tokens(const nlohmann::json& tj, const std::string& source) {
  AddedTokens out;
  if (!tj.contains("added_tokens")) return out;
  DDM_CHECK(tj["added_tokens"].is_array(), source << ": \"added_tokens\" is not a list");
  for (const nlohmann::json& a : tj["added_tokens"]) {
    DDM_CHECK(a.is_object() && a.contains("content") && a["content"].is_string() && a.contains("id"),
              source << ": an entry of \"added_tokens\" has no \"content\" or \"id\"");
    const std::string content = a["content"].get<std::string>();
    if (!content.empty())
      out.emplace_back(utf8_to_u32(content, source + ": an added token"), json_int(a["id"], source + ": added_tokens id", 0));
  }
  return out;
}

std::string config_token(const nlohmann::json& config, const std::string& key, const std::string& fallback,
                         const std::string& file) {
  if (!config.contains(key) || config[key].is_null()) return fallback;
  const nlohmann::json& v = config[key];
  if (v.is_string()) return v.get<std::string>();
  DDM_CHECK(v.is_object() && v.contains("content") && v["content"].is_string(),
            file << ": \"" << key << "\" is neither a token nor an object with \"content\"");
  return v["content"].get<std::string>();
}

void split_on_added(std::u32string_view raw, const AddedTokens& added, std::vector<int64_t>& ids,
                    const std::function<void(std::u32string_view)>& encode_text) {
  for (size_t pos = 0; pos <= raw.size();) {
    size_t best_at = raw.size(), best_len = 0;
    int64_t best_id = -1;
    for (const auto& [content, id] : added) {
      const size_t at = raw.find(content, pos);
      if (at != std::u32string_view::npos && (at < best_at || (at == best_at && content.size() > best_len))) {
        best_at = at, best_len = content.size(), best_id = id;
      }
    }
    if (best_at > pos) encode_text(raw.substr(pos, best_at - pos));
    if (best_id < 0) break;
    ids.push_back(best_id);
    pos = best_at + best_len;
  }
}

}  // namespace ddm::text
