#include "compute_node/compute_rank.h"

#include <algorithm>
#include <chrono>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/layer_message.h"
#include "common/log.h"
#include "common/status.h"
#include "common/transport/factory.h"
#include "common/transport/transport.h"
#include "common/wire.h"

namespace tandem {

namespace {
constexpr uint32_t kAttnBufferBase = 100;  // our receive buffer for memory rank m: 100 + m

double MsSince(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t).count();
}
}  // namespace

ComputeRank::~ComputeRank() = default;

absl::StatusOr<std::unique_ptr<ComputeRank>> ComputeRank::Create(const WeightSource& source,
                                                                 const ComputeRankOptions& options) {
  if (options.memory_addresses.empty()) return absl::InvalidArgumentError("a deployment needs a memory rank");
  RETURN_IF_ERROR(CheckAttentionPartition(options.partition, source.spec().num_kv_heads,
                                          static_cast<int64_t>(options.memory_addresses.size())));
  std::unique_ptr<ComputeRank> r(new ComputeRank());
  r->options_ = options;
  RETURN_IF_ERROR(r->Connect(source));
  return r;
}

absl::Status ComputeRank::Connect(const WeightSource& source) {
  const ComputeRankOptions& o = options_;
  const absl::Time deadline = absl::Now() + o.startup_timeout;
  ASSIGN_OR_RETURN(transport_, transport::CreateTransport({.kind = o.transport, .device = o.device}));
  for (size_t m = 0; m < o.memory_addresses.size(); ++m) {
    Rank rank;
    ASSIGN_OR_RETURN(rank.peer, transport_->Connect(o.memory_addresses[m]));
    rank.name = absl::StrCat("memory rank ", m, " (", o.memory_addresses[m], ")");
    ranks_.push_back(std::move(rank));
  }
  // Weights first: a memory rank on the same GPU sizes its KV from what is left after them.
  const ComputeBackendOptions bo{.max_tokens = o.scheduler.max_tokens_per_step,
                                 .max_requests = o.scheduler.max_batch_size,
                                 .profile = o.profile,
                                 .cuda_graphs = o.cuda_graphs};
  if (o.device < 0) {
    ASSIGN_OR_RETURN(backend_, CreateCpuComputeBackend(source, bo));
  } else {
    ASSIGN_OR_RETURN(backend_, CreateCudaComputeBackend(source, bo, o.device));
  }
  const ModelSpec& s = backend_->spec();
  elem_ = static_cast<size_t>(DTypeSize(backend_->dtype()));
  const size_t t = static_cast<size_t>(o.scheduler.max_tokens_per_step);
  const size_t qkv_bytes = t * static_cast<size_t>(backend_->qkv_width()) * elem_;
  const size_t attn_bytes = t * static_cast<size_t>(s.q_dim()) * elem_;
  ASSIGN_OR_RETURN(qkv_, backend_->memory().Allocate(qkv_bytes, false));
  ASSIGN_OR_RETURN(attn_, backend_->memory().Allocate(attn_bytes, false));
  device_path_ = !backend_->memory().host() && transport_->capabilities().device_polling;
  head_ = o.partition == AttentionPartition::kHead;
  if (!backend_->memory().host() && !device_path_) {
    ASSIGN_OR_RETURN(qkv_host_, backend_->memory().Allocate(qkv_bytes, true));
    if (head_) {
      ASSIGN_OR_RETURN(attn_host_, backend_->memory().Allocate(attn_bytes, true));
    }
  }
  const int64_t num_ranks = static_cast<int64_t>(ranks_.size());
  for (size_t m = 0; m < ranks_.size(); ++m) {
    Rank& rank = ranks_[m];
    rank.attn_buffer = kAttnBufferBase + static_cast<uint32_t>(m);
    rank.slice = HeadSlice{.num_heads = s.num_heads,
                           .num_kv_heads = s.num_kv_heads,
                           .head_dim = s.head_dim,
                           .num_ranks = head_ ? num_ranks : 1,
                           .rank = head_ ? static_cast<int64_t>(m) : 0};
    const size_t pack_bytes = t * static_cast<size_t>(rank.slice.slice_qkv_width()) * elem_;
    const size_t out_bytes = t * static_cast<size_t>(rank.slice.slice_q_dim()) * elem_;
    if (head_) {
      ASSIGN_OR_RETURN(rank.pack, backend_->memory().Allocate(pack_bytes, !device_path_));
    }
    if (device_path_ && head_) {
      // Its outputs land in a buffer of its own, at row 0, and are scattered into its columns.
      ASSIGN_OR_RETURN(rank.out, backend_->memory().Allocate(out_bytes, false));
      RETURN_IF_ERROR(transport_->RegisterBuffer(rank.attn_buffer, rank.out.get(), out_bytes));
    } else if (device_path_) {
      // Every rank writes its rows' outputs straight into the attention buffer, at its offset.
      RETURN_IF_ERROR(transport_->RegisterBuffer(rank.attn_buffer, attn_.get(), attn_bytes));
    } else {
      rank.recv_bytes = kLayerMessageHeaderFrameBytes + out_bytes;
      ASSIGN_OR_RETURN(rank.recv, backend_->memory().Allocate(rank.recv_bytes, true));
      RETURN_IF_ERROR(transport_->RegisterBuffer(rank.attn_buffer, rank.recv.get(), rank.recv_bytes));
    }
    HelloMessage hello;
    hello.memory_rank = static_cast<uint16_t>(m);
    hello.num_memory_ranks = static_cast<uint16_t>(ranks_.size());
    hello.num_layers = static_cast<uint32_t>(s.num_layers);
    hello.num_heads = static_cast<uint32_t>(s.num_heads);
    hello.num_kv_heads = static_cast<uint32_t>(s.num_kv_heads);
    hello.head_dim = static_cast<uint32_t>(s.head_dim);
    hello.max_tokens_per_step = static_cast<uint32_t>(o.scheduler.max_tokens_per_step);
    hello.max_requests_per_step = static_cast<uint32_t>(o.scheduler.max_batch_size);
    hello.max_position = static_cast<uint32_t>(s.max_position);
    hello.dtype = backend_->dtype();
    hello.kv_capacity_tokens = static_cast<uint64_t>(o.kv_capacity_tokens);
    hello.kv_memory_fraction = static_cast<float>(o.kv_memory_fraction);
    hello.attn_out_buffer = rank.attn_buffer;
    hello.checksums = o.checksums;
    hello.prefix_block_tokens = static_cast<uint16_t>(o.scheduler.prefix_block_tokens);
    hello.prefix_sharing = static_cast<uint8_t>(o.scheduler.prefix_sharing);
    hello.partition = o.partition;
    hello.kv_head_begin = static_cast<uint32_t>(rank.slice.kv_head_begin());
    hello.kv_head_end = static_cast<uint32_t>(rank.slice.kv_head_end());
    RETURN_IF_ERROR(Annotate(transport_->Send(rank.peer, EncodeHello(hello)), rank.name));
  }
  // Replies, in any order.
  std::vector<int64_t> capacity(ranks_.size(), 0);
  rank_names_.assign(ranks_.size(), "");  // in rank order, whatever the order of the replies
  for (size_t got = 0; got < ranks_.size(); ++got) {
    std::vector<uint8_t> msg;
    ASSIGN_OR_RETURN(const size_t m, ReceiveFromRank(deadline, "the memory ranks' replies", &msg));
    absl::StatusOr<HelloReplyMessage> reply = DecodeHelloReply(msg);
    if (!reply.ok()) return Annotate(reply.status(), ranks_[m].name);
    if (reply->memory_rank != m || reply->dtype != backend_->dtype()) {
      return absl::InvalidArgumentError(absl::StrCat(ranks_[m].name, ": reply names rank ",
                                                     reply->memory_rank, " and dtype ",
                                                     std::string(DTypeName(reply->dtype))));
    }
    ranks_[m].qkv_buffer = reply->qkv_buffer;
    capacity[m] = static_cast<int64_t>(reply->kv_capacity_tokens);
    rank_names_[m] = absl::StrCat("memory rank ", m, ": ", reply->device, ", ", capacity[m], " KV tokens",
                                  head_ ? absl::StrCat(" of KV heads [", ranks_[m].slice.kv_head_begin(),
                                                       ", ", ranks_[m].slice.kv_head_end(), ")")
                                        : "");
    TANDEM_LOG_INFO("compute", rank_names_[m]);
  }
  if (head_) {
    // Every rank holds every request: one placement group, as large as the smallest rank.
    capacity = {*std::min_element(capacity.begin(), capacity.end())};
  }
  controller_ = std::make_unique<Controller>(s, capacity, o.scheduler);
  TANDEM_LOG_INFO(
      "compute", "transport ", transport_->capabilities().name, ", ",
      device_path_ ? "device data path (whole steps enqueued, device-side waits)" : "host-staged data path",
      ", memory.partition ", AttentionPartitionName(o.partition));
  return absl::OkStatus();
}

