// Reads captions from shard samples and from folders (data/captions.h).
#include "data/captions.h"

#include <cctype>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <set>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/utf8.h"

namespace ddm {
namespace {

namespace fs = std::filesystem;

// "caption", else "text", of a JSON object: the string, none when neither key is there.
std::optional<std::string> json_caption(const nlohmann::json& j, const std::string& what) {
  for (const char* key : {"caption", "text"}) {
    auto it = j.find(key);
    if (it == j.end() || it->is_null()) continue;
    DDM_CHECK(it->is_string(), what << ": its \"" << key << "\" is " << it->type_name() << ", not a string");
    return caption_text(it->get<std::string>(), what);
  }
  return std::nullopt;
}

}  // namespace

std::string caption_text(const std::string& bytes, const std::string& what) {
  utf8_to_u32(bytes, what + " (its caption)");
  const char* space = " \t\r\n\v\f";
  const size_t a = bytes.find_first_not_of(space);
  return a == std::string::npos ? std::string() : bytes.substr(a, bytes.find_last_not_of(space) - a + 1);
}

std::optional<std::string> sample_caption(const ShardSample& s, const std::string& what) {
  if (auto txt = s.files.find("txt"); txt != s.files.end()) return caption_text(txt->second, what + ": its .txt");
  if (auto js = s.files.find("json"); js != s.files.end()) {
    utf8_to_u32(js->second, what + ": its .json");  // bytes that are not UTF-8: named as such, not as bad JSON
    const nlohmann::json j = nlohmann::json::parse(js->second, nullptr, /*allow_exceptions=*/false);
    DDM_CHECK(!j.is_discarded() && j.is_object(), what << ": its .json is not a JSON object");
    return json_caption(j, what + ": its .json");
  }
  return std::nullopt;
}

std::vector<std::string> folder_captions(const std::string& root, const std::vector<std::string>& images) {
  // One captions file, if the folder has one.
  std::map<std::string, std::string> listed;  // path under root -> caption
  std::string list_file;
  for (const char* name : {"captions.jsonl", "metadata.jsonl"}) {
    if (!fs::exists(root + "/" + name)) continue;
    DDM_CHECK(list_file.empty(), root << ": both " << list_file << " and " << name << "; keep the captions in one");
    list_file = root + "/" + name;
  }
  if (!list_file.empty()) {
    std::ifstream in(list_file, std::ios::binary);
    DDM_CHECK(in, list_file << ": cannot read it");
    std::string line;
    for (int n = 1; std::getline(in, line); ++n) {
      const std::string where = list_file + " line " + std::to_string(n);
      if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
      const nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
      DDM_CHECK(!j.is_discarded() && j.is_object(), where << ": not a JSON object (one per line: {\"file_name\": ..., \"caption\": ...})");
      auto file = j.find("file_name");
      DDM_CHECK(file != j.end() && file->is_string(), where << ": no \"file_name\" string (the image's path under " << root << ")");
      const auto caption = json_caption(j, where);
      DDM_CHECK(caption, where << ": no \"caption\" or \"text\"");
      std::string key = fs::path(file->get<std::string>()).lexically_normal().string();
      DDM_CHECK(!listed.count(key), where << ": " << key << " has a caption on an earlier line too");
      DDM_CHECK(fs::exists(root + "/" + key), where << ": " << key << " is not an image under " << root);
      listed[key] = *caption;
    }
  }
  std::vector<std::string> out;
  std::string first_with, first_without;
  for (const auto& image : images) {
    const std::string rel = fs::path(image).lexically_relative(root).lexically_normal().string();
    const std::string txt = fs::path(image).replace_extension(".txt").string();
    std::optional<std::string> caption;
    if (auto it = listed.find(rel); it != listed.end()) {
      caption = it->second;
    } else if (fs::exists(txt)) {
      std::ifstream in(txt, std::ios::binary);
      DDM_CHECK(in, txt << ": cannot read it");
      caption = caption_text(std::string(std::istreambuf_iterator<char>(in), {}), txt);
    }
    if (caption) {
      if (first_with.empty()) first_with = image;
      out.push_back(*caption);
    } else if (first_without.empty()) {
      first_without = image;
    }
  }
  // A .txt beside no image (a caption whose image was renamed, "a.jpg.txt" for "a.jpg") is read by
  // nothing: said, so that a caption meant for an image is not lost without a word. Only in the
  // folders that hold the images, hidden files skipped; in a folder without captions only such
  // "IMAGE.png.txt" names, with an extension the images have (a README.txt there is no caption).
  std::set<std::string> stems, extensions;
  std::set<fs::path> dirs;
  const auto lower = [](std::string e) {
    for (char& ch : e) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    return e;
  };
  for (const auto& image : images) {
    stems.insert(fs::path(image).replace_extension("").lexically_normal().string());
    extensions.insert(lower(fs::path(image).extension().string()));
    dirs.insert(fs::path(image).parent_path());
  }
  int64_t orphans = 0;
  std::string first_orphan;
  for (const fs::path& dir : dirs) {
    std::error_code listing;
    for (fs::directory_iterator it(dir, listing), end; !listing && it != end; it.increment(listing)) {
      const fs::path& f = it->path();
      const std::string name = f.filename().string();
      std::error_code stat;
      if (name.empty() || name[0] == '.' || f.extension() != ".txt" || !it->is_regular_file(stat)) continue;
      if (stems.count(fs::path(f).replace_extension("").lexically_normal().string())) continue;
      if (out.empty() && !extensions.count(lower(f.stem().extension().string()))) continue;
      if (orphans++ == 0) first_orphan = f.string();
    }
  }
  if (orphans > 0)
    std::cerr << "note: " << root << ": " << orphans << " .txt file" << (orphans == 1 ? " is" : "s are")
              << " beside no image and not read as a caption (" << first_orphan
              << (orphans == 1 ? "" : ", ...") << "); a caption is IMAGE-NAME.txt beside IMAGE-NAME.png/.jpg/..."
              << std::endl;
  if (out.empty()) return out;
  DDM_CHECK(first_without.empty(),
            first_without << " has no caption (no .txt beside it" << (list_file.empty() ? "" : ", no line in " + list_file)
                          << ") but " << first_with << " has one; caption every image or none (an empty .txt "
                          << "for an image meant to go uncaptioned)");
  return out;
}

}  // namespace ddm
