// `ddm text tokenize` and `ddm text encode`: what a text model gets from a tokenizer, and what a frozen
// text encoder makes of it, to check either before training on it (src/text/tokenizer.h and
// src/text/encoder.h name the directories ddm reads).
#include <CLI/CLI.hpp>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "cli_util.h"
#include "core/error.h"
#include "core/device.h"
#include "core/safetensors.h"
#include "text/encoder.h"
#include "text/tokenizer.h"

namespace ddm {

Command add_text_command(CLI::App& app) {
  struct Args {
    std::string tokenizer = "clip", file;
    std::vector<std::string> texts;
    int context = 0;
    bool no_pad = false;
    // encode
    std::string encoder, encoder_tokenizer, prompts, out, device = "cpu";
    std::vector<std::string> prompt_args;
    int64_t skip = 0, batch = 64;
    int encode_context = 0;
  };
  auto a = std::make_shared<Args>();
  auto* cmd = app.add_subcommand("text", "Tokenize and encode text as text-to-image models do.");
  cmd->require_subcommand(1);
  auto* tokenize = cmd->add_subcommand(
      "tokenize", "Print the token ids each text becomes, one line per text, as the model gets them.");
  tokenize->add_option("texts", a->texts, "texts to tokenize (or --file)");
  tokenize->add_option("--file,--prompts", a->file, "a UTF-8 file of texts, one per line (--prompts, as `text encode` and `sample` call it)");
  tokenize->add_option("--tokenizer", a->tokenizer,
                       "clip (CLIP's BPE as open_clip tokenizes), a CLIP vocabulary file, a transformers "
                       "tokenizer directory (CLIP or BERT) or a Stable Diffusion directory");
  tokenize->add_option("--context", a->context, "ids per text (default: the tokenizer's: 77 for CLIP, its model_max_length for BERT)")
      ->default_str("")
      ->check(kPositive);
  tokenize->add_flag("--no-pad", a->no_pad, "print each text's ids without the padding");
  tokenize->footer("\nExamples:\n"
                   "  ddm text tokenize 'a red square' 'a blue circle'                  # CLIP's BPE, 77 ids each\n"
                   "  ddm text tokenize --tokenizer stable-diffusion-2-1 --no-pad --file prompts.txt\n");
  auto* encode = cmd->add_subcommand(
      "encode", "Write a frozen text encoder's outputs for prompts into a safetensors file: per-token states "
                "[N, T, D], their attention mask [N, T], the pooled embedding [N, P] and the ids [N, T].");
  encode->add_option("prompts", a->prompt_args, "prompts to encode (or --prompts)");
  encode->add_option("--encoder", a->encoder,
                     "the encoder's directory: open_clip's (open_clip_config.json), transformers' CLIP or BERT "
                     "(config.json), a sentence-transformers model, or a diffusers Stable Diffusion directory")
      ->required();
  encode->add_option("--prompts", a->prompts, "a UTF-8 file of prompts, one per line");
  encode->add_option("--out", a->out, "the safetensors file to write (written whole or not at all)")->required();
  encode->add_option("--skip", a->skip, "CLIP: states from this many layers before the last (1: the penultimate; diffusers' SD 2.x text_encoder/ "
                                        "is stored cut to SD 2.x's penultimate layer already, so 0 there)")
      ->check(kNonNegative);
  encode->add_option("--tokenizer", a->encoder_tokenizer, "a tokenizer instead of the one found with the encoder");
  encode->add_option("--context", a->encode_context, "ids per prompt (default: the tokenizer's, at most the encoder's positions)")
      ->default_str("")
      ->check(kPositive);
  encode->add_option("--batch", a->batch, "prompts encoded at once")->check(kPositive);
  encode->add_option("--device", a->device, "where the encoder runs: cpu | cuda | cuda:N")->check(kDeviceSpec);
  encode->footer("\nExamples:\n"
                 "  ddm text encode --encoder stable-diffusion-2-1 'a red square' --out red.safetensors  # SD 2.x's states\n"
                 "  ddm text encode --encoder all-MiniLM-L6-v2 --prompts prompts.txt --out prompts.safetensors\n");
  return Command{cmd, [a, encode] {
                   if (encode->parsed()) {
                     if (!std::filesystem::path(a->out).has_filename() || std::filesystem::is_directory(a->out))
                       throw InputError("--out " + a->out + ": a directory; name the safetensors file to write (e.g. " +
                                        (std::filesystem::path(a->out).lexically_normal() / "prompts.safetensors").string() + ")");
                     const auto texts = read_texts(a->prompt_args, a->prompts, "--prompts");
                     if (texts.empty()) throw InputError("ddm text encode: give prompts or --prompts (see --help)");
                     text::TextEncoderOptions options;
                     options.skip = a->skip;
                     options.tokenizer = a->encoder_tokenizer;
                     options.context = a->encode_context;
                     auto enc = as_input_error([&] { return text::load_text_encoder(a->encoder, options); });
                     std::cerr << enc->describe() << "\n";
                     const torch::Device device = resolve_device(a->device, 0, "--device");
                     configure_math(device, false);
                     enc->to(device);
                     // Every prompt tokenized first: a bad one stops before any work and names its line.
                     for (const auto& [s, what] : texts) as_input_error([&, &s = s, &what = what] { enc->tokenizer().tokenize(s, enc->context(), what); });
                     std::vector<torch::Tensor> states, masks, pooled, ids;  // per batch
                     const size_t n = texts.size(), step = static_cast<size_t>(a->batch);
                     for (size_t i = 0; i < n; i += step) {
                       std::vector<std::string> batch, what;
                       for (size_t k = i; k < std::min(n, i + step); ++k) {
                         batch.push_back(texts[k].first);
                         what.push_back(texts[k].second);
                       }
                       const auto e = enc->encode(batch, what);
                       states.push_back(e.states.cpu());
                       masks.push_back(e.mask.cpu());
                       pooled.push_back(e.pooled.cpu());
                       ids.push_back(e.ids);
                       if (n > step) std::cerr << "encoded " << std::min(n, i + step) << " of " << n << " prompts\n";
                     }
                     SafetensorsFile f;
                     f.tensors["states"] = torch::cat(states);
                     f.tensors["mask"] = torch::cat(masks);
                     f.tensors["pooled"] = torch::cat(pooled);
                     f.tensors["ids"] = torch::cat(ids);
                     f.metadata["encoder"] = enc->describe();
                     f.metadata["prompts"] = std::to_string(n);
                     as_input_error([&] { save_safetensors(a->out, f); });
                     std::cerr << "wrote " << a->out << ": states " << f.tensors["states"].sizes() << ", pooled "
                               << f.tensors["pooled"].sizes() << "\n";
                     return 0;
                   }
                   const auto texts = read_texts(a->texts, a->file, "--file");
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
