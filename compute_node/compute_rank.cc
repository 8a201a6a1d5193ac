#include "compute_node/compute_rank.h"

#include <algorithm>
#include <bit>
#include <chrono>
#include <limits>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/layer_message.h"
#include "common/log.h"
#include "common/status.h"
#include "common/transport/factory.h"
#include "common/transport/transport.h"
#include "common/wire.h"
#include "compute_node/micro_batches.h"

namespace tandem {

namespace {
constexpr uint32_t kAttnBufferBase = 100;  // our receive buffer for memory rank m: 100 + m
// Rotational pipeline: where the previous compute rank writes micro-batch j's residual stream
// (90 + j: below the attention buffers, distinct from them modulo the p2p transport's doorbell
// slots for up to 51 memory ranks).
constexpr uint32_t kResidualBufferBase = 90;
constexpr absl::Duration kMaxProbeInterval = absl::Seconds(30);  // between rejoin probes of a rank

double MsSince(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t).count();
}

// pipeline.q_first on the device path: rank s.rank's columns of `rows` q,k,v rows (rows of
// s.qkv_width() elements of `elem` bytes) split into its q rows at `q` (s.slice_q_dim() each) and
// its k,v rows at `kv` (its k heads then its v heads), three strided copies in `memory`'s order.
// Under the request partition (one slice) that is every row's q and [k | v].
absl::Status PackSplitColumns(MemorySpace& memory, const HeadSlice& s, int64_t rows, size_t elem,
                              const void* qkv, void* q, void* kv) {
  const size_t d = static_cast<size_t>(s.head_dim) * elem, n = static_cast<size_t>(rows);
  const size_t src_pitch = static_cast<size_t>(s.qkv_width()) * elem;
  const size_t q_width = static_cast<size_t>(s.slice_heads()) * d;
  const size_t kv_width = static_cast<size_t>(s.slice_kv_heads()) * d;
  const size_t q_all = static_cast<size_t>(s.num_heads) * d, kv_all = static_cast<size_t>(s.num_kv_heads) * d;
  const size_t q_at = static_cast<size_t>(s.kv_head_begin() * s.group()) * d;
  const size_t kv_at = static_cast<size_t>(s.kv_head_begin()) * d;
  const auto* src = static_cast<const uint8_t*>(qkv);
  auto* kv_dst = static_cast<uint8_t*>(kv);
  RETURN_IF_ERROR(memory.CopyStrided(q, q_width, src + q_at, src_pitch, q_width, n));
  RETURN_IF_ERROR(memory.CopyStrided(kv_dst, 2 * kv_width, src + q_all + kv_at, src_pitch, kv_width, n));
  return memory.CopyStrided(kv_dst + kv_width, 2 * kv_width, src + q_all + kv_all + kv_at, src_pitch,
                            kv_width, n);
}

// Why a process at a lost memory rank's address was not taken back within the step timeout: the
// stage its greeting had reached (the connection, our hello's reply, then the device connection
// that a transport sets up after the hello: nccl's communicators).
std::string RejoinTimedOut(bool hello_sent, bool replied, absl::Duration step_timeout) {
  return absl::StrCat("no ",
                      !hello_sent ? "connection"
                      : !replied  ? "hello reply"
                                  : "device connection (nccl's communicators)",
                      " within ", absl::FormatDuration(step_timeout), " (launch.step_timeout_s)");
}
}  // namespace

ComputeRank::~ComputeRank() = default;

absl::StatusOr<std::unique_ptr<ComputeRank>> ComputeRank::Create(const WeightSource& source,
                                                                 const ComputeRankOptions& options) {
  if (options.memory_addresses.empty()) return absl::InvalidArgumentError("a deployment needs a memory rank");
  RETURN_IF_ERROR(CheckAttentionPartition(options.partition, source.spec().num_kv_heads,
                                          static_cast<int64_t>(options.memory_addresses.size())));
  if (options.micro_batches < 1 || options.micro_batches > static_cast<int>(kMaxMicroBatches)) {
    return absl::InvalidArgumentError(
        absl::StrCat("pipeline.batches: ", options.micro_batches, " must be in [1, ", kMaxMicroBatches, "]"));
  }
  const size_t compute_ranks = 1 + options.replica_addresses.size();
  if (compute_ranks > static_cast<size_t>(options.micro_batches)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "compute.ranks ", compute_ranks, " needs pipeline.batches of at least as many micro-batches (",
        options.micro_batches, ")"));
  }
  if (options.slice_layers < 0 || options.slice_layers > source.spec().num_layers ||
      (options.slice_layers > 0 && compute_ranks < 2)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "pipeline.slice_layers: ", options.slice_layers, " must be in [1, ", source.spec().num_layers,
        "] with 2 or more compute ranks (pipeline.mode rotational; ", compute_ranks, " compute rank(s))"));
  }
  std::unique_ptr<ComputeRank> r(new ComputeRank());
  r->options_ = options;
  r->compute_ranks_ = r->initial_compute_ranks_ = static_cast<int>(compute_ranks);
  RETURN_IF_ERROR(r->Connect(source));
  return r;
}

