// Decentralized text-to-image as DDM trains it: a folder of captioned images (four colours, the
// caption names the colour) partitioned by pixels into two clusters, a text-conditioned expert per
// cluster trained in isolation, a router conditioned on the prompt like the experts, `ddm ensemble`,
// routed sampling from prompts, and a student distilled from the ensemble. Each expert saw two
// colours only, so a prompt is followed only if the router sends it to the expert that learned it.
// The encoder is the real all-MiniLM-L6-v2.
#include <gtest/gtest.h>

#include <filesystem>

#include "core/fileio.h"
#include <nlohmann/json.hpp>

#include "core/json.h"
#include "core/safetensors.h"
#include "data/shard_write.h"
#include "data/shards.h"
#include "test_util.h"

namespace fs = std::filesystem;
using namespace ddm;

namespace {

const char* kNames[] = {"red", "green", "blue", "yellow"};
const int kColours[4][3] = {{200, 0, 0}, {0, 200, 0}, {0, 0, 200}, {200, 200, 0}};

// 32 RGB 8x8 images, each one colour, its caption "a <colour> square" in a .txt beside it.
void colour_folder(const std::string& root) {
  fs::create_directories(root);
  for (int i = 0; i < 32; ++i) {
    auto img = torch::zeros({3, 8, 8}, torch::kUInt8);
    for (int c = 0; c < 3; ++c) img[c].fill_(kColours[i % 4][c]);
    const std::string stem = root + "/" + zero_padded(i, 3);
    test::write_text(stem + ".png", png_of(img));
    test::write_text(stem + ".txt", std::string("a ") + kNames[i % 4] + " square\n");
  }
}

// Each sample's nearest of the four colours, [n].
torch::Tensor nearest_colour(const std::string& raw) {
  const auto mean = load_safetensors(raw).tensors.at("images").to(torch::kFloat).mean({2, 3});  // [n, 3]
  auto protos = torch::empty({4, 3});
  for (int k = 0; k < 4; ++k)
    for (int c = 0; c < 3; ++c) protos[k][c] = kColours[k][c];
  return torch::cdist(mean, protos).argmin(1);
}

}  // namespace