absl::Status ComputeRank::Step(std::vector<std::pair<int64_t, GenerationResult>>* finished) {
  const auto t0 = std::chrono::steady_clock::now();
  controller_->Schedule(&step_);
  if (step_.empty()) return absl::OkStatus();
  const std::vector<uint8_t> plan = EncodeStepPlan(step_.plan);
  for (Rank& rank : ranks_) RETURN_IF_ERROR(Annotate(transport_->Send(rank.peer, plan), rank.name));
  RETURN_IF_ERROR(device_path_ ? RunLayersOnDevice(step_) : RunLayers(step_));
  std::vector<int32_t> tokens;
  std::vector<float> logprobs;
  const auto finish = std::chrono::steady_clock::now();
  RETURN_IF_ERROR(backend_->Finish(&tokens, &logprobs));
  if (backend_->memory().host()) host_compute_ms_ += MsSince(finish);
  std::vector<std::vector<uint64_t>> released;
  RETURN_IF_ERROR(controller_->Complete(step_, tokens, logprobs, finished, &released));
  RETURN_IF_ERROR(SendReleases(step_.plan.step_id, released));
  busy_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return absl::OkStatus();
}

std::pair<int32_t, int32_t> ComputeRank::RowsOf(const PlannedStep& step, size_t m) const {
  if (head_) return {0, step.rank_rows.back()};
  return {step.rank_rows[m], step.rank_rows[m + 1]};
}

