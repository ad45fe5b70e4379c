// TensorBoard event files, written by ddm itself: what TensorBoard, W&B's TensorBoard sync and most
// dashboards read. A file is a sequence of TFRecords (length, masked CRC-32C of the length, an
// Event protocol buffer, masked CRC-32C of it); an Event holds a wall time, a step and a Summary of
// tagged values: a float (scalars) or a PNG image (grids). The handful of protobuf fields is encoded
// here by hand: linking libprotobuf and generating code from tensorboard's .proto files would pull a
// compiler step into the build for six fields, and Debian ships no CRC-32C library.
//
// Resuming: EventWriter(dir, resume_step) keeps the records of earlier files in `dir` up to
// resume_step, writes them into its own new file and removes the old files, so every reader sees
// one history without the steps a crash made the run repeat (as metrics.jsonl drops its records).
#pragma once
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

namespace ddm {

// CRC-32C (Castagnoli), and the rotated, offset form TFRecords store.
uint32_t crc32c(const void* data, size_t n, uint32_t crc = 0);
uint32_t masked_crc32c(const void* data, size_t n);

// One record of an event file: its step and its serialized Event.
struct EventRecord {
  int64_t step = 0;
  bool header = false;  // the file-version event that opens every file
  std::string event;
};
// The records of an event file, in order, up to a torn or corrupt one (a crash mid-write): checked
// by both CRCs. Throws ddm::Error if the file cannot be read.
std::vector<EventRecord> read_event_records(const std::string& path);

class EventWriter {
 public:
  // Writes dir/events.out.tfevents.<unix seconds>.<host>.<pid>.ddm (creating dir). resume_step: see
  // above; 0 drops every earlier file's records.
  EventWriter(const std::string& dir, int64_t resume_step);
  ~EventWriter();
  EventWriter(const EventWriter&) = delete;
  EventWriter& operator=(const EventWriter&) = delete;

  void scalar(const std::string& tag, int64_t step, double value);
  // A PNG image, as encoded (its size and channels are read from its header; not a PNG: ddm::Error).
  void image(const std::string& tag, int64_t step, const std::string& png);
  const std::string& path() const { return path_; }

 private:
  void write_record(const std::string& event);  // framed, flushed: a crash loses at most this record
  std::string path_;
  std::FILE* file_ = nullptr;
};

}  // namespace ddm
