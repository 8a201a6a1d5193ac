#include "compute_node/compute_rank.h"

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
}

ComputeRank::~ComputeRank() = default;

absl::StatusOr<std::unique_ptr<ComputeRank>> ComputeRank::Create(const WeightSource& source,
                                                                 const ComputeRankOptions& options) {
  if (options.memory_addresses.empty()) return absl::InvalidArgumentError("a deployment needs a memory rank");
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
  if (!backend_->memory().host() && !device_path_) {
    ASSIGN_OR_RETURN(qkv_host_, backend_->memory().Allocate(qkv_bytes, true));
  }
  for (size_t m = 0; m < ranks_.size(); ++m) {
    Rank& rank = ranks_[m];
    rank.attn_buffer = kAttnBufferBase + static_cast<uint32_t>(m);
    if (device_path_) {
      // Every rank writes its rows' outputs straight into the attention buffer, at its offset.
      RETURN_IF_ERROR(transport_->RegisterBuffer(rank.attn_buffer, attn_.get(), attn_bytes));
    } else {
      rank.recv_bytes = kLayerMessageHeaderFrameBytes + attn_bytes;
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
    RETURN_IF_ERROR(Annotate(transport_->Send(rank.peer, EncodeHello(hello)), rank.name));
  }
  // Replies, in any order.
  std::vector<int64_t> capacity(ranks_.size(), 0);
  for (size_t got = 0; got < ranks_.size(); ++got) {
    transport::PeerId from = 0;
    std::vector<uint8_t> msg;
    RETURN_IF_ERROR(
        Annotate(transport_->Receive(&from, &msg, deadline), "waiting for the memory ranks' replies"));
    size_t m = 0;
    while (m < ranks_.size() && ranks_[m].peer != from) ++m;
    if (m == ranks_.size()) return absl::InternalError("reply from an unknown peer");
    ASSIGN_OR_RETURN(const uint32_t magic, PeekFrameMagic(msg));
    if (magic == kErrorMagic) {
      ASSIGN_OR_RETURN(const ErrorMessage err, DecodeError(msg));
      return Annotate(StatusFromErrorMessage(err), ranks_[m].name);
    }
    absl::StatusOr<HelloReplyMessage> reply = DecodeHelloReply(msg);
    if (!reply.ok()) return Annotate(reply.status(), ranks_[m].name);
    if (reply->memory_rank != m || reply->dtype != backend_->dtype()) {
      return absl::InvalidArgumentError(absl::StrCat(ranks_[m].name, ": reply names rank ",
                                                     reply->memory_rank, " and dtype ",
                                                     std::string(DTypeName(reply->dtype))));
    }
    ranks_[m].qkv_buffer = reply->qkv_buffer;
    capacity[m] = static_cast<int64_t>(reply->kv_capacity_tokens);
    rank_names_.push_back(
        absl::StrCat("memory rank ", m, ": ", reply->device, ", ", capacity[m], " KV tokens"));
    TANDEM_LOG_INFO("compute", rank_names_.back());
  }
  controller_ = std::make_unique<Controller>(s, capacity, o.scheduler);
  TANDEM_LOG_INFO(
      "compute", "transport ", transport_->capabilities().name, ", ",
      device_path_ ? "device data path (whole steps enqueued, device-side waits)" : "host-staged data path");
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
  RETURN_IF_ERROR(backend_->Finish(&tokens, &logprobs));
  std::vector<std::vector<uint64_t>> released;
  RETURN_IF_ERROR(controller_->Complete(step_, tokens, logprobs, finished, &released));
  for (size_t m = 0; m < ranks_.size(); ++m) {
    if (released[m].empty()) continue;
    ReleaseMessage rel;
    rel.step_id = step_.plan.step_id;
    rel.request_ids = std::move(released[m]);
    RETURN_IF_ERROR(Annotate(transport_->Send(ranks_[m].peer, EncodeRelease(rel)), ranks_[m].name));
  }
  busy_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return absl::OkStatus();
}

absl::Status ComputeRank::RunLayers(const PlannedStep& step) {
  const ModelSpec& s = backend_->spec();
  const int64_t t = step.rows.num_tokens();
  const size_t qkv_row = static_cast<size_t>(backend_->qkv_width()) * elem_;
  const size_t attn_row = static_cast<size_t>(s.q_dim()) * elem_;
  const bool host = backend_->memory().host();
  auto* qkv_rows = static_cast<uint8_t*>(host ? qkv_.get() : qkv_host_.get());
  RETURN_IF_ERROR(backend_->BeginStep(step.rows));
  for (uint32_t layer = 0; layer < static_cast<uint32_t>(s.num_layers); ++layer) {
    RETURN_IF_ERROR(backend_->PreAttention(layer, qkv_.get()));
    if (!host) {
      RETURN_IF_ERROR(
          backend_->memory().CopyOut(qkv_host_.get(), qkv_.get(), static_cast<size_t>(t) * qkv_row));
      RETURN_IF_ERROR(backend_->memory().Synchronize());
    }
    // Each memory rank's rows are one contiguous range of the step's rows.
    for (size_t m = 0; m < ranks_.size(); ++m) {
      Rank& rank = ranks_[m];
      const int32_t begin = step.rank_rows[m], end = step.rank_rows[m + 1];
      if (begin == end) continue;
      const LayerMessageExpect what{.step_id = step.plan.step_id,
                                    .layer = layer,
                                    .kind = LayerMessageKind::kQkv,
                                    .dtype = backend_->dtype(),
                                    .rows = static_cast<uint32_t>(end - begin),
                                    .row_bytes = static_cast<uint32_t>(qkv_row),
                                    .seqno = ++rank.seqno};
      const absl::Span<const uint8_t> body(qkv_rows + begin * qkv_row,
                                           static_cast<size_t>(end - begin) * qkv_row);
      const std::vector<uint8_t> header = MakeLayerMessageHeader(what, body, options_.checksums);
      const absl::Span<const uint8_t> pieces[] = {header, body};
      RETURN_IF_ERROR(
          Annotate(transport_->Write(rank.peer, rank.qkv_buffer, 0, pieces, rank.seqno), rank.name));
    }
    for (size_t m = 0; m < ranks_.size(); ++m) {
      Rank& rank = ranks_[m];
      const int32_t begin = step.rank_rows[m], end = step.rank_rows[m + 1];
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
      const LayerMessageExpect expect{.step_id = step.plan.step_id,
                                      .layer = layer,
                                      .kind = LayerMessageKind::kAttnOut,
                                      .dtype = backend_->dtype(),
                                      .rows = static_cast<uint32_t>(end - begin),
                                      .row_bytes = static_cast<uint32_t>(attn_row),
                                      .seqno = rank.seqno,
                                      .verify_checksum = options_.checksums};
      absl::StatusOr<absl::Span<const uint8_t>> payload =
          ReadLayerMessage({static_cast<const uint8_t*>(rank.recv.get()), rank.recv_bytes}, expect);
      if (!payload.ok()) return Annotate(payload.status(), rank.name);
      RETURN_IF_ERROR(backend_->memory().CopyIn(static_cast<uint8_t*>(attn_.get()) + begin * attn_row,
                                                payload->data(), payload->size()));
    }
    backend_->MarkAttention();
    RETURN_IF_ERROR(backend_->PostAttention(layer, attn_.get()));
  }
  return absl::OkStatus();
}

absl::Status ComputeRank::RunLayersOnDevice(const PlannedStep& step) {
  const ModelSpec& s = backend_->spec();
  const size_t qkv_row = static_cast<size_t>(backend_->qkv_width()) * elem_;
  const size_t attn_row = static_cast<size_t>(s.q_dim()) * elem_;
  auto* qkv = static_cast<const uint8_t*>(qkv_.get());
  void* stream = backend_->stream();
  RETURN_IF_ERROR(backend_->BeginStep(step.rows));
  for (uint32_t layer = 0; layer < static_cast<uint32_t>(s.num_layers); ++layer) {
    RETURN_IF_ERROR(backend_->PreAttention(layer, qkv_.get()));
    for (size_t m = 0; m < ranks_.size(); ++m) {
      Rank& rank = ranks_[m];
      const int32_t begin = step.rank_rows[m], end = step.rank_rows[m + 1];
      if (begin == end) continue;
      RETURN_IF_ERROR(
          Annotate(transport_->EnqueueWrite(rank.peer, rank.qkv_buffer, 0, qkv + begin * qkv_row,
                                            static_cast<size_t>(end - begin) * qkv_row, ++rank.seqno, stream),
                   rank.name));
    }
    for (size_t m = 0; m < ranks_.size(); ++m) {
      Rank& rank = ranks_[m];
      const int32_t begin = step.rank_rows[m], end = step.rank_rows[m + 1];
      if (begin == end) continue;
      RETURN_IF_ERROR(transport_->EnqueueWait(rank.peer, rank.attn_buffer, begin * attn_row,
                                              static_cast<size_t>(end - begin) * attn_row, rank.seqno,
                                              options_.step_timeout,
                                              absl::StrCat("compute rank: attention output of ", rank.name,
                                                           ", step ", step.plan.step_id, " layer ", layer),
                                              stream));
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

absl::StatusOr<GenerationResult> ComputeRank::Cancel(int64_t id) {
  GenerationResult result;
  std::vector<std::vector<uint64_t>> released;
  RETURN_IF_ERROR(controller_->Cancel(id, &result, &released));
  for (size_t m = 0; m < ranks_.size(); ++m) {
    if (released[m].empty()) continue;
    ReleaseMessage rel;
    rel.step_id = step_.plan.step_id;  // the last step planned (the memory rank does not use it)
    rel.request_ids = std::move(released[m]);
    RETURN_IF_ERROR(Annotate(transport_->Send(ranks_[m].peer, EncodeRelease(rel)), ranks_[m].name));
  }
  return result;
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