absl::Status ComputeRank::SendReleases(uint64_t step_id, const std::vector<std::vector<uint64_t>>& released) {
  for (size_t m = 0; m < ranks_.size(); ++m) {
    // Head partition: the one placement group's releases go to every rank.
    const std::vector<uint64_t>& ids = released[head_ ? 0 : m];
    if (ids.empty()) continue;
    ReleaseMessage rel;
    rel.step_id = step_id;
    rel.request_ids = ids;
    RETURN_IF_ERROR(Annotate(transport_->Send(ranks_[m].peer, EncodeRelease(rel)), ranks_[m].name));
  }
  return absl::OkStatus();
}

absl::Status ComputeRank::RunLayers(const PlannedStep& step) {
  const ModelSpec& s = backend_->spec();
  const int64_t t = step.rows.num_tokens();
  const size_t qkv_row = static_cast<size_t>(backend_->qkv_width()) * elem_;
  const size_t attn_row = static_cast<size_t>(s.q_dim()) * elem_;
  const bool host = backend_->memory().host();
  auto* qkv_rows = static_cast<uint8_t*>(host ? qkv_.get() : qkv_host_.get());
  // Head partition: where the ranks' outputs are scattered (then copied to the device at once).
  void* attn_rows = host ? attn_.get() : attn_host_.get();
  // On the CPU the backend's calls are its compute time and the rest of each layer is the
  // attention phase (a GPU backend times its phases itself, with `profile`).
  auto mark = std::chrono::steady_clock::now();
  auto charge = [&](double* to) {
    if (!host) return;
    *to += MsSince(mark);
    mark = std::chrono::steady_clock::now();
  };
  RETURN_IF_ERROR(backend_->BeginStep(step.rows));
  for (uint32_t layer = 0; layer < static_cast<uint32_t>(s.num_layers); ++layer) {
    RETURN_IF_ERROR(backend_->PreAttention(layer, qkv_.get()));
    charge(&host_compute_ms_);
    if (!host) {
      RETURN_IF_ERROR(
          backend_->memory().CopyOut(qkv_host_.get(), qkv_.get(), static_cast<size_t>(t) * qkv_row));
      RETURN_IF_ERROR(backend_->memory().Synchronize());
    }
    // Each memory rank's rows are one contiguous range of the step's rows (request partition), or
    // every row, packed to its columns (head partition).
    for (size_t m = 0; m < ranks_.size(); ++m) {
      Rank& rank = ranks_[m];
      const auto [begin, end] = RowsOf(step, m);
      if (begin == end) continue;
      const size_t row_bytes = head_ ? static_cast<size_t>(rank.slice.slice_qkv_width()) * elem_ : qkv_row;
      const uint8_t* rows = qkv_rows + begin * qkv_row;
      if (head_) {
        RETURN_IF_ERROR(PackHeadSlice(host_copies_, rank.slice, t, elem_, qkv_rows, rank.pack.get()));
        rows = static_cast<const uint8_t*>(rank.pack.get());
      }
      const LayerMessageExpect what{.step_id = step.plan.step_id,
                                    .layer = layer,
                                    .kind = LayerMessageKind::kQkv,
                                    .dtype = backend_->dtype(),
                                    .rows = static_cast<uint32_t>(end - begin),
                                    .row_bytes = static_cast<uint32_t>(row_bytes),
                                    .seqno = ++rank.seqno};
      const absl::Span<const uint8_t> body(rows, static_cast<size_t>(end - begin) * row_bytes);
      const std::vector<uint8_t> header = MakeLayerMessageHeader(what, body, options_.checksums);
      const absl::Span<const uint8_t> pieces[] = {header, body};
      RETURN_IF_ERROR(
          Annotate(transport_->Write(rank.peer, rank.qkv_buffer, 0, pieces, rank.seqno), rank.name));
    }
    for (size_t m = 0; m < ranks_.size(); ++m) {
      Rank& rank = ranks_[m];
      const auto [begin, end] = RowsOf(step, m);
      if (begin == end) continue;
      const absl::Status waited =
          transport_->WaitDoorbell(rank.attn_buffer, rank.seqno, absl::Now() + options_.step_timeout);
      if (!waited.ok()) {
        // A memory rank that stopped says why in an error message; prefer that to the wait's error.
        transport::PeerId from = 0;
        std::vector<uint8_t> msg;
        if (transport_->Receive(&from, &msg, absl::Now()).ok()) {
          absl::StatusOr<ErrorMessage> err = DecodeError(msg);
          if (err.ok()) return Annotate(StatusFromErrorMessage(*err), "a memory rank stopped");
        }
        return Annotate(waited, absl::StrCat(rank.name, ": attention output of step ", step.plan.step_id,
                                             " layer ", layer));
      }
      const LayerMessageExpect expect{
          .step_id = step.plan.step_id,
          .layer = layer,
          .kind = LayerMessageKind::kAttnOut,
          .dtype = backend_->dtype(),
          .rows = static_cast<uint32_t>(end - begin),
          .row_bytes =
              static_cast<uint32_t>(head_ ? static_cast<size_t>(rank.slice.slice_q_dim()) * elem_ : attn_row),
          .seqno = rank.seqno,
          .verify_checksum = options_.checksums};
      absl::StatusOr<absl::Span<const uint8_t>> payload =
          ReadLayerMessage({static_cast<const uint8_t*>(rank.recv.get()), rank.recv_bytes}, expect);
      if (!payload.ok()) return Annotate(payload.status(), rank.name);
      if (head_) {
        RETURN_IF_ERROR(UnpackHeadSlice(host_copies_, rank.slice, t, elem_, payload->data(), attn_rows));
      } else {
        RETURN_IF_ERROR(backend_->memory().CopyIn(static_cast<uint8_t*>(attn_.get()) + begin * attn_row,
                                                  payload->data(), payload->size()));
      }
    }
    if (head_ && !host) {
      RETURN_IF_ERROR(backend_->memory().CopyIn(attn_.get(), attn_rows, static_cast<size_t>(t) * attn_row));
    }
    backend_->MarkAttention();
    charge(&host_attention_ms_);
    RETURN_IF_ERROR(backend_->PostAttention(layer, attn_.get()));
    charge(&host_compute_ms_);
  }
  return absl::OkStatus();
}

