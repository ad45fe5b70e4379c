// The CLIP text encoder (src/text/clip_text_encoder.*) against transformers and open_clip
// themselves: each library makes its model from the configs open_clip ships (ViT-L/14's text tower
// as SD 1.x's, ViT-H/14's as SD 2.x's, open_clip's whole ViT-H/14), saves it in its own format and
// computes the last, penultimate and pooled outputs (tests/reference/clip_text_encoders.py); ddm
// reads the same directories. Cut to 2 layers of width 64 in the fast test; at full size (354M
// parameters for ViT-H/14's text tower, 5.8 GB of files, 12 GB of memory) with DDM_FULL_SIZE=1.
// And the files a user can get wrong, refused by name.
#include <gtest/gtest.h>

#include <cstdlib>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"
#include "core/safetensors.h"
#include "test_util.h"
#include "text/clip_text_encoder.h"
#include "text/encoder.h"
#include "text/tokenizer.h"

using ddm::test::TempDir;
using ddm::text::ClipTextEncoder;

namespace {

// max |got - want| over max |want|: the difference relative to the output's scale.
double relative(const torch::Tensor& got, const torch::Tensor& want) {
  return (got - want).abs().max().item<double>() / want.abs().max().item<double>();
}

// Makes the three directories with `size` and checks every output of each against its library's.
void check_against_libraries(const std::string& size, int texts) {
  // The small directories are kept between builds (reference_outputs); the full-size ones (12 GB) are not.
  TempDir scratch;
  const std::string args = size + " " + std::to_string(texts);
  const auto made = size == "full" ? ddm::test::ReferenceOutputs{ddm::test::run_command(
                                         ddm::test::reference_python() + " " + ddm::test::source_dir() +
                                         "/tests/reference/clip_text_encoders.py " + scratch.path + " " + args + " 2>&1"),
                                     scratch.path}
                                   : ddm::test::reference_outputs("tests/reference/clip_text_encoders.py", "{dir} " + args);
  ASSERT_EQ(made.run.exit_code, 0) << made.run.output;
  const std::string dir = made.dir;  // read only
  // The texts, tokenized by ddm, are the ids the libraries were given (open_clip's padding with 0).
  const auto tok = ddm::text::load_tokenizer("clip");
  const auto all_texts = nlohmann::json::parse(ddm::test::read_text(dir + "/texts.json"));
  ASSERT_EQ(static_cast<int>(all_texts.size()), texts);
  struct Case {
    const char* name;
    const char* format;
    bool projected;
  };
  for (const Case c : {Case{"transformers_l14", "transformers", true}, Case{"transformers_h14", "transformers", false},
                       Case{"open_clip_h14", "open_clip", true}}) {
    SCOPED_TRACE(c.name);
    const std::string model = dir + "/" + c.name;
    const auto ref = ddm::load_safetensors(model + "/reference.safetensors").tensors;
    const auto enc = ClipTextEncoder::load(model);
    EXPECT_EQ(enc.format, c.format);
    EXPECT_EQ(enc.projection_w.defined(), c.projected);
    const torch::Tensor ids = ref.at("ids");
    if (std::string(c.name) != "transformers_l14") {  // SD 1.x's padding was made in Python from these
      for (int i = 0; i < texts; ++i)
        EXPECT_EQ(torch::tensor(tok->tokenize(all_texts[i].get<std::string>(), 77), torch::kInt64).equal(ids[i]), true)
            << "text " << i;
    }
    const auto last = enc.encode(ids, 0), penultimate = enc.encode(ids, 1);
    // Float32 through up to 24 layers, summed in other orders than PyTorch's: within 1e-4 of each
    // output's largest magnitude, as the issue asks; measured about 1e-6 (recorded below).
    const double r_last = relative(last.states, ref.at("last")), r_pen = relative(penultimate.states, ref.at("penultimate")),
                 r_pool = relative(last.pooled, ref.at("pooled"));
    EXPECT_LT(r_last, 1e-4);
    EXPECT_LT(r_pen, 1e-4);
    EXPECT_LT(r_pool, 1e-4);
    EXPECT_TRUE(penultimate.pooled.equal(last.pooled));  // pooling always takes the last layer
    std::ostringstream s;
    s << std::scientific << r_last << " " << r_pen << " " << r_pool;
    ::testing::Test::RecordProperty(std::string(c.name) + "_relative_last_penultimate_pooled", s.str());
    if (std::string(c.format) == "open_clip") {
      // The same through load_text_encoder: texts in, its own tokenizer (CLIP's BPE, open_clip's
      // padding), SD 2.x's penultimate states out; every position attended to.
      ddm::text::TextEncoderOptions options;
      options.skip = 1;
      const auto text_encoder = ddm::text::load_text_encoder(model, options);
      std::vector<std::string> batch;
      for (const auto& t : all_texts) batch.push_back(t.get<std::string>());
      const auto e = text_encoder->encode(batch);
      EXPECT_LT(relative(e.states, ref.at("penultimate")), 1e-4);
      EXPECT_LT(relative(e.pooled, ref.at("pooled")), 1e-4);
      EXPECT_EQ(e.mask.sum().item<int64_t>(), e.mask.numel());
      EXPECT_EQ(text_encoder->weight_files(), std::vector<std::string>{model + "/open_clip_model.safetensors"});
    }
    std::printf("%s (%s): relative difference last %.2e, penultimate %.2e, pooled %.2e\n", c.name, size.c_str(), r_last,
                r_pen, r_pool);
  }
}

}  // namespace