absl::Status ComputeRank::Connect(const WeightSource& source) {
  const ComputeRankOptions& o = options_;
  const absl::Time deadline = absl::Now() + o.startup_timeout;
  // A replica listens (compute rank 0 connects to it); compute rank 0 only connects.
  ASSIGN_OR_RETURN(transport_, transport::CreateTransport({.kind = o.transport,
                                                           .listen_address = listen_address_,
                                                           .device = o.device,
                                                           .send_timeout = o.step_timeout}));
  transport_->SetDeviceChecksums(o.checksums);
  if (on_listening_) RETURN_IF_ERROR(on_listening_(transport_->address()));
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
  num_layers_ = s.num_layers;
  schedule_ = PipelineSchedule{.compute_ranks = compute_ranks_, .slice_layers = o.slice_layers};
  elem_ = static_cast<size_t>(DTypeSize(backend_->dtype()));
  device_path_ = !backend_->memory().host() && transport_->capabilities().device_polling;
  head_ = o.partition == AttentionPartition::kHead;
  // Lanes (micro-batches in flight) before the hellos: a memory rank on this GPU sizes its KV from
  // what they leave.
  const size_t num_lanes = static_cast<size_t>(o.micro_batches);
  lanes_.resize(num_lanes);
  for (size_t j = 0; j < num_lanes; ++j) {
    if (Runs(j)) RETURN_IF_ERROR(SetUpLane(j));  // else another compute rank's micro-batch
  }
  const int64_t num_ranks = static_cast<int64_t>(ranks_.size());
  for (size_t m = 0; m < ranks_.size(); ++m) {
    Rank& rank = ranks_[m];
    rank.slice = HeadSlice{.num_heads = s.num_heads,
                           .num_kv_heads = s.num_kv_heads,
                           .head_dim = s.head_dim,
                           .num_ranks = head_ ? num_ranks : 1,
                           .rank = head_ ? static_cast<int64_t>(m) : 0};
    rank.lanes.resize(num_lanes);
    for (size_t j = 0; j < num_lanes; ++j) {
      rank.lanes[j].attn_buffer = kAttnBufferBase + static_cast<uint32_t>(m * kMaxMicroBatches + j);
      if (Runs(j)) RETURN_IF_ERROR(SetUpRankLane(m, j));
    }
    if (compute_rank_ > 0) {
      // A replica: compute rank 0's hello set the memory rank up; this one says which it is.
      const ComputeHelloMessage hello{.compute_rank = static_cast<uint16_t>(compute_rank_),
                                      .compute_ranks = static_cast<uint16_t>(compute_ranks_)};
      RETURN_IF_ERROR(Annotate(transport_->Send(rank.peer, EncodeComputeHello(hello)), rank.name));
      continue;
    }
    RETURN_IF_ERROR(Annotate(
        transport_->Send(rank.peer, EncodeHello(MakeHello(m, rank.lanes[0].attn_buffer))), rank.name));
  }
  // Attention-output buffers of rejoining ranks come after every rank's first ones.
  next_attn_buffer_ = kAttnBufferBase + static_cast<uint32_t>(ranks_.size() * kMaxMicroBatches);
  probes_.resize(ranks_.size());
  // Replies, in any order; on compute rank 0 a rank with kv.tiers.persist follows its reply with
  // its persisted blocks reports.
  std::vector<int64_t> capacity(ranks_.size(), 0);
  rank_names_.assign(ranks_.size(), "");     // in rank order, whatever the order of the replies
  std::vector<int> state(ranks_.size(), 0);  // 0: no reply yet, 1: reports to come, 2: done
  std::vector<std::vector<TierBlock>> persisted(ranks_.size());
  for (size_t done = 0; done < ranks_.size();) {
    std::vector<uint8_t> msg;
    ASSIGN_OR_RETURN(const size_t m, ReceiveFromRank(deadline, "the memory ranks' replies", &msg));
    if (state[m] == 1) {
      ASSIGN_OR_RETURN(const bool last, TakePersistedReport(m, msg, &persisted[m]));
      if (last) state[m] = 2, ++done;
      continue;
    }
    if (state[m] == 2) {
      return absl::InvalidArgumentError(absl::StrCat(ranks_[m].name, ": a message (magic 0x",
                                                     absl::Hex(PeekFrameMagic(msg).value_or(0)),
                                                     ") after its hello reply"));
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
    rank_names_[m] = absl::StrCat("memory rank ", m, ": ", reply->device, ", ", capacity[m], " KV tokens",
                                  head_ ? absl::StrCat(" of KV heads [", ranks_[m].slice.kv_head_begin(),
                                                       ", ", ranks_[m].slice.kv_head_end(), ")")
                                        : "");
    TANDEM_LOG_INFO("compute", rank_names_[m]);
    if (reply->persisted && compute_rank_ == 0) {
      state[m] = 1;
    } else {
      state[m] = 2, ++done;
    }
  }
  if (head_) {
    // Every rank holds every request: one placement group, as large as the smallest rank.
    capacity = {*std::min_element(capacity.begin(), capacity.end())};
  }
  if (compute_rank_ > 0) return absl::OkStatus();  // a replica: no controller
  controller_ = std::make_unique<Controller>(s, capacity, o.scheduler);
  for (size_t m = 0; m < ranks_.size(); ++m) {
    if (state[m] == 2 && !persisted[m].empty()) OfferPersisted(m, persisted[m]);
  }
  RETURN_IF_ERROR(ConnectReplicas(deadline));
  TANDEM_LOG_INFO(
      "compute", "transport ", transport_->capabilities().name, ", ",
      device_path_ ? "device data path (whole steps enqueued, device-side waits)" : "host-staged data path",
      ", memory.partition ", AttentionPartitionName(o.partition),
      o.micro_batches > 1 ? absl::StrCat(", pipeline ",
                                         schedule_.rotational() ? absl::StrCat("rotational (slices of ",
                                                                               o.slice_layers, " layers)")
                                                                : (compute_ranks_ > 1 ? "fixed" : "pingpong"),
                                         " over ", o.micro_batches, " micro-batches")
                          : "",
      compute_ranks_ > 1 ? absl::StrCat(" on ", compute_ranks_, " compute ranks") : "",
      o.q_first ? ", q first (k,v after)" : "");
  return absl::OkStatus();
}

absl::Status ComputeRank::SetUpLane(size_t j) {
  const ComputeRankOptions& o = options_;
  Lane& lane = lanes_[j];
  if (lane.backend != nullptr) return absl::OkStatus();
  const size_t t = static_cast<size_t>(o.scheduler.max_tokens_per_step);
  const size_t qkv_bytes = t * static_cast<size_t>(backend_->qkv_width()) * elem_;
  const size_t attn_bytes = t * static_cast<size_t>(backend_->spec().q_dim()) * elem_;
  // The first lane this rank owns runs on backend_ itself, the others on lanes over its weights.
  const bool primary_used =
      std::any_of(lanes_.begin(), lanes_.end(), [&](const Lane& l) { return l.backend == backend_.get(); });
  if (!primary_used) {
    lane.backend = backend_.get();
  } else {
    ASSIGN_OR_RETURN(lane.owned, backend_->CreateLane());
    lane.backend = lane.owned.get();
  }
  ASSIGN_OR_RETURN(lane.qkv, backend_->memory().Allocate(qkv_bytes, false));
  ASSIGN_OR_RETURN(lane.attn, backend_->memory().Allocate(attn_bytes, false));
  if (o.q_first && !device_path_) {
    ASSIGN_OR_RETURN(lane.split, host_copies_.Allocate(qkv_bytes, true));
  } else if (o.q_first && !head_) {
    ASSIGN_OR_RETURN(lane.split, backend_->memory().Allocate(qkv_bytes, false));
  }
  if (!backend_->memory().host() && !device_path_) {
    ASSIGN_OR_RETURN(lane.qkv_host, backend_->memory().Allocate(qkv_bytes, true));
    if (head_) {
      ASSIGN_OR_RETURN(lane.attn_host, backend_->memory().Allocate(attn_bytes, true));
    }
  }
  if (schedule_.rotational()) {
    // The residual stream comes from the previous compute rank into a buffer of its own, copied
    // into the lane's after the wait: written straight into the lane's, it could land before this
    // rank's BeginStep (which embeds into it) had run.
    const size_t resid_bytes = static_cast<size_t>(lane.backend->residual_bytes(static_cast<int64_t>(t)));
    lane.resid_in_bytes = device_path_ ? resid_bytes : kLayerMessageHeaderFrameBytes + resid_bytes;
    ASSIGN_OR_RETURN(lane.resid_in, backend_->memory().Allocate(lane.resid_in_bytes, !device_path_));
    RETURN_IF_ERROR(transport_->RegisterBuffer(kResidualBufferBase + static_cast<uint32_t>(j),
                                               lane.resid_in.get(), lane.resid_in_bytes));
    if (!backend_->memory().host() && !device_path_) {
      ASSIGN_OR_RETURN(lane.resid_host, backend_->memory().Allocate(resid_bytes, true));
    }
  }
  return absl::OkStatus();
}

absl::Status ComputeRank::SetUpRankLane(size_t m, size_t j) {
  return SetUpRankLane(ranks_[m].slice, j, &ranks_[m].lanes[j]);
}

absl::Status ComputeRank::SetUpRankLane(const HeadSlice& slice, size_t j, RankLane* lane) {
  RankLane& rl = *lane;
  if (rl.registered) return absl::OkStatus();  // set up already (a step discard sets up every lane again)
  const size_t t = static_cast<size_t>(options_.scheduler.max_tokens_per_step);
  const size_t pack_bytes = t * static_cast<size_t>(slice.slice_qkv_width()) * elem_;
  const size_t out_bytes = t * static_cast<size_t>(slice.slice_q_dim()) * elem_;
  const size_t attn_bytes = t * static_cast<size_t>(backend_->spec().q_dim()) * elem_;
  if (head_) {
    ASSIGN_OR_RETURN(rl.pack, backend_->memory().Allocate(pack_bytes, !device_path_));
  }
  if (device_path_ && head_) {
    // Its outputs land in a buffer of its own, at row 0, and are scattered into its columns.
    ASSIGN_OR_RETURN(rl.out, backend_->memory().Allocate(out_bytes, false));
    RETURN_IF_ERROR(transport_->RegisterBuffer(rl.attn_buffer, rl.out.get(), out_bytes));
  } else if (device_path_) {
    // Every rank writes its rows' outputs straight into the lane's attention buffer, at its offset.
    RETURN_IF_ERROR(transport_->RegisterBuffer(rl.attn_buffer, lanes_[j].attn.get(), attn_bytes));
  } else {
    rl.recv_bytes = kLayerMessageHeaderFrameBytes + out_bytes;
    ASSIGN_OR_RETURN(rl.recv, backend_->memory().Allocate(rl.recv_bytes, true));
    RETURN_IF_ERROR(transport_->RegisterBuffer(rl.attn_buffer, rl.recv.get(), rl.recv_bytes));
  }
  rl.registered = true;
  return absl::OkStatus();
}

HelloMessage ComputeRank::MakeHello(size_t m, uint32_t attn_buffer) const {
  const ComputeRankOptions& o = options_;
  const ModelSpec& s = backend_->spec();
  const Rank& rank = ranks_[m];
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
  hello.attn_out_buffer = attn_buffer;
  hello.lanes = static_cast<uint8_t>(lanes_.size());
  // Compute ranks by their numbers at start-up (the compute hellos' and step discards' numbering);
  // the mask says which go on (a rank that rejoins waits for their compute hellos only).
  hello.compute_ranks = static_cast<uint8_t>(initial_compute_ranks_);
  hello.compute_mask = LiveComputeMask();
  hello.slice_layers = static_cast<uint16_t>(schedule_.rotational() ? options_.slice_layers : 0);
  hello.q_first = o.q_first;
  hello.rope = s.rope;
  hello.checksums = o.checksums;
  hello.prefix_block_tokens = static_cast<uint16_t>(o.scheduler.prefix_block_tokens);
  hello.prefix_sharing = static_cast<uint8_t>(o.scheduler.prefix_sharing);
  hello.partition = o.partition;
  hello.kv_head_begin = static_cast<uint32_t>(rank.slice.kv_head_begin());
  hello.kv_head_end = static_cast<uint32_t>(rank.slice.kv_head_end());
  return hello;
}

uint8_t ComputeRank::LiveComputeMask() const {
  unsigned mask = 1;
  for (int c = 1; c < initial_compute_ranks_; ++c) {
    const size_t r = static_cast<size_t>(c - 1);
    if (r < replicas_.size() && replicas_[r].lost) continue;  // (none yet at start-up: every one)
    mask |= 1u << c;
  }
  return static_cast<uint8_t>(mask);
}

absl::Status ComputeRank::ConnectReplicas(absl::Time deadline) {
  for (size_t r = 0; r < options_.replica_addresses.size(); ++r) {
    Replica replica;
    replica.name = absl::StrCat("compute rank ", r + 1, " (", options_.replica_addresses[r], ")");
    replica.place = static_cast<int>(r + 1);
    absl::StatusOr<uint32_t> peer = transport_->Connect(options_.replica_addresses[r]);
    if (!peer.ok()) return Annotate(peer.status(), replica.name);
    replica.peer = *peer;
    replicas_.push_back(std::move(replica));
  }
  // Each says hello once it is connected to every memory rank.
  std::vector<bool> ready(replicas_.size(), false);
  for (size_t got = 0; got < replicas_.size();) {
    std::vector<uint8_t> msg;
    ASSIGN_OR_RETURN(const size_t from, ReceiveFromRank(deadline, "the compute replicas to be ready", &msg));
    if (from < ranks_.size()) {
      return absl::InvalidArgumentError(absl::StrCat(ranks_[from].name, ": unexpected message at start-up"));
    }
    const size_t r = from - ranks_.size();
    absl::StatusOr<ComputeHelloMessage> hello = DecodeComputeHello(msg);
    if (!hello.ok()) return Annotate(hello.status(), replicas_[r].name);
    if (hello->compute_rank != r + 1 || hello->compute_ranks != compute_ranks_ || ready[r]) {
      return absl::InvalidArgumentError(absl::StrCat(replicas_[r].name, ": says it is compute rank ",
                                                     hello->compute_rank, " of ", hello->compute_ranks));
    }
    ready[r] = true;
    ++got;
    TANDEM_LOG_INFO("compute", replicas_[r].name, " ready");
  }
  if (!schedule_.rotational()) return absl::OkStatus();
  // The ring: compute rank 0 -> 1 -> ... -> R-1 -> 0. Rank 0 hands residual streams to replica 1
  // and takes them from the last replica, over the connections it has; with 3 or more compute
  // ranks the replicas connect to their successors, and each says hello again once it has.
  next_peer_ = replicas_.front().peer, next_name_ = replicas_.front().name;
  prev_peer_ = replicas_.back().peer, prev_name_ = replicas_.back().name;
  for (size_t r = 0; r < replicas_.size(); ++r) {
    replicas_[r].next = r + 1 < replicas_.size() ? static_cast<int>(r + 2) : 0;
  }
  if (replicas_.size() < 2) return absl::OkStatus();
  for (size_t r = 0; r < replicas_.size(); ++r) {
    const ReplicaRingMessage ring{.next_address = r + 1 < replicas_.size() ? options_.replica_addresses[r + 1]
                                                                           : std::string()};
    RETURN_IF_ERROR(
        Annotate(transport_->Send(replicas_[r].peer, EncodeReplicaRing(ring)), replicas_[r].name));
  }
  for (size_t got = 0; got < replicas_.size(); ++got) {
    std::vector<uint8_t> msg;
    ASSIGN_OR_RETURN(const size_t from, ReceiveFromRank(deadline, "the compute replicas' ring", &msg));
    if (from < ranks_.size()) {
      return absl::InvalidArgumentError(absl::StrCat(ranks_[from].name, ": unexpected message at start-up"));
    }
    const size_t r = from - ranks_.size();
    absl::StatusOr<ComputeHelloMessage> hello = DecodeComputeHello(msg);
    if (!hello.ok()) return Annotate(hello.status(), replicas_[r].name);
    if (hello->compute_rank != r + 1 || !ready[r]) {
      return absl::InvalidArgumentError(absl::StrCat(
          replicas_[r].name, ": joined the ring twice, or as compute rank ", hello->compute_rank));
    }
    ready[r] = false;
  }
  TANDEM_LOG_INFO("compute", "compute ranks connected in a ring");
  return absl::OkStatus();
}

absl::Status ComputeRank::JoinRing(absl::Time deadline) {
  const std::string me = absl::StrCat("compute rank ", compute_rank_);
  const std::string rank0 = "compute rank 0";
  next_rank_ = (compute_rank_ + 1) % compute_ranks_;
  prev_rank_ = compute_rank_ - 1;
  if (compute_ranks_ == 2) {
    next_peer_ = prev_peer_ = rank0_peer_;
    next_name_ = prev_name_ = rank0;
    return absl::OkStatus();
  }
  std::vector<uint8_t> msg;
  transport::PeerId from = 0;
  // The predecessor's hello can come first (it had its ring message and connected before ours
  // arrived): kept for below.
  std::optional<std::pair<transport::PeerId, std::vector<uint8_t>>> early;
  while (true) {
    RETURN_IF_ERROR(
        Annotate(transport_->Receive(&from, &msg, deadline), absl::StrCat(me, ": the ring from ", rank0)));
    if (from == rank0_peer_) break;
    if (early.has_value() || compute_rank_ == 1 || PeekFrameMagic(msg).value_or(0) != kComputeHelloMagic)
      return absl::InvalidArgumentError(absl::StrCat(me, ": unexpected message before the ring"));
    early.emplace(from, std::move(msg));
  }
  ASSIGN_OR_RETURN(const ReplicaRingMessage ring, DecodeReplicaRing(msg));
  const bool last = compute_rank_ + 1 == compute_ranks_;
  if (ring.next_address.empty() != last) {
    return absl::InvalidArgumentError(absl::StrCat(
        me, ": the ring message ", last ? "names a successor for the last replica" : "names no successor"));
  }
  const ComputeHelloMessage hello{.compute_rank = static_cast<uint16_t>(compute_rank_),
                                  .compute_ranks = static_cast<uint16_t>(compute_ranks_)};
  if (last) {
    next_peer_ = rank0_peer_, next_name_ = rank0;
  } else {
    next_name_ = absl::StrCat("compute rank ", compute_rank_ + 1, " (", ring.next_address, ")");
    ASSIGN_OR_RETURN(next_peer_, transport_->Connect(ring.next_address));
    RETURN_IF_ERROR(Annotate(transport_->Send(next_peer_, EncodeComputeHello(hello)), next_name_));
  }
  if (compute_rank_ == 1) {
    prev_peer_ = rank0_peer_, prev_name_ = rank0;
  } else {
    // The predecessor connects and says which compute rank it is.
    ASSIGN_OR_RETURN(prev_peer_, transport_->Accept(deadline));
    if (early.has_value()) {
      from = early->first;
      msg = std::move(early->second);
    } else {
      RETURN_IF_ERROR(Annotate(transport_->Receive(&from, &msg, deadline),
                               absl::StrCat(me, ": compute rank ", compute_rank_ - 1, "'s hello")));
    }
    ASSIGN_OR_RETURN(const ComputeHelloMessage prev, DecodeComputeHello(msg));
    if (from != prev_peer_ || prev.compute_rank + 1 != compute_rank_) {
      return absl::InvalidArgumentError(absl::StrCat(
          me, ": the connection from its predecessor says it is compute rank ", prev.compute_rank));
    }
    prev_name_ = absl::StrCat("compute rank ", compute_rank_ - 1);
  }
  return Annotate(transport_->Send(rank0_peer_, EncodeComputeHello(hello)), rank0);
}

absl::Status ComputeRank::Step(std::vector<std::pair<int64_t, GenerationResult>>* finished) {
  const auto t0 = std::chrono::steady_clock::now();
  // Between steps: a rank that answered its probe takes requests from this one (under the head
  // partition the heads are split again, which may end requests: reported with this step's).
  RETURN_IF_ERROR(AdvanceRejoins());
  for (auto& ended : ended_while_idle_) finished->push_back(std::move(ended));
  ended_while_idle_.clear();
  controller_->Schedule(&step_);
  if (step_.empty()) return absl::OkStatus();
  if (!step_.has_rows()) {
    // Restores only: the ranks load the blocks and answer; no layers run.
    const std::vector<uint8_t> plan = EncodeStepPlan(step_.plan);
    for (size_t m = 0; m < ranks_.size(); ++m) {
      if (ranks_[m].lost) continue;
      const absl::Status sent = transport_->Send(ranks_[m].peer, plan);
      if (!sent.ok()) RETURN_IF_ERROR(LoseRank(m, Annotate(sent, ranks_[m].name)));
    }
    RETURN_IF_ERROR(CollectRestoreReplies(step_.plan));
    return RecoverLostRanks(finished);
  }
  SampledTokens sampled;
  std::vector<SampledTokens> parts;
  if (options_.micro_batches > 1) {
    const MicroBatches mb = SplitStep(step_, options_.micro_batches);
    absl::Status ran = RunParts(mb.parts, &parts);
    while (!ran.ok()) {
      // A compute replica that failed or went silent is given up and the step runs again without
      // it (its plans stay applied on the memory ranks); anything else fails the step.
      RETURN_IF_ERROR(RecoverFromFailedStep(std::move(ran), step_.plan.step_id));
      if (head_ && !lost_in_step_.empty()) return DropStepForHeads(finished, t0);
      ++steps_rerun_;
      ran = RunParts(mb.parts, &parts, /*rerun=*/true);
    }
    RETURN_IF_ERROR(MergeSampled(mb, parts, &sampled));
  } else {
    absl::Status ran = RunParts(std::span<const PlannedStep>(&step_, 1), &parts);
    while (!ran.ok() && DeviceRecovery()) {
      // The device path: a lost memory rank is given up and the step runs again without it.
      RETURN_IF_ERROR(RecoverFromFailedStep(std::move(ran), step_.plan.step_id));
      if (head_ && !lost_in_step_.empty()) return DropStepForHeads(finished, t0);
      ++steps_rerun_;
      ran = RunParts(std::span<const PlannedStep>(&step_, 1), &parts, /*rerun=*/true);
    }
    RETURN_IF_ERROR(ran);
    sampled = std::move(parts[0]);
  }
  RETURN_IF_ERROR(CollectRestoreReplies(step_.plan));
  RETURN_IF_ERROR(RecoverLostRanks(finished));
  std::vector<std::vector<uint64_t>> released;
  RETURN_IF_ERROR(controller_->Complete(step_, sampled, finished, &released));
  RETURN_IF_ERROR(SendReleases(step_.plan.step_id, released));
  busy_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return absl::OkStatus();
}

absl::Status ComputeRank::DropStepForHeads(std::vector<std::pair<int64_t, GenerationResult>>* finished,
                                           std::chrono::steady_clock::time_point t0) {
  TANDEM_LOG_WARN("compute", "step ", step_.plan.step_id,
                  " is dropped: under memory.partition head every request in it had KV heads on the lost "
                  "rank, so none of its tokens are kept");
  RETURN_IF_ERROR(RecoverLostRanks(finished));  // every request requeued, the heads split again
  busy_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return absl::OkStatus();
}

bool ComputeRank::CanRecoverReplica() const {
  // The step runs again on the surviving compute ranks: on the host-staged path (the memory ranks'
  // and the replicas' waits can be left; under pipeline.mode rotational the ring closes over the
  // lost rank, docs/architecture.md, "Failures"), and on a device path that can be reset (every
  // rank drains and resets it first). A rotational ring made anew on a device path also needs the
  // lost rank's neighbours to reach each other there at once (device_path_new_peers: p2p and nccl;
  // deploy/deployment.cc keeps it off on nccl, where it has not been run).
  const transport::Capabilities& caps = transport_->capabilities();
  return options_.recover_compute_replicas && compute_rank_ == 0 && compute_ranks_ >= 2 &&
         (!device_path_ ||
          (caps.device_path_reset && (options_.slice_layers == 0 || caps.device_path_new_peers)));
}

bool ComputeRank::CanRecoverByRerun() const {
  // The step is discarded on every rank and run again without the memory rank, by the same compute
  // ranks (told which memory ranks are lost): on the host-staged path while replicas run (with one
  // compute rank CanRecover applies instead), and on the device path (DeviceRecovery). Under the
  // head partition the step is dropped instead (DropStepForHeads) and the heads split again.
  return options_.recover_memory_ranks && compute_rank_ == 0 &&
         ((!device_path_ && compute_ranks_ > 1) || DeviceRecovery());
}

bool ComputeRank::DeviceRecovery() const {
  // The device path enqueues the whole step, so a memory rank's loss cannot be stepped around: the
  // step is discarded and run again, with every rank's device path reset once it has drained (the
  // replicas' too: KeepAfterDiscard). A transport whose device path can be reset (p2p, nccl). Under the
  // head partition the discarded step is dropped and the heads split again (DropStepForHeads).
  return options_.recover_memory_ranks && device_path_ && compute_rank_ == 0 &&
         transport_->capabilities().device_path_reset;
}

absl::Status ComputeRank::RecoverFromFailedStep(absl::Status ran, uint64_t step_id) {
  // Which replica failed: the one whose connection failed or that says it stopped. The memory
  // rank's disconnect may reach us before the replica's own: the transport gets a moment (the
  // failure path only) to report it. Restore replies that come meanwhile are kept for after the
  // step; an error report of a memory rank means the step cannot go on.
  absl::Status memory_told;
  std::optional<size_t> told_rank;  // the memory rank that sent memory_told
  std::optional<size_t> failed;
  absl::Status failed_why;
  auto find = [&](size_t r, absl::Status why) {
    if (!failed.has_value()) failed = r, failed_why = std::move(why);
  };
  auto drain = [&](absl::Time until) {
    transport::PeerId from = 0;
    std::vector<uint8_t> msg;
    while (transport_->Receive(&from, &msg, until).ok()) {
      until = absl::Now();
      if (TakeStrayMessage(from, &msg)) continue;
      const uint32_t magic = PeekFrameMagic(msg).value_or(0);
      for (size_t m = 0; m < ranks_.size(); ++m) {
        if (ranks_[m].peer != from || ranks_[m].lost) continue;
        if (magic == kRestoreReplyMagic) {
          early_replies_.emplace_back(m, std::move(msg));
        } else if (magic == kErrorMagic) {
          absl::StatusOr<ErrorMessage> err = DecodeError(msg);
          if (err.ok() && memory_told.ok()) {
            memory_told = Annotate(StatusFromErrorMessage(*err), ranks_[m].name);
            told_rank = m;
          }
        } else {
          (void)TakeHeartbeatReply(m, msg);
        }
      }
      for (size_t r = 0; r < replicas_.size(); ++r) {
        if (replicas_[r].peer != from || replicas_[r].lost) continue;
        if (magic == kErrorMagic) {
          absl::StatusOr<ErrorMessage> err = DecodeError(msg);
          if (err.ok())
            find(r, Annotate(StatusFromErrorMessage(*err), absl::StrCat(replicas_[r].name, " stopped")));
        } else {
          (void)TakeReplicaControl(r, msg);  // a late result of the failed step is dropped
        }
      }
    }
  };
  auto peer_failed = [&] {
    for (size_t r = 0; r < replicas_.size(); ++r) {
      if (replicas_[r].lost) continue;
      if (absl::Status peer = transport_->PeerStatus(replicas_[r].peer); !peer.ok()) find(r, peer);
    }
  };
  // A memory rank whose connection failed: the moment for a replica's disconnect is not waited out
  // (whichever failed, the step is discarded and run again).
  auto memory_failed = [&] {
    return std::any_of(ranks_.begin(), ranks_.end(), [&](const Rank& rank) {
      return !rank.lost && !transport_->PeerStatus(rank.peer).ok();
    });
  };
  // (After a deadline nothing disconnected: no moment to wait for.)
  const absl::Time until =
      absl::Now() + (absl::IsDeadlineExceeded(ran) ? absl::ZeroDuration() : absl::Seconds(1));
  do {
    peer_failed();
    if (failed.has_value() || !memory_told.ok() || (CanRecoverByRerun() && memory_failed())) break;
    drain(std::min(until, absl::Now() + absl::Milliseconds(50)));
  } while (absl::Now() < until);
  // Memory ranks that left a heartbeat unanswered after the step's deadline (with their reasons).
  std::vector<std::pair<size_t, absl::Status>> silent;
  if (!failed.has_value() && memory_told.ok() && absl::IsDeadlineExceeded(ran)) {
    // Nothing failed but the step's deadline passed: a replica, or a memory rank, that does not
    // answer a heartbeat within a quarter of the step timeout (at least 0.25 s, at most 5 s; a live
    // one answers from its waits within 0.1 s) is silent: stopped, hung or cut off. Compute rank 0
    // may not have waited on the silent memory rank itself (none of its micro-batches has rows
    // there: a replica waits on it, and this rank on the replica), so every memory rank is asked
    // too, in the same window. The memory ranks wait twice the step timeout for a layer's input,
    // so they are still there for the rerun.
    const absl::Duration allowance =
        std::clamp(options_.step_timeout / 4, absl::Milliseconds(250), absl::Seconds(5));
    const int64_t silence_ms = SilenceMs();
    const absl::Time sent = absl::Now();
    for (Replica& replica : replicas_) {
      if (replica.lost) continue;
      replica.beat_seq = ++beat_seq_;
      replica.beat_sent = sent;
      (void)transport_->Send(
          replica.peer,
          EncodeHeartbeat({.seq = replica.beat_seq, .silence_ms = static_cast<uint32_t>(silence_ms)}));
    }
    BeatMemoryRanks(sent, silence_ms);  // a failed send is the rank's connection failing: found below
    auto answered = [&] {
      return std::all_of(replicas_.begin(), replicas_.end(),
                         [](const Replica& r) { return r.lost || r.beat_seq == 0; }) &&
             std::all_of(ranks_.begin(), ranks_.end(),
                         [](const Rank& r) { return r.lost || r.beat_seq == 0; });
    };
    while (!answered() && !failed.has_value() && memory_told.ok() && absl::Now() < sent + allowance) {
      drain(std::min(sent + allowance, absl::Now() + absl::Milliseconds(50)));
      peer_failed();
    }
    const std::string unanswered =
        absl::StrCat("no answer to a heartbeat for ", absl::FormatDuration(absl::Now() - sent),
                     " after step ", step_id, " passed its deadline (launch.step_timeout_s ",
                     absl::ToDoubleSeconds(options_.step_timeout), "): stopped, hung or cut off");
    for (size_t r = 0; r < replicas_.size() && memory_told.ok(); ++r) {
      if (replicas_[r].lost || replicas_[r].beat_seq == 0) continue;
      find(r, absl::DeadlineExceededError(unanswered));
    }
    // A silent replica is the one to blame (the memory ranks it left waiting answer); else the
    // memory ranks that did not answer, never one that did.
    for (size_t m = 0; m < ranks_.size() && !failed.has_value() && memory_told.ok(); ++m) {
      if (ranks_[m].lost || ranks_[m].beat_seq == 0 || !transport_->PeerStatus(ranks_[m].peer).ok()) continue;
      silent.emplace_back(m, absl::DeadlineExceededError(absl::StrCat(ranks_[m].name, ": ", unanswered)));
    }
  }
  if (failed.has_value() && CanRecoverReplica()) {
    failed_ranks_.clear();  // a memory rank that waited on the replica is not to blame
    // The device path: as for a memory rank's loss (below), nothing of the failed attempt may be in
    // flight when the rerun writes.
    if (device_path_) {
      RETURN_IF_ERROR(Annotate(transport_->ResetDevicePath(backend_->stream()),
                               absl::StrCat("recovering step ", step_id)));
    }
    RETURN_IF_ERROR(LoseReplica(*failed, failed_why, step_id));
    return device_path_ ? AwaitDrained(step_id) : absl::OkStatus();
  }
  if (!failed.has_value() && CanRecoverByRerun()) {
    // No replica failed: a memory rank did (it said so, its connection failed, or, when neither,
    // a wait for it passed its deadline while every replica answered: failed_ranks_). The rank is
    // given up, its requests to be recomputed, and the step runs again on the same compute ranks,
    // which the step discard tells that the rank is lost.
    std::vector<std::pair<size_t, absl::Status>> lose;
    if (told_rank.has_value()) lose.emplace_back(*told_rank, memory_told);
    for (size_t m = 0; m < ranks_.size(); ++m) {
      if (ranks_[m].lost || (told_rank.has_value() && *told_rank == m)) continue;
      if (absl::Status peer = transport_->PeerStatus(ranks_[m].peer); !peer.ok())
        lose.emplace_back(m, Annotate(peer, ranks_[m].name));
    }
    // Then the memory ranks silent past the step's deadline (a rank this one waited on that
    // answered its heartbeat was only left waiting by a silent one), and only when none, the ranks
    // a wait of this one timed out on.
    if (lose.empty()) lose = silent.empty() ? std::move(failed_ranks_) : std::move(silent);
    failed_ranks_.clear();
    // On the device path with no memory rank left there is nothing to run again on: the step's own
    // error (naming the rank and the layer), below.
    const size_t live = static_cast<size_t>(
        std::count_if(ranks_.begin(), ranks_.end(), [](const Rank& r) { return !r.lost; }));
    if (!lose.empty() && (!device_path_ || lose.size() < live)) {
      TANDEM_LOG_WARN("compute", "step ", step_id, " failed: ", ran.message(),
                      "; compute rank 0 discards it to recover ", ranks_[lose[0].first].name);
      // The device path: this rank's step has drained (SyncStream released its waits and wrote
      // nothing more); the memory ranks drain theirs when the discard comes and answer a heartbeat
      // after it (AwaitDrained) before the rerun writes anything to them.
      if (device_path_) {
        RETURN_IF_ERROR(Annotate(transport_->ResetDevicePath(backend_->stream()),
                                 absl::StrCat("recovering step ", step_id)));
      }
      ASSIGN_OR_RETURN(const Regrouped regrouped, Regroup(step_id, lose));
      if (device_path_) RETURN_IF_ERROR(AwaitDrained(step_id));
      if (head_) return absl::OkStatus();  // dropped, not run again (DropStepForHeads)
      TANDEM_LOG_WARN("compute", "step ", step_id, " runs again without it on ", compute_ranks_,
                      " compute rank(s)",
                      regrouped.kept.empty() ? std::string() : absl::StrCat(" (kept: ", regrouped.kept, ")"));
      return absl::OkStatus();
    }
  }
  failed_ranks_.clear();
  if (!memory_told.ok()) return memory_told;
  // The step fails (the deployment stops): failed memory ranks are let go first, so that their
  // failure does not cut later waits short.
  for (const Rank& rank : ranks_) {
    if (!transport_->PeerStatus(rank.peer).ok()) transport_->Close(rank.peer);
  }
  if (failed.has_value()) return Annotate(ran, absl::StrCat(replicas_[*failed].name, " failed"));
  if (!silent.empty()) {
    // Without recovery the step fails naming the memory rank that went silent.
    return absl::DeadlineExceededError(absl::StrCat(silent[0].second.message(), " (", ran.message(), ")"));
  }
  for (size_t r = 0; r < replicas_.size(); ++r) {
    if (absl::StrContains(ran.message(), options_.replica_addresses[r])) {
      return Annotate(ran, absl::StrCat(replicas_[r].name, " failed"));
    }
  }
  return ran;
}

absl::Status ComputeRank::LoseReplica(size_t r, const absl::Status& why, uint64_t step_id) {
  Replica& replica = replicas_[r];
  replica.lost = true;
  replica.unanswered = 0;
  transport_->Close(replica.peer);      // its failure no longer fails waits on the others
  retired_peers_.insert(replica.peer);  // and whatever it still sends is dropped
  ++compute_ranks_lost_;
  // The others go on, each as its place among the survivors (under rotational the lost rank's ring
  // neighbours are connected to each other: Regroup; on p2p's device path the new connection's
  // greeting brings the successor's residual buffers).
  ASSIGN_OR_RETURN(const Regrouped regrouped, Regroup(step_id, {}));
  TANDEM_LOG_WARN("compute", "giving up ", replica.name, ": ", why.message(), "; ",
                  step_id != 0 ? absl::StrCat("step ", step_id, " runs again, and ") : std::string(),
                  compute_ranks_ == 1
                      ? std::string("compute rank 0 runs every micro-batch from now on")
                      : absl::StrCat(compute_ranks_, " compute ranks run the micro-batches from now on"),
                  " (", compute_ranks_lost_, " compute replica(s) lost",
                  regrouped.kept.empty() ? std::string() : absl::StrCat("; kept: ", regrouped.kept), ")");
  return absl::OkStatus();
}

absl::Status ComputeRank::MarkRankLost(size_t m, const absl::Status& why) {
  Rank& rank = ranks_[m];
  if (rank.lost) return absl::OkStatus();
  rank.lost = true;
  transport_->Close(rank.peer);      // its failure no longer fails waits on the others
  retired_peers_.insert(rank.peer);  // and whatever it still sends is dropped
  lost_in_step_.push_back(m);
  ++memory_ranks_lost_;
  TANDEM_LOG_WARN("compute", "giving up ", rank.name, ": ", why.message());
  const bool any = std::any_of(ranks_.begin(), ranks_.end(), [](const Rank& r) { return !r.lost; });
  if (!any) return Annotate(why, "every memory rank is lost");
  return absl::OkStatus();
}

absl::StatusOr<ComputeRank::Regrouped> ComputeRank::Regroup(
    uint64_t step_id, std::span<const std::pair<size_t, absl::Status>> lose) {
  // The replicas still running are kept, each the pipeline's compute rank of its place among them
  // (in rank order); the step discard below tells them.
  std::vector<size_t> kept;
  uint8_t mask = 1;
  for (size_t r = 0; r < replicas_.size(); ++r) {
    Replica& replica = replicas_[r];
    if (replica.lost) continue;
    kept.push_back(r);
    replica.place = static_cast<int>(kept.size());
    ++replica.unanswered;
    mask = static_cast<uint8_t>(mask | (1u << (r + 1)));
  }
  // The micro-batches over the compute ranks that go on: a pipeline of that many ranks (one left:
  // every micro-batch on compute rank 0, the pipeline's micro-batches kept, pingpong).
  compute_ranks_ = 1 + static_cast<int>(kept.size());
  schedule_ = PipelineSchedule{.compute_ranks = compute_ranks_,
                               .slice_layers = compute_ranks_ > 1 ? options_.slice_layers : 0};
  // Rotational: the ring over the compute ranks that go on, in rank order (0 -> kept... -> 0). This
  // rank's neighbours are replicas it has connections to; a kept replica whose successor is now
  // another replica is told its address after the discard (ring, below), one whose successor is
  // now this rank uses its connection to it (each replica works that out from the mask, as this).
  std::vector<size_t> ring;  // kept replicas with a new successor replica
  if (schedule_.rotational()) {
    next_peer_ = replicas_[kept.front()].peer, next_name_ = replicas_[kept.front()].name;
    prev_peer_ = replicas_[kept.back()].peer, prev_name_ = replicas_[kept.back()].name;
    for (size_t i = 0; i < kept.size(); ++i) {
      Replica& replica = replicas_[kept[i]];
      const int next = i + 1 < kept.size() ? static_cast<int>(kept[i + 1] + 1) : 0;
      if (next == replica.next) continue;
      replica.next = next;
      if (next != 0) ring.push_back(kept[i]);
    }
  }
  for (size_t j = 0; j < lanes_.size(); ++j) {
    if (!Runs(j)) continue;  // a replica's
    RETURN_IF_ERROR(SetUpLane(j));
    for (size_t m = 0; m < ranks_.size(); ++m) RETURN_IF_ERROR(SetUpRankLane(m, j));
  }
  // Memory ranks to give up: before the discard, which they do not get and which names them.
  for (const auto& [m, why] : lose) RETURN_IF_ERROR(MarkRankLost(m, why));
  // Every doorbell starts again above anything written so far, on every rank (doorbells only
  // grow): a late write of the failed attempt can never satisfy a wait of the rerun. A memory rank
  // the discard cannot reach is given up too, and the discard goes out again (a new base) naming it.
  StepDiscardMessage d{.step_id = step_id, .compute_mask = mask};
  for (bool again = true; again;) {
    again = false;
    d.seqno_base = ++seqno_ceiling_;
    // Under the head partition a memory rank lost in the step held KV heads of all of it: dropped.
    d.drop = head_ && !lost_in_step_.empty();
    d.lost_memory_ranks.clear();
    for (size_t m = 0; m < ranks_.size(); ++m) {
      if (ranks_[m].lost) d.lost_memory_ranks.push_back(static_cast<uint16_t>(m));
    }
    const std::vector<uint8_t> discard = EncodeStepDiscard(d);
    for (size_t m = 0; m < ranks_.size() && !again; ++m) {
      if (ranks_[m].lost) continue;
      const absl::Status sent = transport_->Send(ranks_[m].peer, discard);
      if (sent.ok()) continue;
      if (!CanRecoverByRerun()) return Annotate(sent, ranks_[m].name);
      RETURN_IF_ERROR(MarkRankLost(m, Annotate(sent, ranks_[m].name)));
      again = true;
    }
  }
  for (Rank& rank : ranks_) {
    for (RankLane& rl : rank.lanes) rl.seqno = d.seqno_base;
  }
  for (Lane& lane : lanes_) lane.resid_in_seqno = lane.resid_out_seqno = d.seqno_base;
  // The same discard keeps each replica. Best effort: one that cannot be told fails the rerun (its
  // answer never comes) and is given up then.
  const std::vector<uint8_t> discard = EncodeStepDiscard(d);
  Regrouped names;
  for (size_t r : kept) {
    (void)transport_->Send(replicas_[r].peer, discard);
    absl::StrAppend(&names.kept, names.kept.empty() ? "" : ", ", replicas_[r].name, " as compute rank ",
                    replicas_[r].place);
  }
  // After its discard (one connection delivers in order): the replica that connects to a new
  // successor replica gets its address, as at start-up (ConnectReplicas).
  for (size_t r : ring) {
    const size_t next = static_cast<size_t>(replicas_[r].next - 1);
    (void)transport_->Send(replicas_[r].peer,
                           EncodeReplicaRing({.next_address = options_.replica_addresses[next]}));
    TANDEM_LOG_INFO("compute", "the ring goes from ", replicas_[r].name, " to ", replicas_[next].name,
                    " from now on");
  }
  replicas_kept_ += static_cast<int64_t>(kept.size());
  if (!kept.empty()) {
    TANDEM_LOG_INFO("compute", "step discard",
                    step_id != 0 ? absl::StrCat(" of step ", step_id) : std::string(), ": ", compute_ranks_,
                    " compute ranks go on (kept: ", names.kept, "), seqnos from ", d.seqno_base,
                    d.lost_memory_ranks.empty() ? std::string() : ", without the memory ranks lost");
  }
  return names;
}

absl::Status ComputeRank::AwaitKeptReplicas() {
  const absl::Time deadline = absl::Now() + options_.step_timeout;
  auto waiting = [&] {
    return std::any_of(replicas_.begin(), replicas_.end(),
                       [](const Replica& r) { return !r.lost && r.unanswered > 0; });
  };
  while (waiting()) {
    std::vector<uint8_t> msg;
    // The answers are taken by ReceiveFromRank (TakeReplicaControl), which then waits on: it is
    // called for short slices, and what else comes is returned.
    absl::StatusOr<size_t> got =
        ReceiveFromRank(std::min(deadline, absl::Now() + absl::Milliseconds(20)),
                        "the kept compute replicas' answers to the step discard", &msg);
    if (!got.ok() && absl::IsDeadlineExceeded(got.status()) && absl::Now() < deadline) continue;
    ASSIGN_OR_RETURN(const size_t from, std::move(got));
    if (from < ranks_.size() && PeekFrameMagic(msg).value_or(0) == kRestoreReplyMagic) {
      early_replies_.emplace_back(from, std::move(msg));  // read after the step (CollectRestoreReplies)
      continue;
    }
    const std::string& name = from < ranks_.size() ? ranks_[from].name : replicas_[from - ranks_.size()].name;
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": unexpected message (magic 0x", absl::Hex(PeekFrameMagic(msg).value_or(0)),
                     ") while the kept compute replicas' answers were awaited"));
  }
  return absl::OkStatus();
}

