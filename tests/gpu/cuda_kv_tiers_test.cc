// KV tiers on the GPU: the CUDA attention executor's slot copies (ReadSlots, WriteSlots,
// WriteSlotsLayer) against a host mirror of its pool, the tiers' layer-wise restore over it, and the
// CUDA colocated engine's multi-turn conversations through a pool too small to keep them: restored
// blocks carry the very bytes the pool held, so the tokens and log-probabilities equal those of an
// engine whose pool keeps everything; and a shifted restore (kv.store_pre_rope). Skips without a GPU.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "colocated/engine.h"
#include "gpu_test_util.h"
#include "gtest/gtest.h"
#include "memory_node/attention_executor.h"
#include "memory_node/kv_tiers.h"
#include "unit/kv_layers_in_pool.h"
#include "unit/shifted_restore_check.h"

namespace tandem {
namespace {

std::vector<uint8_t> RandomBytes(size_t n, std::mt19937& rng) {
  std::vector<uint8_t> b(n);
  for (uint8_t& x : b) x = static_cast<uint8_t>(rng());
  return b;
}

// A host mirror of a bf16 pool: per layer, K of every slot then V of every slot.
struct Mirror {
  AttentionShape shape;
  int64_t slots = 0;
  std::vector<uint8_t> bytes;
  size_t row() const { return static_cast<size_t>(shape.kv_dim()) * 2; }
  uint8_t* at(int64_t layer, int64_t half, int32_t slot) {
    return bytes.data() + ((static_cast<size_t>(layer) * 2 + half) * slots + slot) * row();
  }
  // What ReadSlots returns for `s`: per layer, the K rows in order, then the V rows.
  std::vector<uint8_t> Read(const std::vector<int32_t>& s) {
    std::vector<uint8_t> out;
    for (int64_t l = 0; l < shape.num_layers; ++l)
      for (int64_t h = 0; h < 2; ++h)
        for (int32_t slot : s) out.insert(out.end(), at(l, h, slot), at(l, h, slot) + row());
    return out;
  }
  void Write(const std::vector<int32_t>& s, const uint8_t* in, int64_t only_layer = -1) {
    const size_t layer_bytes = 2 * s.size() * row();
    for (int64_t l = 0; l < shape.num_layers; ++l) {
      const uint8_t* src = in + static_cast<size_t>(l) * layer_bytes;
      if (only_layer >= 0 && l != only_layer) continue;
      for (int64_t h = 0; h < 2; ++h)
        for (int32_t slot : s) {
          std::copy(src, src + row(), at(l, h, slot));
          src += row();
        }
    }
  }
};

std::vector<int32_t> DistinctSlots(int64_t n, int64_t pool, std::mt19937& rng) {
  std::vector<int32_t> all(static_cast<size_t>(pool));
  for (int64_t i = 0; i < pool; ++i) all[static_cast<size_t>(i)] = static_cast<int32_t>(i);
  std::shuffle(all.begin(), all.end(), rng);
  all.resize(static_cast<size_t>(n));
  return all;
}

TEST(CudaKvTiers, SlotCopiesMatchAHostMirror) {
  TANDEM_SKIP_WITHOUT_GPU();
  for (const int64_t head_dim : {64, 128}) {
    SCOPED_TRACE(testing::Message() << "head_dim " << head_dim);
    const AttentionShape shape{.num_layers = 3,
                               .num_heads = 4,
                               .num_kv_heads = 2,
                               .head_dim = head_dim,
                               .max_tokens = 16,
                               .max_requests = 4};
    constexpr int64_t kSlots = 97;
    absl::StatusOr<std::unique_ptr<AttentionExecutor>> exec =
        CreateCudaAttentionExecutor(shape, {.capacity_tokens = kSlots}, 0, nullptr);
    ASSERT_TRUE(exec.ok()) << exec.status();
    std::mt19937 rng(static_cast<uint32_t>(head_dim));
    Mirror m{.shape = shape, .slots = kSlots};
    m.bytes.resize(static_cast<size_t>(shape.num_layers * 2 * kSlots) * m.row());
    // Fill the whole pool (in a shuffled slot order), then mix writes, layer writes and reads of
    // random slot sets of odd sizes.
    const std::vector<int32_t> every = DistinctSlots(kSlots, kSlots, rng);
    const std::vector<uint8_t> fill = RandomBytes(m.bytes.size(), rng);
    ASSERT_TRUE((*exec)->WriteSlots(every, fill.data()).ok());
    m.Write(every, fill.data());
    EXPECT_TRUE((*exec)->AsyncReads());
    for (int round = 0; round < 80; ++round) {
      const int64_t n = 1 + static_cast<int64_t>(rng() % 40);
      const std::vector<int32_t> s = DistinctSlots(n, kSlots, rng);
      const size_t block = static_cast<size_t>(shape.num_layers) * 2 * s.size() * m.row();
      switch (round % 4) {
        case 3: {
          // An asynchronous read, then a write over the same slots enqueued behind it: the read
          // returns the bytes from before the write.
          const std::vector<uint8_t> before = m.Read(s);
          std::vector<uint8_t> out(block, 0xCD);
          absl::StatusOr<int64_t> ticket = (*exec)->StartReadSlots(s, out.data());
          ASSERT_TRUE(ticket.ok()) << ticket.status();
          const std::vector<uint8_t> in = RandomBytes(block, rng);
          ASSERT_TRUE((*exec)->WriteSlots(s, in.data()).ok());
          m.Write(s, in.data());
          ASSERT_TRUE((*exec)->FinishReadSlots(*ticket).ok());
          ASSERT_EQ(out, before) << "round " << round;
          ASSERT_TRUE((*exec)->memory().Synchronize().ok());
          break;
        }
        case 0: {
          const std::vector<uint8_t> in = RandomBytes(block, rng);
          ASSERT_TRUE((*exec)->WriteSlots(s, in.data()).ok());
          m.Write(s, in.data());
          break;
        }
        case 1: {
          const std::vector<uint8_t> in = RandomBytes(block, rng);
          const int64_t layer = static_cast<int64_t>(rng() % shape.num_layers);
          ASSERT_TRUE((*exec)->WriteSlotsLayer(s, layer, in.data()).ok());
          m.Write(s, in.data(), layer);
          break;
        }
        default: {
          std::vector<uint8_t> out(block, 0xCD);
          ASSERT_TRUE((*exec)->ReadSlots(s, out.data()).ok());
          ASSERT_EQ(out, m.Read(s)) << "round " << round;
        }
      }
    }
    std::vector<uint8_t> whole(m.bytes.size());
    ASSERT_TRUE((*exec)->ReadSlots(every, whole.data()).ok());
    EXPECT_EQ(whole, m.Read(every));
    // A slot outside the pool is refused before anything moves; an out-of-range layer too.
    std::vector<uint8_t> junk(static_cast<size_t>(shape.num_layers) * 2 * 2 * m.row(), 0x11);
    const std::vector<int32_t> past_end = {3, static_cast<int32_t>(kSlots)}, three = {3}, negative = {-1};
    const absl::Status bad = (*exec)->WriteSlots(past_end, junk.data());
    EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(std::string(bad.message()).find("outside the pool"), std::string::npos) << bad;
    EXPECT_EQ((*exec)->WriteSlotsLayer(three, shape.num_layers, junk.data()).code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ((*exec)->ReadSlots(negative, junk.data()).code(), absl::StatusCode::kInvalidArgument);
    ASSERT_TRUE((*exec)->ReadSlots(every, whole.data()).ok());
    EXPECT_EQ(whole, m.Read(every)) << "a refused copy changed the pool";
  }
}

// The tiers over the CUDA executor: a demoted block comes back layer by layer, each layer only when
// asked, byte for byte.
TEST(CudaKvTiers, LayerwiseRestoreReachesThePoolLayerByLayer) {
  TANDEM_SKIP_WITHOUT_GPU();
  const AttentionShape shape{
      .num_layers = 3, .num_heads = 2, .num_kv_heads = 1, .head_dim = 64, .max_tokens = 8, .max_requests = 1};
  absl::StatusOr<std::unique_ptr<AttentionExecutor>> exec =
      CreateCudaAttentionExecutor(shape, {.capacity_tokens = 32}, 0, nullptr);
  ASSERT_TRUE(exec.ok()) << exec.status();
  const std::vector<int32_t> slots = {3, 9, 4, 20};
  const size_t layer_bytes = 2 * slots.size() * static_cast<size_t>(shape.kv_dim()) * 2;
  std::mt19937 rng(5);
  const std::vector<uint8_t> kv = RandomBytes(3 * layer_bytes, rng);
  const std::vector<uint8_t> garbage(kv.size(), 0xEE);
  absl::StatusOr<std::unique_ptr<KvTiers>> tiers =
      KvTiers::Create({.host_bytes = 1 << 20}, exec->get(), static_cast<int64_t>(slots.size()), "m");
  ASSERT_TRUE(tiers.ok()) << tiers.status();
  EXPECT_EQ((*tiers)->store().block_bytes(), static_cast<int64_t>(kv.size())) << "bf16 KV: 2 bytes a value";
  ASSERT_TRUE((*exec)->WriteSlots(slots, kv.data()).ok());
  (*tiers)->Demote(1, 0, 1, slots, {});
  ASSERT_TRUE((*exec)->WriteSlots(slots, garbage.data()).ok());
  ASSERT_TRUE((*tiers)->Restore(1, 0, 1, slots));
  std::vector<uint8_t> pool(kv.size());
  auto layers_in_pool = [&] { return testing_tiers::LayersInPool(**exec, slots, kv, garbage, 3, &pool); };
  EXPECT_EQ(layers_in_pool(), 0);
  ASSERT_TRUE((*tiers)->RestoreLayer(0).ok());
  EXPECT_EQ(layers_in_pool(), 1);
  ASSERT_TRUE((*tiers)->RestoreLayer(1).ok());
  EXPECT_EQ(layers_in_pool(), 2);
  ASSERT_TRUE((*tiers)->FinishRestores().ok());
  EXPECT_EQ(pool.size(), kv.size());
  EXPECT_EQ(layers_in_pool(), 3);
  EXPECT_EQ(pool, kv);
}

// kv.store_pre_rope on a bf16 pool: a block assembled from turned rows of a pooled and a demoted
// block (the RopeShift kernel against the CPU op).
TEST(CudaKvTiers, ShiftedRestoreTurnsRowsFromThePoolAndTheHostTier) {
  TANDEM_SKIP_WITHOUT_GPU();
  for (const int64_t head_dim : {64, 128}) {
    SCOPED_TRACE(testing::Message() << "head_dim " << head_dim);
    const AttentionShape shape{.num_layers = 3,
                               .num_heads = 4,
                               .num_kv_heads = 2,
                               .head_dim = head_dim,
                               .max_tokens = 8,
                               .max_requests = 1};
    absl::StatusOr<std::unique_ptr<AttentionExecutor>> exec =
        CreateCudaAttentionExecutor(shape, {.capacity_tokens = 32}, 0, nullptr);
    ASSERT_TRUE(exec.ok()) << exec.status();
    testing_tiers::CheckShiftedRestore(**exec);
  }
}

// --- The CUDA colocated engine, multi-turn ---

std::string ModelDir(const std::string& model) {
  const char* src = std::getenv("TANDEM_SOURCE_DIR");
  return std::string(src ? src : ".") + "/tests/data/reference/" + model;
}

constexpr int64_t kBlock = 16;

std::unique_ptr<ColocatedEngine> MakeEngine(const WeightSource& w, int64_t pool, int64_t host_bytes,
                                            const std::string& disk_dir = "", int64_t disk_bytes = 0) {
  EngineOptions o;
  o.device = "cuda";
  o.max_batch_size = 2;
  o.max_tokens_per_step = 128;
  o.kv_capacity_tokens = pool;
  o.prefix_cache = true;
  o.prefix_block_tokens = kBlock;
  o.tiers_host_bytes = host_bytes;
  o.tiers_disk_dir = disk_dir;
  o.tiers_disk_bytes = disk_bytes;
  absl::StatusOr<std::unique_ptr<ColocatedEngine>> e = ColocatedEngine::Create(w, o);
  EXPECT_TRUE(e.ok()) << e.status();
  return e.ok() ? std::move(*e) : nullptr;
}

// Three conversations of five turns, interleaved, one request at a time; each turn's prompt is the
// conversation's history plus 21 new tokens, 11 tokens answered (greedy, EOS ignored).
std::vector<GenerationResult> Converse(ColocatedEngine& e, int64_t vocab) {
  std::vector<std::vector<int32_t>> history(3);
  uint32_t x = 9090;
  std::vector<GenerationResult> answers;
  for (int turn = 0; turn < 5; ++turn) {
    for (std::vector<int32_t>& h : history) {
      for (int i = 0; i < 21; ++i) {
        x = x * 1664525u + 1013904223u;
        h.push_back(static_cast<int32_t>(2 + (x >> 8) % static_cast<uint32_t>(vocab - 2)));
      }
      GenerationRequest r;
      r.prompt = h;
      r.max_tokens = 11;
      r.ignore_eos = true;
      absl::StatusOr<std::vector<GenerationResult>> out = e.GenerateAll({r});
      EXPECT_TRUE(out.ok()) << out.status();
      if (!out.ok()) return answers;
      h.insert(h.end(), (*out)[0].token_ids.begin(), (*out)[0].token_ids.end());
      answers.push_back((*out)[0]);
    }
  }
  return answers;
}

TEST(CudaKvTiersEngine, EvictedTurnsComeBackWithTheSameTokensAndLogprobs) {
  TANDEM_SKIP_WITHOUT_GPU();
  absl::StatusOr<std::unique_ptr<WeightSource>> source = OpenModel(ModelDir("llama3-gqa-tied"), 0);
  ASSERT_TRUE(source.ok()) << source.status();
  const int64_t vocab = (*source)->spec().vocab_size;
  // The reference: a pool that keeps every conversation, so each turn reuses its history's blocks.
  std::unique_ptr<ColocatedEngine> roomy = MakeEngine(**source, 8192, 0);
  ASSERT_NE(roomy, nullptr);
  const std::vector<GenerationResult> expected = Converse(*roomy, vocab);
  ASSERT_EQ(expected.size(), 15u);
  const int64_t block_bytes = kBlock * (*source)->spec().kv_bytes_per_token(2);
  const std::string dir = ::testing::TempDir() + "/cuda_kv_tiers_disk";
  // Host tier with layer-wise restore (the default) and with whole-block restore (one Load into a
  // buffer reused by the next block: its copies must have run first), then the disk tier alone.
  for (const int variant : {0, 1, 2}) {
    const bool disk = variant == 2;
    SCOPED_TRACE(variant == 0   ? "host tier"
                 : variant == 1 ? "host tier, whole-block restore"
                                : "disk tier only");
    // A pool that holds about one conversation: the others' blocks are evicted between their turns.
    std::unique_ptr<ColocatedEngine> e = disk ? MakeEngine(**source, 224, 0, dir, 256 * block_bytes)
                                              : MakeEngine(**source, 224, 256 * block_bytes);
    ASSERT_NE(e, nullptr);
    e->tiers()->set_layerwise(variant != 1);
    const std::vector<GenerationResult> got = Converse(*e, vocab);
    ASSERT_EQ(got.size(), expected.size());
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_EQ(got[i].token_ids, expected[i].token_ids) << "answer " << i;
      EXPECT_EQ(got[i].logprobs, expected[i].logprobs) << "answer " << i;
    }
    const EngineStats s = e->stats();
    EXPECT_GT(s.demoted_tokens, 0);
    EXPECT_GT(s.restored_tokens, 0);
    EXPECT_EQ(s.restore_failed_tokens, 0);
    EXPECT_EQ(s.tiers.pool_bytes_in, s.tiers.restored_blocks * block_bytes);
    if (disk) {
      EXPECT_GT(s.tiers.disk_hits + s.tiers.host_hits, 0);
    } else {
      EXPECT_EQ(s.tiers.host_hits, s.tiers.restored_blocks);
    }
    std::printf("%s: %lld tokens demoted, %lld restored, %lld recomputed\n",
                variant == 0   ? "host"
                : variant == 1 ? "host, whole"
                               : "disk",
                static_cast<long long>(s.demoted_tokens), static_cast<long long>(s.restored_tokens),
                static_cast<long long>(s.restore_failed_tokens));
  }
}

}  // namespace
}  // namespace tandem
