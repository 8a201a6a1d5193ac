// KV tiers (memory_node/kv_tier_store.h, memory_node/kv_tiers.h): the store's host and disk tiers,
// its checks of what it reads back, and the colocated engine over a tiny KV pool, whose
// conversations must get the same tokens with tiers on and off, whatever happens to the files.
#include "memory_node/kv_tiers.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "colocated/engine.h"
#include "gtest/gtest.h"
#include "memory_node/kv_tier_store.h"
#include "server/metrics.h"
#include "unit/kv_layers_in_pool.h"
#include "unit/shifted_restore_check.h"
#include "unit/truncated_conversations.h"

namespace tandem {
namespace {

namespace fs = std::filesystem;
using testing_tiers::TruncatedConversations;
using testing_tiers::TruncatedRun;

// This process's directory under gtest's temporary directory (TEST_TMPDIR, TMPDIR or /tmp),
// removed when the tests end.
const fs::path& TempRoot() {
  static const fs::path root =
      fs::path(::testing::TempDir()) / ("tandem_kv_tiers_" + std::to_string(::getpid()));
  return root;
}

class RemoveTempRoot : public ::testing::Environment {
 public:
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(TempRoot(), ec);
  }
};
[[maybe_unused]] ::testing::Environment* const kRemoveTempRoot =
    ::testing::AddGlobalTestEnvironment(new RemoveTempRoot);

// A fresh directory under TempRoot().
std::string TempDir(const std::string& name) {
  const fs::path dir = TempRoot() / name;
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir.string();
}

std::vector<uint8_t> Bytes(int64_t n, uint8_t seed) {
  std::vector<uint8_t> v(static_cast<size_t>(n));
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<uint8_t>(seed * 31 + i * 7);
  return v;
}

std::vector<fs::path> BlockFiles(const std::string& dir) {
  std::vector<fs::path> files;
  for (const auto& e : fs::recursive_directory_iterator(dir))
    if (e.path().extension() == ".kvb") files.push_back(e.path());
  return files;
}

TEST(KvTierStore, HostTierKeepsTheMostRecentlyUsedBlocks) {
  auto store = KvTierStore::Create({.host_bytes = 300}, 1, 100);
  ASSERT_TRUE(store.ok()) << store.status();
  for (uint8_t i = 1; i <= 4; ++i) (*store)->Save({.hash = i, .parent_hash = 0, .depth = 1}, Bytes(100, i));
  std::vector<uint8_t> out(100);
  KvTierBlock b;
  EXPECT_TRUE(absl::IsNotFound((*store)->Load(1, &b, out).status()));  // the least recently used went
  for (uint8_t i = 2; i <= 4; ++i) {
    absl::StatusOr<int> tier = (*store)->Load(i, &b, out);
    ASSERT_TRUE(tier.ok()) << tier.status();
    EXPECT_EQ(*tier, 1);
    EXPECT_EQ(out, Bytes(100, i));
  }
  const KvTierStats s = (*store)->stats();
  EXPECT_EQ(s.host_evictions, 1);
  EXPECT_EQ(s.host_hits, 3);
  EXPECT_EQ(s.misses, 1);
  EXPECT_EQ(s.bytes_to_host, 400);
}

// kv.tiers.eviction, randomized over saves, loads and next-use lists, for the host tier and for the
// disk tier (its writes flushed after each save): whenever a full tier lets a block go (one it held,
// or the new block it did not take), next_use never lets a wanted block go while an unwanted one
// is there (counting the new block), takes the least recently used unwanted block first, and
// among wanted ones the farthest use (least recently used among equals); lru takes the least
// recently used, whatever is wanted.
void CheckEvictionOrder(KvTierEviction eviction, bool disk, uint32_t seed) {
  constexpr int64_t kBlockBytes = 100;
  constexpr int kSlots = 6;      // blocks a tier holds
  constexpr int kUniverse = 24;  // distinct block hashes
  const int64_t file_bytes = static_cast<int64_t>(kKvBlockHeaderBytes) + kBlockBytes;
  KvTierOptions o{.eviction = eviction};
  if (disk) {
    o.disk_dir = TempDir(absl::StrCat("eviction_order_", seed));
    o.disk_bytes = kSlots * file_bytes;
  } else {
    o.host_bytes = kSlots * kBlockBytes;
  }
  auto store = KvTierStore::Create(o, 3, kBlockBytes);
  ASSERT_TRUE(store.ok()) << store.status();
  KvTierStore& st = **store;
  auto held = [&](uint64_t h) { return disk ? st.OnDisk(h) : st.InHost(h); };
  std::mt19937 rng(seed);
  auto rnd = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  std::map<uint64_t, int64_t> used;  // the model's last use of each held block
  std::map<uint64_t, int32_t> wanted;
  int64_t tick = 0, let_go = 0, wanted_let_go = 0;
  for (int op = 0; op < 3000; ++op) {
    if (rnd(0, 9) == 0) {  // a new next-use list
      wanted.clear();
      std::vector<KvTierNextUse> uses;
      for (int k = rnd(0, 12); k > 0; --k) {
        const uint64_t h = static_cast<uint64_t>(rnd(1, kUniverse));
        const int32_t use = rnd(0, 9);
        uses.push_back({.hash = h, .next_use = use});
        auto [it, added] = wanted.emplace(h, use);
        if (!added) it->second = std::min(it->second, use);
      }
      st.SetNextUse(uses);
      if (eviction == KvTierEviction::kLru) wanted.clear();  // ignored
      continue;
    }
    const uint64_t h = static_cast<uint64_t>(rnd(1, kUniverse));
    if (rnd(0, 3) == 0) {  // a load: a hit makes the block the most recently used
      std::vector<uint8_t> out(kBlockBytes);
      KvTierBlock b;
      const bool hit = st.Load(h, &b, out).ok();
      EXPECT_EQ(hit, used.contains(h)) << "op " << op;
      if (hit) used[h] = ++tick;
      continue;
    }
    const std::map<uint64_t, int64_t> before = used;
    st.Save({.hash = h, .parent_hash = 0, .depth = 1}, Bytes(kBlockBytes, static_cast<uint8_t>(h)));
    if (disk) st.Flush();
    std::vector<uint64_t> gone;
    for (const auto& [b, t] : before)
      if (!held(b)) gone.push_back(b);
    const bool taken = held(h);
    if (before.contains(h)) {
      EXPECT_TRUE(taken && gone.empty()) << "op " << op << ": saving a held block changed the tier";
      used[h] = ++tick;
      continue;
    }
    ASSERT_LE(gone.size(), 1u) << "op " << op;
    if (!taken) {
      ASSERT_TRUE(gone.empty()) << "op " << op << ": a block went and the new one was not taken";
    }
    if (gone.empty() && taken) {  // room was free
      EXPECT_LT(before.size(), static_cast<size_t>(kSlots)) << "op " << op;
      used[h] = ++tick;
      continue;
    }
    ++let_go;
    // The candidates: every held block, and the new one (most recently used).
    const uint64_t victim = taken ? gone[0] : h;
    std::map<uint64_t, int64_t> all = before;
    all[h] = tick + 1;
    auto use_of = [&](uint64_t b) { return wanted.contains(b) ? wanted.at(b) : -1; };
    // Expected: the oldest unwanted; else the farthest use, oldest among equals.
    uint64_t expect = 0;
    for (const auto& [b, t] : all) {
      if (expect == 0) {
        expect = b;
        continue;
      }
      const int32_t ub = use_of(b), ue = use_of(expect);
      const bool better = (ub < 0) != (ue < 0) ? ub < 0 : (ub != ue ? ub > ue : t < all.at(expect));
      if (better) expect = b;
    }
    EXPECT_EQ(victim, expect) << "op " << op << ": use " << use_of(victim) << " went instead of use "
                              << use_of(expect);
    wanted_let_go += use_of(victim) >= 0;
    if (taken) {
      used.erase(victim);
      used[h] = ++tick;
    }
    if (::testing::Test::HasFailure()) return;
  }
  EXPECT_GT(let_go, 100) << "the tier was seldom full";
  if (eviction == KvTierEviction::kNextUse) {
    EXPECT_GT(wanted_let_go, 0) << "never full of wanted blocks";
  }
}

TEST(KvTierStore, NextUseEvictionOrderRandomized) {
  for (uint32_t seed : {1u, 2u, 3u}) {
    for (bool disk : {false, true}) {
      for (KvTierEviction e : {KvTierEviction::kNextUse, KvTierEviction::kLru}) {
        SCOPED_TRACE(absl::StrCat("seed ", seed, disk ? " disk" : " host",
                                  e == KvTierEviction::kLru ? " lru" : " next_use"));
        CheckEvictionOrder(e, disk, seed);
      }
    }
  }
  EXPECT_EQ(ParseKvTierEviction("lru").value(), KvTierEviction::kLru);
  EXPECT_EQ(ParseKvTierEviction("next_use").value(), KvTierEviction::kNextUse);
  EXPECT_NE(ParseKvTierEviction("fifo").status().message().find("kv.tiers.eviction"), std::string_view::npos);
}

TEST(KvTierStore, DiskTierWritesOnceAndReadsBack) {
  const std::string dir = TempDir("disk");
  auto store = KvTierStore::Create({.host_bytes = 0, .disk_dir = dir, .disk_bytes = 10000}, 7, 100);
  ASSERT_TRUE(store.ok()) << store.status();
  (*store)->Save({.hash = 0xabc, .parent_hash = 0x12, .depth = 3}, Bytes(100, 5));
  (*store)->Save({.hash = 0xabc, .parent_hash = 0x12, .depth = 3}, Bytes(100, 5));
  (*store)->Flush();
  EXPECT_EQ(BlockFiles(dir).size(), 1u);
  EXPECT_EQ((*store)->stats().bytes_to_disk, 164);  // once: header + payload
  std::vector<uint8_t> out(100);
  KvTierBlock b;
  absl::StatusOr<int> tier = (*store)->Load(0xabc, &b, out);
  ASSERT_TRUE(tier.ok()) << tier.status();
  EXPECT_EQ(*tier, 2);
  EXPECT_EQ(out, Bytes(100, 5));
  EXPECT_EQ(b.parent_hash, 0x12u);
  EXPECT_EQ(b.depth, 3);
  store->reset();
  EXPECT_TRUE(BlockFiles(dir).empty()) << "without persist the files go with the store";
}

// Each way a file can go bad: the load refuses it, says so, and the file is gone.
TEST(KvTierStore, BadFilesAreDiscardedNeverReturned) {
  struct Case {
    const char* name;
    std::function<void(const fs::path&)> damage;
  };
  const std::vector<Case> cases = {
      {"payload byte flipped",
       [](const fs::path& p) {
         std::fstream f(p, std::ios::in | std::ios::out | std::ios::binary);
         f.seekp(64 + 50);
         f.put('\x5a');
       }},
      {"truncated", [](const fs::path& p) { fs::resize_file(p, 64 + 20); }},
      {"header byte flipped",
       [](const fs::path& p) {
         std::fstream f(p, std::ios::in | std::ios::out | std::ios::binary);
         f.seekp(33);
         f.put('\x7f');
       }},
      {"removed", [](const fs::path& p) { fs::remove(p); }},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const std::string dir = TempDir("bad");
    auto store = KvTierStore::Create({.disk_dir = dir, .disk_bytes = 10000}, 7, 100);
    ASSERT_TRUE(store.ok()) << store.status();
    (*store)->Save({.hash = 0x99, .parent_hash = 0, .depth = 1}, Bytes(100, 9));
    (*store)->Flush();
    c.damage((*store)->FilePath(0x99));
    std::vector<uint8_t> out(100);
    KvTierBlock b;
    EXPECT_TRUE(absl::IsNotFound((*store)->Load(0x99, &b, out).status()));
    EXPECT_FALSE((*store)->Contains(0x99));
    EXPECT_FALSE(fs::exists((*store)->FilePath(0x99)));
  }
}

TEST(KvTierStore, ForeignFilesAreRefusedAndPersistedOnesReindexed) {
  const std::string dir = TempDir("persist");
  {
    auto store = KvTierStore::Create({.disk_dir = dir, .disk_bytes = 10000, .persist = true}, 7, 100);
    ASSERT_TRUE(store.ok()) << store.status();
    (*store)->Save({.hash = 0x1, .parent_hash = 0, .depth = 1}, Bytes(100, 1));
    (*store)->Save({.hash = 0x2, .parent_hash = 0x1, .depth = 2}, Bytes(100, 2));
    (*store)->Flush();
  }
  std::ofstream(fs::path(dir) / "00000000000000ff.kvb.tmp") << "a write that never finished";
  {
    // Another model (fingerprint): its files are discarded when it opens the directory.
    auto other = KvTierStore::Create({.disk_dir = dir, .disk_bytes = 10000, .persist = true}, 8, 100);
    ASSERT_TRUE(other.ok()) << other.status();
    EXPECT_TRUE((*other)->PersistedBlocks().empty());
    EXPECT_EQ((*other)->stats().discarded, 2);
    EXPECT_TRUE(BlockFiles(dir).empty());
  }
  auto store = KvTierStore::Create({.disk_dir = dir, .disk_bytes = 10000, .persist = true}, 7, 100);
  ASSERT_TRUE(store.ok()) << store.status();
  (*store)->Save({.hash = 0x3, .parent_hash = 0, .depth = 1}, Bytes(100, 3));
  (*store)->Flush();
  store->reset();
  auto again = KvTierStore::Create({.disk_dir = dir, .disk_bytes = 10000, .persist = true}, 7, 100);
  ASSERT_TRUE(again.ok()) << again.status();
  ASSERT_EQ((*again)->PersistedBlocks().size(), 1u);
  std::vector<uint8_t> out(100);
  KvTierBlock b;
  ASSERT_TRUE((*again)->Load(0x3, &b, out).ok());
  EXPECT_EQ(out, Bytes(100, 3));
  EXPECT_FALSE(fs::exists(fs::path(dir) / "00000000000000ff.kvb.tmp"));
}

TEST(KvTierStore, PersistedFilesKeepTheirTokensAndBadOnesAreCountedAtStart) {
  const std::string dir = TempDir("persist_tokens");
  const KvTierOptions persist{.disk_dir = dir, .disk_bytes = 10000, .persist = true};
  {
    auto store = KvTierStore::Create(persist, 7, 100);
    ASSERT_TRUE(store.ok()) << store.status();
    for (uint8_t i = 1; i <= 5; ++i) {
      (*store)->Save({.hash = i, .parent_hash = i > 1 ? i - 1u : 0u, .depth = i, .tokens = {i, 2 * i, 3 * i}},
                     Bytes(100, i));
    }
    (*store)->Flush();
  }
  const auto file = [&](uint64_t hash) { return fs::path(dir) / absl::StrFormat("%016x.kvb", hash); };
  fs::resize_file(file(2), 64 + 6);  // truncated inside its tokens
  {
    std::fstream f(file(3), std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(64 + 1);  // a token byte: caught by the tokens' checksum at start
    f.put('\x7f');
  }
  {
    std::fstream f(file(4), std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(4);  // format version 1
    f.put('\x01');
  }
  auto again = KvTierStore::Create(persist, 7, 100);
  ASSERT_TRUE(again.ok()) << again.status();
  const std::vector<KvTierBlock>& found = (*again)->PersistedBlocks();
  ASSERT_EQ(found.size(), 2u);
  EXPECT_EQ(found[0].hash, 1u);
  EXPECT_EQ(found[0].tokens, (std::vector<int32_t>{1, 2, 3}));
  EXPECT_EQ(found[1].hash, 5u);
  EXPECT_EQ(found[1].parent_hash, 4u);
  EXPECT_EQ(found[1].depth, 5);
  EXPECT_EQ(found[1].tokens, (std::vector<int32_t>{5, 10, 15}));
  EXPECT_EQ((*again)->stats().discarded, 3);
  EXPECT_EQ((*again)->stats().reindexed, 2);
  EXPECT_EQ(BlockFiles(dir).size(), 2u);
  std::vector<uint8_t> out(100);
  KvTierBlock b;
  ASSERT_TRUE((*again)->Load(5, &b, out).ok());
  EXPECT_EQ(out, Bytes(100, 5));
  EXPECT_EQ(b.tokens, (std::vector<int32_t>{5, 10, 15}));
  again->reset();
  // Without persist, a store that opens the directory empties it of block files (only).
  std::ofstream(fs::path(dir) / "notes.txt") << "not a block file";
  auto scratch = KvTierStore::Create({.disk_dir = dir, .disk_bytes = 10000}, 7, 100);
  ASSERT_TRUE(scratch.ok()) << scratch.status();
  EXPECT_TRUE(BlockFiles(dir).empty());
  EXPECT_TRUE((*scratch)->PersistedBlocks().empty());
  EXPECT_TRUE(fs::exists(fs::path(dir) / "notes.txt"));
}

// Without a host tier, a block whose file is not written yet is served from the queued copy (a
// restore right after an eviction must not miss).
TEST(KvTierStore, BlocksOnTheirWayToDiskAreServed) {
  const std::string dir = TempDir("queued");
  constexpr int64_t kBytes = 256 << 10;
  auto store = KvTierStore::Create({.disk_dir = dir, .disk_bytes = 64 * (kBytes + 64)}, 7, kBytes);
  ASSERT_TRUE(store.ok()) << store.status();
  for (uint8_t i = 1; i <= 40; ++i)
    (*store)->Save({.hash = i, .parent_hash = 0, .depth = 1}, Bytes(kBytes, i));
  std::vector<uint8_t> out(kBytes);
  KvTierBlock b;
  absl::StatusOr<int> tier = (*store)->Load(40, &b, out);  // 39 files to write before its own
  ASSERT_TRUE(tier.ok()) << tier.status();
  EXPECT_EQ(out, Bytes(kBytes, 40));
  (*store)->Flush();
  tier = (*store)->Load(40, &b, out);
  ASSERT_TRUE(tier.ok()) << tier.status();
  EXPECT_EQ(*tier, 2);
  EXPECT_EQ(out, Bytes(kBytes, 40));
  EXPECT_EQ((*store)->stats().misses, 0);
}

TEST(KvTierStore, DiskBudgetEvictsLeastRecentlyUsedFiles) {
  const std::string dir = TempDir("budget");
  auto store = KvTierStore::Create({.disk_dir = dir, .disk_bytes = 2 * 164}, 7, 100);
  ASSERT_TRUE(store.ok()) << store.status();
  for (uint8_t i = 1; i <= 3; ++i) {
    (*store)->Save({.hash = i, .parent_hash = 0, .depth = 1}, Bytes(100, i));
    (*store)->Flush();
  }
  EXPECT_EQ(BlockFiles(dir).size(), 2u);
  EXPECT_FALSE((*store)->Contains(1));
  EXPECT_EQ((*store)->stats().disk_evictions, 1);
}

TEST(KvTierStore, SettingsAreCheckedAgainstTheMachine) {
  EXPECT_NE(CheckKvTierOptions({.host_bytes = int64_t{1} << 50}).message().find("kv.tiers.host_bytes"),
            std::string_view::npos);
  EXPECT_NE(CheckKvTierOptions({.disk_bytes = 10}).message().find("kv.tiers.disk_dir"),
            std::string_view::npos);
  const std::string dir = TempDir("check");
  EXPECT_NE(CheckKvTierOptions({.disk_dir = dir, .disk_bytes = int64_t{1} << 50})
                .message()
                .find("kv.tiers.disk_bytes"),
            std::string_view::npos);
  EXPECT_TRUE(CheckKvTierOptions({.host_bytes = 1 << 20, .disk_dir = dir, .disk_bytes = 1 << 20}).ok());
}

// Layer-wise restore (memory_node/kv_tiers.h): Restore puts nothing in the pool yet, RestoreLayer(l)
// copies layers up to l, FinishRestores the rest; whole-block restore copies everything at once.
TEST(KvTiersLayerwise, EachLayerReachesThePoolWhenAsked) {
  const AttentionShape shape{
      .num_layers = 3, .num_heads = 2, .num_kv_heads = 2, .head_dim = 4, .max_tokens = 8, .max_requests = 1};
  absl::StatusOr<std::unique_ptr<AttentionExecutor>> exec =
      CreateCpuAttentionExecutor(shape, {.capacity_tokens = 32});
  ASSERT_TRUE(exec.ok()) << exec.status();
  constexpr int64_t kTokens = 4;
  const std::vector<int32_t> slots = {3, 9, 4, 20};
  const size_t layer_bytes = 2 * kTokens * shape.kv_dim() * sizeof(float);  // K then V rows
  const std::vector<uint8_t> kv = Bytes(static_cast<int64_t>(3 * layer_bytes), 7);
  const std::vector<uint8_t> garbage(kv.size(), 0xEE);
  for (const bool layerwise : {true, false}) {
    SCOPED_TRACE(layerwise ? "layer-wise" : "whole");
    absl::StatusOr<std::unique_ptr<KvTiers>> tiers =
        KvTiers::Create({.host_bytes = 1 << 20}, exec->get(), kTokens, "m");
    ASSERT_TRUE(tiers.ok()) << tiers.status();
    (*tiers)->set_layerwise(layerwise);
    ASSERT_TRUE((*exec)->WriteSlots(slots, kv.data()).ok());
    (*tiers)->Demote(1, 0, 1, slots, {});
    ASSERT_TRUE((*exec)->WriteSlots(slots, garbage.data()).ok());
    ASSERT_TRUE((*tiers)->Restore(1, 0, 1, slots));
    std::vector<uint8_t> pool(kv.size());
    // How many leading layers of the pool hold the block's KV (the rest must still be garbage).
    auto layers_in_pool = [&] { return testing_tiers::LayersInPool(**exec, slots, kv, garbage, 3, &pool); };
    EXPECT_EQ(layers_in_pool(), layerwise ? 0 : 3);
    ASSERT_TRUE((*tiers)->RestoreLayer(0).ok());
    EXPECT_EQ(layers_in_pool(), layerwise ? 1 : 3);
    ASSERT_TRUE((*tiers)->RestoreLayer(0).ok());  // a second lane: nothing more
    ASSERT_TRUE((*tiers)->RestoreLayer(1).ok());
    EXPECT_EQ(layers_in_pool(), layerwise ? 2 : 3);
    ASSERT_TRUE((*tiers)->FinishRestores().ok());
    EXPECT_EQ(layers_in_pool(), 3);
    EXPECT_EQ(pool, kv);
    EXPECT_GT((*tiers)->restore_seconds(), 0);
    EXPECT_LE((*tiers)->restore_stall_seconds(), (*tiers)->restore_seconds());
  }
}

// kv.store_pre_rope: a block assembled from turned rows of a pooled and a demoted block (fp32 pool).
TEST(KvTiersShifted, TurnedRowsComeFromThePoolAndTheHostTier) {
  const AttentionShape shape{
      .num_layers = 2, .num_heads = 4, .num_kv_heads = 2, .head_dim = 16, .max_tokens = 8, .max_requests = 1};
  absl::StatusOr<std::unique_ptr<AttentionExecutor>> exec =
      CreateCpuAttentionExecutor(shape, {.capacity_tokens = 32});
  ASSERT_TRUE(exec.ok()) << exec.status();
  testing_tiers::CheckShiftedRestore(**exec);
}

// --- The colocated engine over a pool that holds about one conversation ---

constexpr int64_t kBlock = 8;

struct Tiers {
  int64_t host_bytes = 0;
  int64_t disk_bytes = 0;
  std::string dir;
  bool persist = false;
  int64_t prefetch = 8;               // kv.tiers.prefetch_lookahead
  int64_t batch = 2;                  // scheduler.max_batch_size
  std::string eviction = "next_use";  // kv.tiers.eviction
  bool pre_rope = false;              // kv.store_pre_rope
};

std::unique_ptr<ColocatedEngine> MakeEngine(const WeightSource& w, bool cache, const Tiers& t) {
  EngineOptions o;
  o.device = "cpu";
  o.max_batch_size = t.batch;
  o.max_tokens_per_step = 64;
  o.kv_capacity_tokens = 160;
  o.prefix_cache = cache;
  o.prefix_block_tokens = kBlock;
  o.tiers_host_bytes = t.host_bytes;
  o.tiers_disk_bytes = t.disk_bytes;
  o.tiers_disk_dir = t.dir;
  o.tiers_persist = t.persist;
  o.tiers_prefetch_lookahead = t.prefetch;
  o.tiers_eviction = t.eviction;
  o.store_pre_rope = t.pre_rope;
  absl::StatusOr<std::unique_ptr<ColocatedEngine>> e = ColocatedEngine::Create(w, o);
  EXPECT_TRUE(e.ok()) << e.status();
  return std::move(*e);
}

// Three conversations of four turns, interleaved: each turn's prompt is the conversation's history
// (prompts and answers) plus a new message; all greedy.
struct Conversations {
  std::vector<std::vector<int32_t>> history = std::vector<std::vector<int32_t>>(3);
  uint32_t x = 777;
  // The next pseudo-random token in [2, vocab).
  int32_t Next(int64_t vocab) {
    x = x * 1664525u + 1013904223u;
    return static_cast<int32_t>(2 + (x >> 8) % static_cast<uint32_t>(vocab - 2));
  }
  // Request a turn of `history` (its next 13 tokens appended): 9 tokens, EOS ignored.
  GenerationRequest Turn(std::vector<int32_t>& h, int64_t vocab) {
    for (int i = 0; i < 13; ++i) h.push_back(Next(vocab));
    GenerationRequest r;
    r.prompt = h;
    r.max_tokens = 9;
    r.ignore_eos = true;
    return r;
  }
};

// Runs turns [from, to) of `c` on `e`. Before each turn, `between` may damage the tiers. Returns
// every answer in order.
std::vector<std::vector<int32_t>> Turns(ColocatedEngine& e, int64_t vocab, Conversations& c, int from, int to,
                                        const std::function<void(int turn)>& between = nullptr) {
  std::vector<std::vector<int32_t>> answers;
  for (int turn = from; turn < to; ++turn) {
    if (between) between(turn);
    for (std::vector<int32_t>& history : c.history) {
      const GenerationRequest r = c.Turn(history, vocab);
      absl::StatusOr<std::vector<GenerationResult>> out = e.GenerateAll({r});
      EXPECT_TRUE(out.ok()) << out.status();
      if (!out.ok()) return answers;
      const std::vector<int32_t>& tokens = (*out)[0].token_ids;
      history.insert(history.end(), tokens.begin(), tokens.end());
      answers.push_back(tokens);
    }
  }
  return answers;
}

std::vector<std::vector<int32_t>> Converse(ColocatedEngine& e, int64_t vocab,
                                           const std::function<void(int turn)>& between = nullptr) {
  Conversations c;
  return Turns(e, vocab, c, 0, 4, between);
}

class KvTiersEngine : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<ModelSpec> spec = PresetSpec("tiny-gqa");
    ASSERT_TRUE(spec.ok());
    weights_ = RandomWeights(*spec, 42);
    auto plain = MakeEngine(*weights_, /*cache=*/false, {});
    expected_ = Converse(*plain, vocab());
    block_bytes_ = kBlock * spec->kv_bytes_per_token(sizeof(float));
  }
  int64_t vocab() const { return weights_->spec().vocab_size; }
  std::unique_ptr<WeightSource> weights_;
  std::vector<std::vector<int32_t>> expected_;
  int64_t block_bytes_ = 0;
};

TEST_F(KvTiersEngine, HostTierRestoresEvictedTurnsWithTheSameTokens) {
  auto cache_only = MakeEngine(*weights_, true, {});
  EXPECT_EQ(Converse(*cache_only, vocab()), expected_);
  const int64_t cached_without_tiers = cache_only->stats().cached_tokens;
  auto e = MakeEngine(*weights_, true, {.host_bytes = 64 * block_bytes_});
  EXPECT_EQ(Converse(*e, vocab()), expected_);
  const EngineStats s = e->stats();
  EXPECT_GT(s.demoted_tokens, 0);
  EXPECT_GT(s.restored_tokens, 0);
  EXPECT_EQ(s.restore_failed_tokens, 0);
  EXPECT_GT(s.cached_tokens, cached_without_tiers) << "restored blocks are not prefilled again";
  EXPECT_GT(e->tiers()->stats().host_hits, 0);
  // The counters agree with each other: every restore was a host hit, every byte into the pool
  // came from host memory.
  const KvTierCounters& t = s.tiers;
  EXPECT_TRUE(t.enabled && t.per_tier);
  EXPECT_EQ(t.restored_blocks * kBlock, s.restored_tokens);
  EXPECT_EQ(t.demoted_blocks * kBlock, s.demoted_tokens);
  EXPECT_EQ(t.host_hits, t.restored_blocks);
  EXPECT_EQ(t.disk_hits, 0);
  EXPECT_EQ(t.pool_bytes_in, t.restored_blocks * block_bytes_);
  EXPECT_EQ(t.bytes_from_host, t.pool_bytes_in);
  EXPECT_EQ(t.pool_bytes_out, t.demoted_blocks * block_bytes_);
  EXPECT_GT(t.bytes_to_host, 0);
  EXPECT_LE(t.bytes_to_host, t.pool_bytes_out);
  EXPECT_GT(t.restore_seconds, 0);
}

// Layer-wise restore (the default) and whole-block restore give the same tokens; layer-wise, only
// the loads delay a step (restore_stall_seconds), the pool copies run before each layer.
TEST_F(KvTiersEngine, LayerwiseAndWholeRestoresGiveTheSameTokens) {
  for (const bool layerwise : {true, false}) {
    SCOPED_TRACE(layerwise ? "layer-wise" : "whole");
    auto e = MakeEngine(*weights_, true, {.host_bytes = 64 * block_bytes_});
    e->tiers()->set_layerwise(layerwise);
    EXPECT_EQ(Converse(*e, vocab()), expected_);
    const KvTierCounters t = e->stats().tiers;
    EXPECT_GT(t.restored_blocks, 0);
    EXPECT_GT(t.restore_stall_seconds, 0);
    if (layerwise) {
      EXPECT_LT(t.restore_stall_seconds, t.restore_seconds);
    } else {
      EXPECT_EQ(t.restore_stall_seconds, t.restore_seconds);
    }
  }
}

// The tiers' counters on the server's /metrics (server/metrics.h), as Prometheus reads them.
TEST_F(KvTiersEngine, CountersReachTheMetricsEndpoint) {
  const std::string dir = TempDir("engine_metrics");
  auto e = MakeEngine(*weights_, true,
                      {.host_bytes = 8 * block_bytes_, .disk_bytes = 64 * (block_bytes_ + 128), .dir = dir});
  EXPECT_EQ(Converse(*e, vocab(), [&](int) { e->tiers()->store().Flush(); }), expected_);
  const KvTierCounters t = e->stats().tiers;
  EXPECT_GT(t.host_hits, 0);
  EXPECT_GT(t.disk_hits, 0) << "a host tier of eight blocks sends some restores to the disk";
  EXPECT_EQ(t.host_hits + t.disk_hits, t.restored_blocks);
  EXPECT_EQ(t.bytes_from_host + t.bytes_from_disk - t.disk_hits * 64, t.pool_bytes_in)
      << "a file read is its header, then the block (its tokens are written only with kv.tiers.persist)";
  server::LoopStats loop;
  loop.tiers = t;
  const std::string text = server::ServerMetrics().Render(loop, "m");
  const auto value = [&](const std::string& series) -> double {
    const size_t at = text.find("\n" + series + " ");
    if (at == std::string::npos) return -1;
    return std::stod(text.substr(at + series.size() + 2));
  };
  EXPECT_EQ(value("tandem:kv_tier_hits_total{model_name=\"m\",tier=\"host\"}"),
            static_cast<double>(t.host_hits));
  EXPECT_EQ(value("tandem:kv_tier_hits_total{model_name=\"m\",tier=\"disk\"}"),
            static_cast<double>(t.disk_hits));
  EXPECT_EQ(value("tandem:kv_tier_bytes_total{model_name=\"m\",tier=\"disk\",direction=\"in\"}"),
            static_cast<double>(t.bytes_to_disk));
  EXPECT_EQ(value("tandem:kv_tier_bytes_total{model_name=\"m\",tier=\"pool\",direction=\"in\"}"),
            static_cast<double>(t.pool_bytes_in));
  EXPECT_EQ(value("tandem:kv_tier_evictions_total{model_name=\"m\",tier=\"pool\"}"),
            static_cast<double>(t.demoted_blocks));
  EXPECT_EQ(value("tandem:kv_tier_evictions_total{model_name=\"m\",tier=\"host\"}"),
            static_cast<double>(t.host_evictions));
  EXPECT_GT(value("tandem:kv_tier_restore_seconds_total{model_name=\"m\"}"), 0);
  EXPECT_NE(text.find("# TYPE tandem:kv_tier_hits_total counter\n"), std::string::npos);
  // An engine without tiers shows none of them; one whose tiers are not its own (a deployment)
  // shows the controller's only.
  EXPECT_EQ(server::ServerMetrics().Render(server::LoopStats{}, "m").find("kv_tier"), std::string::npos);
  loop.tiers.per_tier = false;
  const std::string deployment = server::ServerMetrics().Render(loop, "m");
  EXPECT_NE(deployment.find("tandem:kv_tier_restored_blocks_total"), std::string::npos);
  EXPECT_EQ(deployment.find("tandem:kv_tier_hits_total"), std::string::npos);
}

TEST_F(KvTiersEngine, DiskTierRestoresEvictedTurnsWithTheSameTokens) {
  const std::string dir = TempDir("engine_disk");
  auto e = MakeEngine(*weights_, true, {.disk_bytes = 64 * (block_bytes_ + 64), .dir = dir});
  EXPECT_EQ(Converse(*e, vocab(), [&](int) { e->tiers()->store().Flush(); }), expected_);
  EXPECT_GT(e->stats().restored_tokens, 0);
  EXPECT_GT(e->tiers()->stats().disk_hits, 0);
  // No host tier here; a block restored while still queued for its disk write is served from that
  // queued copy and counts as a host hit, which a slow (loaded) writer makes happen: not checked.
}

// Fault cases: each ends in recomputation (a failed restore) and the same tokens.
TEST_F(KvTiersEngine, DamagedFilesAreRecomputedNeverUsed) {
  struct Case {
    const char* name;
    std::function<void(const std::string& dir)> damage;
  };
  const std::vector<Case> cases = {
      {"corrupt",
       [](const std::string& dir) {
         for (const fs::path& p : BlockFiles(dir)) {
           std::fstream f(p, std::ios::in | std::ios::out | std::ios::binary);
           f.seekp(100);
           f.put('\x42');
           f.seekp(101);
           f.put('\x13');
         }
       }},
      {"truncated",
       [](const std::string& dir) {
         for (const fs::path& p : BlockFiles(dir)) fs::resize_file(p, fs::file_size(p) / 2);
       }},
      {"directory removed", [](const std::string& dir) { fs::remove_all(dir); }},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const std::string dir = TempDir("engine_fault");
    auto e = MakeEngine(*weights_, true, {.disk_bytes = 64 * (block_bytes_ + 64), .dir = dir});
    const auto answers = Converse(*e, vocab(), [&](int turn) {
      e->tiers()->store().Flush();
      if (turn >= 2) c.damage(dir + "/");
    });
    EXPECT_EQ(answers, expected_);
    EXPECT_GT(e->stats().restore_failed_tokens, 0);
    EXPECT_GT(e->tiers()->stats().discarded + e->tiers()->stats().write_errors, 0);
  }
}

TEST_F(KvTiersEngine, FullDiskTierKeepsNothingAndChangesNoToken) {
  const std::string dir = TempDir("engine_full");
  // Smaller than one block file: every write is refused as "tier full".
  auto e = MakeEngine(*weights_, true, {.disk_bytes = block_bytes_ / 2, .dir = dir});
  EXPECT_EQ(Converse(*e, vocab(), [&](int) { e->tiers()->store().Flush(); }), expected_);
  EXPECT_GT(e->tiers()->stats().write_errors, 0);
  EXPECT_EQ(e->stats().restored_tokens, 0);
  EXPECT_TRUE(BlockFiles(dir).empty());
}

// kv.tiers.persist: two turns, the engine ends, a new one over the same directory answers the next
// two turns from the blocks the first left on disk, with the tokens of a run without tiers.
TEST_F(KvTiersEngine, PersistedDiskTierServesTheConversationAfterARestart) {
  const std::string dir = TempDir("engine_persist");
  const Tiers tiers{.disk_bytes = 64 * (block_bytes_ + 128), .dir = dir, .persist = true};
  Conversations c;
  std::vector<std::vector<int32_t>> answers;
  {
    auto first = MakeEngine(*weights_, true, tiers);
    answers = Turns(*first, vocab(), c, 0, 2);
  }
  EXPECT_FALSE(BlockFiles(dir).empty()) << "persisted files outlive the engine";
  auto second = MakeEngine(*weights_, true, tiers);
  EXPECT_GT(second->controller().stats().tier_blocks_added, 0);
  const auto later = Turns(*second, vocab(), c, 2, 4);
  answers.insert(answers.end(), later.begin(), later.end());
  EXPECT_EQ(answers, expected_);
  const EngineStats s = second->stats();
  EXPECT_GT(s.restored_tokens, 0);
  EXPECT_EQ(s.restore_failed_tokens, 0);
  EXPECT_GT(second->tiers()->stats().disk_hits, 0);
}

// The same restart with one block file corrupted and one truncated (each the first block of a
// conversation): the truncated one is dropped at start, the corrupt one when its restore reads it;
// both conversations compute those tokens again, with the same result.
TEST_F(KvTiersEngine, PersistedDiskTierWithDamagedFilesRecomputes) {
  const std::string dir = TempDir("engine_persist_damaged");
  const Tiers tiers{.disk_bytes = 64 * (block_bytes_ + 128), .dir = dir, .persist = true};
  Conversations c;
  std::vector<std::vector<int32_t>> answers;
  {
    auto first = MakeEngine(*weights_, true, tiers);
    answers = Turns(*first, vocab(), c, 0, 2);
  }
  std::vector<fs::path> first_blocks;  // files of depth-1 blocks
  for (const fs::path& p : BlockFiles(dir)) {
    std::ifstream f(p, std::ios::binary);
    char depth[4];
    f.seekg(32);
    f.read(depth, 4);
    if (depth[0] == 1 && depth[1] == 0 && depth[2] == 0 && depth[3] == 0) first_blocks.push_back(p);
  }
  ASSERT_GE(first_blocks.size(), 2u);
  {
    std::fstream f(first_blocks[0], std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(fs::file_size(first_blocks[0]) - 10));  // a KV byte
    f.put('\x42');
  }
  fs::resize_file(first_blocks[1], fs::file_size(first_blocks[1]) - 7);
  auto second = MakeEngine(*weights_, true, tiers);
  EXPECT_EQ(second->tiers()->stats().discarded, 1);  // the truncated file, at start
  const auto later = Turns(*second, vocab(), c, 2, 4);
  answers.insert(answers.end(), later.begin(), later.end());
  EXPECT_EQ(answers, expected_);
  EXPECT_GT(second->stats().restore_failed_tokens, 0);  // the corrupt file, when read
  EXPECT_EQ(second->tiers()->stats().discarded, 2);
}

// The three conversations' turns submitted together behind a one-off prompt, one round per turn,
// one request running at a time: the turns wait in the queue while their histories sit demoted
// in the host tier, and the one-off prompts leave blocks that no conversation needs.
constexpr int kOneOff = 96;  // tokens of a one-off prompt: its blocks make room for prefetches
std::vector<std::vector<int32_t>> Rounds(ColocatedEngine& e, int64_t vocab) {
  Conversations c;
  std::vector<std::vector<int32_t>> answers;
  for (int turn = 0; turn < 4; ++turn) {
    std::vector<GenerationRequest> round;
    GenerationRequest one_off;
    for (int i = 0; i < kOneOff; ++i) one_off.prompt.push_back(c.Next(vocab));
    one_off.max_tokens = 9;
    one_off.ignore_eos = true;
    round.push_back(one_off);
    for (std::vector<int32_t>& history : c.history) round.push_back(c.Turn(history, vocab));
    absl::StatusOr<std::vector<GenerationResult>> out = e.GenerateAll(round);
    EXPECT_TRUE(out.ok()) << out.status();
    if (!out.ok()) return answers;
    for (size_t k = 0; k < round.size(); ++k) {
      const std::vector<int32_t>& tokens = (*out)[k].token_ids;
      if (k > 0) c.history[k - 1].insert(c.history[k - 1].end(), tokens.begin(), tokens.end());
      answers.push_back(tokens);
    }
  }
  return answers;
}

// kv.tiers.prefetch_lookahead: the waiting turns' demoted blocks come back while the turn ahead
// of them runs, so that they attach them at admission; the tokens are those of a run without the
// prefix cache, with tiers but no prefetch, and with the cache but no tiers.
TEST_F(KvTiersEngine, PrefetchBringsWaitingTurnsBackWithTheSameTokens) {
  const auto expected = Rounds(*MakeEngine(*weights_, false, {.batch = 1}), vocab());
  const auto no_tiers = MakeEngine(*weights_, true, {.batch = 1});
  EXPECT_EQ(Rounds(*no_tiers, vocab()), expected);
  const auto no_prefetch =
      MakeEngine(*weights_, true, {.host_bytes = 64 * block_bytes_, .prefetch = 0, .batch = 1});
  EXPECT_EQ(Rounds(*no_prefetch, vocab()), expected);
  const auto prefetch =
      MakeEngine(*weights_, true, {.host_bytes = 64 * block_bytes_, .prefetch = 8, .batch = 1});
  EXPECT_EQ(Rounds(*prefetch, vocab()), expected);
  const EngineStats off = no_prefetch->stats();
  const EngineStats on = prefetch->stats();
  std::printf(
      "no tiers: %lld cached; tiers: %lld cached, %lld restored; prefetch: %lld cached, %lld restored, "
      "%lld prefetched (%lld blocks used, %lld wasted), %lld steps against %lld\n",
      static_cast<long long>(no_tiers->stats().cached_tokens), static_cast<long long>(off.cached_tokens),
      static_cast<long long>(off.restored_tokens), static_cast<long long>(on.cached_tokens),
      static_cast<long long>(on.restored_tokens), static_cast<long long>(on.prefetched_tokens),
      static_cast<long long>(on.tiers.prefetch_used_blocks),
      static_cast<long long>(on.tiers.prefetch_wasted_blocks), static_cast<long long>(on.steps),
      static_cast<long long>(off.steps));
  EXPECT_GT(off.restored_tokens, 0);
  EXPECT_EQ(off.prefetched_tokens, 0);
  EXPECT_GT(on.prefetched_tokens, 0) << "the queue held returning conversations";
  EXPECT_EQ(on.tiers.prefetched_blocks * kBlock, on.prefetched_tokens);
  EXPECT_GT(on.tiers.prefetch_used_blocks, 0) << "admitted turns found their prefetched blocks resident";
  EXPECT_LE(on.tiers.prefetch_used_blocks + on.tiers.prefetch_wasted_blocks, on.tiers.prefetched_blocks);
  EXPECT_LE(on.prefetched_tokens, on.restored_tokens);
  EXPECT_EQ(on.restore_failed_tokens, 0);
  EXPECT_GE(on.cached_tokens, off.cached_tokens);
  // The counters on /metrics.
  server::LoopStats loop;
  loop.tiers = on.tiers;
  const std::string text = server::ServerMetrics().Render(loop, "m");
  EXPECT_NE(text.find(absl::StrCat("\ntandem:kv_tier_prefetched_blocks_total{model_name=\"m\"} ",
                                   on.tiers.prefetched_blocks, "\n")),
            std::string::npos)
      << text;
  EXPECT_NE(text.find(absl::StrCat("\ntandem:kv_tier_prefetch_wasted_blocks_total{model_name=\"m\"} ",
                                   on.tiers.prefetch_wasted_blocks, "\n")),
            std::string::npos);
}

// kv.tiers.eviction: a host tier of 16 blocks, too small for the three histories and the one-off
// prompts' blocks. While the turns wait behind the one-off prompt, next-use eviction drops the
// blocks no waiting turn wants (the one-off prompts', and the histories of turns already served
// this round) and keeps those of the turns still waiting; least recently used eviction drops the
// oldest, which are the histories the next turns need. Same tokens; more host hits with next_use.
TEST_F(KvTiersEngine, NextUseEvictionKeepsWhatWaitingTurnsNeed) {
  const auto expected = Rounds(*MakeEngine(*weights_, false, {.batch = 1}), vocab());
  EngineStats stats[2];
  int i = 0;
  for (const std::string eviction : {"lru", "next_use"}) {
    SCOPED_TRACE(eviction);
    const auto e = MakeEngine(
        *weights_, true, {.host_bytes = 16 * block_bytes_, .prefetch = 0, .batch = 1, .eviction = eviction});
    EXPECT_EQ(Rounds(*e, vocab()), expected);
    stats[i++] = e->stats();
  }
  const EngineStats& lru = stats[0];
  const EngineStats& next_use = stats[1];
  std::printf(
      "lru: %lld host hits, %lld restored tokens, %lld failed, %lld host evictions; next_use: %lld, "
      "%lld, %lld, %lld\n",
      static_cast<long long>(lru.tiers.host_hits), static_cast<long long>(lru.restored_tokens),
      static_cast<long long>(lru.restore_failed_tokens), static_cast<long long>(lru.tiers.host_evictions),
      static_cast<long long>(next_use.tiers.host_hits), static_cast<long long>(next_use.restored_tokens),
      static_cast<long long>(next_use.restore_failed_tokens),
      static_cast<long long>(next_use.tiers.host_evictions));
  EXPECT_GT(next_use.tiers.host_hits, 2 * lru.tiers.host_hits);
  EXPECT_GT(next_use.restored_tokens, 2 * lru.restored_tokens);
  EXPECT_LT(next_use.restore_failed_tokens, lru.restore_failed_tokens);
  EXPECT_GT(lru.tiers.host_evictions, 0) << "the host tier never filled: the test shows nothing";
}

// --- kv.store_pre_rope: histories whose oldest turn the client dropped ---

// One layer: a token's KV there depends on its id and position alone, so KV reused at a new
// position with its keys turned is what recomputation gives (up to rounding), and the answers equal
// a run without any cache. The turned blocks come back from the pool and from the host tier.
TEST_F(KvTiersEngine, PreRopeReuseOfTruncatedHistoriesIsExactWithOneLayer) {
  absl::StatusOr<ModelSpec> spec = PresetSpec("tiny-gqa");
  ASSERT_TRUE(spec.ok());
  spec->num_layers = 1;
  // Untied: with tied random embeddings each token predicts itself whatever attention returns.
  spec->tie_word_embeddings = false;
  const std::unique_ptr<WeightSource> one = RandomWeights(*spec, 7);
  auto plain = MakeEngine(*one, false, {});
  const TruncatedRun want = TruncatedConversations(*plain, vocab(), kBlock);
  auto e = MakeEngine(
      *one, true, {.host_bytes = 64 * kBlock * spec->kv_bytes_per_token(sizeof(float)), .pre_rope = true});
  const TruncatedRun got = TruncatedConversations(*e, vocab(), kBlock);
  testing_tiers::ExpectExactReuse(got, want, e->stats().tiers);
}

// Several layers: the reused rows keep the context they were computed in (the dropped turn), so
// tokens may differ from recomputation; what must hold is that the setting reuses the truncated
// histories, that without it none is reused, and that the reuse is counted where users read it.
TEST_F(KvTiersEngine, PreRopeReusesTruncatedHistoriesOnlyWhenAsked) {
  auto off = MakeEngine(*weights_, true, {.host_bytes = 64 * block_bytes_});
  const TruncatedRun a = TruncatedConversations(*off, vocab(), kBlock);
  EXPECT_EQ(off->stats().tiers.shifted_blocks, 0);
  auto on = MakeEngine(*weights_, true, {.host_bytes = 64 * block_bytes_, .pre_rope = true});
  const TruncatedRun b = TruncatedConversations(*on, vocab(), kBlock);
  ASSERT_EQ(a.answers.size(), 3u);
  ASSERT_EQ(b.answers.size(), 3u);
  const EngineStats s = on->stats();
  EXPECT_GE(s.tiers.shifted_blocks, 3);
  EXPECT_GT(s.cached_tokens, off->stats().cached_tokens) << "turned blocks are not prefilled again";
  server::LoopStats loop;
  loop.tiers = s.tiers;
  const std::string metrics = server::ServerMetrics().Render(loop, "m");
  EXPECT_NE(metrics.find("\ntandem:kv_tier_shifted_blocks_total{model_name=\"m\"} " +
                         std::to_string(s.tiers.shifted_blocks) + "\n"),
            std::string::npos)
      << metrics;
}

TEST_F(KvTiersEngine, PreRopeNeedsTiers) {
  EngineOptions o;
  o.device = "cpu";
  o.kv_capacity_tokens = 160;
  o.prefix_block_tokens = kBlock;
  o.store_pre_rope = true;
  absl::StatusOr<std::unique_ptr<ColocatedEngine>> e = ColocatedEngine::Create(*weights_, o);
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("kv.store_pre_rope needs KV tiers"), std::string_view::npos)
      << e.status();
}

TEST_F(KvTiersEngine, TiersNeedThePrefixCache) {
  EngineOptions o;
  o.device = "cpu";
  o.kv_capacity_tokens = 160;
  o.prefix_cache = false;
  o.tiers_host_bytes = 1 << 20;
  absl::StatusOr<std::unique_ptr<ColocatedEngine>> e = ColocatedEngine::Create(*weights_, o);
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("kv.tiers"), std::string_view::npos) << e.status();
}

}  // namespace
}  // namespace tandem