void ComputeRank::BeatMemoryRanks(absl::Time sent, int64_t silence_ms) {
  for (Rank& rank : ranks_) {
    if (rank.lost) continue;
    rank.beat_seq = ++beat_seq_;
    rank.beat_sent = sent;
    (void)transport_->Send(
        rank.peer, EncodeHeartbeat({.seq = rank.beat_seq, .silence_ms = static_cast<uint32_t>(silence_ms)}));
  }
}

absl::Status ComputeRank::AwaitDrained(uint64_t step_id) {
  // A heartbeat after the discard: a memory rank takes it only once it has drained the discarded
  // step and reset its device path (it reads its messages in order). One that does not answer
  // within the step timeout, or fails meanwhile, is given up too, and the discard goes out again.
  while (true) {
    const absl::Time sent = absl::Now();
    BeatMemoryRanks(sent, SilenceMs());
    const absl::Time deadline = sent + options_.step_timeout;
    std::vector<std::pair<size_t, absl::Status>> lose;
    while (lose.empty()) {
      bool waiting = false;
      for (size_t m = 0; m < ranks_.size(); ++m) {
        if (ranks_[m].lost || ranks_[m].beat_seq == 0) continue;
        waiting = true;
        if (absl::Status peer = transport_->PeerStatus(ranks_[m].peer); !peer.ok()) {
          lose.emplace_back(m, Annotate(peer, ranks_[m].name));
        } else if (absl::Now() >= deadline) {
          lose.emplace_back(
              m, absl::DeadlineExceededError(absl::StrCat(
                     ranks_[m].name, ": no answer within ", absl::FormatDuration(options_.step_timeout),
                     " after the discard of step ", step_id, " (launch.step_timeout_s)")));
        }
      }
      if (!waiting) return absl::OkStatus();
      if (!lose.empty()) break;
      transport::PeerId from = 0;
      std::vector<uint8_t> msg;
      if (!transport_->Receive(&from, &msg, std::min(deadline, absl::Now() + absl::Milliseconds(20))).ok())
        continue;
      if (TakeStrayMessage(from, &msg)) continue;
      // A kept replica's answer to the discard (AwaitKeptReplicas counts it) or a heartbeat reply;
      // anything else of a replica's is left to the rerun, which finds a replica that failed.
      for (size_t r = 0; r < replicas_.size(); ++r) {
        if (replicas_[r].peer == from && !replicas_[r].lost) (void)TakeReplicaControl(r, msg);
      }
      for (size_t m = 0; m < ranks_.size(); ++m) {
        if (ranks_[m].peer != from || ranks_[m].lost) continue;
        const uint32_t magic = PeekFrameMagic(msg).value_or(0);
        if (magic == kRestoreReplyMagic) {
          early_replies_.emplace_back(m, std::move(msg));  // read after the step (CollectRestoreReplies)
        } else if (magic == kErrorMagic) {
          absl::StatusOr<ErrorMessage> err = DecodeError(msg);
          lose.emplace_back(m,
                            Annotate(err.ok() ? StatusFromErrorMessage(*err) : err.status(), ranks_[m].name));
        } else {
          absl::StatusOr<bool> beat = TakeHeartbeatReply(m, msg);
          if (!beat.ok()) lose.emplace_back(m, beat.status());
        }
        break;
      }
    }
    TANDEM_LOG_WARN("compute", "step ", step_id, ": ", ranks_[lose[0].first].name,
                    " did not answer after the step discard; it is given up too");
    ASSIGN_OR_RETURN(const Regrouped regrouped, Regroup(step_id, lose));
    (void)regrouped;
  }
}

int64_t ComputeRank::SilenceMs() const {
  return options_.heartbeat > absl::ZeroDuration()
             ? std::clamp<int64_t>(absl::ToInt64Milliseconds(options_.heartbeat + options_.step_timeout), 1,
                                   kMaxHeartbeatSilenceMs)
             : kMaxHeartbeatSilenceMs;
}

absl::Status ComputeRank::WaitInput(uint32_t buffer, uint64_t seqno, absl::Time deadline) {
  if (compute_rank_ == 0) return transport_->WaitDoorbell(buffer, seqno, deadline);
  // A replica answers compute rank 0's heartbeats while it waits: after a step deadline compute
  // rank 0 asks each replica, and gives up the one that does not answer.
  while (true) {
    const absl::Status st =
        transport_->WaitDoorbell(buffer, seqno, std::min(deadline, absl::Now() + absl::Milliseconds(100)));
    if (!absl::IsDeadlineExceeded(st) || absl::Now() >= deadline) return st;
    const absl::Status polled = ReplicaPoll();
    if (rank0_discard_.has_value()) return AwaitRank0(polled);  // applies it: released or kept
    RETURN_IF_ERROR(polled);
  }
}

absl::Status ComputeRank::ReplicaPoll() {
  // A replica's messages within a step (WaitInput between its host-staged waits; the transport's
  // device poll while its host waits on the device path): heartbeats answered, a step discard
  // kept (Aborted: on the device path the step's waits are released and it drains).
  transport::PeerId from = 0;
  std::vector<uint8_t> msg;
  absl::Status got;
  while ((got = transport_->Receive(&from, &msg, absl::Now())).ok()) {
    if (FromLostRank(from)) continue;  // whatever a memory rank given up still sends
    ASSIGN_OR_RETURN(const uint32_t magic, PeekFrameMagic(msg));
    if (KeepEarlyRingHello(from, magic, &msg)) continue;
    if (from == rank0_peer_ && magic == kHeartbeatMagic) {
      ASSIGN_OR_RETURN(const HeartbeatMessage beat, DecodeHeartbeat(msg));
      const HeartbeatReplyMessage reply{.seq = beat.seq, .memory_rank = static_cast<uint16_t>(compute_rank_)};
      RETURN_IF_ERROR(transport_->Send(rank0_peer_, EncodeHeartbeatReply(reply)));
      continue;
    }
    if (from == rank0_peer_ && magic == kStepDiscardMagic) {
      rank0_discard_ = std::move(msg);
      return absl::AbortedError(
          absl::StrCat("compute rank ", compute_rank_, ": step discarded by compute rank 0"));
    }
    if (magic == kErrorMagic) {
      ASSIGN_OR_RETURN(const ErrorMessage err, DecodeError(msg));
      return Annotate(StatusFromErrorMessage(err),
                      from == rank0_peer_ ? "compute rank 0 stopped" : "a memory rank stopped");
    }
    return absl::InvalidArgumentError(
        absl::StrCat("unexpected message (magic 0x", absl::Hex(magic), ") within a step"));
  }
  return absl::IsDeadlineExceeded(got) ? absl::OkStatus() : got;
}

absl::Status ComputeRank::RunParts(std::span<const PlannedStep> parts, std::vector<SampledTokens>* sampled,
                                   bool rerun) {
  const size_t n = parts.size();
  sampled->assign(n, {});
  // With replicas running, a memory rank LoseRank cannot give up yet fails the step (see LoseRank).
  struct InParts {
    bool* flag;
    ~InParts() { *flag = false; }
  } in_parts{&in_parts_};
  in_parts_ = compute_rank_ == 0 && (compute_ranks_ > 1 || DeviceRecovery());
  if (compute_rank_ == 0) {
    seqno_ceiling_ += static_cast<uint64_t>(num_layers_) * (options_.q_first ? 2 : 1);
    // Every plan first (micro-batches in order; a rerun's are applied already), then the replicas'
    // parts, then the layers. A failed send does not stop the plans to the other ranks: a rerun
    // after it expects every surviving rank to have them.
    absl::Status plans_sent;
    for (const PlannedStep& part : rerun ? std::span<const PlannedStep>() : parts) {
      const std::vector<uint8_t> plan = EncodeStepPlan(part.plan);
      for (size_t m = 0; m < ranks_.size(); ++m) {
        if (ranks_[m].lost) continue;
        const absl::Status sent = transport_->Send(ranks_[m].peer, plan);
        if (sent.ok()) continue;
        if (absl::Status lost = LoseRank(m, Annotate(sent, ranks_[m].name)); !lost.ok() && plans_sent.ok())
          plans_sent = std::move(lost);
      }
    }
    RETURN_IF_ERROR(plans_sent);
    // Replicas kept by a step discard first answer it: what they sent before is dropped.
    RETURN_IF_ERROR(AwaitKeptReplicas());
    // Each replica gets the parts it runs any layer of (fixed: its own; rotational: most often all),
    // by its place among the compute ranks that go on.
    for (const PlannedStep& part : parts) {
      for (size_t r = 0; r < replicas_.size(); ++r) {
        if (replicas_[r].lost || !schedule_.Touches(replicas_[r].place, part.plan.micro_batch, num_layers_))
          continue;
        const ReplicaStepMessage msg{.plan = part.plan, .tokens = part.rows.tokens};
        RETURN_IF_ERROR(
            Annotate(transport_->Send(replicas_[r].peer, EncodeReplicaStep(msg)), replicas_[r].name));
      }
    }
  }
  // This rank's parts k, run on lane j = their micro-batch index.
  std::vector<size_t> mine;
  for (size_t k = 0; k < n; ++k) {
    if (Runs(parts[k].plan.micro_batch)) mine.push_back(k);
  }
  auto lane_of = [&](size_t k) -> Lane& { return lanes_[parts[k].plan.micro_batch]; };
  const bool host = backend_->memory().host();
  // On the CPU the backend's calls are its compute time and the waits for the memory ranks the
  // attention phase (a GPU backend times its phases itself, with `profile`).
  auto mark = std::chrono::steady_clock::now();
  auto charge = [&](double* to) {
    if (!host) return;
    *to += MsSince(mark);
    mark = std::chrono::steady_clock::now();
  };
  // The first lane (the backend itself) begins first and finishes last: it opens and closes the
  // step's phase timeline for its lanes (ComputeBackend::CreateLane).
  for (size_t k : mine) RETURN_IF_ERROR(lane_of(k).backend->BeginStep(parts[k].rows));
  // Interleaved: layer l of micro-batch j runs its linear parts while the memory ranks run the
  // attention of the micro-batches sent before it. With one micro-batch this is the plain
  // sequence QKV -> send -> wait -> rest of the layer.
  // Rotational: a rank runs the layers of a micro-batch that the schedule gives it (receiving the
  // residual stream first where it comes from the previous rank, handing it on where the next
  // layer belongs to the next rank) and only counts the layers it neither sends nor receives. Every
  // rank goes through (layer, micro-batch) in the same order, so what a rank waits for was sent
  // by a rank at an earlier (layer, micro-batch): no rank waits on another in a cycle.
  const uint32_t num_layers = static_cast<uint32_t>(num_layers_);
  const int me = place_;
  for (size_t k : mine) {
    const size_t j = parts[k].plan.micro_batch;
    if (schedule_.OwnerOf(static_cast<int64_t>(j), 0) != me) {
      SkipLayer(j, parts[k]);
      continue;
    }
    RETURN_IF_ERROR(lane_of(k).backend->PreAttention(0, lane_of(k).qkv.get()));
    charge(&host_compute_ms_);
    RETURN_IF_ERROR(SendLayer(j, parts[k], 0));
    charge(&host_attention_ms_);
  }
  for (uint32_t layer = 0; layer < num_layers; ++layer) {
    for (size_t k : mine) {
      Lane& lane = lane_of(k);
      const size_t j = parts[k].plan.micro_batch;
      const bool more = layer + 1 < num_layers;
      if (schedule_.OwnerOf(static_cast<int64_t>(j), layer) != me) {
        if (more) SkipLayer(j, parts[k]);
        continue;
      }
      if (schedule_.HandsOff(static_cast<int64_t>(j), layer))
        RETURN_IF_ERROR(ReceiveResidual(j, parts[k], layer));
      RETURN_IF_ERROR(ReceiveLayer(j, parts[k], layer));
      lane.backend->MarkAttention();
      charge(&host_attention_ms_);
      RETURN_IF_ERROR(lane.backend->PostAttention(layer, lane.attn.get()));
      if (more) RETURN_IF_ERROR(lane.backend->PreAttention(layer + 1, lane.qkv.get()));
      charge(&host_compute_ms_);
      if (more) {
        RETURN_IF_ERROR(SendLayer(j, parts[k], layer + 1));
        if (schedule_.HandsOff(static_cast<int64_t>(j), layer + 1)) {
          RETURN_IF_ERROR(SendResidual(j, parts[k], layer + 1));
        }
        charge(&host_attention_ms_);
      }
    }
  }
  if (device_path_ && !mine.empty()) {
    const absl::Status synced =
        transport_->SyncStream(backend_->stream(), absl::Now() + 2 * options_.step_timeout);
    if (!synced.ok()) {
      // With recovery RecoverFromFailedStep reads what the ranks sent and finds the one lost; a
      // replica leaves them to AwaitRank0 (compute rank 0's step discard among them).
      if (DeviceRecovery() || compute_rank_ != 0)
        return Annotate(synced, absl::StrCat("step ", parts[0].plan.step_id));
      return DeviceStepError(synced, parts[0].plan.step_id);
    }
  }
  const auto finish = std::chrono::steady_clock::now();
  for (size_t i = mine.size(); i-- > 0;) {
    const size_t k = mine[i];
    if (Finishes(parts[k].plan.micro_batch)) {
      RETURN_IF_ERROR(lane_of(k).backend->Finish(&(*sampled)[k]));
    } else {
      RETURN_IF_ERROR(lane_of(k).backend->EndStep());
    }
  }
  if (host) host_compute_ms_ += MsSince(finish);
  if (compute_rank_ != 0) return absl::OkStatus();
  // The replicas' results.
  size_t remote = 0;
  for (size_t k = 0; k < n; ++k) remote += Finishes(parts[k].plan.micro_batch) ? 0 : 1;
  std::vector<bool> got(n, false);
  const absl::Time deadline = absl::Now() + options_.step_timeout;
  while (remote > 0) {
    std::vector<uint8_t> msg;
    ASSIGN_OR_RETURN(
        const size_t from,
        ReceiveFromRank(deadline,
                        absl::StrCat("the compute replicas' results of step ", parts[0].plan.step_id), &msg));
    if (from < ranks_.size()) {
      absl::StatusOr<uint32_t> magic = PeekFrameMagic(msg);
      if (magic.ok() && *magic == kRestoreReplyMagic) {  // read after the step (CollectRestoreReplies)
        early_replies_.emplace_back(from, std::move(msg));
        continue;
      }
      return absl::InvalidArgumentError(
          absl::StrCat(ranks_[from].name, ": unexpected message during a step"));
    }
    const Replica& replica = replicas_[from - ranks_.size()];
    absl::StatusOr<ReplicaResultMessage> result = DecodeReplicaResult(msg);
    if (!result.ok()) return Annotate(result.status(), replica.name);
    const size_t j = result->micro_batch;
    if (result->step_id != parts[0].plan.step_id || j >= n ||
        schedule_.FinisherOf(static_cast<int64_t>(j), num_layers_) != replica.place || got[j] ||
        result->tokens.size() != parts[j].rows.sample_rows.size()) {
      return absl::InvalidArgumentError(absl::StrCat(replica.name, ": a result for step ", result->step_id,
                                                     " micro-batch ", j, " with ", result->tokens.size(),
                                                     " tokens does not match what it was given"));
    }
    // The alternatives must be what each row asked for (the controller checks the counts again).
    for (size_t i = 0; i < result->top.size(); ++i) {
      const int64_t want = std::min<int64_t>(parts[j].rows.top_logprobs_of(i), backend_->spec().vocab_size);
      if (static_cast<int64_t>(result->top[i].size()) != want) {
        return absl::InvalidArgumentError(
            absl::StrCat(replica.name, ": step ", result->step_id, " micro-batch ", j, " token ", i, " has ",
                         result->top[i].size(), " alternatives, asked for ", want));
      }
    }
    got[j] = true;
    SampledTokens& part = (*sampled)[j];
    part.tokens = std::move(result->tokens);
    part.logprobs = std::move(result->logprobs);
    part.top = std::move(result->top);
    ++replica_micro_batches_;
    --remote;
  }
  return absl::OkStatus();
}

bool ComputeRank::CanRecover() const {
  // Recovery runs the rest of the step without the rank, which the host-staged path with one
  // compute rank can do (under the head partition the step's tokens are all dropped and the heads
  // split again after it, RepartitionHeads); elsewhere the loss fails the step as before.
  return options_.recover_memory_ranks && !device_path_ && compute_ranks_ == 1;
}

absl::Status ComputeRank::RecoverLostRanks(std::vector<std::pair<int64_t, GenerationResult>>* finished) {
  if (head_) {
    if (lost_in_step_.empty()) return absl::OkStatus();
    return RepartitionHeads(finished);
  }
  // Memory ranks lost during the step: their requests' tokens of this step are dropped (the rest
  // of the step ran without them) and the requests go back to the queue to be recomputed.
  for (size_t m : lost_in_step_) {
    const std::vector<int64_t> requeued = controller_->LoseRank(static_cast<int>(m));
    requests_recovered_ += static_cast<int64_t>(requeued.size());
    TANDEM_LOG_WARN("compute", ranks_[m].name, " is lost; ", requeued.size(),
                    " of its requests go back to the queue to be recomputed on the ",
                    controller_->live_ranks(), " surviving memory rank(s)");
  }
  if (!lost_in_step_.empty()) {
    const size_t before = finished->size();
    controller_->FailUnplaceable(finished);
    for (size_t i = before; i < finished->size(); ++i) {
      TANDEM_LOG_WARN("compute", "request ", (*finished)[i].first,
                      " ends: ", (*finished)[i].second.error.message());
    }
  }
  lost_in_step_.clear();
  return absl::OkStatus();
}

