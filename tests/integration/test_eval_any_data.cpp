// Quality on the user's own data, through the ddm binary: a folder of images without labels (real
// Fashion-MNIST pictures written as PNG files, as a user's photos would sit in a folder) trains a
// model; `ddm train-classifier --config` learns the self-supervised turn of each image on it;
// `ddm eval` compares samples with held-out images of the folder in that network's space, and its FD
// tells a trained model from an untrained one, and the folder's own images (the anchor) score below
// both; `ddm sample --png-dir` writes a folder of PNGs for other FID tools; what cannot be measured or
// written is a clear error before anything is sampled.
#include <gtest/gtest.h>

#include <filesystem>
#include <iostream>
#include <string>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "core/fileio.h"
#include "core/safetensors.h"
#include "data/dataset.h"
#include "data/shard_write.h"
#include "test_util.h"

namespace fs = std::filesystem;
using namespace ddm;

namespace {

// n images of a Fashion-MNIST split from `first` on, as PNG files in `root`, without labels.
void image_folder(const std::string& root, const std::string& split, int64_t first, int64_t n) {
  DataConfig dc;
  dc.split = split;
  const Dataset d = load_dataset(dc);
  fs::create_directories(root);
  for (int64_t i = 0; i < n; ++i) test::write_text(root + "/" + zero_padded(i, 4) + ".png", png_of(d.images[first + i]));
}

double fd_of(const std::string& json_path) {
  return nlohmann::json::parse(test::read_text(json_path))["fd"].get<double>();
}

}  // namespace