absl::Status ComputeRank::RunLayersOnDevice(const PlannedStep& step) {
  const ModelSpec& s = backend_->spec();
  const size_t qkv_row = static_cast<size_t>(backend_->qkv_width()) * elem_;
  const size_t attn_row = static_cast<size_t>(s.q_dim()) * elem_;
  auto* qkv = static_cast<const uint8_t*>(qkv_.get());
  const int64_t t = step.rows.num_tokens();
  MemorySpace& memory = backend_->memory();  // ordered on `stream`
  void* stream = backend_->stream();
  RETURN_IF_ERROR(backend_->BeginStep(step.rows));
  for (uint32_t layer = 0; layer < static_cast<uint32_t>(s.num_layers); ++layer) {
    RETURN_IF_ERROR(backend_->PreAttention(layer, qkv_.get()));
    for (size_t m = 0; m < ranks_.size(); ++m) {
      Rank& rank = ranks_[m];
      const auto [begin, end] = RowsOf(step, m);
      if (begin == end) continue;
      const void* rows = qkv + begin * qkv_row;
      size_t bytes = static_cast<size_t>(end - begin) * qkv_row;
      if (head_) {
        // Its columns of every row, packed into its own buffer: that buffer is what is written.
        RETURN_IF_ERROR(PackHeadSlice(memory, rank.slice, t, elem_, qkv, rank.pack.get()));
        rows = rank.pack.get();
        bytes = static_cast<size_t>(t * rank.slice.slice_qkv_width()) * elem_;
      }
      RETURN_IF_ERROR(
          Annotate(transport_->EnqueueWrite(rank.peer, rank.qkv_buffer, 0, rows, bytes, ++rank.seqno, stream),
                   rank.name));
    }
    for (size_t m = 0; m < ranks_.size(); ++m) {
      Rank& rank = ranks_[m];
      const auto [begin, end] = RowsOf(step, m);
      if (begin == end) continue;
      // Request partition: its rows of the attention buffer; head partition: its own buffer, from
      // row 0, then scattered into its columns.
      const size_t offset = head_ ? 0 : begin * attn_row;
      const size_t bytes = head_ ? static_cast<size_t>(t * rank.slice.slice_q_dim()) * elem_
                                 : static_cast<size_t>(end - begin) * attn_row;
      RETURN_IF_ERROR(transport_->EnqueueWait(rank.peer, rank.attn_buffer, offset, bytes, rank.seqno,
                                              options_.step_timeout,
                                              absl::StrCat("compute rank: attention output of ", rank.name,
                                                           ", step ", step.plan.step_id, " layer ", layer),
                                              stream));
      if (head_) RETURN_IF_ERROR(UnpackHeadSlice(memory, rank.slice, t, elem_, rank.out.get(), attn_.get()));
    }
    backend_->MarkAttention();
    RETURN_IF_ERROR(backend_->PostAttention(layer, attn_.get()));
  }
  const absl::Status synced = transport_->SyncStream(stream, absl::Now() + 2 * options_.step_timeout);
  if (!synced.ok()) {
    // A memory rank that stopped says why in an error message; prefer that to the wait's error.
    transport::PeerId from = 0;
    std::vector<uint8_t> msg;
    if (transport_->Receive(&from, &msg, absl::Now() + absl::Milliseconds(100)).ok()) {
      absl::StatusOr<ErrorMessage> err = DecodeError(msg);
      if (err.ok()) return Annotate(StatusFromErrorMessage(*err), "a memory rank stopped");
    }
    // A failed peer is named by its address: say which memory rank that is.
    for (size_t m = 0; m < ranks_.size(); ++m) {
      if (absl::StrContains(synced.message(), options_.memory_addresses[m])) {
        return Annotate(synced, absl::StrCat(ranks_[m].name, ", step ", step.plan.step_id));
      }
    }
    return Annotate(synced, absl::StrCat("step ", step.plan.step_id));
  }
  return absl::OkStatus();
}