absl::Status ComputeRank::RepartitionHeads(std::vector<std::pair<int64_t, GenerationResult>>* finished) {
  // Every rank held a slice of every request: all of them are recomputed, whichever rank was lost.
  const std::vector<int64_t> requeued = controller_->LoseRank(0);
  requests_recovered_ += static_cast<int64_t>(requeued.size());
  const ModelSpec& s = backend_->spec();
  std::vector<int64_t> capacity(ranks_.size(), 0);
  // Hellos sent to each rank and not answered yet: a rank answers them in order, so only the
  // answer to the last one (of the current split) counts.
  std::vector<int> unanswered(ranks_.size(), 0);
  std::vector<size_t> live;
  for (bool again = true; again;) {
    again = false;
    live.clear();
    for (size_t m = 0; m < ranks_.size(); ++m) {
      if (!ranks_[m].lost) live.push_back(m);
    }
    if (live.empty()) return absl::UnavailableError("every memory rank is lost");
    TANDEM_LOG_WARN("compute", "memory.partition head: the KV heads are split again over ", live.size(),
                    " memory rank(s); the ", requeued.size(),
                    " request(s) in flight go back to the queue to be recomputed");
    for (size_t i = 0; i < live.size() && !again; ++i) {
      const size_t m = live[i];
      Rank& rank = ranks_[m];
      rank.slice = HeadSlice{.num_heads = s.num_heads,
                             .num_kv_heads = s.num_kv_heads,
                             .head_dim = s.head_dim,
                             .num_ranks = static_cast<int64_t>(live.size()),
                             .rank = static_cast<int64_t>(i)};
      // Fresh attention-output buffers sized for the new slice (the old ones stay registered:
      // their memory must outlive the transport).
      for (RankLane& rl : rank.lanes) retired_lanes_.push_back(std::move(rl));
      rank.lanes.clear();
      rank.lanes.resize(lanes_.size());
      for (size_t j = 0; j < lanes_.size(); ++j) {
        rank.lanes[j].attn_buffer = next_attn_buffer_++;
        RETURN_IF_ERROR(SetUpRankLane(m, j));
      }
      const absl::Status sent =
          transport_->Send(rank.peer, EncodeHello(MakeHello(m, rank.lanes[0].attn_buffer)));
      if (!sent.ok()) {
        RETURN_IF_ERROR(LoseRankInSplit(m, Annotate(sent, rank.name)));
        again = true;
        break;
      }
      ++unanswered[m];
    }
    // The replies, in any order (each rank sets up its pool first).
    const absl::Time deadline = absl::Now() + options_.step_timeout;
    auto left = [&] {
      return std::any_of(live.begin(), live.end(),
                         [&](size_t m) { return !ranks_[m].lost && unanswered[m] > 0; });
    };
    while (!again && left()) {
      transport::PeerId from = 0;
      std::vector<uint8_t> msg;
      const absl::Status got = transport_->Receive(&from, &msg, deadline);
      if (!got.ok()) {
        // Ranks that failed, and at the deadline every one still silent, are given up.
        const bool late = absl::Now() >= deadline;
        for (size_t m : live) {
          if (ranks_[m].lost) continue;
          const absl::Status peer = transport_->PeerStatus(ranks_[m].peer);
          if (peer.ok() && !(late && unanswered[m] > 0)) continue;
          RETURN_IF_ERROR(LoseRankInSplit(
              m, peer.ok() ? absl::DeadlineExceededError(absl::StrCat(
                                 ranks_[m].name, ": no answer to its re-partition hello within ",
                                 absl::FormatDuration(options_.step_timeout), " (launch.step_timeout_s)"))
                           : Annotate(peer, ranks_[m].name)));
          again = true;
        }
        if (!again) return Annotate(got, "waiting for the memory ranks' replies to a re-partition");
        break;
      }
      if (TakeStrayMessage(from, &msg)) continue;
      size_t m = 0;
      while (m < ranks_.size() && ranks_[m].peer != from) ++m;
      if (m == ranks_.size()) {
        // A replica's: its answer to the step discard that dropped the step, a heartbeat reply.
        RETURN_IF_ERROR(TakeReplicaIdleMessage(from, msg, "during a head split"));
        continue;
      }
      if (ranks_[m].lost) continue;
      absl::StatusOr<bool> beat = TakeHeartbeatReply(m, msg);
      if (beat.ok() && *beat) continue;
      absl::StatusOr<HelloReplyMessage> reply = DecodeHelloReply(msg);
      absl::Status bad = beat.ok() ? reply.status() : beat.status();
      if (absl::StatusOr<ErrorMessage> err = DecodeError(msg); err.ok()) {
        bad = StatusFromErrorMessage(*err);
      } else if (bad.ok() && (unanswered[m] == 0 || reply->memory_rank != m ||
                              reply->dtype != backend_->dtype() || reply->kv_capacity_tokens == 0)) {
        bad = absl::InvalidArgumentError(absl::StrCat(
            "a reply to a re-partition hello naming memory rank ", reply->memory_rank, ", dtype ",
            std::string(DTypeName(reply->dtype)), " and ", reply->kv_capacity_tokens, " KV tokens"));
      }
      if (!bad.ok()) {
        RETURN_IF_ERROR(LoseRankInSplit(m, Annotate(bad, ranks_[m].name)));
        again = true;
        break;
      }
      if (--unanswered[m] > 0) continue;  // the answer to a hello of a split given up
      Rank& rank = ranks_[m];
      rank.qkv_buffer = reply->qkv_buffer;
      capacity[m] = static_cast<int64_t>(reply->kv_capacity_tokens);
      rank_names_[m] =
          absl::StrCat("memory rank ", m, ": ", reply->device, ", ", capacity[m], " KV tokens of KV heads [",
                       rank.slice.kv_head_begin(), ", ", rank.slice.kv_head_end(), ")");
    }
    // The compute replicas pack and scatter every rank's columns too: they take the new slices
    // and buffers before any step (a memory rank lost meanwhile: the split starts again).
    if (!again && compute_ranks_ > 1) {
      ASSIGN_OR_RETURN(again, SplitReplicas(live));
    }
  }
  int64_t smallest = std::numeric_limits<int64_t>::max();
  for (size_t m : live) smallest = std::min(smallest, capacity[m]);
  RETURN_IF_ERROR(controller_->RejoinRank(0, smallest));
  lost_in_step_.clear();
  for (size_t m : live) TANDEM_LOG_WARN("compute", rank_names_[m]);
  TANDEM_LOG_WARN("compute", "memory.partition head: ", live.size(),
                  " memory rank(s) hold the KV heads now, ", smallest, " KV tokens each");
  const size_t before = finished->size();
  controller_->FailUnplaceable(finished);
  for (size_t i = before; i < finished->size(); ++i) {
    TANDEM_LOG_WARN("compute", "request ", (*finished)[i].first,
                    " ends: ", (*finished)[i].second.error.message());
  }
  return absl::OkStatus();
}

absl::Status ComputeRank::LoseRankInSplit(size_t m, const absl::Status& why) {
  if (compute_ranks_ == 1) return MarkRankLost(m, why);
  // The replicas let it go too (a step discard of no step names it): one whose connection to it
  // failed waits for compute rank 0's word (AwaitRank0), and this is it.
  const std::pair<size_t, absl::Status> lose[] = {{m, why}};
  ASSIGN_OR_RETURN(const Regrouped regrouped, Regroup(0, lose));
  (void)regrouped;
  return absl::OkStatus();
}

absl::StatusOr<bool> ComputeRank::SplitReplicas(const std::vector<size_t>& live) {
  HeadSplitMessage split{.split = ++head_splits_};
  for (size_t m : live) {
    split.ranks.push_back({.memory_rank = static_cast<uint16_t>(m),
                           .attn_out_buffer = ranks_[m].lanes[0].attn_buffer,
                           .qkv_buffer = ranks_[m].qkv_buffer});
  }
  const std::vector<uint8_t> frame = EncodeHeadSplit(split);
  auto lose_replica = [&](size_t r, const absl::Status& why) {
    return GiveUpIdleReplica(r, Annotate(why, "the head split"));
  };
  std::vector<bool> waiting(replicas_.size(), false);
  for (size_t r = 0; r < replicas_.size(); ++r) {
    if (replicas_[r].lost) continue;
    const absl::Status sent = transport_->Send(replicas_[r].peer, frame);
    if (sent.ok()) {
      waiting[r] = true;
    } else {
      RETURN_IF_ERROR(lose_replica(r, sent));
    }
  }
  const absl::Time deadline = absl::Now() + options_.step_timeout;
  auto left = [&] {
    for (size_t r = 0; r < replicas_.size(); ++r) {
      if (waiting[r] && !replicas_[r].lost) return true;
    }
    return false;
  };
  while (left()) {
    transport::PeerId from = 0;
    std::vector<uint8_t> msg;
    const absl::Status got = transport_->Receive(&from, &msg, deadline);
    if (!got.ok()) {
      // A memory rank that failed: the split starts again without it. Replicas that failed, and at
      // the deadline every one still silent, are given up.
      for (size_t m : live) {
        if (absl::Status peer = transport_->PeerStatus(ranks_[m].peer); !ranks_[m].lost && !peer.ok()) {
          RETURN_IF_ERROR(LoseRankInSplit(m, Annotate(peer, ranks_[m].name)));
          return true;
        }
      }
      const bool late = absl::Now() >= deadline;
      bool found = false;
      for (size_t r = 0; r < replicas_.size(); ++r) {
        if (!waiting[r] || replicas_[r].lost) continue;
        absl::Status peer = transport_->PeerStatus(replicas_[r].peer);
        if (peer.ok() && !late) continue;
        found = true;
        RETURN_IF_ERROR(
            lose_replica(r, peer.ok() ? absl::DeadlineExceededError(absl::StrCat(
                                            "no answer within ", absl::FormatDuration(options_.step_timeout),
                                            " (launch.step_timeout_s)"))
                                      : peer));
      }
      if (!found) return Annotate(got, "waiting for the compute replicas' answers to a head split");
      continue;
    }
    if (TakeStrayMessage(from, &msg)) continue;
    const uint32_t magic = PeekFrameMagic(msg).value_or(0);
    size_t m = 0;
    while (m < ranks_.size() && ranks_[m].peer != from) ++m;
    if (m < ranks_.size()) {
      if (ranks_[m].lost) continue;
      absl::StatusOr<bool> beat = TakeHeartbeatReply(m, msg);
      if (beat.ok() && *beat) continue;
      absl::StatusOr<ErrorMessage> err = DecodeError(msg);
      const absl::Status why =
          err.ok() ? StatusFromErrorMessage(*err)
                   : absl::InvalidArgumentError(absl::StrCat("unexpected message (magic 0x", absl::Hex(magic),
                                                             ") during a head split"));
      RETURN_IF_ERROR(LoseRankInSplit(m, Annotate(why, ranks_[m].name)));
      return true;
    }
    size_t r = 0;
    while (r < replicas_.size() && replicas_[r].peer != from) ++r;
    if (r == replicas_.size() || replicas_[r].lost) continue;
    if (magic == kHeadSplitMagic && waiting[r]) {
      absl::StatusOr<HeadSplitMessage> answer = DecodeHeadSplit(msg);
      if (!answer.ok() || !answer->answer) {
        RETURN_IF_ERROR(lose_replica(
            r, answer.ok() ? absl::InvalidArgumentError("a head split request") : answer.status()));
        continue;
      }
      if (answer->split != split.split) continue;  // the answer to a split given up
      waiting[r] = false;
      if (!answer->text.empty()) RETURN_IF_ERROR(lose_replica(r, absl::UnavailableError(answer->text)));
      continue;
    }
    RETURN_IF_ERROR(TakeReplicaIdleMessage(from, msg, "during a head split"));
  }
  return false;
}

absl::Status ComputeRank::GiveUpIdleReplica(size_t r, const absl::Status& why) {
  const absl::Status named = Annotate(why, replicas_[r].name);
  if (!CanRecoverReplica()) return named;
  return LoseReplica(r, named, 0);
}

absl::Status ComputeRank::TakeReplicaIdleMessage(transport::PeerId from, const std::vector<uint8_t>& msg,
                                                 const char* when) {
  size_t r = 0;
  while (r < replicas_.size() && replicas_[r].peer != from) ++r;
  if (r == replicas_.size() || replicas_[r].lost) return absl::OkStatus();
  if (absl::StatusOr<ErrorMessage> err = DecodeError(msg); err.ok()) {
    return GiveUpIdleReplica(r, Annotate(StatusFromErrorMessage(*err), "stopped"));
  }
  absl::StatusOr<bool> taken = TakeReplicaControl(r, msg);
  if (taken.ok() && *taken) return absl::OkStatus();
  return GiveUpIdleReplica(r, taken.ok() ? absl::InvalidArgumentError(absl::StrCat(
                                               "unexpected message (magic 0x",
                                               absl::Hex(PeekFrameMagic(msg).value_or(0)), ") ", when))
                                         : taken.status());
}

absl::Status ComputeRank::TakeHeadSplit(const std::vector<uint8_t>& msg) {
  const std::string me = absl::StrCat("compute rank ", compute_rank_);
  ASSIGN_OR_RETURN(const HeadSplitMessage split, DecodeHeadSplit(msg));
  if (split.answer || !head_) {
    return absl::InvalidArgumentError(absl::StrCat(me, ": compute rank 0 sent a head split ",
                                                   split.answer ? "answer" : "outside the head partition"));
  }
  std::string refused;
  std::vector<bool> listed(ranks_.size(), false);
  for (const HeadSplitMessage::Rank& r : split.ranks) {
    if (r.memory_rank >= ranks_.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat(me, ": a head split names memory rank ", r.memory_rank, " of ", ranks_.size()));
    }
    listed[r.memory_rank] = true;
    if (ranks_[r.memory_rank].lost && refused.empty())
      refused = absl::StrCat(ranks_[r.memory_rank].name, " is lost here");
  }
  // A rank the split leaves out is lost (compute rank 0 told so with a step discard before): let go.
  for (size_t m = 0; m < ranks_.size(); ++m) {
    if (listed[m] || ranks_[m].lost) continue;
    ranks_[m].lost = true;
    transport_->Close(ranks_[m].peer);
    TANDEM_LOG_WARN("compute", me, ": ", ranks_[m].name, " is lost (left out of head split ", split.split,
                    ")");
  }
  const ModelSpec& s = backend_->spec();
  for (size_t i = 0; i < split.ranks.size() && refused.empty(); ++i) {
    Rank& rank = ranks_[split.ranks[i].memory_rank];
    rank.slice = HeadSlice{.num_heads = s.num_heads,
                           .num_kv_heads = s.num_kv_heads,
                           .head_dim = s.head_dim,
                           .num_ranks = static_cast<int64_t>(split.ranks.size()),
                           .rank = static_cast<int64_t>(i)};
    rank.qkv_buffer = split.ranks[i].qkv_buffer;
    // Fresh buffers under compute rank 0's ids (the old ones stay registered), seqnos at 0 as the
    // memory rank's new lanes.
    for (RankLane& rl : rank.lanes) retired_lanes_.push_back(std::move(rl));
    rank.lanes.clear();
    rank.lanes.resize(lanes_.size());
    for (size_t j = 0; j < lanes_.size(); ++j) {
      rank.lanes[j].attn_buffer = split.ranks[i].attn_out_buffer + static_cast<uint32_t>(j);
    }
    for (size_t j = 0; j < lanes_.size() && refused.empty(); ++j) {
      if (!Runs(j)) continue;  // set up when this rank takes the lane over (Regroup)
      if (absl::Status st = SetUpRankLane(split.ranks[i].memory_rank, j); !st.ok())
        refused = std::string(st.message());
    }
  }
  if (refused.empty()) {
    TANDEM_LOG_INFO("compute", me, ": head split ", split.split, ": the KV heads over ", split.ranks.size(),
                    " memory rank(s)");
  } else {
    TANDEM_LOG_WARN("compute", me, ": cannot take head split ", split.split, ": ", refused);
  }
  const HeadSplitMessage answer{
      .split = split.split, .answer = true, .text = refused.substr(0, kMaxAddressBytes)};
  return Annotate(transport_->Send(rank0_peer_, EncodeHeadSplit(answer)), "compute rank 0");
}

absl::Status ComputeRank::CollectRestoreReplies(const StepPlan& plan) {
  // A lost rank's replies are not awaited (LoseRank: the controller forgets its restores).
  std::vector<bool> expect(ranks_.size(), false);
  size_t left = 0;
  for (const PrefixRestore& r : plan.restores) {
    if (r.memory_rank < expect.size() && !expect[r.memory_rank] && !ranks_[r.memory_rank].lost) {
      expect[r.memory_rank] = true;
      ++left;
    }
  }
  // Ranks lost while the replies are awaited.
  auto drop_lost = [&] {
    for (size_t m = 0; m < ranks_.size(); ++m) {
      if (expect[m] && ranks_[m].lost) {
        expect[m] = false;
        --left;
      }
    }
  };
  const absl::Time deadline = absl::Now() + options_.step_timeout;
  while (left > 0) {
    size_t m = 0;
    std::vector<uint8_t> msg;
    if (!early_replies_.empty()) {
      m = early_replies_.front().first;
      msg = std::move(early_replies_.front().second);
      early_replies_.erase(early_replies_.begin());
      if (ranks_[m].lost) continue;
    } else {
      absl::StatusOr<size_t> from =
          ReceiveFromRank(deadline, absl::StrCat("the restore replies of step ", plan.step_id), &msg);
      if (!from.ok()) {
        // The rank that failed (or the first still silent at the deadline) is given up, or the
        // step fails as without recovery.
        size_t waited_on = 0;
        while (!expect[waited_on]) ++waited_on;
        RETURN_IF_ERROR(LoseFailedRanks(waited_on, from.status()));
        drop_lost();
        continue;
      }
      m = *from;
    }
    if (m >= ranks_.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat(replicas_[m - ranks_.size()].name, ": unexpected message after a step"));
    }
    if (absl::StatusOr<ErrorMessage> err = DecodeError(msg); err.ok()) {  // the rank stopped
      RETURN_IF_ERROR(LoseRank(m, Annotate(StatusFromErrorMessage(*err), ranks_[m].name)));
      drop_lost();
      continue;
    }
    absl::StatusOr<RestoreReplyMessage> reply = DecodeRestoreReply(msg);
    if (!reply.ok()) return Annotate(reply.status(), ranks_[m].name);
    if (reply->step_id != plan.step_id || reply->memory_rank != m || !expect[m]) {
      return absl::InvalidArgumentError(absl::StrCat(ranks_[m].name, ": a restore reply for step ",
                                                     reply->step_id, " from memory rank ", reply->memory_rank,
                                                     " while step ", plan.step_id, " was awaited"));
    }
    expect[m] = false;
    --left;
    controller_->RestoreResult(plan, static_cast<int>(m), reply->failed);
  }
  return absl::OkStatus();
}

absl::Status ComputeRank::LoseRank(size_t m, absl::Status why) {
  Rank& rank = ranks_[m];
  if (rank.lost) return absl::OkStatus();
  if (!CanRecover()) {
    if (!CanRecoverByRerun()) return why;
    if (in_parts_) {
      // The replicas' micro-batches are in flight: the step fails, and RecoverFromFailedStep gives
      // the rank up and runs the step again with the replicas, told so by the step discard.
      failed_ranks_.emplace_back(m, why);
      return why;
    }
    // Between steps: the rank is given up and the replicas, told so by a step discard (of no step),
    // go on without it.
    TANDEM_LOG_WARN("compute", "compute rank 0 gives up ", rank.name, " with ", compute_ranks_ - 1,
                    " compute replica(s) running: ", why.message());
    const std::pair<size_t, absl::Status> lose[] = {{m, why}};
    ASSIGN_OR_RETURN(const Regrouped regrouped, Regroup(0, lose));
    (void)regrouped;
    return absl::OkStatus();
  }
  return MarkRankLost(m, why);
}

absl::StatusOr<bool> ComputeRank::TakePersistedReport(size_t m, const std::vector<uint8_t>& msg,
                                                      std::vector<TierBlock>* blocks) {
  if (absl::StatusOr<ErrorMessage> err = DecodeError(msg); err.ok())
    return Annotate(StatusFromErrorMessage(*err), ranks_[m].name);
  absl::StatusOr<PersistedBlocksMessage> report = DecodePersistedBlocks(msg);
  if (!report.ok()) {
    return Annotate(report.status(),
                    absl::StrCat(ranks_[m].name, ": its persisted blocks report (kv.tiers.persist)"));
  }
  if (report->memory_rank != m) {
    return absl::InvalidArgumentError(absl::StrCat(
        ranks_[m].name, ": its persisted blocks report names memory rank ", report->memory_rank));
  }
  for (PersistedBlock& b : report->blocks)
    blocks->push_back({.hash = b.hash, .parent_hash = b.parent_hash, .tokens = std::move(b.tokens)});
  return report->last;
}

void ComputeRank::OfferPersisted(size_t m, std::span<const TierBlock> blocks) {
  const int64_t added = controller_->AddTierBlocks(static_cast<int>(m), blocks);
  TANDEM_LOG_INFO("compute", ranks_[m].name, ": kv.tiers.persist: ", added, " of ", blocks.size(),
                  " blocks it found on disk registered for reuse");
}

bool ComputeRank::TakeStrayMessage(transport::PeerId from, std::vector<uint8_t>* msg) {
  for (size_t m = 0; m < probes_.size(); ++m) {
    Probe& probe = probes_[m];
    if (!probe.active || probe.peer != from) continue;
    // Its first message: the hello reply (or an error report), read at the next AdvanceRejoins;
    // then its persisted blocks reports (kv.tiers.persist).
    if (probe.reply.empty()) {
      probe.reply = std::move(*msg);
    } else if (!probe.reports_done && probe.report_error.empty()) {
      absl::StatusOr<bool> last = TakePersistedReport(m, *msg, &probe.persisted);
      if (!last.ok()) probe.report_error = std::string(last.status().message());
      probe.reports_done = last.value_or(false);
    }
    return true;
  }
  return retired_peers_.contains(from);
}

void ComputeRank::DropProbe(size_t m, const std::string& why) {
  Probe& probe = probes_[m];
  if (probe.active) retired_peers_.insert(probe.peer);  // Close()d from the start
  // Buffers registered for it stay registered: their memory must outlive the transport.
  for (RankLane& rl : probe.lanes) retired_lanes_.push_back(std::move(rl));
  // Nothing answered: the next probe a rejoin_probe later, then less often (a rank restarted
  // within a second or so is found quickly; one that stays away costs a connection per 30 s).
  const absl::Duration wait = std::max(
      options_.rejoin_probe, std::min(probe.backoff * 2, std::max(options_.rejoin_probe, kMaxProbeInterval)));
  TANDEM_LOG_DEBUG("compute", ranks_[m].name, ": rejoin probe dropped (next in ", absl::FormatDuration(wait),
                   "): ", why);
  probe = Probe{.next = absl::Now() + wait, .backoff = wait};
}

