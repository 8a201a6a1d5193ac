// Shifted matches (kv.store_pre_rope; docs/architecture.md, "KV cache on a memory rank"): where the
// KV of a prompt block that the prefix registry does not hold can be copied from, when the same
// tokens sit in registered blocks at other positions. A conversation whose client dropped its oldest
// turns sends a prompt whose later blocks no chained hash finds (every block's hash stands for the
// whole prefix before it), although the registry holds those tokens one or more positions further on.
//
// FindShiftedBlock covers the prompt's tokens [start, start + B) (B = block_tokens) with runs of rows
// of registered blocks (resident or demoted), greedily from the left:
//   - a run continues where the previous one stopped (the next row of the same source block, then
//     the source's children) as long as the tokens agree: a truncated history stays in step with
//     its old chain;
//   - the first block after a chained match starts from the children of the last matched block (the
//     tokens that followed the kept part of the history, such as the end of a system prompt);
//   - otherwise it looks for a block anchored (PrefixIndex::WithAnchor) at one of the next B positions
//     and takes the rows before the anchor from the end of that block's parent, when they agree.
// Every run's tokens equal the prompt's (compared, not hashed). A block that takes more than
// kMaxPrefixSegments runs (common/wire.h), or any token no registered block holds, is not covered.
//
// What the copied KV is: the same tokens' keys and values, computed with the context they had where
// they were written. Keys are turned to the new positions (AttentionExecutor::RotateKeys), so the
// first layer's K and V equal a recomputation's; deeper layers differ where the context differs
// (the dropped turns), which is the approximation this reuse makes (docs/benchmarks.md measures it).
//
// Thread safety: reads the registry only; as PrefixIndex.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <vector>

#include "common/wire.h"
#include "compute_node/prefix_index.h"

namespace tandem {

// Rows [row, row + rows) of registered block `block`, copied to consecutive positions.
struct ShiftedRun {
  int32_t block = -1;
  int32_t row = 0;
  int32_t rows = 0;
};

// Where the run after a covered block would continue (FindShiftedBlock's `next`): block -1 when
// nowhere.
struct ShiftedCursor {
  int32_t block = -1;
  int32_t row = 0;
};

// The runs covering prompt[start, start + B), or nullopt. start + B <= prompt.size(); `prev` is the
// registry id of the block before (a chained match's last, -1 when there is none or it was
// itself shifted); `cursor` where the previous shifted block's last run stopped ({-1} for none).
// `usable(id)` says whether a block may be a source (the caller leaves out blocks whose KV does not
// exist yet). On success *next (when given) says where a following block's run would continue.
// Needs content look-ups (PrefixIndex::EnableContentLookup).
std::optional<std::vector<ShiftedRun>> FindShiftedBlock(const PrefixIndex& index,
                                                        std::span<const int32_t> prompt, int64_t start,
                                                        int32_t prev, ShiftedCursor cursor,
                                                        const std::function<bool(int32_t)>& usable,
                                                        ShiftedCursor* next = nullptr);

}  // namespace tandem
