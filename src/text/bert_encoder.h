// A frozen BERT text encoder as sentence-transformers runs it (transformers' BertModel, then mean
// pooling over the attention mask and, where its modules.json lists Normalize, unit length):
// all-MiniLM-L6-v2 and its kind, read from the directory they are kept in (config.json +
// model.safetensors or its sharded index, transformers' key names; 1_Pooling/config.json), never
// converted. Inference only: the weights are plain tensors, no gradients.
#pragma once
#include <map>
#include <string>
#include <vector>
#include <torch/torch.h>

namespace ddm::text {

struct BertEncoder {
  // Reads DIR/config.json and DIR/model.safetensors. Throws ddm::Error naming the file and the
  // key (a missing tensor, a shape that contradicts the config, a config ddm does not run).
  static BertEncoder load(const std::string& dir);

  // ids, mask: [B, T] int64 (mask 1 for tokens, 0 for padding). Returns the last hidden states
  // [B, T, hidden] (transformers' last_hidden_state).
  torch::Tensor forward(const torch::Tensor& ids, const torch::Tensor& mask) const;
  // sentence-transformers' embedding: the mean of the states over the mask, at unit length where the
  // directory's modules say Normalize. [B, hidden]
  torch::Tensor sentence_embedding(const torch::Tensor& ids, const torch::Tensor& mask) const;

  int64_t hidden = 0, heads = 0, layers = 0;
  double eps = 1e-12;
  bool normalize = false;          // sentence-transformers' Normalize module follows the pooling
  int64_t max_seq_length = 0;      // sentence_bert_config.json's (0: none given)
  std::vector<std::string> files;  // the weights' files (a run pins them by sha256)
  std::map<std::string, torch::Tensor> w;  // transformers' names, without a "bert." prefix
};

}  // namespace ddm::text