absl::Status ComputeRank::AdvanceRejoins() {
  // On a device path the probe's connection must carry the device connection too
  // (capabilities().device_path_new_peers: p2p).
  const bool device_rejoin = transport_->capabilities().device_path_new_peers;
  if (options_.rejoin_probe <= absl::ZeroDuration() || (device_path_ && !device_rejoin) ||
      !(CanRecover() || CanRecoverByRerun()))
    return absl::OkStatus();
  const absl::Time now = absl::Now();
  for (size_t m = 0; m < ranks_.size(); ++m) {
    Rank& rank = ranks_[m];
    Probe& probe = probes_[m];
    if (!rank.lost) continue;
    if (!probe.active) {
      if (now < probe.next) continue;
      // A connection whose refusal (reported by the transport from any later wait) must fail
      // nothing: Close()d before anything can fail on it. Connect itself does not block.
      absl::StatusOr<transport::PeerId> peer = transport_->Connect(options_.memory_addresses[m]);
      if (!peer.ok()) {
        DropProbe(m, std::string(peer.status().message()));
        continue;
      }
      transport_->Close(*peer);
      probe = Probe{.active = true, .peer = *peer, .started = now, .backoff = probe.backoff};
    }
    if (absl::Status st = transport_->PeerStatus(probe.peer); !st.ok()) {
      DropProbe(m, std::string(st.message()));  // refused (nothing listens there yet) or failed
      continue;
    }
    if (now - probe.started > options_.step_timeout) {
      DropProbe(m, RejoinTimedOut(probe.hello_sent, !probe.reply.empty(), options_.step_timeout));
      continue;
    }
    if (!probe.hello_sent) {
      if (transport_->Connecting(probe.peer)) {
        // The bootstrap is still under way (on nccl also the communicators' set-up, if the new
        // process greeted first: its progress needs calls into the transport, which a device-path
        // step makes none of between steps).
        if (device_path_) RETURN_IF_ERROR(TakeMessagesBetweenSteps());
        continue;
      }
      // Attention outputs of the new process go to buffers of its own: fresh ids (the old ones'
      // doorbells stay at the lost process's last seqno) over fresh memory (a late write of the
      // lost process, stopped and then continued, lands in its own buffers). On the device path
      // every rank writes its rows' outputs straight into the lane's attention buffer, as the
      // lost process did (a late write of it: its device path stopped with its failed step, or
      // the process is gone); the new id's doorbell starts at 0. Ids for every lane; buffers for
      // the lanes this rank runs (a replica's lanes are the replica's: RejoinReplicas, and set up
      // here when taken over).
      const uint32_t first = next_attn_buffer_;
      probe.lanes.clear();
      probe.lanes.resize(lanes_.size());
      absl::Status st;
      for (size_t j = 0; j < lanes_.size() && st.ok(); ++j) {
        probe.lanes[j].attn_buffer = next_attn_buffer_++;
        if (Runs(j)) st = SetUpRankLane(rank.slice, j, &probe.lanes[j]);
      }
      if (st.ok()) st = transport_->Send(probe.peer, EncodeHello(MakeHello(m, first)));
      if (!st.ok()) {
        DropProbe(m, std::string(st.message()));
        continue;
      }
      probe.hello_sent = true;
      TANDEM_LOG_INFO("compute", rank.name, " answers at its address again: sent it a hello");
      continue;
    }
    // The device path reads no message within a step (the host-staged path takes the reply with a
    // layer's output): look for it here. The same calls make progress with the peer's device
    // connection where the transport sets one up after the hello (nccl's communicators, set up
    // only between steps): the rank is taken only once that is done, since a step's first
    // transfer to it could not wait for it.
    if (device_path_ && (probe.reply.empty() || transport_->Connecting(probe.peer)))
      RETURN_IF_ERROR(TakeMessagesBetweenSteps());
    if (probe.reply.empty() || transport_->Connecting(probe.peer)) continue;
    // The reply: the new process is set up; it takes the rank's place from the next step.
    absl::StatusOr<HelloReplyMessage> reply = DecodeHelloReply(probe.reply);
    if (!reply.ok()) {
      absl::StatusOr<ErrorMessage> err = DecodeError(probe.reply);
      DropProbe(m, std::string(err.ok() ? StatusFromErrorMessage(*err).message() : reply.status().message()));
      continue;
    }
    if (reply->memory_rank != m || reply->dtype != backend_->dtype()) {
      TANDEM_LOG_WARN("compute", rank.name, ": a process at its address answers as memory rank ",
                      reply->memory_rank, " with dtype ", std::string(DTypeName(reply->dtype)),
                      "; not taken");
      DropProbe(m, "not this rank");
      continue;
    }
    if (!probe.report_error.empty()) {
      DropProbe(m, probe.report_error);
      continue;
    }
    if (reply->persisted && !probe.reports_done) continue;  // its reports are still on their way
    // With replicas running, each connects to the new process (which waits for their compute
    // hellos) before the rank takes requests: their micro-batches have rows on it too.
    const bool with_replicas = compute_ranks_ > 1;
    if (with_replicas) {
      ASSIGN_OR_RETURN(const std::string refused, RejoinReplicas(m, probe.lanes.front().attn_buffer));
      if (!refused.empty()) {
        DropProbe(m, refused);
        continue;
      }
    }
    const int64_t capacity = static_cast<int64_t>(reply->kv_capacity_tokens);
    // Head partition: the rank comes back through a new split of the heads (below).
    if (absl::Status st = head_ ? absl::OkStatus() : controller_->RejoinRank(static_cast<int>(m), capacity);
        !st.ok()) {
      DropProbe(m, std::string(st.message()));
      if (with_replicas) {
        // The replicas took the rank: a step discard of no step names it lost again.
        ASSIGN_OR_RETURN(const Regrouped regrouped, Regroup(0, {}));
        (void)regrouped;
      }
      continue;
    }
    transport_->Reopen(probe.peer);  // live: its failure is a failure again
    rank.peer = probe.peer;
    rank.qkv_buffer = reply->qkv_buffer;
    for (RankLane& rl : rank.lanes) retired_lanes_.push_back(std::move(rl));  // still registered
    rank.lanes = std::move(probe.lanes);
    rank.lost = false;
    rank.beat_seq = 0;
    if (!probe.persisted.empty()) OfferPersisted(m, probe.persisted);
    probe = Probe{};
    ++memory_ranks_rejoined_;
    rank_names_[m] = absl::StrCat("memory rank ", m, ": ", reply->device, ", ", capacity, " KV tokens");
    TANDEM_LOG_WARN("compute", rank.name, " rejoined (", reply->device, ", ", capacity,
                    " KV tokens); it takes requests again (", memory_ranks_rejoined_, " rejoin(s) so far, ",
                    controller_->live_ranks(), " live memory rank(s)",
                    with_replicas ? absl::StrCat(", every one of the ", compute_ranks_ - 1,
                                                 " compute replica(s) connected to it")
                                  : std::string(),
                    ")");
    // Every live rank takes a new slice of the heads, and every request in flight is recomputed;
    // requests that this ends are reported by the next Step.
    if (head_) RETURN_IF_ERROR(RepartitionHeads(&ended_while_idle_));
  }
  return absl::OkStatus();
}

absl::Status ComputeRank::TakeMessagesBetweenSteps() {
  // What the transport has (1 ms at most: UCX makes progress only before a deadline): a probe's
  // messages (TakeStrayMessage), heartbeat replies; a live rank's error report or any other
  // message loses it, as in Heartbeat, and its requests go back to the queue at once.
  RETURN_IF_ERROR(TakeArrivedMessages("between steps"));
  return RecoverLostRanks(&ended_while_idle_);
}

absl::Status ComputeRank::TakeArrivedMessages(const char* when) {
  transport::PeerId from = 0;
  std::vector<uint8_t> msg;
  while (transport_->Receive(&from, &msg, absl::Now() + absl::Milliseconds(1)).ok()) {
    if (TakeStrayMessage(from, &msg)) continue;
    size_t m = 0;
    while (m < ranks_.size() && ranks_[m].peer != from) ++m;
    if (m == ranks_.size()) {
      RETURN_IF_ERROR(TakeReplicaIdleMessage(from, msg, when));
    } else if (!ranks_[m].lost) {
      RETURN_IF_ERROR(TakeIdleMessage(m, msg, when));
    }
  }
  return absl::OkStatus();
}

absl::Status ComputeRank::TakeIdleMessage(size_t m, const std::vector<uint8_t>& msg, const char* when) {
  absl::StatusOr<bool> beat = TakeHeartbeatReply(m, msg);
  if (beat.ok() && *beat) return absl::OkStatus();
  if (PeekFrameMagic(msg).value_or(0) == kMemoryStatsMagic)
    return absl::OkStatus();  // late: Pipeline gave up
  absl::Status why = beat.status();
  if (why.ok()) {
    absl::StatusOr<ErrorMessage> err = DecodeError(msg);
    why = err.ok()
              ? StatusFromErrorMessage(*err)
              : absl::InvalidArgumentError(absl::StrCat(
                    "unexpected message (magic 0x", absl::Hex(PeekFrameMagic(msg).value_or(0)), ") ", when));
  }
  return LoseRank(m, Annotate(why, ranks_[m].name));
}

absl::StatusOr<std::string> ComputeRank::RejoinReplicas(size_t m, uint32_t attn_buffer) {
  const MemoryRejoinMessage request{.memory_rank = static_cast<uint16_t>(m),
                                    .attn_out_buffer = attn_buffer,
                                    .text = options_.memory_addresses[m]};
  const std::vector<uint8_t> frame = EncodeMemoryRejoin(request);
  std::vector<bool> waiting(replicas_.size(), false);
  std::string refused;
  bool told = false;
  for (size_t r = 0; r < replicas_.size() && refused.empty(); ++r) {
    if (replicas_[r].lost) continue;
    if (absl::Status sent = transport_->Send(replicas_[r].peer, frame); !sent.ok()) {
      refused = absl::StrCat(replicas_[r].name, " cannot be told: ", sent.message());
      break;
    }
    waiting[r] = told = true;
  }
  TANDEM_LOG_INFO("compute", ranks_[m].name,
                  ": its new process answered; the compute replicas connect to it");
  // The answers (up to the step timeout: each replica connects, says its compute hello and takes the
  // hello reply). Whatever else comes between steps is taken as Heartbeat would (heartbeat replies,
  // a probe's messages, restore replies kept for after the next step); anything else ends the wait,
  // and the step or heartbeat that follows finds the rank or replica that failed.
  const absl::Time deadline = absl::Now() + options_.step_timeout;
  while (refused.empty() && std::find(waiting.begin(), waiting.end(), true) != waiting.end()) {
    transport::PeerId from = 0;
    std::vector<uint8_t> msg;
    const absl::Status got =
        transport_->Receive(&from, &msg, std::min(deadline, absl::Now() + absl::Milliseconds(20)));
    if (!got.ok()) {
      if (absl::Now() >= deadline) {
        std::string names;
        for (size_t r = 0; r < replicas_.size(); ++r) {
          if (waiting[r]) absl::StrAppend(&names, names.empty() ? "" : ", ", replicas_[r].name);
        }
        refused =
            absl::StrCat("no answer from ", names, " within ", absl::FormatDuration(options_.step_timeout),
                         " (launch.step_timeout_s) to its memory rejoin");
      } else if (!absl::IsDeadlineExceeded(got)) {
        refused = absl::StrCat("a connection failed while the compute replicas connected: ", got.message());
      }
      continue;
    }
    if (TakeStrayMessage(from, &msg)) continue;
    size_t k = 0;
    while (k < ranks_.size() && ranks_[k].peer != from) ++k;
    if (k < ranks_.size()) {
      if (PeekFrameMagic(msg).value_or(0) == kRestoreReplyMagic) {
        early_replies_.emplace_back(k, std::move(msg));
      } else if (!TakeHeartbeatReply(k, msg).value_or(false)) {
        refused = absl::StrCat(ranks_[k].name, " sent a message (magic 0x",
                               absl::Hex(PeekFrameMagic(msg).value_or(0)),
                               ") while the compute replicas connected");
      }
      continue;
    }
    size_t r = 0;
    while (r < replicas_.size() && replicas_[r].peer != from) ++r;
    if (r == replicas_.size()) continue;
    const Replica& replica = replicas_[r];
    if (PeekFrameMagic(msg).value_or(0) == kMemoryRejoinMagic) {
      absl::StatusOr<MemoryRejoinMessage> answer = DecodeMemoryRejoin(msg);
      if (!answer.ok()) return Annotate(answer.status(), replica.name);
      if (!answer->answer || answer->memory_rank != m || !waiting[r]) {
        return absl::InvalidArgumentError(
            absl::StrCat(replica.name, ": a memory rejoin ", answer->answer ? "answer" : "request",
                         " for memory rank ", answer->memory_rank, " while ", ranks_[m].name, " rejoined"));
      }
      waiting[r] = false;
      if (!answer->text.empty())
        refused = absl::StrCat(replica.name, " cannot connect to it: ", answer->text);
      continue;
    }
    ASSIGN_OR_RETURN(const bool taken, TakeReplicaControl(r, msg));
    if (!taken) {
      absl::StatusOr<ErrorMessage> err = DecodeError(msg);
      refused = absl::StrCat(
          replica.name,
          err.ok() ? absl::StrCat(" stopped: ", err->message) : std::string(" sent an unexpected message"),
          " while it connected");
    }
  }
  if (refused.empty()) return refused;
  TANDEM_LOG_WARN("compute", ranks_[m].name, ": not taken back: ", refused);
  if (told) {
    // A replica that connected took the rank: a step discard of no step names it lost again (and
    // whatever the replicas still answer is dropped: TakeReplicaControl).
    ASSIGN_OR_RETURN(const Regrouped regrouped, Regroup(0, {}));
    (void)regrouped;
  }
  return refused;
}

absl::Status ComputeRank::LoseFailedRanks(size_t waited_on, absl::Status why) {
  transport::PeerId from = 0;
  std::vector<uint8_t> msg;
  auto heartbeat_reply = [&](transport::PeerId peer) {
    for (size_t m = 0; m < ranks_.size(); ++m) {
      if (ranks_[m].peer == peer) return TakeHeartbeatReply(m, msg).value_or(false);
    }
    return false;
  };
  // A replica leaves the messages to AwaitRank0 (compute rank 0's step discard among them).
  if (compute_rank_ != 0) return why;
  if (!CanRecover() && CanRecoverByRerun() && in_parts_) {
    // Replicas run: the step fails, and RecoverFromFailedStep reads the messages and looks for the
    // rank that failed; `waited_on` is the one given up when it finds none.
    failed_ranks_.emplace_back(waited_on, why);
    return why;
  }
  if (!CanRecover()) {
    // The step fails: with the error report of a memory rank that stopped when there is one,
    // else with the wait's error (which names the peer that failed first).
    while (transport_->Receive(&from, &msg, absl::Now()).ok()) {
      if (TakeStrayMessage(from, &msg) || heartbeat_reply(from)) continue;
      size_t m = 0;
      while (m < ranks_.size() && ranks_[m].peer != from) ++m;
      if (m < ranks_.size() && PeekFrameMagic(msg).value_or(0) == kRestoreReplyMagic) {
        early_replies_.emplace_back(m, std::move(msg));  // read after the step (CollectRestoreReplies)
        continue;
      }
      absl::StatusOr<ErrorMessage> err = DecodeError(msg);
      if (!err.ok()) break;
      std::string who = "a memory rank stopped";
      for (const Replica& replica : replicas_) {
        if (replica.peer == from) who = absl::StrCat(replica.name, " stopped");
      }
      return Annotate(StatusFromErrorMessage(*err), who);
    }
    return why;
  }
  bool blamed = false;
  while (transport_->Receive(&from, &msg, absl::Now()).ok()) {
    if (TakeStrayMessage(from, &msg) || heartbeat_reply(from)) continue;
    absl::StatusOr<ErrorMessage> err = DecodeError(msg);
    for (size_t m = 0; m < ranks_.size(); ++m) {
      if (ranks_[m].peer != from || ranks_[m].lost) continue;
      absl::StatusOr<uint32_t> magic = PeekFrameMagic(msg);
      if (magic.ok() && *magic == kRestoreReplyMagic) {  // read after the step (CollectRestoreReplies)
        early_replies_.emplace_back(m, std::move(msg));
        break;
      }
      // Anything but an error report from a rank in the middle of a step breaks the protocol.
      const absl::Status reason = err.ok() ? StatusFromErrorMessage(*err)
                                           : absl::InternalError("an unexpected message during a step");
      RETURN_IF_ERROR(LoseRank(m, Annotate(reason, ranks_[m].name)));
      blamed = true;
    }
  }
  for (size_t m = 0; m < ranks_.size(); ++m) {
    if (ranks_[m].lost) continue;
    const absl::Status peer = transport_->PeerStatus(ranks_[m].peer);
    if (peer.ok()) continue;
    RETURN_IF_ERROR(LoseRank(m, Annotate(peer, ranks_[m].name)));
    blamed = true;
  }
  if (!blamed) RETURN_IF_ERROR(LoseRank(waited_on, std::move(why)));
  return absl::OkStatus();
}

absl::StatusOr<bool> ComputeRank::TakeHeartbeatReply(size_t m, const std::vector<uint8_t>& msg) {
  absl::StatusOr<uint32_t> magic = PeekFrameMagic(msg);
  if (!magic.ok() || *magic != kHeartbeatReplyMagic) return false;
  Rank& rank = ranks_[m];
  absl::StatusOr<HeartbeatReplyMessage> reply = DecodeHeartbeatReply(msg);
  if (!reply.ok()) return Annotate(reply.status(), rank.name);
  if (reply->memory_rank != m) {
    return absl::InvalidArgumentError(
        absl::StrCat(rank.name, ": a heartbeat reply names memory rank ", reply->memory_rank));
  }
  if (reply->seq == rank.beat_seq) rank.beat_seq = 0;  // else an answer to one given up on
  return true;
}

absl::StatusOr<bool> ComputeRank::TakeReplicaControl(size_t r, const std::vector<uint8_t>& msg) {
  absl::StatusOr<uint32_t> magic = PeekFrameMagic(msg);
  if (!magic.ok()) return false;
  Replica& replica = replicas_[r];
  if (*magic == kComputeHelloMagic && replica.unanswered > 0) {
    // Its answer to the step discard that kept it: from now on its messages are of the steps after.
    // (Any other compute hello is the caller's: start-up's.)
    absl::StatusOr<ComputeHelloMessage> hello = DecodeComputeHello(msg);
    if (!hello.ok()) return Annotate(hello.status(), replica.name);
    if (hello->compute_rank != r + 1) {
      return absl::InvalidArgumentError(
          absl::StrCat(replica.name, ": answers a step discard as compute rank ", hello->compute_rank));
    }
    --replica.unanswered;
    TANDEM_LOG_INFO("compute", replica.name, " goes on as compute rank ", replica.place, " of ",
                    compute_ranks_);
    return true;
  }
  if (*magic == kReplicaResultMagic && replica.unanswered > 0) return true;  // of a step discarded
  if (*magic == kMemoryRejoinMagic) return true;  // a late answer to a rejoin given up (RejoinReplicas)
  if (*magic == kHeadSplitMagic) return true;     // a late answer to a head split given up (SplitReplicas)
  if (*magic != kHeartbeatReplyMagic) return false;
  absl::StatusOr<HeartbeatReplyMessage> reply = DecodeHeartbeatReply(msg);
  if (!reply.ok()) return Annotate(reply.status(), replica.name);
  if (reply->memory_rank != r + 1) {  // a replica answers with its compute rank
    return absl::InvalidArgumentError(
        absl::StrCat(replica.name, ": a heartbeat reply names compute rank ", reply->memory_rank));
  }
  if (reply->seq == replica.beat_seq) replica.beat_seq = 0;
  return true;
}

absl::Status ComputeRank::Heartbeat() {
  if (options_.heartbeat <= absl::ZeroDuration()) return absl::OkStatus();
  // What arrived since the last call (replies, error reports). A failed peer ends the drain; it is
  // found by its status below.
  RETURN_IF_ERROR(TakeArrivedMessages("while idle"));
  // Ranks the transport knows failed, and ranks silent past the step timeout: each is named by
  // its own heartbeat, so a silent rank is never mistaken for its neighbour.
  const absl::Time now = absl::Now();
  for (size_t m = 0; m < ranks_.size(); ++m) {
    Rank& rank = ranks_[m];
    if (rank.lost) continue;
    if (absl::Status peer = transport_->PeerStatus(rank.peer); !peer.ok()) {
      RETURN_IF_ERROR(LoseRank(m, Annotate(peer, rank.name)));
    } else if (SilentPastHeartbeat(rank, now)) {
      RETURN_IF_ERROR(
          LoseRank(m, absl::DeadlineExceededError(absl::StrCat(
                          rank.name, ": no answer to a heartbeat for ",
                          absl::StrFormat("%.1f s", absl::ToDoubleSeconds(now - rank.beat_sent)),
                          " (launch.step_timeout_s ", absl::ToDoubleSeconds(options_.step_timeout),
                          "): stopped, hung or cut off"))));
    }
  }
  // Compute replicas: no recovery without one (the step needs its micro-batches), so a replica
  // that failed or stays silent ends the deployment, named.
  for (size_t r = 0; r < replicas_.size(); ++r) {
    Replica& replica = replicas_[r];
    if (replica.lost) continue;
    absl::Status why;
    if (absl::Status peer = transport_->PeerStatus(replica.peer); !peer.ok()) {
      why = Annotate(peer, absl::StrCat(replica.name, " is lost"));
    } else if (replica.beat_seq != 0 && now - replica.beat_sent > options_.step_timeout) {
      why = absl::DeadlineExceededError(
          absl::StrCat(replica.name, " is lost: no answer to a heartbeat for ",
                       absl::StrFormat("%.1f s", absl::ToDoubleSeconds(now - replica.beat_sent)),
                       " (launch.step_timeout_s ", absl::ToDoubleSeconds(options_.step_timeout),
                       "): stopped, hung or cut off"));
    }
    if (why.ok()) continue;
    if (!CanRecoverReplica()) return why;
    RETURN_IF_ERROR(LoseReplica(r, why, 0));
  }
  if (now >= next_beat_) {
    next_beat_ = now + options_.heartbeat;
    // A rank may stop once it has not heard from this one for a heartbeat and a step timeout.
    const int64_t silence_ms = SilenceMs();
    const std::vector<uint8_t> replica_beat =
        EncodeHeartbeat({.seq = beat_seq_ + 1, .silence_ms = static_cast<uint32_t>(silence_ms)});
    for (Replica& replica : replicas_) {
      if (replica.lost || replica.beat_seq != 0) continue;
      RETURN_IF_ERROR(Annotate(transport_->Send(replica.peer, replica_beat), replica.name));
      replica.beat_seq = beat_seq_ + 1;
      replica.beat_sent = now;
    }
    if (!replicas_.empty()) ++beat_seq_;
    for (size_t m = 0; m < ranks_.size(); ++m) {
      Rank& rank = ranks_[m];
      if (rank.lost || rank.beat_seq != 0) continue;
      const uint64_t seq = ++beat_seq_;
      const absl::Status sent = transport_->Send(
          rank.peer, EncodeHeartbeat({.seq = seq, .silence_ms = static_cast<uint32_t>(silence_ms)}));
      if (!sent.ok()) {
        RETURN_IF_ERROR(LoseRank(m, Annotate(sent, rank.name)));
        continue;
      }
      rank.beat_seq = seq;
      rank.beat_sent = now;
    }
  }
  RETURN_IF_ERROR(RecoverLostRanks(&ended_while_idle_));
  return AdvanceRejoins();
}