absl::StatusOr<size_t> ComputeRank::ReceiveFromRank(absl::Time deadline, const std::string& awaited,
                                                    std::vector<uint8_t>* msg) {
  transport::PeerId from = 0;
  RETURN_IF_ERROR(Annotate(transport_->Receive(&from, msg, deadline), absl::StrCat("waiting for ", awaited)));
  size_t m = 0;
  while (m < ranks_.size() && ranks_[m].peer != from) ++m;
  if (m == ranks_.size())
    return absl::InternalError(absl::StrCat("a message from an unknown peer (", awaited, ")"));
  ASSIGN_OR_RETURN(const uint32_t magic, PeekFrameMagic(*msg));
  if (magic == kErrorMagic) {
    ASSIGN_OR_RETURN(const ErrorMessage err, DecodeError(*msg));
    return Annotate(StatusFromErrorMessage(err), ranks_[m].name);
  }
  return m;
}

absl::StatusOr<PipelineTotals> ComputeRank::Pipeline(absl::Duration timeout) {
  PipelineTotals t;
  t.steps = controller_->stats().steps;
  t.step_ms = busy_seconds_ * 1e3;
  const std::vector<std::pair<std::string, double>> phases = backend_->PhaseTotalsMs();
  if (phases.empty()) {
    t.compute_ms = host_compute_ms_;
    t.attention_phase_ms = host_attention_ms_;
    t.phases_timed = backend_->memory().host();  // a GPU backend without `profile` has no timings
  }
  for (const auto& [name, ms] : phases) (name == "attention" ? t.attention_phase_ms : t.compute_ms) += ms;
  const uint64_t cookie = ++stats_cookie_;
  const std::vector<uint8_t> request = EncodeStatsRequest(StatsRequestMessage{cookie});
  for (Rank& rank : ranks_) RETURN_IF_ERROR(Annotate(transport_->Send(rank.peer, request), rank.name));
  t.rank_attention_ms.assign(ranks_.size(), -1.0);
  const absl::Time deadline = absl::Now() + timeout;
  for (size_t got = 0; got < ranks_.size();) {
    std::vector<uint8_t> msg;
    ASSIGN_OR_RETURN(const size_t m, ReceiveFromRank(deadline, "the memory ranks' stats", &msg));
    ASSIGN_OR_RETURN(const uint32_t magic, PeekFrameMagic(msg));
    if (magic != kMemoryStatsMagic) {
      return absl::InvalidArgumentError(absl::StrCat(ranks_[m].name, ": unexpected message (magic 0x",
                                                     absl::Hex(magic), ") instead of its stats"));
    }
    absl::StatusOr<MemoryStatsMessage> stats = DecodeMemoryStats(msg);
    if (!stats.ok()) return Annotate(stats.status(), ranks_[m].name);
    if (stats->cookie != cookie) continue;  // an answer to an earlier request that gave up
    if (stats->memory_rank != m || t.rank_attention_ms[m] >= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(ranks_[m].name, ": stats name memory rank ", stats->memory_rank));
    }
    t.rank_attention_ms[m] = static_cast<double>(stats->attention_ns) * 1e-6;
    ++got;
  }
  return t;
}

