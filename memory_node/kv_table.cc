#include "memory_node/kv_table.h"

#include <algorithm>
#include <unordered_set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status.h"

namespace tandem {
namespace {

std::string Hex(uint64_t h) { return absl::StrFormat("%016x", h); }

}  // namespace

std::vector<uint64_t> KvTable::ChainTo(uint64_t hash) const {
  const Block* b = &blocks_.at(hash);
  std::vector<uint64_t> chain(static_cast<size_t>(b->depth));
  for (int32_t d = b->depth; d >= 1; --d) {
    chain[static_cast<size_t>(d - 1)] = hash;
    if (d > 1) {
      hash = b->parent;
      b = &blocks_.at(hash);
    }
  }
  return chain;
}

absl::Status KvTable::Check(const StepPlan& plan, uint16_t memory_rank,
                            std::vector<const StepRequest*>* mine) const {
  const std::string step = absl::StrCat("step ", plan.step_id, ": ");
  auto bad = [&](auto&&... parts) { return absl::InvalidArgumentError(absl::StrCat(step, parts...)); };
  const bool registry = block_tokens_ > 0;

  // Evictions, in order (leaves first): what they free and which hashes they remove.
  std::unordered_set<uint64_t> evicted;
  std::unordered_map<uint64_t, int32_t> children_gone;
  int64_t freed = 0;
  for (const PrefixEvict& e : plan.evictions) {
    if (e.memory_rank != memory_rank) continue;
    if (!registry) return bad("evicts block ", Hex(e.block_hash), " but this rank has no prefix registry");
    auto it = blocks_.find(e.block_hash);
    if (it == blocks_.end() || evicted.contains(e.block_hash))
      return bad("evicts block ", Hex(e.block_hash), ", which is not registered");
    const Block& b = it->second;
    if (b.users > 0) return bad("evicts block ", Hex(e.block_hash), ", which ", b.users, " request(s) use");
    if (b.num_children > children_gone[e.block_hash])
      return bad("evicts block ", Hex(e.block_hash), " before its children");
    evicted.insert(e.block_hash);
    if (b.depth > 1) ++children_gone[b.parent];
    for (int32_t s : b.slots) freed += allocator_.refcount(s) == 1;
  }
  auto registered = [&](uint64_t h) { return blocks_.contains(h) && !evicted.contains(h); };

  // Restores: new blocks below registered (or just restored) parents.
  int64_t new_rows = 0;
  std::unordered_set<uint64_t> restored;
  for (size_t i = 0; i < plan.restores.size(); ++i) {
    const PrefixRestore& e = plan.restores[i];
    if (e.memory_rank != memory_rank) continue;
    const std::string what = absl::StrCat("restore of block ", Hex(e.block_hash), ": ");
    if (!registry || tiers_ == nullptr) return bad(what, "this rank has no KV tiers");
    if (registered(e.block_hash) || !restored.insert(e.block_hash).second)
      return bad(what, "already registered");
    if (e.block_index > 0) {
      const bool parent_ok = restored.contains(e.parent_hash) ||
                             (registered(e.parent_hash) && blocks_.at(e.parent_hash).depth == e.block_index);
      if (!parent_ok)
        return bad(what, "its parent ", Hex(e.parent_hash), " is not registered at depth ", e.block_index);
    }
    if (!e.segments.empty()) {  // a shifted restore: its segments must fill the block
      int64_t rows = 0;
      for (size_t j = 0; j < e.segments.size(); ++j) {
        const PrefixSegment& g = e.segments[j];
        if (g.rows < 1 || g.source_row + g.rows > block_tokens_)
          return bad(what, "segment ", j, " copies rows [", g.source_row, ", ", g.source_row + g.rows,
                     ") of a block of ", block_tokens_);
        rows += g.rows;
      }
      if (rows != block_tokens_) return bad(what, "its segments copy ", rows, " rows, not ", block_tokens_);
    }
    new_rows += block_tokens_;
  }

  // Requests.
  bool seen_multi = false;
  std::unordered_map<uint64_t, const StepRequest*> by_id;
  for (const StepRequest& r : plan.requests) {
    if (r.memory_rank != memory_rank) continue;
    const std::string who = absl::StrCat("request ", r.request_id, ": ");
    if (!by_id.emplace(r.request_id, &r).second) return bad(who, "listed twice");
    auto known = contexts_.find(r.request_id);
    if (known == contexts_.end() && r.position > 0) {
      if (!registry) {
        return bad(who, "position ", r.position, " but this rank holds 0 tokens of its context");
      }
      if (!registered(r.attach_hash)) {
        return bad(who, "attaches block ", Hex(r.attach_hash), ", which is not registered");
      }
      const int64_t covers = blocks_.at(r.attach_hash).depth * block_tokens_;
      if (covers != r.position) {
        return bad(who, "position ", r.position, " but the attached blocks cover ", covers, " tokens");
      }
    } else if (r.position != context_length(r.request_id)) {
      return bad(who, "position ", r.position, " but this rank holds ", context_length(r.request_id),
                 " tokens of its context");
    }
    if (r.q_len < 1 || static_cast<int64_t>(r.kv_len) != static_cast<int64_t>(r.position) + r.q_len) {
      return bad(who, "kv_len ", r.kv_len, " != position ", r.position, " + q_len ", r.q_len);
    }
    if (r.q_len == 1 && seen_multi) return bad(who, "single-row request after a multi-row one");
    seen_multi |= r.q_len > 1;
    new_rows += r.q_len;
    mine->push_back(&r);
  }
  if (new_rows > allocator_.num_free() + freed) {
    return absl::ResourceExhaustedError(absl::StrCat(step, new_rows, " new KV slots needed but ",
                                                     allocator_.num_free() + freed, " of ",
                                                     allocator_.num_slots(), " are free"));
  }
  // A request's chain at the start of the step: its own, or the one it attaches.
  // (A reference to the table's own chain; only an attaching request's is built, into `attaching`.)
  std::vector<uint64_t> attaching;
  auto chain_of = [&](const StepRequest& r) -> const std::vector<uint64_t>& {
    auto known = contexts_.find(r.request_id);
    if (known != contexts_.end()) return known->second.chain;
    attaching = r.position > 0 ? ChainTo(r.attach_hash) : std::vector<uint64_t>{};
    return attaching;
  };

  // Publishes extend their request's chain one block at a time, inside its context.
  std::unordered_map<uint64_t, std::vector<uint64_t>> grown;
  std::unordered_set<uint64_t> published;
  for (const PrefixPublish& p : plan.publishes) {
    if (p.memory_rank != memory_rank) continue;
    const std::string what = absl::StrCat("publish of block ", Hex(p.block_hash), ": ");
    if (!registry) return bad(what, "this rank has no prefix registry");
    auto r = by_id.find(p.request_id);
    if (r == by_id.end())
      return bad(what, "request ", p.request_id, " has no rows on this rank in this step");
    auto [chain, fresh] = grown.try_emplace(p.request_id);
    if (fresh) chain->second = chain_of(*r->second);
    if (p.block_index != static_cast<int64_t>(chain->second.size())) {
      return bad(what, "block_index ", p.block_index, " but request ", p.request_id, " holds ",
                 chain->second.size(), " registered blocks");
    }
    if (!chain->second.empty() && p.parent_hash != chain->second.back()) {
      return bad(what, "parent ", Hex(p.parent_hash), " is not the last block of request ", p.request_id);
    }
    if ((static_cast<int64_t>(p.block_index) + 1) * block_tokens_ > r->second->kv_len) {
      return bad(what, "block ", p.block_index, " ends past request ", p.request_id, "'s context of ",
                 r->second->kv_len, " tokens");
    }
    if (registered(p.block_hash) || !published.insert(p.block_hash).second) {
      return bad(what, "already registered");
    }
    chain->second.push_back(p.block_hash);
  }

  // Groups: registered before this step, nested along one chain, held by their members.
  for (size_t g = 0; g < plan.groups.size(); ++g) {
    const PrefixGroup& grp = plan.groups[g];
    if (grp.memory_rank != memory_rank) continue;
    const std::string what = absl::StrCat("group ", g, ": ");
    if (!registry) return bad(what, "this rank has no prefix registry");
    if (!registered(grp.block_hash)) return bad(what, "block ", Hex(grp.block_hash), " is not registered");
    const int32_t depth = blocks_.at(grp.block_hash).depth;
    if (depth * block_tokens_ != grp.prefix_tokens) {
      return bad(what, "prefix_tokens ", grp.prefix_tokens, " but its block ends at token ",
                 depth * block_tokens_);
    }
    if (grp.parent >= 0) {
      const PrefixGroup& parent = plan.groups[static_cast<size_t>(grp.parent)];
      const int64_t parent_depth = parent.prefix_tokens / block_tokens_;
      if (ChainTo(grp.block_hash)[static_cast<size_t>(parent_depth - 1)] != parent.block_hash) {
        return bad(what, "its parent group ", grp.parent, " is not a prefix of it");
      }
    }
  }
  for (const StepRequest* r : *mine) {
    if (r->prefix_group < 0) continue;
    const PrefixGroup& grp = plan.groups[static_cast<size_t>(r->prefix_group)];
    const std::string who = absl::StrCat("request ", r->request_id, ": group ", r->prefix_group, ": ");
    if (grp.memory_rank != memory_rank) return bad(who, "belongs to memory rank ", grp.memory_rank);
    if (r->position < grp.prefix_tokens) {
      return bad(who, "prefix of ", grp.prefix_tokens, " tokens overlaps the rows from position ",
                 r->position);
    }
    const std::vector<uint64_t>& chain = chain_of(*r);
    const size_t depth = static_cast<size_t>(grp.prefix_tokens / block_tokens_);
    if (chain.size() < depth || chain[depth - 1] != grp.block_hash) {
      return bad(who, "the request does not hold block ", Hex(grp.block_hash));
    }
  }
  return absl::OkStatus();
}

absl::Status KvTable::Apply(const StepPlan& plan, uint16_t memory_rank, AttentionBatch* batch,
                            std::vector<uint64_t>* failed_restores) {
  batch->Clear();
  // Check everything first: nothing may change if the step is refused.
  std::vector<const StepRequest*> mine;
  RETURN_IF_ERROR(Check(plan, memory_rank, &mine));

  if (tiers_ != nullptr && plan.micro_batch == 0) {
    // The plan's own restores are used now (position 0): its evictions must not push them out.
    std::vector<KvTierNextUse> uses;
    for (const PrefixRestore& e : plan.restores) {
      if (e.memory_rank == memory_rank) uses.push_back({.hash = e.block_hash, .next_use = 0});
    }
    for (const PrefixNextUse& u : plan.next_uses) {
      if (u.memory_rank == memory_rank) uses.push_back({.hash = u.block_hash, .next_use = u.next_use});
    }
    tiers_->SetNextUse(uses);
  }
  for (const PrefixEvict& e : plan.evictions) {
    if (e.memory_rank != memory_rank) continue;
    auto it = blocks_.find(e.block_hash);
    if (tiers_ != nullptr)
      tiers_->Demote(e.block_hash, it->second.parent, it->second.depth, it->second.slots, e.tokens);
    allocator_.Release(it->second.slots);
    if (it->second.depth > 1) --blocks_.at(it->second.parent).num_children;
    blocks_.erase(it);
  }
  std::unordered_set<uint64_t> failed;
  for (const PrefixRestore& e : plan.restores) {
    if (e.memory_rank != memory_rank) continue;
    Block b;
    b.parent = e.parent_hash;
    b.depth = e.block_index + 1;
    TANDEM_CHECK(allocator_.Allocate(block_tokens_, &b.slots).ok());  // counted in Check
    const bool ok = (e.block_index == 0 || !failed.contains(e.parent_hash)) &&
                    (e.segments.empty() ? tiers_->Restore(e.block_hash, e.parent_hash, b.depth, b.slots)
                                        : RestoreShifted(e, b.slots));
    if (!ok) {
      allocator_.Release(b.slots);
      failed.insert(e.block_hash);
      if (failed_restores != nullptr) failed_restores->push_back(e.block_hash);
      continue;
    }
    if (e.block_index > 0) ++blocks_.at(e.parent_hash).num_children;
    blocks_.emplace(e.block_hash, std::move(b));
  }
  for (const StepRequest* r : mine) {
    auto [it, fresh] = contexts_.try_emplace(r->request_id);
    Context& c = it->second;
    if (fresh && r->position > 0) {  // attach: the chain's slots become the context's start
      c.chain = ChainTo(r->attach_hash);
      for (uint64_t h : c.chain) {
        Block& b = blocks_.at(h);
        ++b.users;
        c.slots.insert(c.slots.end(), b.slots.begin(), b.slots.end());
      }
      allocator_.Retain(c.slots);
    }
    const size_t start = c.slots.size();
    // Cannot fail: the total was checked against the free count above.
    TANDEM_CHECK(allocator_.Allocate(r->q_len, &c.slots).ok());
    batch->new_slots.insert(batch->new_slots.end(), c.slots.begin() + static_cast<std::ptrdiff_t>(start),
                            c.slots.end());
    batch->q_indptr.push_back(batch->q_indptr.back() + r->q_len);
    if (r->q_len == 1) ++batch->num_single;
    batch->max_q_len = std::max<int64_t>(batch->max_q_len, r->q_len);
  }
  for (const PrefixPublish& p : plan.publishes) {
    if (p.memory_rank != memory_rank) continue;
    Context& c = contexts_.at(p.request_id);
    Block b;
    b.parent = p.parent_hash;
    b.depth = p.block_index + 1;
    b.users = 1;
    const auto first = c.slots.begin() + static_cast<std::ptrdiff_t>(p.block_index * block_tokens_);
    b.slots.assign(first, first + static_cast<std::ptrdiff_t>(block_tokens_));
    allocator_.Retain(b.slots);
    if (p.block_index > 0) ++blocks_.at(p.parent_hash).num_children;
    blocks_.emplace(p.block_hash, std::move(b));
    c.chain.push_back(p.block_hash);
  }
  BuildGroups(plan, memory_rank, mine, batch);
  return absl::OkStatus();
}

void KvTable::BuildGroups(const StepPlan& plan, uint16_t memory_rank,
                          const std::vector<const StepRequest*>& mine, AttentionBatch* batch) const {
  // Plan groups of this rank: their rows (members and members of nested groups) and whether each
  // takes the cascade path. A refused group's rows stay with its nearest taken ancestor.
  const size_t num_plan_groups = plan.groups.size();
  std::vector<std::vector<int32_t>> rows(num_plan_groups);
  std::vector<const StepRequest*> member(num_plan_groups, nullptr);  // any one: all hold the blocks
  if (sharing_ != PrefixSharing::kOff) {
    int32_t row = 0;
    for (const StepRequest* r : mine) {
      for (int32_t g = r->prefix_group; g >= 0; g = plan.groups[static_cast<size_t>(g)].parent) {
        for (int32_t i = 0; i < r->q_len; ++i) rows[static_cast<size_t>(g)].push_back(row + i);
        if (member[static_cast<size_t>(g)] == nullptr) member[static_cast<size_t>(g)] = r;
      }
      row += r->q_len;
    }
  }
  std::vector<int32_t> emitted(num_plan_groups, -1);  // batch group of a taken plan group
  std::vector<int32_t> taken_ancestor(num_plan_groups, -1);
  for (size_t g = 0; g < num_plan_groups; ++g) {
    const PrefixGroup& grp = plan.groups[g];
    if (grp.memory_rank != memory_rank || rows[g].empty()) continue;
    const int32_t parent = grp.parent;
    const int32_t anc = parent < 0 ? -1
                                   : (emitted[static_cast<size_t>(parent)] >= 0
                                          ? parent
                                          : taken_ancestor[static_cast<size_t>(parent)]);
    taken_ancestor[g] = anc;
    const int32_t start = anc < 0 ? 0 : plan.groups[static_cast<size_t>(anc)].prefix_tokens;
    const int64_t own = grp.prefix_tokens - start;
    const int64_t n = static_cast<int64_t>(rows[g].size());
    if (sharing_ == PrefixSharing::kAuto && !(filter_ && filter_(n, own))) continue;
    emitted[g] = static_cast<int32_t>(batch->group_parent.size());
    batch->group_parent.push_back(anc < 0 ? -1 : emitted[static_cast<size_t>(anc)]);
    batch->group_level.push_back(
        anc < 0 ? 0 : batch->group_level[static_cast<size_t>(emitted[static_cast<size_t>(anc)])] + 1);
    batch->group_rows.insert(batch->group_rows.end(), rows[g].begin(), rows[g].end());
    batch->group_row_indptr.push_back(static_cast<int32_t>(batch->group_rows.size()));
    batch->max_group_rows = std::max(batch->max_group_rows, n);
    batch->max_group_kv = std::max(batch->max_group_kv, own);
    // Its own keys: positions [start, prefix_tokens) of any member's context.
    const std::vector<int32_t>& slots = contexts_.at(member[g]->request_id).slots;
    batch->group_kv_slots.insert(batch->group_kv_slots.end(), slots.begin() + start,
                                 slots.begin() + grp.prefix_tokens);
    batch->group_kv_indptr.push_back(static_cast<int32_t>(batch->group_kv_slots.size()));
  }
  // Each request's own keys start after its deepest taken group (none taken: its whole context).
  std::vector<int32_t> suffix_start(mine.size(), 0);
  for (size_t i = 0; i < mine.size(); ++i) {
    int32_t g = mine[i]->prefix_group;
    if (g >= 0 && emitted[static_cast<size_t>(g)] < 0) g = taken_ancestor[static_cast<size_t>(g)];
    if (g >= 0) suffix_start[i] = plan.groups[static_cast<size_t>(g)].prefix_tokens;
  }
  for (size_t i = 0; i < mine.size(); ++i) {
    const std::vector<int32_t>& slots = contexts_.at(mine[i]->request_id).slots;
    batch->kv_slots.insert(batch->kv_slots.end(), slots.begin() + suffix_start[i], slots.end());
    batch->kv_indptr.push_back(static_cast<int32_t>(batch->kv_slots.size()));
    batch->max_kv_len =
        std::max<int64_t>(batch->max_kv_len, static_cast<int64_t>(slots.size()) - suffix_start[i]);
  }
}

void KvTable::SaveRegistered(const std::function<std::span<const int32_t>(uint64_t hash)>& tokens_of) {
  if (tiers_ == nullptr) return;
  std::vector<std::pair<int32_t, uint64_t>> order;  // (depth, hash)
  order.reserve(blocks_.size());
  for (const auto& [hash, b] : blocks_) order.emplace_back(b.depth, hash);
  std::sort(order.begin(), order.end());
  for (const auto& [depth, hash] : order) {
    const Block& b = blocks_.at(hash);
    tiers_->Demote(hash, depth > 1 ? b.parent : 0, depth, b.slots, tokens_of(hash));
  }
}

void KvTable::Release(std::span<const uint64_t> request_ids) {
  for (uint64_t id : request_ids) {
    auto it = contexts_.find(id);
    if (it == contexts_.end()) continue;
    for (uint64_t h : it->second.chain) --blocks_.at(h).users;
    allocator_.Release(it->second.slots);
    contexts_.erase(it);
  }
}

int64_t KvTable::context_length(uint64_t request_id) const {
  auto it = contexts_.find(request_id);
  return it == contexts_.end() ? 0 : static_cast<int64_t>(it->second.slots.size());
}

bool KvTable::RestoreShifted(const PrefixRestore& restore, std::span<const int32_t> slots) {
  std::vector<KvShiftedSource> sources;
  for (const PrefixSegment& g : restore.segments) {
    KvShiftedSource src{
        .hash = g.source_hash, .source_index = g.source_index, .row = g.source_row, .rows = g.rows};
    // In the pool (registered before the plan, or restored earlier in it) at the depth the plan
    // names; else the tiers' copy.
    auto it = blocks_.find(g.source_hash);
    if (it != blocks_.end() && it->second.depth == g.source_index + 1)
      src.pool_slots = std::span(it->second.slots).subspan(g.source_row, g.rows);
    sources.push_back(src);
  }
  return tiers_->RestoreShifted(sources, slots, static_cast<int64_t>(restore.block_index) * block_tokens_);
}

}  // namespace tandem