std::pair<int32_t, int32_t> ComputeRank::RowsOf(const PlannedStep& step, size_t m) const {
  if (head_) return {0, step.rank_rows.back()};
  return {step.rank_rows[m], step.rank_rows[m + 1]};
}

absl::Status ComputeRank::SendReleases(uint64_t step_id, const std::vector<std::vector<uint64_t>>& released) {
  for (size_t m = 0; m < ranks_.size(); ++m) {
    // Head partition: the one placement group's releases go to every rank.
    const std::vector<uint64_t>& ids = released[head_ ? 0 : m];
    if (ids.empty() || ranks_[m].lost) continue;
    ReleaseMessage rel;
    rel.step_id = step_id;
    rel.request_ids = ids;
    RETURN_IF_ERROR(Annotate(transport_->Send(ranks_[m].peer, EncodeRelease(rel)), ranks_[m].name));
  }
  return absl::OkStatus();
}

absl::Status ComputeRank::SendLayer(size_t j, const PlannedStep& step, uint32_t layer) {
  Lane& lane = lanes_[j];
  const int64_t t = step.rows.num_tokens();
  const size_t qkv_row = static_cast<size_t>(backend_->qkv_width()) * elem_;
  MemorySpace& memory = backend_->memory();
  if (device_path_) {
    // The rows go straight from the lane's qkv buffer (or a rank's packed columns) to the rank's
    // GPU buffer of this lane, ordered on the backend's stream.
    if (options_.q_first) return SendSplitOnDevice(j, step);
    void* stream = backend_->stream();
    auto* qkv = static_cast<const uint8_t*>(lane.qkv.get());
    for (size_t m = 0; m < ranks_.size(); ++m) {
      Rank& rank = ranks_[m];
      RankLane& rl = rank.lanes[j];
      const auto [begin, end] = RowsOf(step, m);
      if (begin == end || rank.lost) continue;  // a rerun's rows of a lost rank are dropped after it
      const void* rows = qkv + begin * qkv_row;
      size_t bytes = static_cast<size_t>(end - begin) * qkv_row;
      if (head_) {
        // Its columns of every row, packed into its own buffer: that buffer is what is written.
        RETURN_IF_ERROR(PackHeadSlice(memory, rank.slice, t, elem_, qkv, rl.pack.get()));
        rows = rl.pack.get();
        bytes = static_cast<size_t>(t * rank.slice.slice_qkv_width()) * elem_;
      }
      RETURN_IF_ERROR(Annotate(transport_->EnqueueWrite(rank.peer, rank.qkv_buffer + static_cast<uint32_t>(j),
                                                        0, rows, bytes, ++rl.seqno, stream),
                               rank.name));
    }
    return absl::OkStatus();
  }
  // Host-staged: the rows (device -> pinned host first on a GPU), each rank's with a layer
  // message header.
  const bool host = memory.host();
  auto* qkv_rows = static_cast<uint8_t*>(host ? lane.qkv.get() : lane.qkv_host.get());
  if (!host) {
    RETURN_IF_ERROR(memory.CopyOut(lane.qkv_host.get(), lane.qkv.get(), static_cast<size_t>(t) * qkv_row));
    RETURN_IF_ERROR(memory.Synchronize());
  }
  // Each memory rank's rows are one contiguous range of the step's rows (request partition), or
  // every row, packed to its columns (head partition).
  for (size_t m = 0; m < ranks_.size(); ++m) {
    Rank& rank = ranks_[m];
    RankLane& rl = rank.lanes[j];
    const auto [begin, end] = RowsOf(step, m);
    if (begin == end || rank.lost) continue;
    const size_t row_bytes = head_ ? static_cast<size_t>(rank.slice.slice_qkv_width()) * elem_ : qkv_row;
    const uint8_t* rows = qkv_rows + begin * qkv_row;
    if (head_) {
      RETURN_IF_ERROR(PackHeadSlice(host_copies_, rank.slice, t, elem_, qkv_rows, rl.pack.get()));
      rows = static_cast<const uint8_t*>(rl.pack.get());
    }
    if (options_.q_first) {
      const absl::Status wrote =
          SendSplit(step, layer, m, j, rows, static_cast<size_t>(end - begin), row_bytes);
      if (!wrote.ok()) RETURN_IF_ERROR(LoseRank(m, Annotate(wrote, rank.name)));
      continue;
    }
    const LayerMessageExpect what{.step_id = step.plan.step_id,
                                  .layer = layer,
                                  .kind = LayerMessageKind::kQkv,
                                  .dtype = backend_->dtype(),
                                  .rows = static_cast<uint32_t>(end - begin),
                                  .row_bytes = static_cast<uint32_t>(row_bytes),
                                  .seqno = ++rl.seqno};
    const absl::Status wrote = WriteLayer(rank.peer, rank.qkv_buffer + static_cast<uint32_t>(j), 0, what,
                                          {rows, static_cast<size_t>(end - begin) * row_bytes});
    if (!wrote.ok()) RETURN_IF_ERROR(LoseRank(m, Annotate(wrote, rank.name)));
  }
  return absl::OkStatus();
}

absl::Status ComputeRank::SendSplit(const PlannedStep& step, uint32_t layer, size_t m, size_t j,
                                    const uint8_t* rows, size_t n, size_t row_bytes) {
  Rank& rank = ranks_[m];
  // Its rows' q columns first, then their k,v columns, each a message of its own.
  const size_t q_row = static_cast<size_t>(rank.slice.slice_q_dim()) * elem_;
  const size_t kv_row = row_bytes - q_row;
  auto* split = static_cast<uint8_t*>(lanes_[j].split.get());
  uint8_t* kv = split + n * q_row;
  CopyStridedHost(split, q_row, rows, row_bytes, q_row, n);
  CopyStridedHost(kv, kv_row, rows + q_row, row_bytes, kv_row, n);
  RankLane& rl = rank.lanes[j];
  const uint32_t buffer = rank.qkv_buffer + static_cast<uint32_t>(j);
  LayerMessageExpect what{.step_id = step.plan.step_id,
                          .layer = layer,
                          .kind = LayerMessageKind::kQ,
                          .dtype = backend_->dtype(),
                          .rows = static_cast<uint32_t>(n),
                          .row_bytes = static_cast<uint32_t>(q_row),
                          .seqno = ++rl.seqno};
  RETURN_IF_ERROR(WriteLayer(rank.peer, buffer, 0, what, {split, n * q_row}));
  what.kind = LayerMessageKind::kKv;
  what.row_bytes = static_cast<uint32_t>(kv_row);
  what.seqno = ++rl.seqno;
  const size_t offset = QFirstKvOffset(static_cast<size_t>(options_.scheduler.max_tokens_per_step), q_row);
  return WriteLayer(rank.peer, buffer, offset, what, {kv, n * kv_row});
}

absl::Status ComputeRank::SendSplitOnDevice(size_t j, const PlannedStep& step) {
  Lane& lane = lanes_[j];
  const int64_t t = step.rows.num_tokens();
  MemorySpace& memory = backend_->memory();
  void* stream = backend_->stream();
  const size_t max_rows = static_cast<size_t>(options_.scheduler.max_tokens_per_step);
  // Request partition: every row's q and k,v columns split once into the lane's split buffer (q
  // rows, then k,v rows); each rank's rows are a range of both.
  auto* split = static_cast<uint8_t*>(lane.split.get());
  if (!head_) {
    const size_t q_row = static_cast<size_t>(backend_->spec().q_dim()) * elem_;
    RETURN_IF_ERROR(PackSplitColumns(memory, ranks_[0].slice, t, elem_, lane.qkv.get(), split,
                                     split + static_cast<size_t>(t) * q_row));
  }
  for (size_t m = 0; m < ranks_.size(); ++m) {
    Rank& rank = ranks_[m];
    RankLane& rl = rank.lanes[j];
    const auto [begin, end] = RowsOf(step, m);
    if (begin == end || rank.lost) continue;
    const size_t q_row = static_cast<size_t>(rank.slice.slice_q_dim()) * elem_;
    const size_t kv_row = static_cast<size_t>(rank.slice.slice_qkv_width()) * elem_ - q_row;
    const uint8_t *q = nullptr, *kv = nullptr;
    if (head_) {
      // Its columns of every row, split into its own pack buffer (its writes read from there).
      auto* pack = static_cast<uint8_t*>(rl.pack.get());
      RETURN_IF_ERROR(PackSplitColumns(memory, rank.slice, t, elem_, lane.qkv.get(), pack,
                                       pack + static_cast<size_t>(t) * q_row));
      q = pack;
      kv = pack + static_cast<size_t>(t) * q_row;
    } else {
      q = split + static_cast<size_t>(begin) * q_row;
      kv = split + static_cast<size_t>(t) * q_row + static_cast<size_t>(begin) * kv_row;
    }
    const size_t n = static_cast<size_t>(end - begin);
    const uint32_t buffer = rank.qkv_buffer + static_cast<uint32_t>(j);
    RETURN_IF_ERROR(Annotate(transport_->EnqueueWrite(rank.peer, buffer, 0, q, n * q_row, ++rl.seqno, stream),
                             rank.name));
    RETURN_IF_ERROR(Annotate(transport_->EnqueueWrite(rank.peer, buffer, QFirstKvOffset(max_rows, q_row), kv,
                                                      n * kv_row, ++rl.seqno, stream),
                             rank.name));
  }
  return absl::OkStatus();
}

absl::Status ComputeRank::WriteLayer(uint32_t peer, uint32_t buffer, uint64_t offset,
                                     const LayerMessageExpect& what, absl::Span<const uint8_t> body) {
  const std::vector<uint8_t> header = MakeLayerMessageHeader(what, body, options_.checksums);
  const absl::Span<const uint8_t> pieces[] = {header, body};
  return transport_->Write(peer, buffer, offset, pieces, what.seqno);
}

void ComputeRank::SkipLayer(size_t j, const PlannedStep& step) {
  // As SendLayer counts: every rank with rows but the lost ones (every compute rank knows them,
  // from the step discards that named them).
  for (size_t m = 0; m < ranks_.size(); ++m) {
    const auto [begin, end] = RowsOf(step, m);
    if (begin == end || ranks_[m].lost) continue;
    ranks_[m].lanes[j].seqno += options_.q_first ? 2 : 1;  // q-first: a q and a k,v message
  }
}

absl::Status ComputeRank::SendResidual(size_t j, const PlannedStep& step, uint32_t layer) {
  Lane& lane = lanes_[j];
  const int64_t t = step.rows.num_tokens();
  const size_t bytes = static_cast<size_t>(lane.backend->residual_bytes(t));
  const uint32_t buffer = kResidualBufferBase + static_cast<uint32_t>(j);
  MemorySpace& memory = backend_->memory();
  const void* src = lane.backend->residual();
  if (device_path_) {
    return Annotate(transport_->EnqueueWrite(next_peer_, buffer, 0, src, bytes, ++lane.resid_out_seqno,
                                             backend_->stream()),
                    next_name_);
  }
  if (!memory.host()) {
    RETURN_IF_ERROR(memory.CopyOut(lane.resid_host.get(), src, bytes));
    RETURN_IF_ERROR(memory.Synchronize());
    src = lane.resid_host.get();
  }
  const LayerMessageExpect what{.step_id = step.plan.step_id,
                                .layer = layer,
                                .kind = LayerMessageKind::kResidual,
                                .dtype = DType::kF32,
                                .rows = static_cast<uint32_t>(t),
                                .row_bytes = static_cast<uint32_t>(backend_->spec().hidden_size * 4),
                                .seqno = ++lane.resid_out_seqno};
  return Annotate(WriteLayer(next_peer_, buffer, 0, what, {static_cast<const uint8_t*>(src), bytes}),
                  next_name_);
}

absl::Status ComputeRank::ReceiveResidual(size_t j, const PlannedStep& step, uint32_t layer) {
  Lane& lane = lanes_[j];
  const int64_t t = step.rows.num_tokens();
  const size_t bytes = static_cast<size_t>(lane.backend->residual_bytes(t));
  const uint32_t buffer = kResidualBufferBase + static_cast<uint32_t>(j);
  MemorySpace& memory = backend_->memory();
  const std::string what = absl::StrCat(prev_name_, ": residual stream of step ", step.plan.step_id,
                                        " micro-batch ", j, " layer ", layer);
  if (device_path_) {
    RETURN_IF_ERROR(transport_->EnqueueWait(
        prev_peer_, buffer, 0, bytes, ++lane.resid_in_seqno, options_.step_timeout,
        absl::StrCat("compute rank ", compute_rank_, ": ", what), backend_->stream()));
    return memory.CopyStrided(lane.backend->residual(), bytes, lane.resid_in.get(), bytes, bytes, 1);
  }
  RETURN_IF_ERROR(
      Annotate(WaitInput(buffer, ++lane.resid_in_seqno, absl::Now() + options_.step_timeout), what));
  const LayerMessageExpect expect{.step_id = step.plan.step_id,
                                  .layer = layer,
                                  .kind = LayerMessageKind::kResidual,
                                  .dtype = DType::kF32,
                                  .rows = static_cast<uint32_t>(t),
                                  .row_bytes = static_cast<uint32_t>(backend_->spec().hidden_size * 4),
                                  .seqno = lane.resid_in_seqno,
                                  .verify_checksum = options_.checksums};
  absl::StatusOr<absl::Span<const uint8_t>> payload =
      ReadLayerMessage({static_cast<const uint8_t*>(lane.resid_in.get()), lane.resid_in_bytes}, expect);
  if (!payload.ok()) return Annotate(payload.status(), what);
  return memory.CopyIn(lane.backend->residual(), payload->data(), payload->size());
}

absl::Status ComputeRank::ReceiveLayer(size_t j, const PlannedStep& step, uint32_t layer) {
  Lane& lane = lanes_[j];
  const ModelSpec& s = backend_->spec();
  const int64_t t = step.rows.num_tokens();
  const size_t attn_row = static_cast<size_t>(s.q_dim()) * elem_;
  MemorySpace& memory = backend_->memory();
  const std::string micro = options_.micro_batches > 1 ? absl::StrCat(" micro-batch ", j) : "";
  if (device_path_) {
    void* stream = backend_->stream();
    for (size_t m = 0; m < ranks_.size(); ++m) {
      Rank& rank = ranks_[m];
      RankLane& rl = rank.lanes[j];
      const auto [begin, end] = RowsOf(step, m);
      if (begin == end || rank.lost) continue;
      // Request partition: its rows of the lane's attention buffer; head partition: its own
      // buffer, from row 0, then scattered into its columns.
      const size_t offset = head_ ? 0 : begin * attn_row;
      const size_t bytes = head_ ? static_cast<size_t>(t * rank.slice.slice_q_dim()) * elem_
                                 : static_cast<size_t>(end - begin) * attn_row;
      RETURN_IF_ERROR(
          transport_->EnqueueWait(rank.peer, rl.attn_buffer, offset, bytes, rl.seqno, options_.step_timeout,
                                  absl::StrCat("compute rank: attention output of ", rank.name, ", step ",
                                               step.plan.step_id, micro, " layer ", layer),
                                  stream));
      if (head_)
        RETURN_IF_ERROR(UnpackHeadSlice(memory, rank.slice, t, elem_, rl.out.get(), lane.attn.get()));
    }
    return absl::OkStatus();
  }
  const bool host = memory.host();
  // Head partition: where the ranks' outputs are scattered (then copied to the device at once).
  void* attn_rows = host ? lane.attn.get() : lane.attn_host.get();
  for (size_t m = 0; m < ranks_.size(); ++m) {
    Rank& rank = ranks_[m];
    RankLane& rl = rank.lanes[j];
    const auto [begin, end] = RowsOf(step, m);
    if (begin == end || rank.lost) continue;
    const absl::Time deadline = absl::Now() + options_.step_timeout;
    absl::Status waited;
    while (!rank.lost && !(waited = WaitInput(rl.attn_buffer, rl.seqno, deadline)).ok()) {
      // Which rank failed: the one whose error message is waiting (a memory rank that stops says
      // why), those the transport knows to have failed, or else this one, silent past the
      // deadline. A wait cut short by another rank's failure goes on once that rank is lost.
      RETURN_IF_ERROR(
          LoseFailedRanks(m, Annotate(waited, absl::StrCat(rank.name, ": attention output of step ",
                                                           step.plan.step_id, micro, " layer ", layer))));
    }
    if (rank.lost) continue;
    const LayerMessageExpect expect{
        .step_id = step.plan.step_id,
        .layer = layer,
        .kind = LayerMessageKind::kAttnOut,
        .dtype = backend_->dtype(),
        .rows = static_cast<uint32_t>(end - begin),
        .row_bytes =
            static_cast<uint32_t>(head_ ? static_cast<size_t>(rank.slice.slice_q_dim()) * elem_ : attn_row),
        .seqno = rl.seqno,
        .verify_checksum = options_.checksums};
    absl::StatusOr<absl::Span<const uint8_t>> payload =
        ReadLayerMessage({static_cast<const uint8_t*>(rl.recv.get()), rl.recv_bytes}, expect);
    if (!payload.ok()) return Annotate(payload.status(), rank.name);
    if (head_) {
      RETURN_IF_ERROR(UnpackHeadSlice(host_copies_, rank.slice, t, elem_, payload->data(), attn_rows));
    } else {
      RETURN_IF_ERROR(memory.CopyIn(static_cast<uint8_t*>(lane.attn.get()) + begin * attn_row,
                                    payload->data(), payload->size()));
    }
  }
  if (head_ && !host) {
    RETURN_IF_ERROR(memory.CopyIn(lane.attn.get(), attn_rows, static_cast<size_t>(t) * attn_row));
  }
  return absl::OkStatus();
}

absl::Status ComputeRank::DeviceStepError(absl::Status synced, uint64_t step_id) {
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
      return Annotate(synced, absl::StrCat(ranks_[m].name, ", step ", step_id));
    }
  }
  return Annotate(synced, absl::StrCat("step ", step_id));
}