TEST(ClipTextEncoder, EqualsTransformersAndOpenClipOnTheirOwnDirectoriesCutSmall) {
  check_against_libraries("small", 24);
}

TEST(ClipTextEncoder, EqualsTransformersAndOpenClipAtFullSize) {
  if (!std::getenv("DDM_FULL_SIZE")) GTEST_SKIP() << "full size needs 5.8 GB of files and 12 GB of memory: set DDM_FULL_SIZE=1";
  check_against_libraries("full", 4);
}

namespace {

// A 1-layer transformers CLIP text model of width 8 with its config, written by hand to be broken.
ddm::SafetensorsFile tiny_transformers(const std::string& dir, int64_t layers = 1) {
  ddm::test::write_text(dir + "/config.json", R"({"model_type": "clip_text_model", "hidden_size": 8, "num_attention_heads": 2,
      "num_hidden_layers": 1, "intermediate_size": 16, "max_position_embeddings": 5, "vocab_size": 12,
      "hidden_act": "quick_gelu", "eos_token_id": 11})");
  ddm::SafetensorsFile f;
  auto put = [&](const std::string& k, std::vector<int64_t> shape) { f.tensors["text_model." + k] = torch::randn(shape); };
  put("embeddings.token_embedding.weight", {12, 8});
  put("embeddings.position_embedding.weight", {5, 8});
  for (int64_t l = 0; l < layers; ++l) {
    const std::string p = "encoder.layers." + std::to_string(l) + ".";
    for (const char* m : {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj"}) {
      put(p + m + ".weight", {8, 8});
      put(p + m + ".bias", {8});
    }
    for (const char* n : {"layer_norm1", "layer_norm2"}) {
      put(p + n + ".weight", {8});
      put(p + n + ".bias", {8});
    }
    put(p + "mlp.fc1.weight", {16, 8});
    put(p + "mlp.fc1.bias", {16});
    put(p + "mlp.fc2.weight", {8, 16});
    put(p + "mlp.fc2.bias", {8});
  }
  put("final_layer_norm.weight", {8});
  put("final_layer_norm.bias", {8});
  ddm::save_safetensors(dir + "/model.safetensors", f);
  return f;
}

std::string load_error(const std::string& dir) {
  return ddm::test::error_message([&] { ClipTextEncoder::load(dir); });
}

}  // namespace

