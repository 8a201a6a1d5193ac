// Which compute rank runs which part of a pipelined step (pipeline.mode; docs/architecture.md,
// "Compute replicas"). Compute and memory ranks both follow it: a memory rank writes micro-batch
// j's attention output of layer l to OwnerOf(j, l) and, on the device path, waits for its q,k,v
// from SenderOf(j, l).
//
//   fixed       micro-batch j stays on compute rank j % R for the whole step (R = compute.ranks);
//   rotational  layers are cut into slices of `slice_layers`; slice k of micro-batch j runs on
//               compute rank (j + k) % R. The rank that owns layer l's attention output runs the
//               rest of layer l and the next layer's norm, QKV and RoPE, and sends its q,k,v; when
//               layer l + 1 belongs to the next slice, that rank also hands the residual stream to
//               rank (c + 1) % R, which receives it while the memory ranks run layer l + 1's
//               attention. So the residual stream moves around a ring of compute ranks and each
//               rank talks to its successor only.
//
// In both modes OwnerOf(j, l) runs PostAttention(l) and PreAttention(l + 1); PreAttention(0) (and
// the embedding) runs on OwnerOf(j, 0), the sampling on OwnerOf(j, num_layers - 1).
//
// Thread safety: a value type; all members are pure.
#pragma once

#include <cstdint>

namespace tandem {

struct PipelineSchedule {
  int compute_ranks = 1;  // R >= 1
  int slice_layers = 0;   // 0: fixed; else rotational, layers per slice (>= 1)

  bool rotational() const { return slice_layers > 0 && compute_ranks > 1; }
  // The compute rank that receives micro-batch j's attention output of `layer`.
  int OwnerOf(int64_t j, int64_t layer) const {
    const int64_t slice = rotational() ? layer / slice_layers : 0;
    return static_cast<int>((j + slice) % compute_ranks);
  }
  // The compute rank that sends micro-batch j's q,k,v of `layer`.
  int SenderOf(int64_t j, int64_t layer) const { return OwnerOf(j, layer > 0 ? layer - 1 : 0); }
  // Whether the residual stream moves to another rank between PreAttention(layer) (on the sender)
  // and PostAttention(layer) (on the owner): the first layer of every slice but the first.
  bool HandsOff(int64_t j, int64_t layer) const { return SenderOf(j, layer) != OwnerOf(j, layer); }
  // The compute rank that samples micro-batch j (runs its last layer).
  int FinisherOf(int64_t j, int64_t num_layers) const { return OwnerOf(j, num_layers - 1); }
  // Whether compute rank c runs any part of micro-batch j in a model of num_layers.
  bool Touches(int c, int64_t j, int64_t num_layers) const {
    if (!rotational()) return OwnerOf(j, 0) == c;
    const int64_t slices = (num_layers + slice_layers - 1) / slice_layers;
    for (int64_t k = 0; k < slices && k < compute_ranks; ++k) {
      if (OwnerOf(j, k * slice_layers) == c) return true;
    }
    return false;
  }
};

}  // namespace tandem
