#include "fuzz_entries.h"

#include <cstdint>
#include <string_view>

#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "cli/prompts.h"
#include "common/config.h"
#include "common/status.h"
#include "common/wire.h"

namespace tandem::fuzz {
namespace {

// A decoded frame must be valid and re-encode to the bytes it came from (wire.h: "An OK result
// re-encodes to `frame`").
template <typename Message, typename Decode, typename Encode>
void RoundTrip(absl::Span<const uint8_t> frame, Decode decode, Encode encode, const char* what) {
  absl::StatusOr<Message> m = decode(frame);
  if (!m.ok()) return;
  const std::vector<uint8_t> again = encode(*m);
  TANDEM_CHECK_MSG(again.size() == frame.size() && std::equal(again.begin(), again.end(), frame.begin()),
                   what, ": a decoded frame does not re-encode to its bytes");
}

const ConfigSchema& Schema() {
  static const ConfigSchema* schema = [] {
    auto* s = new ConfigSchema();
    s->Int("scheduler.max_batch_size", 64, "requests per step", 1, 65536)
        .Int("kv.capacity_tokens", 0, "KV slots", 0, 2147483647.0)
        .Double("kv.memory_fraction", 0.9, "share of free memory", 0.0, 1.0)
        .Double("sampling.temperature", 0.0, "temperature")
        .Bool("transport.checksums", true, "crc32c on payloads")
        .String("model.name", "small", "model")
        .Enum("memory.partition", "request", {"request", "head"}, "attention split")
        .List("memory.hosts", "memory pool");
    return s;
  }();
  return *schema;
}

bool SameValues(const Config& a, const Config& b) {
  for (const KnobSpec& k : Schema().knobs()) {
    switch (k.type) {
      case KnobType::kInt:
        if (a.GetInt(k.path) != b.GetInt(k.path)) return false;
        break;
      case KnobType::kDouble:
        if (a.GetDouble(k.path) != b.GetDouble(k.path)) return false;
        break;
      case KnobType::kBool:
        if (a.GetBool(k.path) != b.GetBool(k.path)) return false;
        break;
      case KnobType::kString:
      case KnobType::kEnum:
        if (a.GetString(k.path) != b.GetString(k.path)) return false;
        break;
      case KnobType::kList:
        if (a.GetList(k.path) != b.GetList(k.path)) return false;
        break;
    }
  }
  return true;
}

std::vector<uint8_t> Concat(std::vector<uint8_t> a, const std::vector<uint8_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

}  // namespace

namespace {

void DecodeEveryFormat(absl::Span<const uint8_t> f) {
  RoundTrip<StepPlan>(f, DecodeStepPlan, EncodeStepPlan, "step plan");
  RoundTrip<LayerMessageHeader>(f, DecodeLayerMessageHeader, EncodeLayerMessageHeader,
                                "layer message header");
  RoundTrip<HelloMessage>(f, DecodeHello, EncodeHello, "hello");
  RoundTrip<HelloReplyMessage>(f, DecodeHelloReply, EncodeHelloReply, "hello reply");
  RoundTrip<ReleaseMessage>(f, DecodeRelease, EncodeRelease, "release");
  RoundTrip<ErrorMessage>(f, DecodeError, EncodeError, "error");
  RoundTrip<ByeMessage>(f, DecodeBye, EncodeBye, "bye");
  RoundTrip<StatsRequestMessage>(f, DecodeStatsRequest, EncodeStatsRequest, "stats request");
  RoundTrip<MemoryStatsMessage>(f, DecodeMemoryStats, EncodeMemoryStats, "memory stats");
  RoundTrip<ComputeHelloMessage>(f, DecodeComputeHello, EncodeComputeHello, "compute hello");
  RoundTrip<ReplicaRingMessage>(f, DecodeReplicaRing, EncodeReplicaRing, "replica ring");
  RoundTrip<ReplicaStepMessage>(f, DecodeReplicaStep, EncodeReplicaStep, "replica step");
  RoundTrip<ReplicaResultMessage>(f, DecodeReplicaResult, EncodeReplicaResult, "replica result");
  RoundTrip<RestoreReplyMessage>(f, DecodeRestoreReply, EncodeRestoreReply, "restore reply");
  RoundTrip<HeartbeatMessage>(f, DecodeHeartbeat, EncodeHeartbeat, "heartbeat");
  RoundTrip<HeartbeatReplyMessage>(f, DecodeHeartbeatReply, EncodeHeartbeatReply, "heartbeat reply");
  RoundTrip<StepDiscardMessage>(f, DecodeStepDiscard, EncodeStepDiscard, "step discard");
  RoundTrip<PersistedBlocksMessage>(f, DecodePersistedBlocks, EncodePersistedBlocks, "persisted blocks");
  RoundTrip<MemoryRejoinMessage>(f, DecodeMemoryRejoin, EncodeMemoryRejoin, "memory rejoin");
  RoundTrip<HeadSplitMessage>(f, DecodeHeadSplit, EncodeHeadSplit, "head split");
  if (absl::StatusOr<StepPlan> plan = DecodeStepPlan(f); plan.ok()) {
    TANDEM_CHECK_MSG(ValidateStepPlan(*plan).ok(), "a decoded step plan fails ValidateStepPlan");
  }
  if (absl::StatusOr<HelloMessage> hello = DecodeHello(f); hello.ok()) {
    TANDEM_CHECK_MSG(ValidateHello(*hello).ok(), "a decoded hello fails ValidateHello");
  }
  if (absl::StatusOr<ErrorMessage> error = DecodeError(f); error.ok()) {
    TANDEM_CHECK_MSG(!StatusFromErrorMessage(*error).ok(), "an error message decoded to an OK status");
  }
  (void)PeekFrameMagic(f);
}

}  // namespace

void FuzzWireFrame(const uint8_t* data, size_t size) {
  DecodeEveryFormat(absl::Span<const uint8_t>(data, size));
  // The same bytes with body_bytes and body_crc32c made right, so that mutations reach the body
  // checks instead of stopping at the crc.
  if (size < kFrameHeaderBytes || size - kFrameHeaderBytes > UINT32_MAX) return;
  std::vector<uint8_t> fixed(data, data + size);
  const uint32_t body = static_cast<uint32_t>(size - kFrameHeaderBytes);
  const uint32_t crc = Crc32c(absl::Span<const uint8_t>(fixed).subspan(kFrameHeaderBytes));
  for (int i = 0; i < 4; ++i) {
    fixed[8 + i] = static_cast<uint8_t>(body >> (8 * i));
    fixed[12 + i] = static_cast<uint8_t>(crc >> (8 * i));
  }
  DecodeEveryFormat(fixed);
}

void FuzzPromptsJsonl(const uint8_t* data, size_t size) {
  const absl::string_view text(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<std::vector<cli::PromptSpec>> specs = cli::ParsePromptsJsonl(text, "fuzz");
  if (specs.ok()) {
    TANDEM_CHECK_MSG(!specs->empty(), "a prompts file parsed to no prompts");
    for (const cli::PromptSpec& p : *specs) {
      const int inputs = (p.prompt_ids.empty() ? 0 : 1) + (p.prompt ? 1 : 0) + (p.messages.empty() ? 0 : 1);
      TANDEM_CHECK_MSG(inputs <= 1, "a prompt parsed with more than one input");
    }
  }
  (void)cli::ParseIdList(text);
}

void FuzzConfigYaml(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  std::vector<std::string> overrides;
  if (const size_t nl = text.find('\n'); nl != std::string::npos && text.find('=') < nl) {
    overrides.push_back(text.substr(0, nl));
  }
  absl::StatusOr<Config> c = LoadConfig(Schema(), text, "fuzz.yaml", overrides);
  if (!c.ok()) return;
  const std::string dump = c->DumpYaml();
  absl::StatusOr<Config> again = LoadConfig(Schema(), dump, "dump.yaml", {});
  TANDEM_CHECK_MSG(again.ok(), "the dump of a loaded config does not load: ", again.status().ToString(), "\n",
                   dump);
  TANDEM_CHECK_MSG(SameValues(*c, *again), "the dump of a loaded config loads to other values:\n", dump);
}

std::vector<std::vector<uint8_t>> WireSeeds() {
  StepPlan plan{.step_id = 7, .micro_batch = 0, .micro_batches = 1};
  plan.requests.push_back({.request_id = 1,
                           .memory_rank = 0,
                           .prefix_group = 0,
                           .attach_hash = 0,
                           .position = 0,
                           .q_len = 4,
                           .kv_len = 4,
                           .sample = true,
                           .temperature = 0.5f,
                           .top_k = 3,
                           .top_p = 0.9f,
                           .seed = 11,
                           .counter = 0,
                           .top_logprobs = 3});
  plan.requests.push_back({.request_id = 2,
                           .memory_rank = 1,
                           .prefix_group = -1,
                           .attach_hash = 0,
                           .position = 3,
                           .q_len = 1,
                           .kv_len = 4,
                           .sample = true});
  plan.groups.push_back({.block_hash = 99, .prefix_tokens = 2, .parent = -1, .memory_rank = 0});
  plan.publishes.push_back(
      {.request_id = 1, .block_hash = 98, .parent_hash = 0, .block_index = 0, .memory_rank = 0});
  plan.evictions.push_back({.block_hash = 97, .memory_rank = 1, .tokens = {3, 4}});
  plan.restores.push_back({.block_hash = 96, .parent_hash = 0, .block_index = 0, .memory_rank = 1});
  plan.restores.push_back({.block_hash = 95, .parent_hash = 96, .block_index = 1, .memory_rank = 1});
  plan.restores.push_back(
      {.block_hash = 94,
       .parent_hash = 95,
       .block_index = 2,
       .memory_rank = 1,
       .segments = {{.source_hash = 93, .source_index = 4, .source_row = 3, .rows = 5},
                    {.source_hash = 92, .source_index = 5, .source_row = 0, .rows = 11}}});
  plan.next_uses.push_back({.block_hash = 97, .next_use = 0, .memory_rank = 1});
  plan.next_uses.push_back({.block_hash = 94, .next_use = 3, .memory_rank = 1});
  HelloMessage hello{.memory_rank = 1,
                     .num_memory_ranks = 2,
                     .num_layers = 2,
                     .num_heads = 4,
                     .num_kv_heads = 2,
                     .head_dim = 8,
                     .max_tokens_per_step = 16,
                     .max_requests_per_step = 4,
                     .max_position = 64};
  hello.kv_head_end = 2;
  hello.prefix_block_tokens = 2;
  hello.prefix_sharing = 2;
  LayerMessageHeader header{.step_id = 3,
                            .layer = 1,
                            .kind = LayerMessageKind::kAttnOut,
                            .dtype = DType::kBF16,
                            .rows = 2,
                            .row_bytes = 8,
                            .seqno = 5,
                            .payload_bytes = 16,
                            .payload_crc32c = 0x1234};
  // pipeline.q_first: the hello's flag and a q message's header.
  HelloMessage q_hello = hello;
  q_hello.q_first = true;
  LayerMessageHeader q_header = header;
  q_header.kind = LayerMessageKind::kQ;
  ReplicaStepMessage replica{.plan = plan, .tokens = {1, 2, 3, 4, 5}};
  replica.plan.micro_batches = 2;
  return {
      EncodeStepPlan(plan),
      EncodeStepPlan(StepPlan{}),
      EncodeLayerMessageHeader(header),
      EncodeHello(hello),
      EncodeHelloReply({.memory_rank = 1,
                        .dtype = DType::kF32,
                        .kv_capacity_tokens = 100,
                        .qkv_buffer = 2,
                        .device = "cpu",
                        .persisted = true}),
      EncodeRelease({.step_id = 4, .request_ids = {1, 2, 3}}),
      EncodeError({.code = 14, .message = "memory rank 1: gone"}),
      EncodeBye({.steps = 12}),
      EncodeStatsRequest({.cookie = 5}),
      EncodeMemoryStats({.cookie = 5, .memory_rank = 1, .steps = 3, .attention_ns = 1000}),
      EncodeComputeHello({.compute_rank = 1, .compute_ranks = 2}),
      EncodeReplicaRing({.next_address = "127.0.0.1:4567"}),
      EncodeReplicaRing({}),
      EncodeReplicaStep(replica),
      EncodeReplicaResult({.step_id = 7, .micro_batch = 1, .tokens = {4, 5}, .logprobs = {-0.5f, -1.0f}}),
      EncodeReplicaResult({.step_id = 7,
                           .micro_batch = 1,
                           .tokens = {4, 5},
                           .logprobs = {-0.5f, -1.0f},
                           .top = {{{4, -0.5f}, {9, -1.5f}}, {}}}),
      EncodeRestoreReply({.step_id = 7, .memory_rank = 1, .failed = {95}}),
      EncodeHeartbeat({.seq = 3, .silence_ms = 4000}),
      EncodeHeartbeatReply({.seq = 3, .memory_rank = 1}),
      Concat(EncodeBye({.steps = 1}), EncodeBye({.steps = 2})),  // two frames: refused
      EncodeHello(q_hello),
      EncodeLayerMessageHeader(q_header),
      EncodeStepDiscard({.step_id = 7, .seqno_base = 40, .compute_mask = 5, .lost_memory_ranks = {0, 2}}),
      EncodePersistedBlocks({.memory_rank = 1,
                             .last = false,
                             .blocks = {{.hash = 96, .parent_hash = 0, .depth = 1, .tokens = {1, 2}},
                                        {.hash = 95, .parent_hash = 96, .depth = 2, .tokens = {3, 4}}}}),
      EncodePersistedBlocks({.memory_rank = 0}),
      EncodeMemoryRejoin({.memory_rank = 1, .attn_out_buffer = 130, .text = "127.0.0.1:4567"}),
      EncodeMemoryRejoin({.memory_rank = 1, .answer = true, .attn_out_buffer = 130}),
      EncodeStepDiscard(
          {.step_id = 9, .seqno_base = 41, .compute_mask = 1, .drop = true, .lost_memory_ranks = {1}}),
      EncodeHeadSplit({.split = 3,
                       .ranks = {{.memory_rank = 0, .attn_out_buffer = 140, .qkv_buffer = 9},
                                 {.memory_rank = 2, .attn_out_buffer = 148, .qkv_buffer = 9}}}),
      EncodeHeadSplit({.split = 3, .answer = true, .text = "cannot register"}),
  };
}

std::vector<std::string> PromptsSeeds() {
  return {
      "{\"prompt_ids\": [1, 2, 3]}\n",
      "{\"prompt_ids\": [5], \"max_tokens\": 4, \"temperature\": 0.7, \"top_k\": 5, \"top_p\": 0.9, "
      "\"seed\": 3, "
      "\"ignore_eos\": true}\n\n{\"prompt\": \"Once upon a time\"}\n",
      "{\"messages\": [{\"role\": \"system\", \"content\": \"Be brief.\"}, {\"role\": \"user\", \"content\": "
      "\"Hi\"}]}\n",
      "1,2, 3",
      "{\"prompt_ids\": [[[[1]]]]}\n",
      "{\"prompt\": \"\\u00e9\\ud83d\\ude00\", \"max_tokens\": 9223372036854775807}\n",
  };
}

std::vector<std::string> ConfigSeeds() {
  return {
      "scheduler.max_batch_size=8\nscheduler:\n  max_batch_size: 32\nkv:\n  memory_fraction: 0.25\n",
      "kv.capacity_tokens: 4096\ntransport:\n  checksums: false\nmodel:\n  name: \"a b\"\n",
      "memory:\n  partition: head\n  hosts: [{host: a, devices: [cpu, cpu]}, {host: b, devices: [cuda:0]}]\n",
      "sampling.temperature: 1.5e-3\n# comment\n",
      "memory.partition=request\nsampling:\n  temperature: 0.1\n",
  };
}

}  // namespace tandem::fuzz