TEST(ClipTextEncoder, ShardedWeightsLoadAsOneFile) {
  TempDir dir;
  const auto whole = tiny_transformers(dir.path);
  const auto ids = torch::tensor({{3, 4, 11, 11, 11}}, torch::kInt64);
  const auto want = ClipTextEncoder::load(dir.path).encode(ids);
  // Split as save_pretrained splits a large model: two shards and an index naming each tensor's.
  ddm::SafetensorsFile a, b;
  nlohmann::json index = {{"metadata", {{"total_size", 0}}}, {"weight_map", nlohmann::json::object()}};
  int i = 0;
  for (const auto& [name, t] : whole.tensors) {
    (i++ % 2 ? a : b).tensors[name] = t;
    index["weight_map"][name] = i % 2 ? "model-00001-of-00002.safetensors" : "model-00002-of-00002.safetensors";
  }
  std::filesystem::remove(dir / "model.safetensors");
  ddm::save_safetensors(dir / "model-00001-of-00002.safetensors", a);
  ddm::save_safetensors(dir / "model-00002-of-00002.safetensors", b);
  ddm::test::write_text(dir / "model.safetensors.index.json", index.dump());
  const auto got = ClipTextEncoder::load(dir.path).encode(ids);
  EXPECT_TRUE(got.states.equal(want.states));
  EXPECT_TRUE(got.pooled.equal(want.pooled));
  // The pooled state is the first end token's (eos_token_id 11, not the legacy 2).
  EXPECT_TRUE(got.pooled[0].equal(got.states[0][2]));
}

// A tokenizer whose ids the encoder's embedding does not have (CLIP's BPE of 49408 ids on a model of
// 12): refused by name on the host, before the ids go to the weights' device (on a GPU an id past the
// embedding is a device-side assertion that ends the process).
TEST(ClipTextEncoder, ATokenizerOfAnotherVocabularyIsRefusedByName) {
  TempDir dir;
  tiny_transformers(dir.path);
  ddm::text::TextEncoderOptions options;
  options.tokenizer = "clip";
  options.context = 5;
  const auto encoder = ddm::text::load_text_encoder(dir.path, options);
  EXPECT_EQ(encoder->vocab(), 12);
  const std::string e = ddm::test::error_message([&] { encoder->encode({"a", "a red square"}, {"prompt 1", "prompt 2"}); });
  EXPECT_NE(e.find("outside the text encoder's vocabulary of 12 for prompt 1"), std::string::npos) << e;
  EXPECT_NE(e.find("the tokenizer does not belong to this encoder"), std::string::npos) << e;
}