absl::StatusOr<GenerationResult> ComputeRank::Cancel(int64_t id) {
  GenerationResult result;
  std::vector<std::vector<uint64_t>> released;
  RETURN_IF_ERROR(controller_->Cancel(id, &result, &released));
  // Named by the last step planned (the memory rank does not use it).
  RETURN_IF_ERROR(SendReleases(step_.plan.step_id, released));
  return result;
}

std::vector<KvUsage> ComputeRank::kv_usage() const {
  std::vector<KvUsage> usage = KvUsageOf(*controller_);
  if (head_) {
    const KvUsage group = usage[0];
    usage.assign(ranks_.size(), group);
  }
  return usage;
}

EngineStats ComputeRank::stats() const {
  const ControllerStats& cs = controller_->stats();
  return {.steps = cs.steps,
          .prefill_tokens = cs.prefill_tokens,
          .decode_tokens = cs.decode_tokens,
          .cached_tokens = cs.cached_tokens,
          .busy_seconds = busy_seconds_};
}

absl::Status ComputeRank::Shutdown() {
  // Best effort: a memory rank exits as soon as its bye arrives, and the transport may report
  // that as a disconnect while the other byes are still going out. A rank that misses its bye is
  // stopped by the launcher.
  ByeMessage bye;
  bye.steps = static_cast<uint64_t>(controller_ ? controller_->stats().steps : 0);
  const std::vector<uint8_t> frame = EncodeBye(bye);
  for (Rank& rank : ranks_) {
    transport_->Close(rank.peer);  // it exits once the bye arrives: not a failure
    absl::Status st = transport_->Send(rank.peer, frame);
    if (!st.ok()) TANDEM_LOG_INFO("compute", rank.name, ": bye not delivered: ", st.message());
  }
  (void)transport_->Flush(absl::Now() + absl::Seconds(5));
  return absl::OkStatus();
}

}  // namespace tandem
