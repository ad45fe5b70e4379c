// `ddm text tokenize`: what a text model gets from a tokenizer, to check a tokenizer before training
// on it (src/text/tokenizer.h names the tokenizers ddm reads).
#include <CLI/CLI.hpp>

#include <algorithm>
#include <fstream>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "cli_util.h"
#include "core/error.h"
#include "text/tokenizer.h"

namespace ddm {

Command add_text_command(CLI::App& app) {
  struct Args {
    std::string tokenizer = "clip", file;
    std::vector<std::string> texts;
    int context = 0;
    bool no_pad = false;
  };
  auto a = std::make_shared<Args>();
  auto* cmd = app.add_subcommand("text", "The text side of text-to-image models: tokenizers.");
  cmd->require_subcommand(1);
  auto* tokenize = cmd->add_subcommand(
      "tokenize", "Print the token ids each text becomes, one line per text, as the model gets them.");
  tokenize->add_option("texts", a->texts, "texts to tokenize (or --file)");
  tokenize->add_option("--file", a->file, "a UTF-8 file of texts, one per line");
  tokenize->add_option("--tokenizer", a->tokenizer,
                       "clip (default: CLIP's BPE as open_clip tokenizes), a CLIP vocabulary file, a transformers "
                       "tokenizer directory (CLIP or BERT) or a Stable Diffusion directory");
  tokenize->add_option("--context", a->context, "ids per text (default: the tokenizer's: 77 for CLIP, its model_max_length for BERT)")->check(kPositive);
  tokenize->add_flag("--no-pad", a->no_pad, "print each text's ids without the padding");
  return Command{cmd, [a] {
                   std::vector<std::pair<std::string, std::string>> texts;  // text, what to call it in errors
                   for (size_t i = 0; i < a->texts.size(); ++i)
                     texts.emplace_back(a->texts[i], "text " + std::to_string(i + 1) + " of the command line");
                   if (!a->file.empty()) {
                     std::ifstream in(a->file, std::ios::binary);
                     if (!in) throw InputError(a->file + ": cannot read it (--file)");
                     std::string line;
                     for (int n = 1; std::getline(in, line); ++n) {
                       if (!line.empty() && line.back() == '\r') line.pop_back();
                       texts.emplace_back(line, a->file + " line " + std::to_string(n));
                     }
                   }
                   if (texts.empty()) throw InputError("ddm text tokenize: give texts or --file (see --help)");
                   const auto t = as_input_error([&] { return text::load_tokenizer(a->tokenizer); });
                   std::cerr << text::describe(*t, a->tokenizer) << "\n";
                   std::vector<std::vector<int64_t>> all;  // every text first: a bad one prints nothing
                   std::vector<int64_t> lengths;
                   for (const auto& [s, what] : texts) {
                     int64_t length = 0;
                     all.push_back(as_input_error([&, &s = s, &what = what] { return t->tokenize(s, a->context, what, &length); }));
                     lengths.push_back(length);
                   }
                   for (size_t k = 0; k < all.size(); ++k) {
                     const auto& ids = all[k];
                     const size_t n = a->no_pad ? static_cast<size_t>(lengths[k]) : ids.size();
                     for (size_t i = 0; i < n && i < ids.size(); ++i) std::cout << (i ? " " : "") << ids[i];
                     std::cout << "\n";
                   }
                   return 0;
                 }};
}

}  // namespace ddm
