// Captions: each sample's text for text-to-image training, where users' data keeps it.
//   Tar shards (WebDataset): KEY.txt, or KEY.json with a "caption" or "text" string (img2dataset
//   writes "caption"); .txt wins when a sample has both.
//   Folders: a .txt beside each image with the image's name (cat.png, cat.txt), or one
//   captions.jsonl or metadata.jsonl (Hugging Face's imagefolder convention) in the folder: a JSON
//   object per line with "file_name" (the image's path under the folder) and "caption" or "text".
// A caption is the text with the whitespace around it (a final line break) removed, and must be
// UTF-8. Either every sample of a dataset has a caption or none has: an image meant to go
// uncaptioned gets an empty one (an empty .txt), so a forgotten file is never read as an empty prompt.
#pragma once
#include <optional>
#include <string>
#include <vector>

#include "data/shards.h"

namespace ddm {

// The caption in `bytes` (surrounding whitespace removed). Throws ddm::Error "<what>: ... not UTF-8".
std::string caption_text(const std::string& bytes, const std::string& what);

// A shard sample's caption (above), or none. `what` names shard and key in errors (not UTF-8, a
// .json that is not an object or whose "caption" is not a string).
std::optional<std::string> sample_caption(const ShardSample& s, const std::string& what);

// The captions of a folder's images (paths under `root`, as the folder dataset lists them), in
// their order: all of them, or an empty vector when the folder has no captions at all. Throws,
// naming the first image without one, when only some have captions; naming file and line for a
// malformed captions file or one naming an image that is not there. Notes on stderr the .txt files
// that are beside no image (read by nothing).
std::vector<std::string> folder_captions(const std::string& root, const std::vector<std::string>& images);

}  // namespace ddm