TEST(ClipTextEncoder, FilesAUserCanGetWrongAreRefusedByName) {
  TempDir dir;
  auto f = tiny_transformers(dir.path);
  EXPECT_NE(load_error(dir / "nothing").find("not a directory"), std::string::npos);
  // A missing tensor, then one of the wrong shape.
  f.tensors.erase("text_model.encoder.layers.0.mlp.fc2.bias");
  ddm::save_safetensors(dir / "model.safetensors", f);
  EXPECT_NE(load_error(dir.path).find("model.safetensors: no tensor \"text_model.encoder.layers.0.mlp.fc2.bias\""),
            std::string::npos) << load_error(dir.path);
  f.tensors["text_model.encoder.layers.0.mlp.fc2.bias"] = torch::zeros({9});
  ddm::save_safetensors(dir / "model.safetensors", f);
  EXPECT_NE(load_error(dir.path).find("\"text_model.encoder.layers.0.mlp.fc2.bias\" has shape [9], its config says [8]"),
            std::string::npos) << load_error(dir.path);
  // More layers in the file than the config says (a config that contradicts its weights).
  tiny_transformers(dir.path, 2);
  EXPECT_NE(load_error(dir.path).find("holds more layers than the 1 of config.json's num_hidden_layers"), std::string::npos)
      << load_error(dir.path);
  // Not a CLIP model, an activation ddm does not run, a pickle only.
  ddm::test::write_text(dir / "config.json", R"({"model_type": "t5"})");
  EXPECT_NE(load_error(dir.path).find("model_type \"t5\" is not a CLIP text model"), std::string::npos);
  ddm::test::write_text(dir / "config.json", R"({"model_type": "clip_text_model", "hidden_size": 8, "num_attention_heads": 2,
      "num_hidden_layers": 1, "intermediate_size": 16, "max_position_embeddings": 5, "vocab_size": 12, "hidden_act": "relu"})");
  EXPECT_NE(load_error(dir.path).find("hidden_act \"relu\""), std::string::npos);
  ddm::test::write_text(dir / "config.json", R"({"model_type": "clip_text_model", "hidden_size": 8, "num_attention_heads": 3,
      "num_hidden_layers": 1, "intermediate_size": 16, "max_position_embeddings": 5, "vocab_size": 12})");
  EXPECT_NE(load_error(dir.path).find("not a multiple of the 3 attention heads"), std::string::npos);
  // Values of the wrong type (found by fuzz_text_encoder_files: they escaped as nlohmann's exceptions).
  ddm::test::write_text(dir / "config.json", R"({"model_type": 5})");
  EXPECT_NE(load_error(dir.path).find("config.json: [json.exception.type_error"), std::string::npos) << load_error(dir.path);
  ddm::test::write_text(dir / "config.json", R"({"model_type": "clip"})");
  EXPECT_NE(load_error(dir.path).find("model_type \"clip\" without a \"text_config\" object"), std::string::npos)
      << load_error(dir.path);
  ddm::test::write_text(dir / "config.json", R"({"model_type": "clip_text_model", "num_attention_heads": 2})");
  EXPECT_NE(load_error(dir.path).find("config.json: no \"hidden_size\""), std::string::npos) << load_error(dir.path);
  tiny_transformers(dir.path);
  std::filesystem::rename(dir / "model.safetensors", dir / "pytorch_model.bin");
  EXPECT_NE(load_error(dir.path).find("it has pytorch_model.bin, a PyTorch pickle, which ddm does not read"),
            std::string::npos) << load_error(dir.path);
  // open_clip: a text tower built otherwise than CLIP's, and a config without its model.
  TempDir oc;
  ddm::test::write_text(oc / "open_clip_config.json", R"({"model_cfg": {"embed_dim": 8, "text_cfg": {"hf_model_name": "roberta-base"}}})");
  EXPECT_NE(load_error(oc.path).find("text_cfg.hf_model_name = \"roberta-base\": ddm runs open_clip's standard CLIP text tower"),
            std::string::npos) << load_error(oc.path);
  ddm::test::write_text(oc / "open_clip_config.json", R"({"model_cfg": {"custom_text": 1, "text_cfg": {"pool_type": 3}}})");
  EXPECT_NE(load_error(oc.path).find("pool_type must be a string, got 3"), std::string::npos) << load_error(oc.path);
  ddm::test::write_text(oc / "open_clip_config.json", R"({"preprocess_cfg": {}})");
  EXPECT_NE(load_error(oc.path).find("no \"model_cfg\" object"), std::string::npos);
  ddm::test::write_text(oc / "open_clip_config.json", R"({"model_cfg": {"embed_dim": 8, "text_cfg": {"width": 8, "heads": 2,
      "layers": 1, "context_length": 5, "vocab_size": 12}}})");
  EXPECT_NE(load_error(oc.path).find("no open_clip_model.safetensors"), std::string::npos) << load_error(oc.path);
  // Ids the model cannot take.
  tiny_transformers(dir.path);
  ddm::test::write_text(dir / "config.json", R"({"model_type": "clip_text_model", "hidden_size": 8, "num_attention_heads": 2,
      "num_hidden_layers": 1, "intermediate_size": 16, "max_position_embeddings": 5, "vocab_size": 12})");
  const auto enc = ClipTextEncoder::load(dir.path);
  EXPECT_NE(ddm::test::error_message([&] { enc.encode(torch::zeros({1, 6}, torch::kInt64)); }).find("6 tokens, but the model has 5"),
            std::string::npos);
  EXPECT_NE(ddm::test::error_message([&] { enc.encode(torch::full({1, 3}, 12, torch::kInt64)); }).find("outside the vocabulary of 12"),
            std::string::npos);
  EXPECT_NE(ddm::test::error_message([&] { enc.encode(torch::zeros({1, 3}, torch::kInt64), 1); }).find("cannot skip 1 of its 1 layers"),
            std::string::npos);
}