TEST(TextDecentral, ExpertsAPromptConditionedRouterAndTheirStudentFollowThePrompts) {
  test::TempDir dir;
  const std::string root = dir / "images", cfg = dir / "text.toml";
  const std::string encoder = dir / "minilm";  // a copy, to move it at the end
  fs::copy(test::minilm_package_dir() + "/model", encoder, fs::copy_options::recursive);
  colour_folder(root);
  test::write_text(cfg, "[data]\nsource = \"folder\"\nroot = \"" + root + "\"\n[model]\npreset = \"unet-tiny\"\n" +
                            "channels = 8\ngroups = 4\nattn_levels = [1]\nheads = 2\ntext_encoder = \"" + encoder +
                            "\"\ntext_tokens = 16\n[train]\nsteps = 100\nbatch_size = 12\nwarmup = 5\nthreads = 1\n" +
                            "log_every = 50\nckpt_every = 100\nseed = 3\n");
  auto r = test::run_ddm("partition --config " + cfg + " --k 2 --out " + (dir / "parts"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (int k = 0; k < 2; ++k) {
    r = test::run_ddm("train --quiet --config " + cfg + " --partition " + (dir / "parts") + " --expert " +
                      std::to_string(k) + " --out " + (dir / ("e" + std::to_string(k))));
    ASSERT_EQ(r.exit_code, 0) << r.output;
  }
  r = test::run_ddm("train-router --config " + cfg + " --partition " + (dir / "parts") +
                    " --holdout 8 --set model.patch=4 --set train.steps=50 --out " + (dir / "router"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // Measured on each held-out image's own caption: the caption names the colour, the colour the
  // cluster, so the router knows the cluster at every noise level; the null prompt does not.
  const auto eval = nlohmann::json::parse(test::read_text(dir / "router/router_eval.json"));
  const auto& noisiest = eval.at("buckets").back();
  EXPECT_EQ(noisiest.at("accuracy").get<double>(), 1.0) << eval.dump(1);
  const std::string experts = " --expert " + (dir / "e0") + " --expert " + (dir / "e1");
  r = test::run_ddm("ensemble --out " + (dir / "ens") + " --partition " + (dir / "parts") + " --router " +
                    (dir / "router") + experts);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("next: ddm sample --ensemble " + (dir / "ens") + " --prompt '"), std::string::npos) << r.output;
  std::string prompts;
  for (const char* n : kNames) prompts += std::string(" --prompt 'a ") + n + " square'";
  r = test::run_ddm("sample --ensemble " + (dir / "ens") + prompts + " --n 16 --steps 10 --cfg 3 --out " +
                    (dir / "s.png") + " --raw " + (dir / "s.safetensors") + " --png-dir " + (dir / "pngs"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // Each sample's prompt kept with it: in --raw's metadata, and beside each PNG of --png-dir.
  const auto kept = nlohmann::json::parse(load_safetensors(dir / "s.safetensors").metadata.at("prompts"));
  ASSERT_EQ(kept.size(), 16u);
  for (size_t i = 0; i < 16; ++i) EXPECT_EQ(kept[i], std::string("a ") + kNames[i / 4] + " square") << i;
  EXPECT_EQ(test::read_text(dir / "pngs/000005.txt"), "a green square\n");
  EXPECT_NE(r.output.find("text: 4 prompt(s), 4 sample(s) each per row"), std::string::npos) << r.output;
  const auto want = torch::arange(4, torch::kLong).repeat_interleave(4);
  EXPECT_TRUE(nearest_colour(dir / "s.safetensors").equal(want)) << nearest_colour(dir / "s.safetensors");
  // --cfg 0: the router and every expert take the negative prompt.
  r = test::run_ddm("sample --ensemble " + (dir / "ens") + " --prompt 'a red square' --negative-prompt 'a yellow square'" +
                    " --n 4 --steps 10 --cfg 0 --out " + (dir / "n.png") + " --raw " + (dir / "n.safetensors"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(nearest_colour(dir / "n.safetensors").eq(3).all().item<bool>()) << nearest_colour(dir / "n.safetensors");
  // Distilled into one text model: each caption's target is its cluster's expert, conditioned on it.
  r = test::run_ddm("distill --quiet --ensemble " + (dir / "ens") + " --out " + (dir / "student") + " --set train.steps=100");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("next: ddm sample --ckpt " + (dir / "student") + " --prompt '"), std::string::npos) << r.output;
  r = test::run_ddm("sample --ckpt " + (dir / "student") + prompts + " --n 16 --steps 10 --cfg 3 --out " + (dir / "d.png") +
                    " --raw " + (dir / "d.safetensors"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(nearest_colour(dir / "d.safetensors").equal(want)) << nearest_colour(dir / "d.safetensors");
  // A router that does not see the text cannot route prompts: refused, naming it.
  r = test::run_ddm("train-router --config " + cfg + " --partition " + (dir / "parts") + " --holdout 8 --set model.patch=4" +
                    " --set model.text_encoder= --set model.text_tokens=0 --set train.steps=2 --out " + (dir / "plain"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  test::expect_error(test::run_ddm("ensemble --out " + (dir / "bad") + " --partition " + (dir / "parts") + " --router " +
                                   (dir / "plain") + experts),
                     "is not conditioned on text, the experts on " + encoder);
  EXPECT_FALSE(fs::exists(dir / "bad/ensemble.json"));
  // The encoder moved (a project moved, an environment rebuilt): named as missing; assembled,
  // sampled and distilled from its new place, the same weights (its sha256) accepted.
  const std::string moved = dir / "moved-minilm";
  fs::rename(encoder, moved);
  const std::string again = "ensemble --force --out " + (dir / "ens") + " --partition " + (dir / "parts") + " --router " +
                            (dir / "router") + experts;
  test::expect_error(test::run_ddm(again), "frozen text encoder " + encoder + " (model.text_encoder) is not there");
  r = test::run_ddm(again + " --text-encoder " + moved);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find(" --out grid.png --text-encoder " + moved), std::string::npos) << r.output;
  r = test::run_ddm("sample --ensemble " + (dir / "ens") + " --prompt 'a red square' --n 2 --steps 2 --out " +
                    (dir / "m.png") + " --text-encoder " + moved);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = test::run_ddm("distill --quiet --ensemble " + (dir / "ens") + " --out " + (dir / "moved-student") +
                    " --set train.steps=2 --text-encoder " + moved);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(test::read_text(dir / "moved-student/config.toml").find("text_encoder = '" + moved + "'"), std::string::npos);
  test::expect_error(test::run_ddm("distill --quiet --ensemble " + (dir / "ens") + " --out " + (dir / "s2") +
                                   " --text-encoder " + (dir / "nowhere")),
                     "--text-encoder " + (dir / "nowhere") + ": no such directory");
}

// Partitioned by what the captions say (`--features text`): images of noise, so their pixels carry
// nothing, captioned by two topics (dogs, dishes) in varied words. The clusters are the topics, in memory and over
// tar shards alike; `ddm text encode`'s output read as a features file gives the same partition; a
// shard sample without a caption is named.
TEST(TextDecentral, APartitionByTheCaptionsGroupsTheirTopics) {
  test::TempDir dir;
  const std::string root = dir / "images", cfg = dir / "text.toml", shards_cfg = dir / "shards.toml";
  const std::string encoder = test::minilm_package_dir() + "/model";
  const char* animals[] = {"a dog running in the park", "a small dog asleep on the sofa", "a puppy chewing a bone",
                           "a dog catching a frisbee", "a brown dog swimming in a lake", "two dogs playing in the snow"};
  const char* food[] = {"a bowl of tomato soup", "a slice of pepperoni pizza", "a plate of spaghetti with sauce",
                        "a bowl of chicken soup", "a pizza with cheese and tomato", "spaghetti with meatballs"};
  fs::create_directories(root);
  torch::manual_seed(5);
  std::string captions;  // in dataset order, for `ddm text encode`
  std::vector<ShardSample> samples;
  for (int i = 0; i < 24; ++i) {
    const auto img = torch::randint(0, 256, {3, 8, 8}, torch::kLong).to(torch::kUInt8);
    const std::string caption = i % 2 ? food[(i / 2) % 6] : animals[(i / 2) % 6];
    const std::string stem = zero_padded(i, 3);
    test::write_text(root + "/" + stem + ".png", png_of(img));
    test::write_text(root + "/" + stem + ".txt", caption + "\n");
    captions += caption + "\n";
    ShardSample s;
    s.key = stem;
    s.files["png"] = png_of(img);
    s.files["txt"] = caption;
    samples.push_back(s);
  }
  const auto topics = torch::arange(24, torch::kLong).remainder(2);
  const auto same_split = [&](const std::string& parts) {  // the clusters are the topics, in either order
    const auto labels = load_safetensors(parts + "/partition.safetensors").tensors.at("labels");
    return labels.equal(topics) || labels.equal(1 - topics);
  };
  test::write_text(cfg, "[data]\nsource = \"folder\"\nroot = \"" + root + "\"\n[model]\ntext_encoder = \"" + encoder +
                            "\"\n");
  auto r = test::run_ddm("partition --config " + cfg + " --k 2 --features text --out " + (dir / "by-text"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("captions' pooled embeddings by"), std::string::npos) << r.output;
  EXPECT_TRUE(same_split(dir / "by-text")) << load_safetensors(dir / "by-text/partition.safetensors").tensors.at("labels");
  // The same rows from `ddm text encode` (its pooled embeddings), read as a features file.
  test::write_text(dir / "captions.txt", captions);
  r = test::run_ddm("text encode --encoder " + encoder + " --prompts " + (dir / "captions.txt") + " --out " +
                    (dir / "captions.safetensors"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = test::run_ddm("partition --config " + cfg + " --k 2 --features file:" + (dir / "captions.safetensors") +
                    " --out " + (dir / "by-file"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(load_safetensors(dir / "by-file/partition.safetensors").tensors.at("labels").equal(
      load_safetensors(dir / "by-text/partition.safetensors").tensors.at("labels")));
  // Without an encoder in the config or the flag: named.
  test::write_text(dir / "plain.toml", "[data]\nsource = \"folder\"\nroot = \"" + root + "\"\n");
  test::expect_error(test::run_ddm("partition --config " + (dir / "plain.toml") + " --k 2 --features text --out " +
                                   (dir / "none")),
                     "--features text: name the text encoder");
  EXPECT_FALSE(fs::exists(dir / "none"));

  // Tar shards: the captions read from the shards alone, the same clusters.
  fs::create_directories(dir / "shards");
  for (int s = 0; s < 2; ++s) {
    TarShardWriter w(dir / ("shards/part-" + std::to_string(s) + ".tar"));
    for (int i = 12 * s; i < 12 * s + 12; ++i) w.add(samples[static_cast<size_t>(i)]);
    w.finish();
  }
  test::write_text(shards_cfg, "[data]\nsource = \"shards\"\nroot = \"" + (dir / "shards") +
                                   "\"\nresolution = 8\nchannels = 3\n");
  r = test::run_ddm("partition --config " + shards_cfg + " --k 2 --features text:" + encoder + " --out " +
                    (dir / "by-text-shards"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(load_safetensors(dir / "by-text-shards/partition.safetensors").tensors.at("labels").equal(
      load_safetensors(dir / "by-text/partition.safetensors").tensors.at("labels")));
  // `ddm encode --text` shards: the pooled encodings they hold are read, not encoded again (and give
  // the same clusters); with another text length they are encoded again, and said.
  test::write_text(dir / "encode.toml", "[data]\nsource = \"shards\"\nroot = \"" + (dir / "shards") +
                                            "\"\nresolution = 8\nchannels = 3\n[model]\ntext_encoder = \"" + encoder +
                                            "\"\n");
  r = test::run_ddm("encode --threads 1 --text --config " + (dir / "encode.toml") + " --out " + (dir / "encoded"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  test::write_text(dir / "encoded.toml", "[data]\nsource = \"latents\"\nroot = \"" + (dir / "encoded") + "\"\n");
  r = test::run_ddm("partition --config " + (dir / "encoded.toml") + " --k 2 --features text:" + encoder + " --out " +
                    (dir / "by-stored"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("-d), as `ddm encode --text` stored them"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("encoding 24 captions"), std::string::npos) << r.output;
  EXPECT_TRUE(load_safetensors(dir / "by-stored/partition.safetensors").tensors.at("labels").equal(
      load_safetensors(dir / "by-text/partition.safetensors").tensors.at("labels")));
  r = test::run_ddm("encode --threads 1 --text --config " + (dir / "encode.toml") + " --set model.text_tokens=16 --out " +
                    (dir / "encoded16"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  test::write_text(dir / "encoded16.toml", "[data]\nsource = \"latents\"\nroot = \"" + (dir / "encoded16") + "\"\n");
  r = test::run_ddm("partition --config " + (dir / "encoded16.toml") + " --k 2 --features text:" + encoder + " --out " +
                    (dir / "by-16"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("note: the shards hold the text encodings of " + encoder + " at 16 tokens, and the "
                          "partition's encoder (" + encoder + ") cuts captions at 256 tokens: the captions are encoded "
                          "again"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("encoding 24 captions"), std::string::npos) << r.output;
  {  // a sample without its caption
    samples[14].files.erase("txt");
    TarShardWriter w(dir / "shards/part-1.tar");
    for (int i = 12; i < 24; ++i) w.add(samples[static_cast<size_t>(i)]);
    w.finish();
  }
  test::expect_error(test::run_ddm("partition --config " + shards_cfg + " --k 2 --features text:" + encoder +
                                   " --out " + (dir / "bad")),
                     "sample '014' of shard " + (dir / "shards/part-1.tar") + " has no caption");
  EXPECT_FALSE(fs::exists(dir / "bad"));
}
