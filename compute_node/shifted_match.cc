#include "compute_node/shifted_match.h"

#include <algorithm>

#include "common/status.h"

namespace tandem {

std::optional<std::vector<ShiftedRun>> FindShiftedBlock(const PrefixIndex& index,
                                                        std::span<const int32_t> prompt, int64_t start,
                                                        int32_t prev, ShiftedCursor cursor,
                                                        const std::function<bool(int32_t)>& usable,
                                                        ShiftedCursor* next) {
  const int64_t bt = index.block_tokens();
  const int64_t end = start + bt;
  TANDEM_CHECK(index.content_lookup() && start >= 0 && end <= static_cast<int64_t>(prompt.size()));
  int64_t i = start;
  // How many rows of block `id` from `row` on agree with prompt[i, end).
  const auto agree = [&](int32_t id, int64_t row) {
    const std::vector<int32_t>& t = index.tokens(id);
    int64_t n = 0;
    while (row + n < bt && i + n < end &&
           t[static_cast<size_t>(row + n)] == prompt[static_cast<size_t>(i + n)])
      ++n;
    return n;
  };
  // The usable child of `id` that agrees longest from its first row (the lowest id on a tie).
  const auto child = [&](int32_t id) {
    ShiftedCursor best;
    int64_t best_rows = 0;
    for (int32_t c : index.Children(id)) {
      if (!usable(c)) continue;
      const int64_t n = agree(c, 0);
      if (n > best_rows) {
        best = {c, 0};
        best_rows = n;
      }
    }
    return best;
  };
  // A block anchored at one of the next block_tokens positions, entered at the row that lines up
  // with prompt[i] (in its parent when the anchor is further on).
  const auto anchor = [&]() -> ShiftedCursor {
    const int64_t k = index.anchor_tokens();
    for (int64_t t = 0; t < bt && i + t + k <= static_cast<int64_t>(prompt.size()); ++t) {
      for (int32_t id : index.WithAnchor(prompt.subspan(static_cast<size_t>(i + t)))) {
        if (!usable(id)) continue;
        if (t == 0) return {id, 0};
        const int32_t p = index.parent(id);
        if (p < 0 || !usable(p)) continue;
        const std::vector<int32_t>& pt = index.tokens(p);
        if (std::equal(pt.end() - static_cast<std::ptrdiff_t>(t), pt.end(),
                       prompt.begin() + static_cast<std::ptrdiff_t>(i)))
          return {p, static_cast<int32_t>(bt - t)};
      }
    }
    return {};
  };

  if (cursor.block < 0 && prev >= 0) cursor = child(prev);
  std::vector<ShiftedRun> runs;
  while (i < end) {
    if (cursor.block >= 0 && cursor.row == bt) cursor = child(cursor.block);
    const int64_t n = cursor.block >= 0 && usable(cursor.block) ? agree(cursor.block, cursor.row) : 0;
    if (n == 0) {
      cursor = anchor();
      if (cursor.block < 0) return std::nullopt;
      continue;
    }
    if (runs.size() == kMaxPrefixSegments) return std::nullopt;
    runs.push_back({cursor.block, cursor.row, static_cast<int32_t>(n)});
    i += n;
    cursor.row += static_cast<int32_t>(n);
    if (i < end && cursor.row < bt) cursor = {};  // the tokens part ways inside the source block
  }
  if (next != nullptr) *next = cursor;
  return runs;
}

}  // namespace tandem