absl::StatusOr<size_t> ComputeRank::ReceiveFromRank(absl::Time deadline, const std::string& awaited,
                                                    std::vector<uint8_t>* msg) {
  transport::PeerId from = 0;
  size_t m = 0;
  while (true) {
    RETURN_IF_ERROR(
        Annotate(transport_->Receive(&from, msg, deadline), absl::StrCat("waiting for ", awaited)));
    if (TakeStrayMessage(from, msg)) continue;  // a probe's reply, or a connection given up
    m = 0;
    while (m < ranks_.size() && ranks_[m].peer != from) ++m;
    if (m < ranks_.size() && ranks_[m].lost) continue;  // whatever a lost memory rank still sends is dropped
    if (m < ranks_.size()) {
      absl::StatusOr<bool> beat = TakeHeartbeatReply(m, *msg);
      if (!beat.ok()) return beat.status();
      if (*beat) continue;  // the answer to a heartbeat sent while idle
    }
    break;
  }
  std::string name;
  if (m < ranks_.size()) {
    name = ranks_[m].name;
  } else {
    size_t r = 0;
    while (r < replicas_.size() && replicas_[r].peer != from) ++r;
    if (r == replicas_.size())
      return absl::InternalError(absl::StrCat("a message from an unknown peer (", awaited, ")"));
    name = replicas_[r].name;
    m = ranks_.size() + r;
    absl::StatusOr<bool> beat = TakeReplicaControl(r, *msg);
    if (!beat.ok()) return beat.status();
    if (*beat) return ReceiveFromRank(deadline, awaited, msg);  // the answer to a heartbeat sent while idle
  }
  ASSIGN_OR_RETURN(const uint32_t magic, PeekFrameMagic(*msg));
  if (magic == kErrorMagic) {
    ASSIGN_OR_RETURN(const ErrorMessage err, DecodeError(*msg));
    return Annotate(StatusFromErrorMessage(err), name);
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
  size_t live = 0;
  for (Rank& rank : ranks_) {
    if (rank.lost) continue;  // its attention time stays -1 (unknown)
    RETURN_IF_ERROR(Annotate(transport_->Send(rank.peer, request), rank.name));
    ++live;
  }
  t.rank_attention_ms.assign(ranks_.size(), -1.0);
  const absl::Time deadline = absl::Now() + timeout;
  for (size_t got = 0; got < live;) {
    std::vector<uint8_t> msg;
    ASSIGN_OR_RETURN(const size_t m, ReceiveFromRank(deadline, "the memory ranks' stats", &msg));
    if (m >= ranks_.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat(replicas_[m - ranks_.size()].name, ": unexpected message between steps"));
    }
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

absl::Status ComputeRank::NameFailedPeer(absl::Status st) {
  if (st.ok()) return st;
  // The memory ranks leave as soon as compute rank 0 dies, and their disconnects may reach this
  // rank before its own: give the transport a moment (the failure path only) to report it.
  // A memory rank that saw compute rank 0 go says so first (an error message): that is the cause.
  // Up to 3 s: 1 s was seen too short on a loaded 2-core host.
  const absl::Time until = absl::Now() + absl::Seconds(3);
  absl::Status told;
  while (transport_->PeerStatus(rank0_peer_).ok() && told.ok() && absl::Now() < until) {
    transport::PeerId from = 0;
    std::vector<uint8_t> msg;
    if (!transport_->Receive(&from, &msg, absl::Now() + absl::Milliseconds(50)).ok()) continue;
    if (from == rank0_peer_ || PeekFrameMagic(msg).value_or(0) != kErrorMagic) continue;
    absl::StatusOr<ErrorMessage> err = DecodeError(msg);
    if (err.ok()) told = Annotate(StatusFromErrorMessage(*err), "a memory rank stopped");
  }
  if (!told.ok() && transport_->PeerStatus(rank0_peer_).ok()) return told;
  // Compute rank 0 first: when it dies, the memory ranks it served may leave too. They are told
  // (so that one that sees this rank leave first names compute rank 0, not it).
  if (absl::Status peer = transport_->PeerStatus(rank0_peer_); !peer.ok()) {
    rank0_gone_ = true;
    st = AnnotateGone(st, absl::StrCat("compute rank 0 (", transport_->PeerName(rank0_peer_), ")"), peer);
    const std::vector<uint8_t> frame =
        EncodeError(ErrorMessageFromStatus(Annotate(st, absl::StrCat("compute rank ", compute_rank_))));
    for (const Rank& rank : ranks_) {
      if (transport_->PeerStatus(rank.peer).ok()) (void)transport_->Send(rank.peer, frame);
    }
    (void)transport_->Flush(absl::Now() + absl::Seconds(2));
    return st;
  }
  for (const Rank& rank : ranks_) {
    if (rank.lost) continue;  // given up by compute rank 0, which goes on without it
    if (absl::Status peer = transport_->PeerStatus(rank.peer); !peer.ok()) {
      return AnnotateGone(st, rank.name, peer);
    }
  }
  for (const auto& [peer, name] : {std::pair(next_peer_, next_name_), std::pair(prev_peer_, prev_name_)}) {
    if (!schedule_.rotational() || peer == rank0_peer_) continue;
    if (absl::Status failed = transport_->PeerStatus(peer); !failed.ok()) {
      return AnnotateGone(st, name, failed);
    }
  }
  return st;
}

absl::Status ComputeRank::ServeReplica(const ComputeReplicaOptions& options) {
  auto stopped = [&] { return options.stop_requested && options.stop_requested(); };
  const std::string me = absl::StrCat("compute rank ", compute_rank_);
  // Compute rank 0 connects once every replica listens.
  const absl::Time deadline = absl::Now() + options_.startup_timeout;
  while (true) {
    if (stopped()) return absl::CancelledError("stopped while waiting for compute rank 0");
    absl::StatusOr<transport::PeerId> peer =
        transport_->Accept(std::min(deadline, absl::Now() + absl::Milliseconds(100)));
    if (peer.ok()) {
      rank0_peer_ = *peer;
      break;
    }
    if (!absl::IsDeadlineExceeded(peer.status())) return peer.status();
    if (absl::Now() >= deadline)
      return absl::DeadlineExceededError(absl::StrCat(me, ": compute rank 0 never connected"));
  }
  const ComputeHelloMessage ready{.compute_rank = static_cast<uint16_t>(compute_rank_),
                                  .compute_ranks = static_cast<uint16_t>(compute_ranks_)};
  RETURN_IF_ERROR(transport_->Send(rank0_peer_, EncodeComputeHello(ready)));
  if (schedule_.rotational()) RETURN_IF_ERROR(JoinRing(deadline));
  // While the host waits on the device path, compute rank 0's heartbeats are answered and its step
  // discard stops the step (ReplicaPoll).
  if (device_path_) transport_->SetDevicePoll([this] { return ReplicaPoll(); });
  TANDEM_LOG_INFO("compute", me, ": ready, serving compute rank 0");
  const size_t groups = head_ ? 1 : ranks_.size();
  std::vector<PlannedStep> parts;
  size_t expected = 0;
  uint64_t steps = 0;
  // Rotational ring: the connections to other replicas (not rank 0's; a step discard can change
  // them, ReconnectRing), and the byes that came on them before rank 0's.
  auto ring_peers = [&] {
    std::vector<transport::PeerId> ring;
    if (schedule_.rotational()) {
      for (transport::PeerId p : {next_peer_, prev_peer_}) {
        if (p != rank0_peer_ && std::find(ring.begin(), ring.end(), p) == ring.end()) ring.push_back(p);
      }
    }
    return ring;
  };
  size_t ring_byes = 0;
  // Compute rank 0's heartbeats (sent while it is idle) say how long it may stay silent: past that
  // (no heartbeat, no replica step) it is stopped, hung or cut off, and this rank stops.
  absl::Time last_heard = absl::Now();
  absl::Duration silence = absl::InfiniteDuration();
  while (true) {
    std::vector<uint8_t> msg;
    transport::PeerId from = 0;
    absl::Status got;
    if (!rank0_deferred_.empty()) {  // what compute rank 0 sent while the ring was made anew
      msg = std::move(rank0_deferred_.front());
      rank0_deferred_.pop_front();
      from = rank0_peer_;
    } else {
      got = transport_->Receive(&from, &msg, absl::Now() + absl::Milliseconds(100));
    }
    if (absl::IsDeadlineExceeded(got)) {
      if (stopped()) return absl::CancelledError("stopped");
      if (parts.empty() && absl::Now() - last_heard > silence) {
        rank0_gone_ = true;
        // Not told: a silent peer may not read, and a send would wait for the send timeout. The
        // memory ranks are told, so that they name compute rank 0, not this rank.
        const absl::Status silent = absl::DeadlineExceededError(
            absl::StrCat(me, ": compute rank 0 has been silent for ",
                         absl::StrFormat("%.1f s", absl::ToDoubleSeconds(absl::Now() - last_heard)),
                         " (no step, no heartbeat; its heartbeats allow ",
                         absl::StrFormat("%.1f s", absl::ToDoubleSeconds(silence)),
                         "): it is stopped, hung or cut off; this rank stops"));
        const std::vector<uint8_t> frame = EncodeError(ErrorMessageFromStatus(silent));
        for (const Rank& rank : ranks_) {
          if (transport_->PeerStatus(rank.peer).ok()) (void)transport_->Send(rank.peer, frame);
        }
        (void)transport_->Flush(absl::Now() + absl::Seconds(2));
        return silent;
      }
      continue;
    }
    if (!got.ok()) {
      // Another peer failed (a memory rank, a ring neighbour): compute rank 0 decides what follows.
      if (transport_->PeerStatus(rank0_peer_).ok()) {
        const absl::Status st = AwaitRank0(got);
        if (!kept_) return st;
        kept_ = false, parts.clear(), last_heard = absl::Now();  // kept: the next steps come
        continue;
      }
      rank0_gone_ = true;
      return NameFailedPeer(got);
    }
    if (FromLostRank(from)) continue;  // whatever a memory rank given up still sends
    if (from == rank0_peer_) last_heard = absl::Now();
    ASSIGN_OR_RETURN(const uint32_t magic, PeekFrameMagic(msg));
    if (KeepEarlyRingHello(from, magic, &msg)) continue;
    if (magic == kErrorMagic) {
      ASSIGN_OR_RETURN(const ErrorMessage err, DecodeError(msg));
      // A memory rank that left because compute rank 0 went silent says so: then rank 0 is not
      // told why this rank stops (a send to a silent peer waits for the send timeout).
      if (from != rank0_peer_ && absl::Now() - last_heard > silence / 2) rank0_gone_ = true;
      return Annotate(StatusFromErrorMessage(err),
                      from == rank0_peer_ ? "compute rank 0 stopped" : "a memory rank stopped");
    }
    if (const std::vector<transport::PeerId> ring = ring_peers();
        magic == kByeMagic && std::find(ring.begin(), ring.end(), from) != ring.end()) {
      ++ring_byes;  // a ring neighbour got rank 0's bye first
      continue;
    }
    if (from != rank0_peer_) {
      return absl::InvalidArgumentError(
          absl::StrCat("unexpected message (magic 0x", absl::Hex(magic), ") from a memory rank"));
    }
    if (magic == kByeMagic) {
      // Part from every memory rank (a bye each way, so that neither sees the other vanish), then
      // answer compute rank 0, which says bye to the memory ranks once every replica has.
      TANDEM_LOG_INFO("compute", me, ": bye after ", steps, " steps");
      const std::vector<uint8_t> bye = EncodeBye(ByeMessage{.steps = steps});
      transport_->Close(rank0_peer_);
      size_t waiting = 0;
      for (Rank& rank : ranks_) {
        if (rank.lost) continue;       // given up: nothing to say to it
        transport_->Close(rank.peer);  // closed first: its going away later is expected
        waiting += transport_->Send(rank.peer, bye).ok() ? 1 : 0;
      }
      // The ring's connections between replicas (rotational, 3 or more compute ranks): a bye each
      // way too, so that neither leaves while the other could still see it go unannounced.
      const std::vector<transport::PeerId> ring = ring_peers();
      for (transport::PeerId p : ring) {
        transport_->Close(p);
        (void)transport_->Send(p, bye);
      }
      waiting += ring.size() - std::min(ring.size(), ring_byes);
      const absl::Time until = absl::Now() + absl::Seconds(5);
      while (waiting > 0) {
        transport::PeerId peer = 0;
        if (!transport_->Receive(&peer, &msg, until).ok()) break;
        absl::StatusOr<uint32_t> m = PeekFrameMagic(msg);
        if (m.ok() && *m == kByeMagic && peer != rank0_peer_) --waiting;
      }
      (void)transport_->Send(rank0_peer_, bye);
      (void)transport_->Flush(absl::Now() + absl::Seconds(2));
      return absl::OkStatus();
    }
    if (magic == kHeartbeatMagic) {
      // The same heartbeat as the memory ranks get; the reply names this compute rank.
      ASSIGN_OR_RETURN(const HeartbeatMessage beat, DecodeHeartbeat(msg));
      silence = absl::Milliseconds(beat.silence_ms);
      const HeartbeatReplyMessage reply{.seq = beat.seq, .memory_rank = static_cast<uint16_t>(compute_rank_)};
      RETURN_IF_ERROR(transport_->Send(rank0_peer_, EncodeHeartbeatReply(reply)));
      continue;
    }
    if (magic == kMemoryRejoinMagic) {
      // Between steps: a memory rank compute rank 0 gave up comes back (a new process).
      RETURN_IF_ERROR(TakeMemoryRejoin(msg));
      last_heard = absl::Now();
      continue;
    }
    if (magic == kHeadSplitMagic) {
      // Between steps, under the head partition: the live memory ranks split the KV heads again.
      RETURN_IF_ERROR(TakeHeadSplit(msg));
      continue;
    }
    if (magic == kStepDiscardMagic) {
      // Between steps (or with some of a step's parts still to come): released, or kept, and then
      // the parts that come are the rerun's (or the next step's).
      const absl::Status st = TakeRank0Discard(msg);
      if (!kept_) return st;
      kept_ = false, parts.clear();
      continue;
    }
    if (magic != kReplicaStepMagic) {
      return absl::InvalidArgumentError(
          absl::StrCat("unexpected message (magic 0x", absl::Hex(magic), ") from compute rank 0"));
    }
    ASSIGN_OR_RETURN(ReplicaStepMessage step, DecodeReplicaStep(msg));
    const StepPlan& plan = step.plan;
    if (!Runs(plan.micro_batch) || plan.micro_batches > lanes_.size() ||
        (!parts.empty() &&
         (plan.step_id != parts[0].plan.step_id || plan.micro_batches != parts[0].plan.micro_batches ||
          plan.micro_batch <= parts.back().plan.micro_batch))) {
      return absl::InvalidArgumentError(absl::StrCat("replica step ", plan.step_id, " micro-batch ",
                                                     int{plan.micro_batch}, " of ", int{plan.micro_batches},
                                                     " is not one of ", me, "'s, or out of order"));
    }
    if (parts.empty()) {
      expected = 0;
      for (size_t j = 0; j < plan.micro_batches; ++j) expected += Runs(j) ? 1 : 0;
    }
    // The part's rows, as the controller built them (compute_node/controller.cc, Schedule).
    PlannedStep part;
    part.plan = plan;
    part.rank_rows.assign(groups + 1, 0);
    StepTokens& rows = part.rows;
    rows.tokens = std::move(step.tokens);
    for (const StepRequest& q : plan.requests) {
      if (q.memory_rank >= groups) {
        return absl::InvalidArgumentError(absl::StrCat("replica step ", plan.step_id, ": request ",
                                                       q.request_id, " on memory rank ", q.memory_rank,
                                                       " of ", groups));
      }
      for (int32_t i = 0; i < q.q_len; ++i) rows.positions.push_back(q.position + i);
      part.rank_rows[q.memory_rank + 1] += q.q_len;
      if (q.sample) {
        rows.sample_rows.push_back(static_cast<int32_t>(rows.positions.size()) - 1);
        rows.sampling.push_back(
            {.temperature = q.temperature, .top_k = q.top_k, .top_p = q.top_p, .seed = q.seed});
        rows.counters.push_back(q.counter);
        if (q.top_logprobs > 0 || !rows.top_logprobs.empty()) {
          rows.top_logprobs.resize(rows.sample_rows.size() - 1);
          rows.top_logprobs.push_back(q.top_logprobs);
        }
      }
    }
    for (size_t g = 1; g < part.rank_rows.size(); ++g) part.rank_rows[g] += part.rank_rows[g - 1];
    parts.push_back(std::move(part));
    if (parts.size() < expected) continue;
    std::vector<SampledTokens> sampled;
    if (absl::Status ran = RunParts(parts, &sampled); !ran.ok()) {
      const absl::Status st = AwaitRank0(std::move(ran));
      if (!kept_) return st;
      // Kept by a step discard: the step is dropped, and compute rank 0 sends it again.
      kept_ = false, parts.clear(), last_heard = absl::Now();
      continue;
    }
    for (size_t k = 0; k < parts.size(); ++k) {
      if (!Finishes(parts[k].plan.micro_batch)) continue;  // another rank samples it
      const ReplicaResultMessage result{.step_id = parts[k].plan.step_id,
                                        .micro_batch = parts[k].plan.micro_batch,
                                        .tokens = std::move(sampled[k].tokens),
                                        .logprobs = std::move(sampled[k].logprobs),
                                        .top = std::move(sampled[k].top)};
      RETURN_IF_ERROR(NameFailedPeer(transport_->Send(rank0_peer_, EncodeReplicaResult(result))));
    }
    parts.clear();
    ++steps;
    last_heard = absl::Now();  // the step came from compute rank 0
  }
}

absl::Status ComputeRank::TakeRank0Discard(const std::vector<uint8_t>& msg) {
  const std::string me = absl::StrCat("compute rank ", compute_rank_);
  ASSIGN_OR_RETURN(StepDiscardMessage d, DecodeStepDiscard(msg));
  // A later discard can come while this one is applied (ReconnectRing): each is taken in turn.
  while (compute_rank_ < 8 && ((d.compute_mask >> compute_rank_) & 1) != 0) {
    ASSIGN_OR_RETURN(std::optional<StepDiscardMessage> later, KeepAfterDiscard(d));
    if (later.has_value()) {
      d = std::move(*later);
      continue;
    }
    kept_ = true;
    return absl::AbortedError(
        absl::StrCat(me, ": step ", d.step_id, " discarded by compute rank 0; this rank goes on"));
  }
  TANDEM_LOG_WARN("compute", me, ": released by compute rank 0 (a step discard that leaves it out)",
                  d.step_id != 0 ? absl::StrCat(" (step ", d.step_id, " discarded)") : std::string(),
                  "; this rank stops");
  return absl::CancelledError(absl::StrCat(me, ": released by compute rank 0"));
}

absl::StatusOr<std::optional<StepDiscardMessage>> ComputeRank::KeepAfterDiscard(const StepDiscardMessage& d) {
  const std::string me = absl::StrCat("compute rank ", compute_rank_);
  if (initial_compute_ranks_ < 8 && (d.compute_mask >> initial_compute_ranks_) != 0) {
    return absl::InvalidArgumentError(absl::StrFormat("%s: a step discard keeps compute ranks 0x%02x of %d",
                                                      me, d.compute_mask, initial_compute_ranks_));
  }
  const int survivors = std::popcount(d.compute_mask);
  for (uint16_t m : d.lost_memory_ranks) {
    if (m >= ranks_.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat(me, ": a step discard names memory rank ", m, " lost, of ", ranks_.size()));
    }
  }
  // Its place among the compute ranks that go on (in rank order) and their schedule.
  place_ = std::popcount(static_cast<unsigned>(d.compute_mask & ((1u << compute_rank_) - 1)));
  compute_ranks_ = survivors;
  schedule_ = PipelineSchedule{.compute_ranks = compute_ranks_,
                               .slice_layers = compute_ranks_ > 1 ? options_.slice_layers : 0};
  // The memory ranks compute rank 0 gave up are let go (their failure no longer fails waits, what
  // they still send is dropped); the others, let go while compute rank 0's word was awaited
  // (AwaitRank0), count again, as do the ring's neighbours.
  for (uint16_t m : d.lost_memory_ranks) {
    if (ranks_[m].lost) continue;
    ranks_[m].lost = true;
    transport_->Close(ranks_[m].peer);
    TANDEM_LOG_WARN("compute", me, ": ", ranks_[m].name, " is lost (compute rank 0 gave it up)");
  }
  // The ring over the compute ranks that go on, before the memory ranks count again: a memory
  // rank's failure meanwhile must not cut the wait for a new neighbour short.
  std::optional<StepDiscardMessage> later;
  if (schedule_.rotational()) {
    ASSIGN_OR_RETURN(later, ReconnectRing(d.compute_mask));
  }
  for (const Rank& rank : ranks_) {
    if (!rank.lost) transport_->Reopen(rank.peer);
  }
  if (schedule_.rotational()) {
    for (transport::PeerId p : {next_peer_, prev_peer_}) {
      if (p != rank0_peer_) transport_->Reopen(p);
    }
  }
  // Every doorbell starts again from the discard's base, as on every other rank.
  for (Rank& rank : ranks_) {
    for (RankLane& rl : rank.lanes) rl.seqno = d.seqno_base;
  }
  for (Lane& lane : lanes_) lane.resid_in_seqno = lane.resid_out_seqno = d.seqno_base;
  for (size_t j = 0; j < lanes_.size(); ++j) {
    if (!Runs(j)) continue;
    RETURN_IF_ERROR(SetUpLane(j));  // the lanes it takes over; no-ops for its own
    for (size_t m = 0; m < ranks_.size(); ++m) RETURN_IF_ERROR(SetUpRankLane(m, j));
  }
  // The device path: the discarded step has drained (its SyncStream failed, or it had ended), and
  // the path is made usable for the rerun before the answer, after which compute rank 0 lets the
  // rerun write.
  if (device_path_) RETURN_IF_ERROR(Annotate(transport_->ResetDevicePath(backend_->stream()), me));
  // The answer: what this rank sends compute rank 0 after it is of the steps that follow.
  const ComputeHelloMessage hello{.compute_rank = static_cast<uint16_t>(compute_rank_),
                                  .compute_ranks = static_cast<uint16_t>(initial_compute_ranks_)};
  RETURN_IF_ERROR(Annotate(transport_->Send(rank0_peer_, EncodeComputeHello(hello)), "compute rank 0"));
  TANDEM_LOG_WARN("compute", me, ": kept by compute rank 0",
                  d.step_id != 0 ? absl::StrCat(" (step ", d.step_id, " discarded)") : std::string(),
                  ": goes on as ", "compute rank ", place_, " of ", compute_ranks_, " in the pipeline",
                  schedule_.rotational() ? absl::StrCat(" (ring: from ", prev_name_, " to ", next_name_, ")")
                                         : std::string(),
                  ", seqnos from ", d.seqno_base);
  return later;
}

bool ComputeRank::KeepEarlyRingHello(transport::PeerId from, uint32_t magic, std::vector<uint8_t>* msg) {
  if (magic != kComputeHelloMagic || !schedule_.rotational() || from == rank0_peer_ || from == next_peer_ ||
      from == prev_peer_ ||
      std::any_of(ranks_.begin(), ranks_.end(), [&](const Rank& r) { return r.peer == from; }))
    return false;
  transport_->Close(from);  // not a peer of this rank's yet: its failure fails no wait
  early_ring_hellos_.emplace_back(from, std::move(*msg));
  return true;
}

absl::StatusOr<std::optional<StepDiscardMessage>> ComputeRank::ReconnectRing(uint8_t mask) {
  const std::string me = absl::StrCat("compute rank ", compute_rank_);
  const std::string rank0 = "compute rank 0";
  const int n = initial_compute_ranks_;
  auto live = [&](int c) { return ((mask >> c) & 1) != 0; };
  int next = compute_rank_, prev = compute_rank_;
  do next = (next + 1) % n;
  while (!live(next));
  do prev = (prev + n - 1) % n;
  while (!live(prev));
  const bool new_next = next != next_rank_, new_prev = prev != prev_rank_;
  if (!new_next && !new_prev) return std::nullopt;
  // A neighbour that is gone: its connection is let go (its failure fails nothing, whatever it still
  // sends is dropped). Compute rank 0's connection stays, and a predecessor that never connected
  // (prev_rank_ -1) has none.
  std::vector<transport::PeerId> gone;
  if (new_next && next_peer_ != rank0_peer_) gone.push_back(next_peer_);
  if (new_prev && prev_rank_ > 0 && prev_peer_ != rank0_peer_) gone.push_back(prev_peer_);
  for (transport::PeerId p : gone) {
    transport_->Close(p);
    retired_peers_.insert(p);
  }
  if (new_next && next == 0) next_peer_ = rank0_peer_, next_name_ = rank0, next_rank_ = 0;
  if (new_prev && prev == 0) prev_peer_ = rank0_peer_, prev_name_ = rank0, prev_rank_ = 0;
  bool await_address = new_next && next != 0;  // compute rank 0's replica ring message
  bool await_hello = new_prev && prev != 0;    // the new predecessor's connection and compute hello
  if (!await_address && !await_hello) return std::nullopt;
  if (await_hello) {
    // Until it has connected (the placeholder is compute rank 0's connection, which nothing here
    // lets go or reopens as a ring neighbour's).
    prev_rank_ = -1, prev_peer_ = rank0_peer_;
    prev_name_ = absl::StrCat("compute rank ", prev, " (not connected yet)");
  }
  // Every peer but compute rank 0 is let go while this waits (KeepAfterDiscard makes the live ones
  // count again): a memory rank's failure must not fail the wait, compute rank 0 decides on it.
  for (const Rank& rank : ranks_) {
    if (!rank.lost) transport_->Close(rank.peer);
  }
  // Incoming connections are Close()d as they are accepted (their failure fails no wait) until
  // one turns out to be the predecessor (KeepAfterDiscard reopens it).
  const bool accepting = await_hello;
  auto accept_all = [&] {
    for (absl::StatusOr<transport::PeerId> p = transport_->Accept(absl::Now()); p.ok();
         p = transport_->Accept(absl::Now())) {
      transport_->Close(*p);
    }
  };
  // A compute hello on an incoming connection: the predecessor's is taken; another compute rank's
  // is kept for a later discard's ring (a rank that connected before this one had that discard);
  // anything else lets the connection go.
  std::vector<std::pair<transport::PeerId, std::vector<uint8_t>>> deferred;
  auto take_hello = [&](transport::PeerId from, std::vector<uint8_t> msg) {
    absl::StatusOr<ComputeHelloMessage> hello = DecodeComputeHello(msg);
    if (await_hello && hello.ok() && hello->compute_rank == prev) {
      prev_peer_ = from, prev_rank_ = prev;
      prev_name_ = absl::StrCat("compute rank ", prev);
      await_hello = false;
      return;
    }
    transport_->Close(from);
    if (hello.ok()) {
      deferred.emplace_back(from, std::move(msg));
      return;
    }
    retired_peers_.insert(from);
    TANDEM_LOG_WARN("compute", me, ": lets go an incoming connection (", transport_->PeerName(from),
                    "): unexpected message (magic 0x", absl::Hex(PeekFrameMagic(msg).value_or(0)), ")");
  };
  struct Defer {  // what is deferred goes back to early_ring_hellos_, however this returns
    ComputeRank* self;
    std::vector<std::pair<transport::PeerId, std::vector<uint8_t>>>* deferred;
    ~Defer() {
      for (auto& d : *deferred) self->early_ring_hellos_.push_back(std::move(d));
    }
  } defer{this, &deferred};
  for (auto& [from, msg] : std::exchange(early_ring_hellos_, {})) {
    if (!retired_peers_.contains(from)) take_hello(from, std::move(msg));
  }
  const absl::Duration allowance = 2 * options_.step_timeout + absl::Seconds(5);
  const absl::Time deadline = absl::Now() + allowance;
  while (await_address || await_hello) {
    if (!transport_->PeerStatus(rank0_peer_).ok()) {
      return NameFailedPeer(absl::UnavailableError(absl::StrCat(me, ": connecting the ring anew")));
    }
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          me, ": ",
          await_address
              ? absl::StrCat("no replica ring message from compute rank 0 naming compute rank ", next)
              : absl::StrCat("compute rank ", prev, " did not connect as this rank's predecessor"),
          " within ", absl::FormatDuration(allowance), " of the step discard that made the ring anew"));
    }
    if (await_hello) accept_all();
    transport::PeerId from = 0;
    std::vector<uint8_t> msg;
    const absl::Status got =
        transport_->Receive(&from, &msg, std::min(deadline, absl::Now() + absl::Milliseconds(20)));
    if (!got.ok()) {
      if (absl::IsDeadlineExceeded(got)) continue;
      // The new successor failed (every other peer but compute rank 0, checked above, is let go):
      // let go too while this waits; KeepAfterDiscard makes it count again, and the rerun's
      // hand-off to it fails.
      if (next_peer_ != rank0_peer_ && !transport_->PeerStatus(next_peer_).ok())
        transport_->Close(next_peer_);
      absl::SleepFor(absl::Milliseconds(10));
      continue;
    }
    if (FromLostRank(from)) continue;
    const uint32_t magic = PeekFrameMagic(msg).value_or(0);
    const bool from_memory =
        std::any_of(ranks_.begin(), ranks_.end(), [&](const Rank& r) { return r.peer == from; });
    if (from == rank0_peer_ || from_memory) {
      if (magic == kErrorMagic) {
        ASSIGN_OR_RETURN(const ErrorMessage err, DecodeError(msg));
        if (from != rank0_peer_) rank0_gone_ = true;  // a memory rank says compute rank 0 went
        return Annotate(StatusFromErrorMessage(err),
                        from == rank0_peer_ ? "compute rank 0 stopped" : "a memory rank stopped");
      }
      if (from_memory) continue;  // a late message of the step discarded
      if (magic == kHeartbeatMagic) {
        ASSIGN_OR_RETURN(const HeartbeatMessage beat, DecodeHeartbeat(msg));
        const HeartbeatReplyMessage reply{.seq = beat.seq,
                                          .memory_rank = static_cast<uint16_t>(compute_rank_)};
        RETURN_IF_ERROR(transport_->Send(rank0_peer_, EncodeHeartbeatReply(reply)));
        continue;
      }
      if (magic == kReplicaRingMagic && await_address) {
        ASSIGN_OR_RETURN(const ReplicaRingMessage ring, DecodeReplicaRing(msg));
        if (ring.next_address.empty()) {
          return absl::InvalidArgumentError(absl::StrCat(me,
                                                         ": compute rank 0's replica ring message names no "
                                                         "successor; its step discard names compute rank ",
                                                         next));
        }
        next_name_ = absl::StrCat("compute rank ", next, " (", ring.next_address, ")");
        next_rank_ = next;
        absl::StatusOr<transport::PeerId> peer = transport_->Connect(ring.next_address);
        if (!peer.ok()) return Annotate(peer.status(), next_name_);
        next_peer_ = *peer;
        const ComputeHelloMessage hello{.compute_rank = static_cast<uint16_t>(compute_rank_),
                                        .compute_ranks = static_cast<uint16_t>(initial_compute_ranks_)};
        if (absl::Status sent = transport_->Send(next_peer_, EncodeComputeHello(hello)); !sent.ok()) {
          // Left failed: the rerun's hand-off to it fails, and compute rank 0, which finds it lost
          // (its own connection to it), says what follows.
          transport_->Close(next_peer_);
          TANDEM_LOG_WARN("compute", me, ": cannot reach its new successor ", next_name_, ": ",
                          sent.message());
        }
        await_address = false;
        continue;
      }
      if (magic == kStepDiscardMagic) {
        // Another rank was lost meanwhile: the ring is made again from that discard's mask. Its
        // replica ring message, if any, comes after it.
        if (await_address) {
          return absl::InvalidArgumentError(absl::StrCat(
              me, ": a step discard came before the replica ring message naming compute rank ", next));
        }
        ASSIGN_OR_RETURN(StepDiscardMessage later, DecodeStepDiscard(msg));
        return std::optional<StepDiscardMessage>(std::move(later));
      }
      if (magic == kByeMagic) return absl::CancelledError(absl::StrCat(me, ": compute rank 0 said bye"));
      if (magic == kMemoryRejoinMagic || magic == kHeadSplitMagic) {
        // A memory rank rejoins (compute rank 0 found it back while idle), or the heads are split
        // again after a memory rank's loss: taken between steps.
        rank0_deferred_.push_back(std::move(msg));
        continue;
      }
      return absl::InvalidArgumentError(absl::StrCat(me, ": unexpected message (magic 0x", absl::Hex(magic),
                                                     ") from compute rank 0 while the ring was made anew"));
    }
    if (from == next_peer_ || from == prev_peer_)
      continue;  // a neighbour that stays (a bye: rank 0's follows)
    // An incoming connection: the new predecessor says which compute rank it is.
    take_hello(from, std::move(msg));
  }
  // A connection is queued for Accept before any of its messages is delivered: the predecessor's
  // is taken off the queue here (Close()d, then reopened by KeepAfterDiscard).
  if (accepting) accept_all();
  return std::nullopt;
}