TEST(EvalAnyData, AnUnlabelledFolderTrainsItsFeatureNetworkAndFdTellsTrainedFromUntrained) {
  test::TempDir dir;
  image_folder(dir / "mine", "train", 0, 800);
  image_folder(dir / "held", "test", 0, 200);
  test::write_text(dir / "mine.toml", "[data]\nsource = \"folder\"\nroot = \"" + (dir / "mine") +
                                          "\"\n[model]\npreset = \"unet-tiny\"\nchannels = 16\nchannel_mult = [1, 2]\n"
                                          "groups = 4\n[train]\nsteps = 200\nbatch_size = 32\nwarmup = 20\n"
                                          "threads = 2\nlog_every = 100\nckpt_every = 200\nseed = 1\n[sample]\nsteps = 10\n");
  const std::string cfg = " --config " + (dir / "mine.toml");
  auto r = test::run_ddm("train --quiet" + cfg + " --out " + (dir / "run"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = test::run_ddm("train --quiet" + cfg + " --set train.steps=1 --out " + (dir / "untrained"));
  ASSERT_EQ(r.exit_code, 0) << r.output;

  // The feature network: no labels, so it learns which way each image was turned, measured on a
  // held-out tenth.
  const std::string net = dir / "mine-net.safetensors";
  r = test::run_ddm("train-classifier" + cfg + " --epochs 3 --out " + net);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("has no class labels: the network learns the self-supervised task"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("measuring on 80 images of"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("drawn at random (held out)"), std::string::npos) << r.output;
  const auto meta = load_safetensors(net).metadata;
  EXPECT_EQ(meta.at("task"), "rotation");
  EXPECT_EQ(meta.at("num_classes"), "4");
  // Turning garments is easy to tell: far above the 25% of a guess.
  EXPECT_GT(std::stod(meta.at("test_correct")) / std::stod(meta.at("test_total")), 0.6) << r.output;

  // Without a network of its data, a folder model is refused by name; with one, scored against the
  // held-out folder.
  const std::string cache = " --cache-dir " + (dir / "cache");
  test::expect_error(test::run_ddm("eval --ckpt " + (dir / "run") + " --n 200" + cache),
                     "was trained on data from \"folder\", not Fashion-MNIST: give --feature-net FILE");
  const std::string eval = " --n 200 --feature-net " + net + " --reference-set data.root=" + (dir / "held") + cache;
  // What would refuse the samples is refused before they are made: too few for FD, a missing network.
  r = test::run_ddm("eval --ckpt " + (dir / "run") + " --n 64 --feature-net " + net + " --reference-set data.root=" +
                    (dir / "held") + cache);
  test::expect_error(r, "64 images, but FD needs more than the feature network's 128 feature dimensions; give a larger --n");
  EXPECT_EQ(r.output.find("sampling 64 images"), std::string::npos) << r.output;
  r = test::run_ddm("eval --ckpt " + (dir / "run") + " --n 200 --feature-net " + (dir / "nothere.safetensors") + cache);
  test::expect_error(r, "--feature-net " + (dir / "nothere.safetensors") + ": no such file");
  EXPECT_EQ(r.output.find("sampling 200 images"), std::string::npos) << r.output;
  r = test::run_ddm("eval --ckpt " + (dir / "run") + eval + " --out " + (dir / "e-run"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("reference: "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("not Inception FID"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("FD-fmnist"), std::string::npos) << r.output;
  r = test::run_ddm("eval --ckpt " + (dir / "untrained") + eval + " --out " + (dir / "e-untrained"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // (cfg 1: an unconditional model has nothing to guide by)
  const std::string json = "euler-10steps-cfg1.00-n200.json";
  const double trained = fd_of(dir / "e-run/" + json), untrained = fd_of(dir / "e-untrained/" + json);
  const auto info = nlohmann::json::parse(test::read_text(dir / "e-run/" + json))["info"];
  EXPECT_EQ(info["steps"], 10) << info.dump();  // numbers as numbers (they were "10", "1.000000")
  EXPECT_EQ(info["cfg"], 1) << info.dump();
  EXPECT_EQ(info["checkpoint"], dir / "run/ckpt/step-00000200") << info.dump();
  std::cout << "FD: trained " << trained << ", untrained " << untrained << std::endl;
  EXPECT_LT(trained * 1.5, untrained) << "trained " << trained << ", untrained " << untrained;

  // Samples as a PNG folder, and scored from their file against a reference config of their own.
  r = test::run_ddm("sample --ckpt " + (dir / "run") + " --n 200 --out " + (dir / "s.png") + " --raw " +
                    (dir / "s.safetensors") + " --png-dir " + (dir / "pngs"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(fs::exists(dir / "pngs/000199.png"));
  EXPECT_FALSE(fs::exists(dir / "pngs/000200.png"));
  test::expect_error(test::run_ddm("sample --ckpt " + (dir / "run") + " --n 2 --out " + (dir / "t.png") + " --png-dir " +
                                   (dir / "pngs")),
                     "holds files already");
  // Outputs that cannot be written, and a reference of another size, are refused before sampling.
  r = test::run_ddm("sample --ckpt " + (dir / "run") + " --n 2 --out /proc/ddm-test.png");
  test::expect_error(r, "--out /proc/ddm-test.png: cannot write there");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_EQ(r.output.find("sampling 2"), std::string::npos) << r.output;
  {
    DataConfig dc;
    dc.split = "test";
    const Dataset d = load_dataset(dc);
    fs::create_directories(dir / "small");
    for (int64_t i = 0; i < 200; ++i)
      test::write_text(dir / ("small/" + zero_padded(i, 4) + ".png"), png_of(d.images[i].narrow(1, 0, 14).narrow(2, 0, 14)));
  }
  r = test::run_ddm("eval --ckpt " + (dir / "run") + " --n 200 --feature-net " + net + " --reference-set data.root=" +
                    (dir / "small") + cache);
  test::expect_error(r, "holds images of [1, 14, 14], but the samples of " + (dir / "run/ckpt/step-00000200") +
                            " and the feature network are [1, 28, 28]: compare them at one size");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_EQ(r.output.find("sampling 200"), std::string::npos) << r.output;
  // The anchors of this data: random images of the folder (the floor) against the held-out ones.
  r = test::run_ddm("eval --anchor train --n 200 --feature-net " + net + " --reference-config " + (dir / "mine.toml") +
                    " --reference-set data.root=" +
                    (dir / "held") + cache + " --out " + (dir / "e-anchor"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("anchor: 200 random images of folder " + (dir / "mine")), std::string::npos) << r.output;
  EXPECT_LT(fd_of(dir / "e-anchor/anchor-train-n200.json"), trained);  // real images: below any model
  test::write_text(dir / "held.toml", "[data]\nsource = \"folder\"\nroot = \"" + (dir / "held") + "\"\n");
  r = test::run_ddm("eval --samples " + (dir / "s.safetensors") + " --feature-net " + net + " --reference-config " +
                    (dir / "held.toml") + cache + " --out " + (dir / "e-file"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(fd_of(dir / "e-file/s.json"), trained);  // the same samples, the same cached reference

  // Other data needs a network of its own; unlabelled data has no classes for CAS.
  test::expect_error(test::run_ddm("eval --samples " + (dir / "s.safetensors") + " --reference-config " +
                                   (dir / "held.toml") + cache),
                     "needs a feature network trained on that data");
  test::expect_error(test::run_ddm("eval --samples " + (dir / "s.safetensors") + " --feature-net " + net +
                                   " --reference-config " + (dir / "held.toml") + " --cas" + cache),
                     "CAS measures a classifier of the samples on the reference's classes, and folder");
  // A network of other classes (the shipped one: Fashion-MNIST's ten) does not score a labelled
  // reference's classes: CAS refused, naming what it was trained on.
  image_folder(dir / "labelled/boots", "test", 0, 100);
  image_folder(dir / "labelled/shirts", "test", 100, 100);
  test::write_text(dir / "labelled.toml", "[data]\nsource = \"folder\"\nroot = \"" + (dir / "labelled") + "\"\n");
  r = test::run_ddm("eval --samples " + (dir / "s.safetensors") + " --feature-net " +
                    test::source_dir() + "/assets/feature-net/fmnist-cnn.safetensors" + " --reference-config " +
                    (dir / "labelled.toml") + " --cas" + cache);
  test::expect_error(r, "--cas: the feature network classifies 10 classes, the reference has 2: it was trained on "
                        "other data (fashion-mnist train: 60000 x 1x28x28, 10 classes)");
  EXPECT_EQ(r.exit_code, 2) << r.output;
}
