// TensorBoard event files (core/tensorboard.h): CRC-32C against its published check value, records
// read back as written, a resume that keeps the steps up to where it resumes in one new file, and a
// file torn by a crash read up to its last whole record. tests/integration/test_train_watch.cpp reads
// what a training run writes with tensorboard's own reader.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/fileio.h"
#include "core/tensorboard.h"
#include "test_util.h"

namespace fs = std::filesystem;
using namespace ddm;

namespace {

std::vector<fs::path> event_files(const std::string& dir) {
  std::vector<fs::path> out;
  for (const auto& e : fs::directory_iterator(dir)) out.push_back(e.path());
  return out;
}

std::vector<int64_t> steps_of(const std::string& file) {
  std::vector<int64_t> out;
  for (const EventRecord& r : read_event_records(file))
    if (!r.header) out.push_back(r.step);
  return out;
}

}  // namespace

TEST(TensorBoard, Crc32cGivesItsCheckValue) {
  // The check value of CRC-32C (Castagnoli): the CRC of the nine ASCII digits "123456789".
  EXPECT_EQ(crc32c("123456789", 9), 0xE3069283u);
  EXPECT_EQ(crc32c("", 0), 0u);
  // Computing it in two pieces gives the whole's.
  EXPECT_EQ(crc32c("6789", 4, crc32c("12345", 5)), 0xE3069283u);
}

TEST(TensorBoard, RecordsReadBackAsWritten) {
  test::TempDir dir;
  std::string path;
  {
    EventWriter w(dir / "tb", 0);
    w.scalar("train/loss", 1, 0.5);
    w.scalar("train/loss", 2, 0.25);
    path = w.path();
  }
  EXPECT_NE(fs::path(path).filename().string().find("tfevents"), std::string::npos) << path;
  const auto records = read_event_records(path);
  ASSERT_EQ(records.size(), 3u);
  EXPECT_TRUE(records[0].header);
  EXPECT_NE(records[0].event.find("brain.Event:2"), std::string::npos);
  EXPECT_EQ(steps_of(path), (std::vector<int64_t>{1, 2}));
  EXPECT_NE(records[1].event.find("train/loss"), std::string::npos);
}

TEST(TensorBoard, AResumeKeepsTheStepsUpToItInOneNewFile) {
  test::TempDir dir;
  const std::string tb = dir / "tb";
  {
    EventWriter w(tb, 0);
    for (int64_t s = 1; s <= 6; ++s) w.scalar("train/loss", s, 1.0 / s);
  }
  {
    EventWriter w(tb, 4);  // the run resumes from its checkpoint at step 4, after a crash at 6
    EXPECT_EQ(event_files(tb).size(), 1u);
    w.scalar("train/loss", 5, 0.1);
  }
  const auto files = event_files(tb);
  ASSERT_EQ(files.size(), 1u);
  EXPECT_EQ(steps_of(files[0].string()), (std::vector<int64_t>{1, 2, 3, 4, 5}));
  {
    EventWriter w(tb, 0);  // a fresh start keeps nothing
  }
  EXPECT_EQ(steps_of(event_files(tb).at(0).string()), std::vector<int64_t>{});
}

TEST(TensorBoard, ATornFileIsReadUpToItsLastWholeRecord) {
  test::TempDir dir;
  const std::string tb = dir / "tb";
  std::string path;
  {
    EventWriter w(tb, 0);
    for (int64_t s = 1; s <= 3; ++s) w.scalar("train/loss", s, 1.0);
    path = w.path();
  }
  const std::string whole = read_file(path);
  // Cut inside the last record, and flip a byte of the second record's data: each stops the reading.
  std::ofstream(path, std::ios::binary | std::ios::trunc) << whole.substr(0, whole.size() - 5);
  EXPECT_EQ(steps_of(path), (std::vector<int64_t>{1, 2}));
  std::string flipped = whole;
  const size_t second = whole.find("train/loss", whole.find("train/loss") + 1);
  flipped[second] ^= 1;
  std::ofstream(path, std::ios::binary | std::ios::trunc) << flipped;
  EXPECT_EQ(steps_of(path), (std::vector<int64_t>{1}));
  // A resume from such a file keeps what is whole.
  {
    EventWriter w(tb, 10);
  }
  EXPECT_EQ(steps_of(event_files(tb).at(0).string()), (std::vector<int64_t>{1}));
}

TEST(TensorBoard, AnImageMustBeAPng) {
  test::TempDir dir;
  EventWriter w(dir / "tb", 0);
  try {
    w.image("samples", 1, "GIF89a: not a PNG at all, but long enough for one");
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("samples is not a PNG"), std::string::npos) << e.what();
  }
}