absl::Status ComputeRank::TakeMemoryRejoin(const std::vector<uint8_t>& msg) {
  const std::string me = absl::StrCat("compute rank ", compute_rank_);
  ASSIGN_OR_RETURN(const MemoryRejoinMessage request, DecodeMemoryRejoin(msg));
  const size_t m = request.memory_rank;
  if (request.answer || m >= ranks_.size() || !ranks_[m].lost) {
    return absl::InvalidArgumentError(absl::StrCat(
        me, ": compute rank 0 says memory rank ", m, " rejoins, which ",
        request.answer ? "is an answer"
                       : (m >= ranks_.size() ? "is not a memory rank" : "this rank has not lost")));
  }
  Rank& rank = ranks_[m];
  auto answer = [&](const std::string& why) {
    const MemoryRejoinMessage a{.memory_rank = request.memory_rank,
                                .answer = true,
                                .attn_out_buffer = request.attn_out_buffer,
                                .text = why.substr(0, kMaxAddressBytes)};
    return Annotate(transport_->Send(rank0_peer_, EncodeMemoryRejoin(a)), "compute rank 0");
  };
  // Like compute rank 0's probe: a connection Close()d from the start (its failure fails nothing),
  // taken live only once the new process has answered.
  absl::StatusOr<transport::PeerId> peer = transport_->Connect(request.text);
  if (!peer.ok()) return answer(std::string(peer.status().message()));
  transport_->Close(*peer);
  auto refuse = [&](const std::string& why) {
    retired_peers_.insert(*peer);  // whatever it still sends is dropped
    TANDEM_LOG_WARN("compute", me, ": cannot connect to the new process of ", rank.name, ": ", why);
    return answer(why);
  };
  const absl::Time deadline = absl::Now() + options_.step_timeout;
  bool hello_sent = false;
  std::vector<uint8_t> reply;
  // Until the hello reply, and the device connection that the transport sets up after the hello
  // (nccl's communicators: a step's first transfer to the rank could not wait for it).
  while (reply.empty() || transport_->Connecting(*peer)) {
    if (absl::Status st = transport_->PeerStatus(*peer); !st.ok()) return refuse(std::string(st.message()));
    if (absl::Now() >= deadline) {
      return refuse(RejoinTimedOut(hello_sent, !reply.empty(), options_.step_timeout));
    }
    if (!hello_sent && !transport_->Connecting(*peer)) {
      const ComputeHelloMessage hello{.compute_rank = static_cast<uint16_t>(compute_rank_),
                                      .compute_ranks = static_cast<uint16_t>(initial_compute_ranks_)};
      if (absl::Status st = transport_->Send(*peer, EncodeComputeHello(hello)); !st.ok())
        return refuse(std::string(st.message()));
      hello_sent = true;
    }
    transport::PeerId from = 0;
    std::vector<uint8_t> got;
    if (!transport_->Receive(&from, &got, std::min(deadline, absl::Now() + absl::Milliseconds(20))).ok())
      continue;  // a failed connection is found by its status (this one's) or by the next wait (others')
    if (from == *peer && reply.empty()) {
      reply = std::move(got);
      continue;
    }
    if (FromLostRank(from)) continue;
    ASSIGN_OR_RETURN(const uint32_t magic, PeekFrameMagic(got));
    if (from == rank0_peer_ && magic == kHeartbeatMagic) {
      ASSIGN_OR_RETURN(const HeartbeatMessage beat, DecodeHeartbeat(got));
      const HeartbeatReplyMessage r{.seq = beat.seq, .memory_rank = static_cast<uint16_t>(compute_rank_)};
      RETURN_IF_ERROR(transport_->Send(rank0_peer_, EncodeHeartbeatReply(r)));
      continue;
    }
    if (magic == kErrorMagic) {
      ASSIGN_OR_RETURN(const ErrorMessage err, DecodeError(got));
      return Annotate(StatusFromErrorMessage(err),
                      from == rank0_peer_ ? "compute rank 0 stopped" : "a memory rank stopped");
    }
    return absl::InvalidArgumentError(absl::StrCat(me, ": unexpected message (magic 0x", absl::Hex(magic),
                                                   ") while connecting to the new process of ", rank.name));
  }
  absl::StatusOr<HelloReplyMessage> hello_reply = DecodeHelloReply(reply);
  if (!hello_reply.ok()) {
    absl::StatusOr<ErrorMessage> err = DecodeError(reply);
    return refuse(std::string(err.ok() ? err->message : hello_reply.status().message()));
  }
  if (hello_reply->memory_rank != m || hello_reply->dtype != backend_->dtype()) {
    return refuse(absl::StrCat("the process at its address answers as memory rank ", hello_reply->memory_rank,
                               " with dtype ", std::string(DTypeName(hello_reply->dtype))));
  }
  // Taken: its outputs land in fresh buffers (the request's ids, as compute rank 0's; the lost
  // process's stay registered, their doorbells at its last seqno), every seqno of it from 0 as the
  // new process's; the old connection's late messages are dropped.
  retired_peers_.insert(rank.peer);
  for (RankLane& rl : rank.lanes) retired_lanes_.push_back(std::move(rl));
  rank.lanes.clear();
  rank.lanes.resize(lanes_.size());
  for (size_t j = 0; j < lanes_.size(); ++j)
    rank.lanes[j].attn_buffer = request.attn_out_buffer + static_cast<uint32_t>(j);
  rank.peer = *peer;
  rank.qkv_buffer = hello_reply->qkv_buffer;
  rank.lost = false;
  for (size_t j = 0; j < lanes_.size(); ++j) {
    if (Runs(j)) RETURN_IF_ERROR(SetUpRankLane(m, j));  // the others when taken over (KeepAfterDiscard)
  }
  transport_->Reopen(*peer);  // live: its failure is a failure again
  TANDEM_LOG_WARN("compute", me, ": ", rank.name, " rejoined (a new process, ", hello_reply->device,
                  "); this rank is connected to it");
  return answer("");
}

absl::Status ComputeRank::AwaitRank0(absl::Status ran) {
  if (absl::IsCancelled(ran) || kept_) return ran;  // released or kept (TakeRank0Discard)
  if (rank0_discard_.has_value()) {
    // Taken while the step's device work ran (ReplicaPoll), which stopped it: drained now.
    const std::vector<uint8_t> msg = std::move(*rank0_discard_);
    rank0_discard_.reset();
    return TakeRank0Discard(msg);
  }
  if (!transport_->PeerStatus(rank0_peer_).ok()) return NameFailedPeer(ran);
  // Only a peer's failure (or a wait past its deadline, a silent peer) is compute rank 0's to
  // decide on; this rank's own error goes to compute rank 0 at once, which gives it up.
  std::vector<transport::PeerId> others;
  for (const Rank& rank : ranks_) {
    if (!rank.lost) others.push_back(rank.peer);
  }
  if (schedule_.rotational()) {
    for (transport::PeerId p : {next_peer_, prev_peer_}) {
      if (p != rank0_peer_) others.push_back(p);
    }
  }
  const bool peer_failed = std::any_of(others.begin(), others.end(),
                                       [&](transport::PeerId p) { return !transport_->PeerStatus(p).ok(); });
  if (!peer_failed && !absl::IsDeadlineExceeded(ran)) return NameFailedPeer(ran);
  const std::string me = absl::StrCat("compute rank ", compute_rank_);
  TANDEM_LOG_WARN("compute", me, ": step failed (", ran.message(),
                  "); waiting for compute rank 0 to say what follows");
  // Done with every peer but compute rank 0 (it goes on without this rank, or ends the deployment):
  // their failures must not cut the wait short.
  for (transport::PeerId p : others) transport_->Close(p);
  const absl::Time deadline = absl::Now() + 2 * options_.step_timeout + absl::Seconds(5);
  while (absl::Now() < deadline) {
    std::vector<uint8_t> msg;
    transport::PeerId from = 0;
    const absl::Status got =
        transport_->Receive(&from, &msg, std::min(deadline, absl::Now() + absl::Milliseconds(100)));
    if (!transport_->PeerStatus(rank0_peer_).ok()) return NameFailedPeer(ran);
    if (!got.ok()) {
      if (!absl::IsDeadlineExceeded(got)) absl::SleepFor(absl::Milliseconds(10));
      continue;
    }
    const uint32_t magic = PeekFrameMagic(msg).value_or(0);
    if (magic == kErrorMagic) {
      ASSIGN_OR_RETURN(const ErrorMessage err, DecodeError(msg));
      if (from != rank0_peer_) rank0_gone_ = true;  // a memory rank says compute rank 0 went
      return Annotate(StatusFromErrorMessage(err),
                      from == rank0_peer_ ? "compute rank 0 stopped" : "a memory rank stopped");
    }
    if (KeepEarlyRingHello(from, magic, &msg)) continue;
    if (from != rank0_peer_) continue;                             // a late message of a peer let go
    if (magic == kStepDiscardMagic) return TakeRank0Discard(msg);  // released, or kept (kept_)
    if (magic == kByeMagic) return absl::CancelledError(absl::StrCat(me, ": compute rank 0 said bye"));
    if (magic == kHeartbeatMagic) {
      ASSIGN_OR_RETURN(const HeartbeatMessage beat, DecodeHeartbeat(msg));
      const HeartbeatReplyMessage reply{.seq = beat.seq, .memory_rank = static_cast<uint16_t>(compute_rank_)};
      RETURN_IF_ERROR(transport_->Send(rank0_peer_, EncodeHeartbeatReply(reply)));
    }
  }
  return NameFailedPeer(ran);
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
    for (size_t m = 0; m < ranks_.size(); ++m) {
      if (ranks_[m].lost) usage[m] = KvUsage{};  // given up: it holds nothing
    }
  }
  return usage;
}

EngineStats ComputeRank::stats() const {
  const ControllerStats& cs = controller_->stats();
  KvTierCounters tiers;
  if (options_.scheduler.tier_blocks > 0) {
    // Memory ranks keep KV in the compute rank's dtype (fp32 on CPU, bf16 on CUDA); a block is
    // prefix_block_tokens of it.
    const int64_t block_bytes = options_.scheduler.prefix_block_tokens *
                                backend_->spec().kv_bytes_per_token(DTypeSize(backend_->dtype()));
    tiers = {.enabled = true,
             .demoted_blocks = cs.demoted_blocks,
             .restored_blocks = cs.restored_blocks,
             .restore_failed_blocks = cs.restore_failed_blocks,
             .pool_bytes_out = cs.demoted_blocks * block_bytes,
             .pool_bytes_in = cs.restored_blocks * block_bytes,
             .prefetched_blocks = cs.prefetched_blocks,
             .prefetch_used_blocks = cs.prefetch_used_blocks,
             .prefetch_wasted_blocks = cs.prefetch_wasted_blocks,
             .shifted_blocks = cs.shifted_blocks,
             .shifted_failed_blocks = cs.shifted_failed_blocks};
  }
  return {.steps = cs.steps,
          .prefill_tokens = cs.prefill_tokens,
          .decode_tokens = cs.decode_tokens,
          .cached_tokens = cs.cached_tokens,
          .demoted_tokens = cs.demoted_tokens,
          .restored_tokens = cs.restored_tokens,
          .restore_failed_tokens = cs.restore_failed_tokens,
          .prefetched_tokens = cs.prefetched_tokens,
          .tiers = tiers,
          .busy_seconds = busy_seconds_,
          .memory_ranks_lost = memory_ranks_lost_,
          .requests_recovered = requests_recovered_,
          .memory_ranks_rejoined = memory_ranks_rejoined_,
          .compute_ranks_lost = compute_ranks_lost_,
          .steps_rerun = steps_rerun_,
          .compute_replicas_kept = replicas_kept_,
          .compute_ranks_live = compute_ranks_,
          .replica_micro_batches = replica_micro_batches_};
}

void ComputeRank::Abandon(const absl::Status& why) {
  const std::vector<uint8_t> frame =
      EncodeError(ErrorMessageFromStatus(Annotate(why, "compute rank 0 stops the deployment")));
  const absl::Time now = absl::Now();
  for (const Rank& rank : ranks_) {
    if (rank.lost || SilentPastHeartbeat(rank, now)) continue;
    (void)transport_->Send(rank.peer, frame);
  }
  // The compute replicas too (each stops naming the cause), but not one that failed or is silent.
  for (const Replica& replica : replicas_) {
    if (replica.lost || !transport_->PeerStatus(replica.peer).ok()) continue;
    if (replica.beat_seq != 0 && now - replica.beat_sent > options_.step_timeout) continue;
    (void)transport_->Send(replica.peer, frame);
  }
  (void)transport_->Flush(absl::Now() + absl::Seconds(2));
}

absl::Status ComputeRank::Shutdown() {
  // A bye each way, so that no process sees a peer vanish: each peer is Close()d before its bye is
  // sent (its leaving is then expected), answers with a bye once it has let go of us, and only
  // then leaves. Replicas first: each parts from the memory ranks the same way before it answers.
  // Best effort: a rank that does not answer within the deadline is stopped by the launcher.
  ByeMessage bye;
  bye.steps = static_cast<uint64_t>(controller_ ? controller_->stats().steps : 0);
  const std::vector<uint8_t> frame = EncodeBye(bye);
  auto part = [&](auto& peers) {
    size_t byes = 0;
    for (auto& peer : peers) {
      if constexpr (requires { peer.slice; }) {
        // Given up, or silent past its heartbeat (recovery off): nothing to say to it, no answer to wait for.
        if (peer.lost || SilentPastHeartbeat(peer, absl::Now())) continue;
      }
      transport_->Close(peer.peer);
      absl::Status st = transport_->Send(peer.peer, frame);
      if (st.ok()) {
        ++byes;
      } else {
        TANDEM_LOG_INFO("compute", peer.name, ": bye not delivered: ", st.message());
      }
    }
    const absl::Time deadline = absl::Now() + absl::Seconds(5);
    while (byes > 0) {
      std::vector<uint8_t> msg;
      transport::PeerId from = 0;
      if (!transport_->Receive(&from, &msg, deadline).ok()) break;
      absl::StatusOr<uint32_t> magic = PeekFrameMagic(msg);
      if (magic.ok() && *magic == kByeMagic) --byes;
    }
  };
  std::vector<Replica> live;  // a replica given up gets no bye
  for (const Replica& replica : replicas_) {
    if (!replica.lost) live.push_back(replica);
  }
  part(live);
  part(ranks_);
  // A rejoining rank's new process that got its hello waits for steps: a bye for it too.
  size_t probe_byes = 0;
  for (const Probe& probe : probes_) {
    if (!probe.active || !probe.hello_sent) continue;
    probe_byes += transport_->Send(probe.peer, frame).ok() ? 1 : 0;
  }
  for (const absl::Time deadline = absl::Now() + absl::Seconds(5); probe_byes > 0;) {
    std::vector<uint8_t> msg;
    transport::PeerId from = 0;
    if (!transport_->Receive(&from, &msg, deadline).ok()) break;
    if (PeekFrameMagic(msg).value_or(0) == kByeMagic) --probe_byes;
  }
  (void)transport_->Flush(absl::Now() + absl::Seconds(5));
  return absl::OkStatus();
}

}  // namespace tandem

namespace tandem {

absl::Status RunComputeReplica(const WeightSource& source, const ComputeReplicaOptions& options) {
  const ComputeRankOptions& o = options.rank;
  if (options.compute_ranks < 2 || options.compute_rank < 1 ||
      options.compute_rank >= options.compute_ranks || options.compute_ranks > o.micro_batches) {
    return absl::InvalidArgumentError(absl::StrCat("compute replica ", options.compute_rank, " of ",
                                                   options.compute_ranks, " compute ranks with ",
                                                   o.micro_batches,
                                                   " micro-batches: needs 1 <= replica < compute.ranks <= "
                                                   "pipeline.batches"));
  }
  if (o.memory_addresses.empty())
    return absl::InvalidArgumentError("a compute replica needs the memory ranks");
  RETURN_IF_ERROR(CheckAttentionPartition(o.partition, source.spec().num_kv_heads,
                                          static_cast<int64_t>(o.memory_addresses.size())));
  std::unique_ptr<ComputeRank> r(new ComputeRank());
  r->options_ = o;
  r->compute_rank_ = options.compute_rank;
  r->compute_ranks_ = r->initial_compute_ranks_ = options.compute_ranks;
  r->place_ = options.compute_rank;
  r->listen_address_ = options.listen_address;
  r->on_listening_ = options.on_listening;
  RETURN_IF_ERROR(r->Connect(source));
  absl::Status st = r->ServeReplica(options);
  if (!st.ok() && !absl::IsCancelled(st) && !r->rank0_gone_) {
    // Compute rank 0 learns why (best effort), then the replica ends.
    (void)r->transport_->Send(r->rank0_peer_, EncodeError(ErrorMessageFromStatus(Annotate(
                                                  st, absl::StrCat("compute rank ", options.compute_rank)))));
    (void)r->transport_->Flush(absl::Now() + absl::Seconds(2));
  }
  return absl::IsCancelled(st) ? absl::OkStatus() : st;
}

}  // namespace tandem
