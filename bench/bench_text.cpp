// ddm_bench_text: tokenizer throughput on one thread, one JSON line per tokenizer. The texts are a
// JSON list of strings (bench/tokenizers.sh writes the corpus of tests/reference/clip_tokenizer.py);
// bench/tokenizers_reference.py times open_clip's and transformers' tokenizers on the same list.
// The first pass starts with an empty BPE cache; "warm" is the best of --repeat further passes.
// Results are reported, never asserted.
//
// usage: ddm_bench_text TEXTS.json [--repeat 3] [--tokenizer SPEC ...]   (default: clip)
#include <chrono>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "text/tokenizer.h"

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::cerr << "usage: ddm_bench_text TEXTS.json [--repeat 3] [--tokenizer SPEC ...]\n";
    return 2;
  }
  std::ifstream in(argv[1]);
  const auto texts = nlohmann::json::parse(in).get<std::vector<std::string>>();
  int repeat = 3;
  std::vector<std::string> specs;
  for (int i = 2; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--repeat") repeat = std::stoi(argv[i + 1]);
    else if (flag == "--tokenizer") specs.push_back(argv[i + 1]);
  }
  if (specs.empty()) specs.push_back("clip");
  for (const auto& spec : specs) {
    auto t0 = std::chrono::steady_clock::now();
    const auto tok = ddm::text::load_tokenizer(spec);
    const double load = seconds_since(t0);
    int64_t checksum = 0;
    auto pass = [&] {
      const auto start = std::chrono::steady_clock::now();
      for (const auto& s : texts) checksum += tok->tokenize(s, 77)[1];
      return seconds_since(start);
    };
    const double first = pass();
    double warm = 1e30;
    for (int r = 0; r < repeat; ++r) warm = std::min(warm, pass());
    nlohmann::json line = {{"impl", "ddm"},       {"tokenizer", tok->kind()},
                           {"texts", texts.size()}, {"load_s", load},
                           {"first_pass_strings_per_s", texts.size() / first},
                           {"warm_strings_per_s", texts.size() / warm}, {"checksum", checksum}};
    std::cout << line.dump() << std::endl;
  }
  return 0;
}
