#include "memory_node/memory_rank.h"

#include <algorithm>
#include <bit>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/layer_message.h"
#include "common/log.h"
#include "common/pipeline_schedule.h"
#include "common/status.h"
#include "common/transport/transport.h"
#include "common/wire.h"
#include "kernels/cpu/ops.h"
#include "memory_node/attention_executor.h"
#include "memory_node/kv_table.h"
#include "memory_node/kv_tiers.h"

namespace tandem {

namespace {

using transport::PeerId;
using transport::Transport;

constexpr uint32_t kQkvBuffer = 1;  // this rank's receive buffer for q,k,v rows
constexpr absl::Duration kPoll = absl::Milliseconds(100);

// Parses "cpu" -> -1, "cuda" -> 0, "cuda:N" -> N.
absl::StatusOr<int> ParseDevice(const std::string& device) {
  if (device == "cpu") return -1;
  if (device == "cuda") return 0;
  int index = 0;
  if (device.rfind("cuda:", 0) == 0 && absl::SimpleAtoi(device.substr(5), &index) && index >= 0) return index;
  return absl::InvalidArgumentError(
      absl::StrCat("memory device: expected cpu, cuda or cuda:N, got \"", device, "\""));
}

class MemoryRank {
 public:
  explicit MemoryRank(const MemoryRankOptions& o) : o_(o) {}

  absl::Status Run() {
    ASSIGN_OR_RETURN(const int device, ParseDevice(o_.device));
    ASSIGN_OR_RETURN(transport_, transport::CreateTransport({.kind = o_.transport,
                                                             .listen_address = o_.listen_address,
                                                             .device = device,
                                                             .send_timeout = o_.step_timeout}));
    TANDEM_LOG_INFO("memory", "memory rank ", o_.rank, " listening on ", transport_->address(), " (device ",
                    o_.device, ")");
    if (o_.on_listening) RETURN_IF_ERROR(o_.on_listening(transport_->address()));
    const absl::Time start_deadline = absl::Now() + o_.startup_timeout;
    absl::Status st = Meet(device, start_deadline);
    if (!st.ok()) return peer_set_ ? Fail(st) : st;
    std::vector<uint8_t> msg;
    // Serve until bye, a signal or an error. Once compute rank 0 sends heartbeats, it must not
    // stay silent longer than the last one allowed.
    absl::Time last_heard = absl::Now();
    absl::Duration silence = absl::InfiniteDuration();
    while (true) {
      absl::Status r = ReceiveFromCompute(&msg, last_heard + silence, "the next step plan");
      if (absl::IsCancelled(r)) return absl::OkStatus();  // stop requested
      if (absl::IsDeadlineExceeded(r) && silence != absl::InfiniteDuration()) {
        // Not sent to it: a silent peer may not read, and a send would wait for the send timeout.
        // The compute replicas are told, so that they name compute rank 0, not this rank.
        const absl::Status silent = absl::DeadlineExceededError(
            absl::StrCat("memory rank ", o_.rank, ": compute rank 0 has been silent for ",
                         absl::StrFormat("%.1f s", absl::ToDoubleSeconds(absl::Now() - last_heard)),
                         " (no step, no heartbeat; its heartbeats allow ",
                         absl::StrFormat("%.1f s", absl::ToDoubleSeconds(silence)),
                         "): it is stopped, hung or cut off; this rank stops"));
        TellReplicas(silent);
        return silent;
      }
      RETURN_IF_ERROR(r);
      last_heard = absl::Now();
      ASSIGN_OR_RETURN(const uint32_t magic, PeekFrameMagic(msg));
      if (magic == kHeartbeatMagic) {
        absl::StatusOr<HeartbeatMessage> beat = DecodeHeartbeat(msg);
        if (!beat.ok()) return Fail(beat.status());
        silence = absl::Milliseconds(beat->silence_ms);
        const HeartbeatReplyMessage reply{.seq = beat->seq, .memory_rank = static_cast<uint16_t>(o_.rank)};
        st = transport_->Send(peer_, EncodeHeartbeatReply(reply));
        if (!st.ok()) return Fail(st);
        continue;
      }
      if (magic == kHelloMagic) {
        // Head partition: compute rank 0 splits the KV heads again (a rank was lost or came back).
        st = Repartition(msg, device);
        if (!st.ok()) return Fail(st);
        continue;
      }
      if (magic == kStepDiscardMagic) {
        // A compute replica was lost after this rank ran the step's layers (or while idle): the
        // step, if it is the last one, runs again with the survivors.
        st = RerunAfterDiscard(msg);
        if (!st.ok()) return Fail(NameFailedPeer(st));
        last_heard = absl::Now();
        continue;
      }
      if (magic == kStepPlanMagic) {
        absl::StatusOr<StepPlan> plan = DecodeStepPlan(msg);
        st = plan.ok() ? RunStep(*plan) : plan.status();
        if (!st.ok()) return Fail(NameFailedPeer(st));
        last_heard = absl::Now();  // the step's data came from compute rank 0 too
      } else if (magic == kStatsRequestMagic) {
        absl::StatusOr<StatsRequestMessage> req = DecodeStatsRequest(msg);
        if (!req.ok()) return Fail(req.status());
        const MemoryStatsMessage stats{.cookie = req->cookie,
                                       .memory_rank = static_cast<uint16_t>(o_.rank),
                                       .steps = static_cast<uint64_t>(steps_),
                                       .attention_ns = attention_ns_};
        st = transport_->Send(peer_, EncodeMemoryStats(stats));
        if (!st.ok()) return Fail(st);
      } else if (magic == kReleaseMagic) {
        absl::StatusOr<ReleaseMessage> rel = DecodeRelease(msg);
        if (!rel.ok()) return Fail(rel.status());
        kv_->Release(rel->request_ids);
      } else if (magic == kByeMagic) {
        absl::StatusOr<ByeMessage> bye = DecodeBye(msg);
        if (!bye.ok()) return Fail(bye.status());
        TANDEM_LOG_INFO("memory", "memory rank ", o_.rank, ": bye after ", bye->steps, " steps (", steps_,
                        " with rows here)");
        if (tiers_) {
          const KvTierStats t = tiers_->stats();
          TANDEM_LOG_INFO("memory", "memory rank ", o_.rank, ": KV tiers: ", t.saves,
                          " blocks saved; hits host ", t.host_hits, ", disk ", t.disk_hits, ", misses ",
                          t.misses, ", discarded ", t.discarded, "; bytes to host ", t.bytes_to_host,
                          ", from host ", t.bytes_from_host, ", to disk ", t.bytes_to_disk, ", from disk ",
                          t.bytes_from_disk, "; evictions host ", t.host_evictions, ", disk ",
                          t.disk_evictions, "; disk write errors ", t.write_errors, "; restore time ",
                          tiers_->restore_seconds(), " s, of which ", tiers_->restore_stall_seconds(),
                          " s before a step's layers; save time ", tiers_->save_seconds(), " s");
        }
        // Answer (the compute rank waits for it before it leaves), then go.
        transport_->Close(peer_);
        (void)transport_->Send(peer_, EncodeBye(ByeMessage{.steps = static_cast<uint64_t>(steps_)}));
        (void)transport_->Flush(absl::Now() + absl::Seconds(2));
        return absl::OkStatus();
      } else if (magic == kErrorMagic) {
        absl::StatusOr<ErrorMessage> err = DecodeError(msg);
        if (!err.ok()) return err.status();
        return Annotate(StatusFromErrorMessage(*err), "the compute rank stopped");
      } else {
        return Fail(absl::InvalidArgumentError(
            absl::StrCat("unexpected message (magic 0x", absl::Hex(magic), ") from the compute rank")));
      }
    }
  }

 private:
  // Retries `wait` in short slices so that a stop request is noticed.
  template <typename F>
  auto WaitFor(F wait, absl::Time deadline, const std::string& what) -> decltype(wait(deadline)) {
    while (true) {
      if (o_.stop_requested && o_.stop_requested()) {
        return absl::CancelledError(absl::StrCat("stopped while waiting for ", what));
      }
      const absl::Time slice = std::min(deadline, absl::Now() + kPoll);
      auto r = wait(slice);
      if (r.ok() || !absl::IsDeadlineExceeded(r.status()) || absl::Now() >= deadline) {
        if (!r.ok() && absl::IsDeadlineExceeded(r.status())) {
          return absl::DeadlineExceededError(
              absl::StrCat("memory rank ", o_.rank, ": timed out waiting for ", what));
        }
        return r;
      }
    }
  }

  absl::Status ReceiveFromCompute(std::vector<uint8_t>* msg, absl::Time deadline, const std::string& what) {
    if (!deferred_.empty()) {  // compute rank 0's, taken while the last step's device work drained
      *msg = std::move(deferred_.front());
      deferred_.pop_front();
      return absl::OkStatus();
    }
    while (true) {
      PeerId from = 0;
      absl::StatusOr<bool> r = WaitFor(
          [&](absl::Time d) -> absl::StatusOr<bool> {
            RETURN_IF_ERROR(transport_->Receive(&from, msg, d));
            return true;
          },
          deadline, what);
      if (!r.ok()) {
        if (absl::IsDeadlineExceeded(r.status())) return r.status();
        if (DropFailedReplicas()) continue;  // compute rank 0 goes on without it (a step discard)
        return NameFailedPeer(r.status());
      }
      if (from == peer_) return absl::OkStatus();
      auto it =
          std::find_if(replicas_.begin(), replicas_.end(), [&](const auto& r) { return r.second == from; });
      if (it == replicas_.end()) {
        // Compute rank 0 connects anew to probe for a new process of a rank it gave up (a stop or a
        // silence past launch.step_timeout_s): this process is that rank's old one.
        return absl::FailedPreconditionError(
            absl::StrCat("a message from ", transport_->PeerName(from),
                         ", which is not compute rank 0's connection: compute rank 0 gave this rank up and "
                         "probes for a new "
                         "process of it; this rank stops"));
      }
      if (lost_replicas_.contains(it->first)) continue;  // whatever a replica given up still sends
      // A compute replica leaving (compute rank 0 ends the deployment): a bye each way, and its
      // connection closes quietly. One that stops says why (an error message) and is given up:
      // compute rank 0 goes on without it or ends the deployment, and says which.
      absl::StatusOr<uint32_t> magic = PeekFrameMagic(*msg);
      if (magic.ok() && *magic == kErrorMagic) {
        absl::StatusOr<ErrorMessage> err = DecodeError(*msg);
        DropReplica(it->first, err.ok() ? std::string(StatusFromErrorMessage(*err).message())
                                        : std::string(err.status().message()));
        continue;
      }
      if (!magic.ok() || *magic != kByeMagic) {
        return absl::InvalidArgumentError(absl::StrCat("unexpected message from compute rank ", it->first));
      }
      transport_->Close(from);  // first: it may leave as soon as the answer arrives
      RETURN_IF_ERROR(transport_->Send(from, EncodeBye(ByeMessage{.steps = static_cast<uint64_t>(steps_)})));
      (void)transport_->Flush(absl::Now() + absl::Seconds(2));
      replicas_.erase(it);
    }
  }

  // A compute replica gone (its connection failed, it said it stops, or compute rank 0 gave it up):
  // its connection is let go (its failure no longer fails waits) and its messages are dropped.
  // Compute rank 0 decides what follows: a step discard that goes on without it, or an error.
  void DropReplica(uint16_t rank, const std::string& why) {
    if (!lost_replicas_.insert(rank).second) return;
    auto it = replicas_.find(rank);
    if (it != replicas_.end()) transport_->Close(it->second);
    TANDEM_LOG_WARN("memory", "memory rank ", o_.rank, ": compute rank ", rank, " is gone (", why,
                    "); compute rank 0 decides whether the step goes on without it");
  }

  // Gives up the compute replicas whose connection failed; true if there were any.
  bool DropFailedReplicas() {
    bool any = false;
    for (const auto& [rank, peer] : replicas_) {
      if (lost_replicas_.contains(rank)) continue;
      if (absl::Status st = transport_->PeerStatus(peer); !st.ok()) {
        DropReplica(rank, std::string(st.message()));
        any = true;
      }
    }
    return any;
  }

  // Within a step's layers: the control messages that came (none is expected but these). A
  // heartbeat from compute rank 0 is answered; a step discard from compute rank 0 is kept in
  // discard_ and returns Aborted (the layers stop where they are); an error message from compute
  // rank 0 is the rank's error; a replica that stops is given up. OK when nothing (else) came.
  // `wait`: how long the first receive may wait (the transport makes progress only while it
  // waits: a caller that does not wait elsewhere in between, AwaitDiscard, gives it time here).
  absl::Status TakeMidStepMessages(absl::Duration wait = absl::ZeroDuration()) {
    while (true) {
      PeerId from = 0;
      std::vector<uint8_t> msg;
      const absl::Status got = transport_->Receive(&from, &msg, absl::Now() + wait);
      wait = absl::ZeroDuration();
      if (absl::IsDeadlineExceeded(got)) return absl::OkStatus();
      if (!got.ok()) {
        if (DropFailedReplicas()) continue;
        return got;
      }
      ASSIGN_OR_RETURN(const uint32_t magic, PeekFrameMagic(msg));
      if (from == peer_) {
        if (magic == kHeartbeatMagic) {
          // After a step's deadline compute rank 0 asks every memory rank, and gives up the one that
          // does not answer (this rank may be waiting on a replica that waits on a silent rank).
          ASSIGN_OR_RETURN(const HeartbeatMessage beat, DecodeHeartbeat(msg));
          const HeartbeatReplyMessage reply{.seq = beat.seq, .memory_rank = static_cast<uint16_t>(o_.rank)};
          RETURN_IF_ERROR(transport_->Send(peer_, EncodeHeartbeatReply(reply)));
          continue;
        }
        if (magic == kStepDiscardMagic) {
          ASSIGN_OR_RETURN(discard_, DecodeStepDiscard(msg));
          return absl::AbortedError(absl::StrCat("step ", discard_->step_id, " discarded"));
        }
        if (magic == kErrorMagic) {
          ASSIGN_OR_RETURN(const ErrorMessage err, DecodeError(msg));
          return Annotate(StatusFromErrorMessage(err), "the compute rank stopped");
        }
        if (device_path_) {
          // The host polls until it sees the step's stream done, which can be after compute rank 0
          // has its outputs and has gone on (releases, the next plan): kept, in order, for after.
          deferred_.push_back(std::move(msg));
          continue;
        }
        return absl::InvalidArgumentError(absl::StrCat("unexpected message (magic 0x", absl::Hex(magic),
                                                       ") from compute rank 0 within a step"));
      }
      auto it =
          std::find_if(replicas_.begin(), replicas_.end(), [&](const auto& r) { return r.second == from; });
      if (it == replicas_.end()) {
        return absl::FailedPreconditionError(absl::StrCat(
            "a message from ", transport_->PeerName(from),
            " within a step, which is not a compute rank's connection: compute rank 0 gave this rank up and "
            "probes for a new process of it; this rank stops"));
      }
      if (lost_replicas_.contains(it->first)) continue;
      if (magic != kErrorMagic) {
        return absl::InvalidArgumentError(absl::StrCat("unexpected message (magic 0x", absl::Hex(magic),
                                                       ") from compute rank ", it->first, " within a step"));
      }
      absl::StatusOr<ErrorMessage> err = DecodeError(msg);
      DropReplica(it->first, err.ok() ? std::string(StatusFromErrorMessage(*err).message())
                                      : std::string(err.status().message()));
    }
  }

  // A layer's input of lane j (doorbell `seqno` of `buffer`), within twice the step timeout (the
  // compute rank may itself spend one step timeout waiting for another memory rank that went
  // silent, or for a compute replica, before it goes on without it). Meanwhile: a stop request
  // (Cancelled), a step discard (Aborted, see TakeMidStepMessages; also when it came before the
  // write that reached the doorbell), a replica that fails (given up;
  // the wait goes on until compute rank 0 says what follows).
  absl::Status WaitLayerInput(uint32_t buffer, uint64_t seqno, const std::string& what) {
    const absl::Time deadline = absl::Now() + 2 * o_.step_timeout;
    while (true) {
      if (o_.stop_requested && o_.stop_requested()) {
        return absl::CancelledError(absl::StrCat("stopped while waiting for ", what));
      }
      RETURN_IF_ERROR(TakeMidStepMessages());
      const absl::Status st =
          transport_->WaitDoorbell(buffer, seqno, std::min(deadline, absl::Now() + kPoll));
      // Reached: unless compute rank 0 discarded the step meanwhile, and the write is its rerun's
      // (a step discard is sent before the rerun's data, and one connection delivers in order).
      if (st.ok()) return TakeMidStepMessages();
      if (absl::IsDeadlineExceeded(st)) {
        if (absl::Now() >= deadline) {
          return absl::DeadlineExceededError(
              absl::StrCat("memory rank ", o_.rank, ": timed out waiting for ", what));
        }
        continue;
      }
      if (DropFailedReplicas()) continue;
      return st;
    }
  }

  // Whether step discard `d` drops its step rather than running it again: under the head partition
  // a lost memory rank held KV heads of every request, so compute rank 0 drops the step (the
  // discard's drop) and splits the heads again (a hello follows: Repartition).
  bool DropsStep(const StepDiscardMessage& d) const {
    return d.drop && hello_.partition == AttentionPartition::kHead;
  }

  // A step discard (wire.h): the compute ranks of its mask go on, in rank order the pipeline's
  // ranks 0, 1, ...; every lane's seqno starts again from its base.
  absl::Status ApplyDiscard(const StepDiscardMessage& d) {
    if (hello_.compute_ranks < 8 && (d.compute_mask >> hello_.compute_ranks) != 0) {
      return absl::InvalidArgumentError(absl::StrFormat("a step discard keeps compute ranks 0x%02x of %d",
                                                        d.compute_mask, int{hello_.compute_ranks}));
    }
    std::vector<PeerId> peers;
    for (uint16_t c = 0; c < hello_.compute_ranks; ++c) {
      const bool keep = (d.compute_mask >> c) & 1;
      if (c == 0) {
        peers.push_back(peer_);
        continue;
      }
      auto it = replicas_.find(c);
      if (!keep) {
        DropReplica(c, "compute rank 0 gave it up");
        continue;
      }
      if (it == replicas_.end() || lost_replicas_.contains(c)) {
        return absl::InvalidArgumentError(
            absl::StrCat("a step discard keeps compute rank ", c, ", which this rank lost"));
      }
      peers.push_back(it->second);
    }
    compute_peers_ = std::move(peers);
    const int survivors = static_cast<int>(compute_peers_.size());
    schedule_ =
        PipelineSchedule{.compute_ranks = survivors, .slice_layers = survivors > 1 ? hello_.slice_layers : 0};
    for (Lane& lane : lanes_) lane.seqno = d.seqno_base;
    TANDEM_LOG_WARN("memory", "memory rank ", o_.rank, ": step discard",
                    d.step_id != 0 ? absl::StrCat(" of step ", d.step_id) : std::string(), "; ", survivors,
                    " compute rank(s) go on, seqnos from ", d.seqno_base);
    return absl::OkStatus();
  }

  // The step's layers (either data path), run again from layer 0 each time compute rank 0 discards
  // the step: the plans stay applied (the same slots take the new rows' K and V again).
  // On the device path the discard fails the step's device work (every wait released, nothing
  // more written, the stream drained) and the path is reset before the rerun enqueues anything;
  // compute rank 0 writes nothing of the rerun until this rank has answered a heartbeat it sent
  // after the discard, which this rank takes only in the rerun's waits: no late write of the
  // failed attempt can land in its buffers, nor one of the rerun be taken by a wait of the
  // failed attempt.
  // Under the head partition a discard that names a lost memory rank drops the step instead
  // (DropsStep; *dropped set): compute rank 0 splits the heads again next.
  absl::Status RunLayers(uint64_t step_id, size_t lanes, bool* dropped) {
    while (true) {
      const size_t replicas_lost = lost_replicas_.size();
      absl::Status st = device_path_ ? LayersOnDevice(step_id, lanes) : Layers(step_id, lanes);
      // A replica failed under the device path's waits (its connection did): compute rank 0 says
      // what follows, as on the host-staged path (WaitLayerInput).
      if (!st.ok() && device_path_ && !discard_.has_value() &&
          (DropFailedReplicas() || lost_replicas_.size() > replicas_lost)) {
        st = AwaitDiscard(st);
      }
      if (!discard_.has_value()) return st;
      const StepDiscardMessage d = *discard_;
      discard_.reset();
      if (d.step_id != step_id) {
        return absl::InvalidArgumentError(
            absl::StrCat("a step discard of step ", d.step_id, " arrived within step ", step_id));
      }
      if (device_path_) RETURN_IF_ERROR(transport_->ResetDevicePath(exec_->stream()));
      RETURN_IF_ERROR(ApplyDiscard(d));
      if (DropsStep(d)) {
        *dropped = true;
        return absl::OkStatus();
      }
      for (size_t k = 0; k < lanes; ++k) {
        if (lanes_[k].rows > 0) RETURN_IF_ERROR(lanes_[k].exec->BeginStep(lanes_[k].batch));
      }
    }
  }

  // After a replica's loss failed the step on the device path: compute rank 0's messages are taken
  // (heartbeats answered) until its step discard (OK, discard_ set), an error, or twice the step
  // timeout (`failed`, the step's error).
  absl::Status AwaitDiscard(const absl::Status& failed) {
    const absl::Time deadline = absl::Now() + 2 * o_.step_timeout;
    while (absl::Now() < deadline) {
      if (o_.stop_requested && o_.stop_requested()) return absl::CancelledError("stopped within a step");
      const absl::Status taken = TakeMidStepMessages(absl::Milliseconds(5));
      if (discard_.has_value()) return absl::OkStatus();
      RETURN_IF_ERROR(taken);
    }
    return failed;
  }

  // `st` (a failed wait or send) annotated with the compute rank the transport knows failed:
  // compute rank 0 first, then the replicas; `st` when none did.
  // The replicas are told when it is compute rank 0 (TellReplicas), so that they name it too.
  // A replica's disconnect can come before compute rank 0's when the replica left because rank 0
  // went: up to 3 s (the failure path only; 1 s was seen too short on a loaded 2-core host) for
  // rank 0's to be known, or for the replica's error message saying why it stopped.
  absl::Status NameFailedPeer(absl::Status st) {
    if (st.ok() || !transport_) return st;
    const bool replica_failed = std::any_of(replicas_.begin(), replicas_.end(), [&](const auto& r) {
      return !transport_->PeerStatus(r.second).ok();
    });
    absl::Status told;
    for (const absl::Time until = absl::Now() + absl::Seconds(3); replica_failed && peer_set_ &&
                                                                  transport_->PeerStatus(peer_).ok() &&
                                                                  told.ok() && absl::Now() < until;) {
      PeerId from = 0;
      std::vector<uint8_t> msg;
      if (!transport_->Receive(&from, &msg, absl::Now() + absl::Milliseconds(50)).ok()) continue;
      if (PeekFrameMagic(msg).value_or(0) != kErrorMagic) continue;
      for (const auto& [rank, peer] : replicas_) {
        absl::StatusOr<ErrorMessage> err = DecodeError(msg);
        if (peer == from && err.ok()) {
          told = Annotate(StatusFromErrorMessage(*err), absl::StrCat("compute rank ", rank, " stopped"));
        }
      }
    }
    if (!told.ok() && transport_->PeerStatus(peer_).ok()) return told;
    if (absl::Status peer = transport_->PeerStatus(peer_); peer_set_ && !peer.ok()) {
      st = AnnotateGone(st, absl::StrCat("compute rank 0 (", transport_->PeerName(peer_), ")"), peer);
      TellReplicas(Named(st));
      return st;
    }
    for (const auto& [rank, peer] : replicas_) {
      if (absl::Status failed = transport_->PeerStatus(peer); !failed.ok()) {
        return AnnotateGone(st, absl::StrCat("compute rank ", rank, " (", transport_->PeerName(peer), ")"),
                            failed);
      }
    }
    return st;
  }

  // Tells the compute replicas still connected why this rank stops (best effort, bounded by a 2 s
  // flush).
  void TellReplicas(const absl::Status& why) {
    if (replicas_.empty()) return;
    const std::vector<uint8_t> frame = EncodeError(ErrorMessageFromStatus(why));
    for (const auto& [rank, peer] : replicas_) {
      if (transport_->PeerStatus(peer).ok()) (void)transport_->Send(peer, frame);
    }
    (void)transport_->Flush(absl::Now() + absl::Seconds(2));
  }

  // `st` with "memory rank N: " in front, unless its message starts so already (the waits name
  // this rank themselves).
  absl::Status Named(const absl::Status& st) const {
    const std::string me = absl::StrCat("memory rank ", o_.rank);
    return absl::StartsWith(st.message(), absl::StrCat(me, ": ")) ? st : Annotate(st, me);
  }

  // Tells the compute rank (if it can be reached) why this rank stops, and returns `st`.
  absl::Status Fail(absl::Status st) {
    st = Named(st);
    if (transport_ && !absl::IsUnavailable(st)) {
      const std::vector<uint8_t> frame = EncodeError(ErrorMessageFromStatus(st));
      (void)transport_->Send(peer_, frame);
      (void)transport_->Flush(absl::Now() + absl::Seconds(2));
    }
    return st;
  }

  // Start-up: the compute ranks connect, in any order: compute rank 0 with its hello (which sets
  // this rank up), and with compute.ranks > 1 the replicas with a compute hello each. Every one
  // gets the hello reply once the rank is set up. The hello's compute_mask names the replicas that
  // connect: every one at start-up; a process that rejoins after compute rank 0 gave replicas up
  // (or released them) waits for the ones that go on only.
  absl::Status Meet(int device, absl::Time deadline) {
    std::vector<uint8_t> msg;
    std::vector<PeerId> waiting;  // replicas that said hello before compute rank 0 did
    bool ready = false;
    auto expected = [&] { return static_cast<size_t>(std::popcount(unsigned{hello_.compute_mask})) - 1; };
    while (!ready || replicas_.size() < expected()) {
      if (o_.stop_requested && o_.stop_requested()) return absl::CancelledError("stopped while starting");
      if (absl::Now() >= deadline) {
        return absl::DeadlineExceededError(
            absl::StrCat("memory rank ", o_.rank, ": timed out waiting for the compute ranks to connect (",
                         ready ? "compute rank 0 and " : "", replicas_.size(), " replica(s) said hello)"));
      }
      // New connections are accepted as they come; the first message says who the peer is.
      absl::StatusOr<PeerId> accepted = transport_->Accept(absl::Now() + absl::Milliseconds(10));
      if (!accepted.ok() && !absl::IsDeadlineExceeded(accepted.status())) return accepted.status();
      PeerId from = 0;
      const absl::Status got = transport_->Receive(&from, &msg, absl::Now() + absl::Milliseconds(40));
      if (absl::IsDeadlineExceeded(got)) continue;
      RETURN_IF_ERROR(got);
      ASSIGN_OR_RETURN(const uint32_t magic, PeekFrameMagic(msg));
      if (magic == kHelloMagic && !ready) {
        peer_ = from;
        peer_set_ = true;
        RETURN_IF_ERROR(Setup(msg, device));
        ready = true;
        for (PeerId p : waiting) RETURN_IF_ERROR(transport_->Send(p, reply_));
      } else if (magic == kComputeHelloMagic) {
        ASSIGN_OR_RETURN(const ComputeHelloMessage hello, DecodeComputeHello(msg));
        if (replicas_.contains(hello.compute_rank)) {
          return absl::InvalidArgumentError(
              absl::StrCat("two connections say they are compute rank ", hello.compute_rank));
        }
        if (ready && hello.compute_ranks != hello_.compute_ranks) {
          return absl::InvalidArgumentError(
              absl::StrCat("compute rank ", hello.compute_rank, " counts ", hello.compute_ranks,
                           " compute ranks, compute rank 0 ", int{hello_.compute_ranks}));
        }
        if (ready && ((hello_.compute_mask >> hello.compute_rank) & 1) == 0) {
          return absl::InvalidArgumentError(
              absl::StrCat("compute rank ", hello.compute_rank, " says hello, which compute rank 0 gave up"));
        }
        replicas_[hello.compute_rank] = from;
        if (ready) {
          RETURN_IF_ERROR(transport_->Send(from, reply_));
        } else {
          waiting.push_back(from);
        }
      } else if (magic == kErrorMagic) {
        ASSIGN_OR_RETURN(const ErrorMessage err, DecodeError(msg));
        return Annotate(StatusFromErrorMessage(err), "a compute rank stopped");
      } else {
        return absl::InvalidArgumentError(
            absl::StrCat("unexpected first message (magic 0x", absl::Hex(magic), ") from a compute rank"));
      }
    }
    if (ready && replicas_.size() > expected()) {
      return absl::InvalidArgumentError(absl::StrCat(replicas_.size(),
                                                     " compute replicas connected but compute "
                                                     "rank 0 counts ",
                                                     expected() + 1, " compute ranks"));
    }
    // A lane's q,k,v come from, and its outputs go to, the compute rank the schedule names for
    // each layer over the compute ranks that go on (fixed: always j % their count).
    for (const auto& [c, peer] : replicas_) {
      if (c >= hello_.compute_ranks || ((hello_.compute_mask >> c) & 1) == 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("compute rank ", c, " said hello, which compute rank 0 does not count"));
      }
    }
    compute_peers_.assign(1, peer_);
    for (uint16_t c = 1; c < hello_.compute_ranks; ++c) {
      if (((hello_.compute_mask >> c) & 1) == 0) {
        lost_replicas_.insert(c);  // given up before this process started
        continue;
      }
      auto it = replicas_.find(c);
      if (it == replicas_.end()) {
        return absl::InvalidArgumentError(absl::StrCat("compute rank ", c, " never said hello"));
      }
      compute_peers_.push_back(it->second);
    }
    const int ranks = static_cast<int>(compute_peers_.size());
    schedule_ = PipelineSchedule{.compute_ranks = ranks, .slice_layers = ranks > 1 ? hello_.slice_layers : 0};
    if (ranks < hello_.compute_ranks) {
      TANDEM_LOG_INFO("memory", "memory rank ", o_.rank, ": ", ranks, " of ", int{hello_.compute_ranks},
                      " compute ranks go on (compute rank 0 gave the others up)");
    }
    return absl::OkStatus();
  }

  absl::Status Setup(const std::vector<uint8_t>& msg, int device) {
    ASSIGN_OR_RETURN(const uint32_t magic, PeekFrameMagic(msg));
    if (magic != kHelloMagic)
      return absl::InvalidArgumentError("the compute rank's first message is not a hello");
    ASSIGN_OR_RETURN(hello_, DecodeHello(msg));
    if (hello_.memory_rank != o_.rank) {
      return absl::InvalidArgumentError(absl::StrCat("hello addressed to memory rank ", hello_.memory_rank,
                                                     " reached memory rank ", o_.rank));
    }
    // The KV heads of its slice (all of them under the request partition) and their query heads;
    // the hello's decoder checked the slice against the partition.
    const int64_t kv_heads = static_cast<int64_t>(hello_.kv_head_end) - hello_.kv_head_begin;
    const int64_t heads = static_cast<int64_t>(hello_.num_heads / hello_.num_kv_heads) * kv_heads;
    placement_rank_ = hello_.partition == AttentionPartition::kHead ? 0 : static_cast<uint16_t>(o_.rank);
    shape_ = AttentionShape{.num_layers = hello_.num_layers,
                            .num_heads = heads,
                            .num_kv_heads = kv_heads,
                            .head_dim = hello_.head_dim,
                            .max_tokens = hello_.max_tokens_per_step,
                            .max_requests = hello_.max_requests_per_step};
    const KvPoolOptions kv{
        .capacity_tokens = static_cast<int64_t>(hello_.kv_capacity_tokens),
        .memory_fraction = hello_.kv_memory_fraction / std::max(1, o_.kv_share),
        .max_useful_tokens = static_cast<int64_t>(hello_.max_requests_per_step) * hello_.max_position};
    if (device < 0) {
      ASSIGN_OR_RETURN(exec_, CreateCpuAttentionExecutor(shape_, kv));
    } else {
      ASSIGN_OR_RETURN(exec_, CreateCudaAttentionExecutor(shape_, kv, device, nullptr));
    }
    if (exec_->dtype() != hello_.dtype) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the compute rank sends ", std::string(DTypeName(hello_.dtype)), " activations but memory rank ",
          o_.rank, " computes in ", std::string(DTypeName(exec_->dtype())), " on ", exec_->device(),
          "; put both roles on the same kind of device"));
    }
    kv_ = std::make_unique<KvTable>(exec_->kv_capacity(), hello_.prefix_block_tokens);
    if (o_.tiers.enabled()) {
      if (hello_.partition != AttentionPartition::kRequest) {
        return absl::InvalidArgumentError(
            "kv.tiers.host_bytes / kv.tiers.disk_bytes: KV tiers need memory.partition: request");
      }
      KvTierOptions tiers = o_.tiers;
      if (!tiers.disk_dir.empty()) tiers.disk_dir = absl::StrCat(tiers.disk_dir, "/rank-", o_.rank);
      ASSIGN_OR_RETURN(tiers_, KvTiers::Create(tiers, exec_.get(), hello_.prefix_block_tokens, o_.model));
      // kv.store_pre_rope: shifted restores turn keys with the model's rotary embedding.
      tiers_->set_rotary(kernels::cpu::RopeInvFreq(hello_.rope, hello_.head_dim));
      kv_->SetTiers(tiers_.get());
    }
    AttentionExecutor* exec = exec_.get();
    kv_->SetPrefixSharing(static_cast<PrefixSharing>(hello_.prefix_sharing),
                          [exec](int64_t rows, int64_t tokens) { return exec->CascadePays(rows, tokens); });
    elem_ = DTypeSize(exec_->dtype());
    const size_t qkv_bytes = static_cast<size_t>(shape_.max_tokens * shape_.qkv_width()) * elem_;
    const size_t out_bytes = static_cast<size_t>(shape_.max_tokens * shape_.q_dim()) * elem_;
    device_path_ = !exec_->memory().host() && transport_->capabilities().device_polling;
    transport_->SetDeviceChecksums(hello_.checksums);
    // While the host waits for a step on the device path, compute rank 0's messages are taken as
    // between the host-staged path's waits: a heartbeat is answered, a step discard stops the step
    // (its waits released, its stream drained) to be run again (RunLayers).
    if (device_path_) transport_->SetDevicePoll([this] { return TakeMidStepMessages(); });
    if (hello_.q_first && !exec_->SupportsSplitLayer()) {
      return absl::InvalidArgumentError(absl::StrCat("pipeline.q_first: memory rank ", o_.rank,
                                                     " runs attention on ", exec_->device(),
                                                     ", which has no split attention layer; set "
                                                     "pipeline.q_first: false"));
    }
    // q-first: the q rows at 0, the k,v rows at kv_offset_ (common/layer_message.h), on both data
    // paths (the device path's rows come without headers, at the same offsets); a CUDA rank's device
    // input buffer then holds both.
    kv_offset_ =
        QFirstKvOffset(static_cast<size_t>(shape_.max_tokens), static_cast<size_t>(shape_.q_dim()) * elem_);
    const size_t in_bytes =
        hello_.q_first ? kv_offset_ + static_cast<size_t>(shape_.max_tokens * 2 * shape_.kv_dim()) * elem_
                       : qkv_bytes;
    // One lane per micro-batch in flight (the hello's lanes): each its own executor lane over the
    // one KV pool, its own receive buffer (qkv_base_ + j) and staging.
    lanes_.resize(hello_.lanes);
    for (size_t j = 0; j < lanes_.size(); ++j) {
      Lane& lane = lanes_[j];
      if (j == 0) {
        lane.exec = exec_.get();
      } else {
        ASSIGN_OR_RETURN(lane.owned, exec_->CreateLane());
        lane.exec = lane.owned.get();
      }
      const uint32_t buffer = qkv_base_ + static_cast<uint32_t>(j);
      if (hello_.q_first) lane.exec->ExpectSplitLayers();
      if (!exec_->memory().host()) {
        ASSIGN_OR_RETURN(lane.qkv_dev, exec_->memory().Allocate(in_bytes, false));
        ASSIGN_OR_RETURN(lane.out_dev, exec_->memory().Allocate(out_bytes, false));
      }
      if (device_path_) {
        // q,k,v rows land straight in the executor's input buffer; no header, no staging.
        RETURN_IF_ERROR(transport_->RegisterBuffer(buffer, lane.qkv_dev.get(), in_bytes));
      } else {
        lane.recv_bytes = (hello_.q_first ? 2 : 1) * kLayerMessageHeaderFrameBytes + qkv_bytes;
        ASSIGN_OR_RETURN(lane.recv, exec_->memory().Allocate(lane.recv_bytes, true));
        ASSIGN_OR_RETURN(lane.send, exec_->memory().Allocate(out_bytes, true));
        RETURN_IF_ERROR(transport_->RegisterBuffer(buffer, lane.recv.get(), lane.recv_bytes));
      }
    }
    HelloReplyMessage reply;
    reply.memory_rank = static_cast<uint16_t>(o_.rank);
    reply.dtype = exec_->dtype();
    reply.kv_capacity_tokens = static_cast<uint64_t>(exec_->kv_capacity());
    reply.qkv_buffer = qkv_base_;
    reply.device = exec_->device().substr(0, 256);
    reply.persisted = tiers_ != nullptr && o_.tiers.persist;
    reply_ = EncodeHelloReply(reply);
    RETURN_IF_ERROR(transport_->Send(peer_, reply_));
    if (reply.persisted) RETURN_IF_ERROR(ReportPersistedBlocks());
    TANDEM_LOG_INFO("memory", "memory rank ", o_.rank, ": ", shape_.num_layers, " layers, ", shape_.num_heads,
                    "/", shape_.num_kv_heads, " heads of ", shape_.head_dim, " (partition ",
                    AttentionPartitionName(hello_.partition), ", KV heads [", hello_.kv_head_begin, ", ",
                    hello_.kv_head_end, ")); KV ", exec_->kv_capacity(), " tokens on ", exec_->device(),
                    "; transport ", transport_->capabilities().name, ", ",
                    device_path_ ? "device data path" : "host-staged data path");
    return absl::OkStatus();
  }

  // A later hello under the head partition (ComputeRank::RepartitionHeads): a new slice of the
  // heads. Every request was dropped by compute rank 0 (it recomputes them all), so the KV pool,
  // the table and the lanes go, and the rank is set up for the slice as at start (a new reply).
  // Receive buffers get fresh ids (an id cannot be registered twice) and the old ones keep their
  // memory (on the device path the transport keeps the old ones' registrations and mappings; the
  // step before was drained, DropsStep). The compute replicas keep their connections (compute
  // rank 0 tells them the new buffers: a head split). Under the head partition only: elsewhere the
  // hello is an error.
  absl::Status Repartition(const std::vector<uint8_t>& msg, int device) {
    ASSIGN_OR_RETURN(const HelloMessage next, DecodeHello(msg));
    if (hello_.partition != AttentionPartition::kHead || next.partition != AttentionPartition::kHead) {
      return absl::InvalidArgumentError(absl::StrCat(
          "memory rank ", o_.rank,
          ": a second hello from compute rank 0, which only the head partition's re-partition sends"));
    }
    if (next.num_layers != hello_.num_layers || next.num_heads != hello_.num_heads ||
        next.num_kv_heads != hello_.num_kv_heads || next.head_dim != hello_.head_dim ||
        next.dtype != hello_.dtype || next.lanes != hello_.lanes || next.q_first != hello_.q_first ||
        next.compute_ranks != hello_.compute_ranks) {
      return absl::InvalidArgumentError(absl::StrCat("memory rank ", o_.rank,
                                                     ": a re-partition hello for another model shape or "
                                                     "pipeline than the first hello's"));
    }
    const uint32_t begin = hello_.kv_head_begin, end = hello_.kv_head_end;
    // Kept: what the transport has registered (the receive buffers; the device path's input
    // buffers, mapped by compute rank 0) and the host-staged path's send staging (a UCX write of
    // the last step may still read it). The device path's drained output buffers go.
    for (Lane& lane : lanes_) {
      for (BackendBuffer* b : {&lane.recv, &lane.send, device_path_ ? &lane.qkv_dev : nullptr}) {
        if (b != nullptr && b->get() != nullptr) retired_.push_back(std::move(*b));
      }
    }
    qkv_base_ += static_cast<uint32_t>(lanes_.size());
    lanes_.clear();  // their executor lanes before the executor
    kv_.reset();
    exec_.reset();
    RETURN_IF_ERROR(Setup(msg, device));
    TANDEM_LOG_WARN("memory", "memory rank ", o_.rank, ": re-partitioned by compute rank 0: KV heads [",
                    begin, ", ", end, ") -> [", hello_.kv_head_begin, ", ", hello_.kv_head_end,
                    "), its KV dropped (every request is recomputed)");
    return absl::OkStatus();
  }

  // kv.tiers.persist: the blocks the disk tier found at start (with their tokens, parents first) go
  // to compute rank 0, which registers them demoted on this rank; one empty report when none.
  absl::Status ReportPersistedBlocks() {
    std::vector<PersistedBlock> found;
    for (KvTierBlock& b : tiers_->PersistedBlocks()) {
      found.push_back(
          {.hash = b.hash, .parent_hash = b.parent_hash, .depth = b.depth, .tokens = std::move(b.tokens)});
    }
    const size_t blocks = found.size();
    const std::vector<PersistedBlocksMessage> reports =
        SplitPersistedBlocks(static_cast<uint16_t>(o_.rank), std::move(found));
    for (const PersistedBlocksMessage& report : reports)
      RETURN_IF_ERROR(transport_->Send(peer_, EncodePersistedBlocks(report)));
    TANDEM_LOG_INFO("memory", "memory rank ", o_.rank, ": kv.tiers.persist: ", blocks,
                    " blocks found on disk offered to compute rank 0 (", reports.size(), " report(s))");
    return absl::OkStatus();
  }

  // A step discard taken between steps: applied, and the last step's layers run again when it
  // names that step (its plans all arrived and it had rows here).
  absl::Status RerunAfterDiscard(const std::vector<uint8_t>& msg) {
    ASSIGN_OR_RETURN(const StepDiscardMessage d, DecodeStepDiscard(msg));
    RETURN_IF_ERROR(ApplyDiscard(d));
    if (d.step_id == 0 || d.step_id != micro_step_id_ || next_micro_batch_ != 0 || DropsStep(d))
      return absl::OkStatus();
    const size_t lanes = micro_count_;
    bool any = false;
    for (size_t k = 0; k < lanes; ++k) {
      if (lanes_[k].rows == 0) continue;
      any = true;
      RETURN_IF_ERROR(lanes_[k].exec->BeginStep(lanes_[k].batch));
    }
    if (!any) return absl::OkStatus();
    bool dropped = false;
    RETURN_IF_ERROR(RunLayers(d.step_id, lanes, &dropped));
    for (size_t k = 0; k < lanes; ++k) {
      ASSIGN_OR_RETURN(const uint64_t attention, lanes_[k].exec->TakeLayerTimeNs());
      attention_ns_ += attention;
    }
    return absl::OkStatus();
  }

  // A step plan, or one micro-batch's plan of a pipelined step: micro-batches arrive in order,
  // each is applied to the KV table and begun on its lane at once, and the last one runs the
  // step's layers, the lanes in turn per layer (the order the compute rank sends them in).
  absl::Status RunStep(const StepPlan& plan) {
    const size_t j = plan.micro_batch;
    if (plan.micro_batches > lanes_.size()) {
      return absl::InvalidArgumentError(absl::StrCat("step ", plan.step_id, " has ", int{plan.micro_batches},
                                                     " micro-batches but the hello set up ", lanes_.size(),
                                                     " lanes"));
    }
    if (j != next_micro_batch_ || (j > 0 && plan.step_id != micro_step_id_)) {
      return absl::InvalidArgumentError(
          absl::StrCat("step ", plan.step_id, " micro-batch ", j, " arrived but micro-batch ",
                       next_micro_batch_, " of step ", j > 0 ? micro_step_id_ : plan.step_id, " was next"));
    }
    if (j > 0 && plan.micro_batches != micro_count_) {
      return absl::InvalidArgumentError(absl::StrCat("step ", plan.step_id, " micro-batch ", j, " says ",
                                                     int{plan.micro_batches},
                                                     " micro-batches, micro-batch 0 said ", micro_count_));
    }
    micro_step_id_ = plan.step_id;
    micro_count_ = plan.micro_batches;
    next_micro_batch_ = j + 1 == plan.micro_batches ? 0 : j + 1;
    // Requests come in memory rank order (the decoder checked it), so under the request partition
    // this rank's rows start after the lower ranks' rows in the compute rank's attention buffer
    // (the micro-batch's buffer). Under the head partition every request is placed on rank 0 and
    // every rank applies the plan as rank 0 (the same KV table on every rank, over its heads); its
    // output goes to a buffer of its own on the compute rank, at row 0.
    Lane& lane = lanes_[j];
    lane.row_offset = 0;
    for (const StepRequest& r : plan.requests) {
      if (r.memory_rank < placement_rank_) lane.row_offset += static_cast<uint64_t>(r.q_len);
    }
    std::vector<uint64_t> failed;
    RETURN_IF_ERROR(kv_->Apply(plan, placement_rank_, &lane.batch, &failed));
    if (std::any_of(plan.restores.begin(), plan.restores.end(),
                    [&](const PrefixRestore& r) { return r.memory_rank == placement_rank_; })) {
      const RestoreReplyMessage reply{.step_id = plan.step_id,
                                      .memory_rank = static_cast<uint16_t>(o_.rank),
                                      .failed = std::move(failed)};
      RETURN_IF_ERROR(transport_->Send(peer_, EncodeRestoreReply(reply)));
    }
    lane.rows = lane.batch.num_tokens();
    if (lane.rows > 0) RETURN_IF_ERROR(lane.exec->BeginStep(lane.batch));
    if (next_micro_batch_ != 0) return absl::OkStatus();  // more micro-batches to come
    const size_t lanes = plan.micro_batches;
    bool any = false;
    for (size_t k = 0; k < lanes; ++k) any |= lanes_[k].rows > 0;
    if (!any) return tiers_ == nullptr ? absl::OkStatus() : tiers_->FinishRestores();  // restores only
    ++steps_;
    bool dropped = false;
    RETURN_IF_ERROR(RunLayers(plan.step_id, lanes, &dropped));
    if (dropped) return absl::OkStatus();
    if (tiers_ != nullptr) RETURN_IF_ERROR(tiers_->FinishRestores());
    // The step's work has run (both paths wait for it): its attention time.
    for (size_t k = 0; k < lanes; ++k) {
      ASSIGN_OR_RETURN(const uint64_t attention, lanes_[k].exec->TakeLayerTimeNs());
      attention_ns_ += attention;
    }
    return absl::OkStatus();
  }

  // Host-staged: per layer and lane, wait for the q,k,v message, run the layer, write the output
  // back.
  absl::Status Layers(uint64_t step_id, size_t lanes) {
    const uint32_t qkv_row = static_cast<uint32_t>(shape_.qkv_width() * static_cast<int64_t>(elem_));
    const uint32_t out_row = static_cast<uint32_t>(shape_.q_dim() * static_cast<int64_t>(elem_));
    for (uint32_t layer = 0; layer < static_cast<uint32_t>(shape_.num_layers); ++layer) {
      // Layer-wise restore: this layer's KV of the blocks restored for the step, copied while
      // compute rank 0 computes the layer's q, k, v (before waiting for them).
      if (tiers_ != nullptr) RETURN_IF_ERROR(tiers_->RestoreLayer(layer));
      for (size_t j = 0; j < lanes; ++j) {
        Lane& lane = lanes_[j];
        if (lane.rows == 0) continue;
        AttentionExecutor& exec = *lane.exec;
        const size_t out_bytes = static_cast<size_t>(lane.rows) * out_row;
        if (hello_.q_first) {
          RETURN_IF_ERROR(SplitLayer(step_id, lanes, j, layer));
          continue;
        }
        ++lane.seqno;
        const uint32_t buffer = qkv_base_ + static_cast<uint32_t>(j);
        const LayerMessageExpect in{.step_id = step_id,
                                    .layer = layer,
                                    .kind = LayerMessageKind::kQkv,
                                    .dtype = exec.dtype(),
                                    .rows = static_cast<uint32_t>(lane.rows),
                                    .row_bytes = qkv_row,
                                    .seqno = lane.seqno,
                                    .verify_checksum = hello_.checksums};
        RETURN_IF_ERROR(WaitLayerInput(
            buffer, lane.seqno,
            absl::StrCat("q,k,v of step ", step_id, lanes > 1 ? absl::StrCat(" micro-batch ", j) : "",
                         " layer ", layer)));
        ASSIGN_OR_RETURN(
            absl::Span<const uint8_t> payload,
            ReadLayerMessage({static_cast<const uint8_t*>(lane.recv.get()), lane.recv_bytes}, in));
        void* out = lane.send.get();
        if (exec.memory().host()) {
          RETURN_IF_ERROR(exec.MarkLayerStart());
          RETURN_IF_ERROR(exec.Layer(layer, payload.data(), out));
          RETURN_IF_ERROR(exec.MarkLayerEnd());
        } else {
          RETURN_IF_ERROR(exec.memory().CopyIn(lane.qkv_dev.get(), payload.data(), payload.size()));
          RETURN_IF_ERROR(exec.MarkLayerStart());
          RETURN_IF_ERROR(exec.Layer(layer, lane.qkv_dev.get(), lane.out_dev.get()));
          RETURN_IF_ERROR(exec.MarkLayerEnd());
          RETURN_IF_ERROR(exec.memory().CopyOut(out, lane.out_dev.get(), out_bytes));
          RETURN_IF_ERROR(exec.memory().Synchronize());
        }
        LayerMessageExpect reply = in;
        reply.kind = LayerMessageKind::kAttnOut;
        reply.row_bytes = out_row;
        const absl::Span<const uint8_t> body(static_cast<const uint8_t*>(out), out_bytes);
        const std::vector<uint8_t> header = MakeLayerMessageHeader(reply, body, hello_.checksums);
        const absl::Span<const uint8_t> pieces[] = {header, body};
        RETURN_IF_ERROR(WriteOutput(j, layer, pieces, lane.seqno));
      }
    }
    return absl::OkStatus();
  }

  // q-first (pipeline.q_first), host-staged: lane j's layer from two messages. The q rows
  // (seqno s) start the attention over the context; the k,v rows (seqno s + 1, at kv_offset_)
  // complete it; the output goes back with seqno s + 1. A CUDA executor gets each part copied to
  // its input buffer (q at 0, k,v at kv_offset_) and runs the context part while the host waits
  // for k,v.
  absl::Status SplitLayer(uint64_t step_id, size_t lanes, size_t j, uint32_t layer) {
    Lane& lane = lanes_[j];
    AttentionExecutor& exec = *lane.exec;
    const uint32_t q_row = static_cast<uint32_t>(shape_.q_dim() * static_cast<int64_t>(elem_));
    const uint32_t kv_row = static_cast<uint32_t>(2 * shape_.kv_dim() * static_cast<int64_t>(elem_));
    const uint32_t buffer = qkv_base_ + static_cast<uint32_t>(j);
    const auto* recv = static_cast<const uint8_t*>(lane.recv.get());
    const std::string micro = lanes > 1 ? absl::StrCat(" micro-batch ", j) : "";
    auto wait = [&](uint64_t seqno, const char* what) {
      return WaitLayerInput(buffer, seqno, absl::StrCat(what, " of step ", step_id, micro, " layer ", layer));
    };
    LayerMessageExpect in{.step_id = step_id,
                          .layer = layer,
                          .kind = LayerMessageKind::kQ,
                          .dtype = exec.dtype(),
                          .rows = static_cast<uint32_t>(lane.rows),
                          .row_bytes = q_row,
                          .seqno = ++lane.seqno,
                          .verify_checksum = hello_.checksums};
    RETURN_IF_ERROR(wait(in.seqno, "q"));
    ASSIGN_OR_RETURN(absl::Span<const uint8_t> q, ReadLayerMessage({recv, kv_offset_}, in));
    const bool host = exec.memory().host();
    auto* dev = static_cast<uint8_t*>(lane.qkv_dev.get());
    if (!host) RETURN_IF_ERROR(exec.memory().CopyIn(dev, q.data(), q.size()));
    RETURN_IF_ERROR(exec.MarkLayerStart());
    RETURN_IF_ERROR(exec.LayerContext(layer, host ? q.data() : dev));
    RETURN_IF_ERROR(exec.MarkLayerEnd());
    in.kind = LayerMessageKind::kKv;
    in.row_bytes = kv_row;
    in.seqno = ++lane.seqno;
    RETURN_IF_ERROR(wait(in.seqno, "k,v"));
    ASSIGN_OR_RETURN(absl::Span<const uint8_t> kv,
                     ReadLayerMessage({recv + kv_offset_, lane.recv_bytes - kv_offset_}, in));
    void* out = lane.send.get();
    const size_t out_bytes = static_cast<size_t>(lane.rows) * static_cast<size_t>(shape_.q_dim()) * elem_;
    if (host) {
      RETURN_IF_ERROR(exec.MarkLayerStart());
      RETURN_IF_ERROR(exec.LayerNew(layer, kv.data(), out));
      RETURN_IF_ERROR(exec.MarkLayerEnd());
    } else {
      RETURN_IF_ERROR(exec.memory().CopyIn(dev + kv_offset_, kv.data(), kv.size()));
      RETURN_IF_ERROR(exec.MarkLayerStart());
      RETURN_IF_ERROR(exec.LayerNew(layer, dev + kv_offset_, lane.out_dev.get()));
      RETURN_IF_ERROR(exec.MarkLayerEnd());
      RETURN_IF_ERROR(exec.memory().CopyOut(out, lane.out_dev.get(), out_bytes));
      RETURN_IF_ERROR(exec.memory().Synchronize());
    }
    LayerMessageExpect reply = in;
    reply.kind = LayerMessageKind::kAttnOut;
    reply.row_bytes = static_cast<uint32_t>(shape_.q_dim() * static_cast<int64_t>(elem_));
    const absl::Span<const uint8_t> body(static_cast<const uint8_t*>(out), out_bytes);
    const std::vector<uint8_t> header = MakeLayerMessageHeader(reply, body, hello_.checksums);
    const absl::Span<const uint8_t> pieces[] = {header, body};
    return WriteOutput(j, layer, pieces, lane.seqno);
  }

  // Lane j's attention output of `layer` to the compute rank that gets it (host-staged path). A
  // replica that fails meanwhile (or was given up) is let go: compute rank 0 discards the step.
  absl::Status WriteOutput(size_t j, uint32_t layer, absl::Span<const absl::Span<const uint8_t>> pieces,
                           uint64_t seqno) {
    const int owner = schedule_.OwnerOf(static_cast<int64_t>(j), layer);
    const PeerId peer = compute_peers_[static_cast<size_t>(owner)];
    uint16_t replica = 0;
    for (const auto& [rank, p] : replicas_) {
      if (p == peer && owner != 0) replica = rank;
    }
    if (replica != 0 && lost_replicas_.contains(replica)) return absl::OkStatus();
    const absl::Status st =
        transport_->Write(peer, hello_.attn_out_buffer + static_cast<uint32_t>(j), 0, pieces, seqno);
    if (st.ok() || replica == 0 || transport_->PeerStatus(peer).ok()) return st;
    DropReplica(replica, std::string(st.message()));
    return absl::OkStatus();
  }

  // The whole step enqueued on the executor's stream (see memory_rank.h), the lanes in turn per
  // layer; the host waits once. With q-first a layer has two device-side waits, for its q rows
  // (seqno s, at 0) and then its k,v rows (s + 1, at kv_offset_): the compute rank writes them in
  // that order (a two-sided transport matches them in issue order), and the context part runs
  // between the two.
  absl::Status LayersOnDevice(uint64_t step_id, size_t lanes) {
    void* stream = exec_->stream();
    const size_t qkv_row = static_cast<size_t>(shape_.qkv_width()) * elem_;
    const size_t out_row = static_cast<size_t>(shape_.q_dim()) * elem_;
    const size_t q_row = static_cast<size_t>(shape_.q_dim()) * elem_;
    const size_t kv_row = static_cast<size_t>(2 * shape_.kv_dim()) * elem_;
    for (uint32_t layer = 0; layer < static_cast<uint32_t>(shape_.num_layers); ++layer) {
      // Layer-wise restore: this layer's KV of the blocks restored for the step, enqueued on the
      // executor's stream ahead of the layer's attention.
      if (tiers_ != nullptr) RETURN_IF_ERROR(tiers_->RestoreLayer(layer));
      for (size_t j = 0; j < lanes; ++j) {
        Lane& lane = lanes_[j];
        if (lane.rows == 0) continue;
        const size_t t = static_cast<size_t>(lane.rows);
        const PeerId sender =
            compute_peers_[static_cast<size_t>(schedule_.SenderOf(static_cast<int64_t>(j), layer))];
        auto wait = [&](const char* what, uint64_t offset, size_t bytes) {
          // Twice the step timeout, as on the host-staged path (WaitLayerInput).
          return transport_->EnqueueWait(
              sender, qkv_base_ + static_cast<uint32_t>(j), offset, bytes, ++lane.seqno, 2 * o_.step_timeout,
              absl::StrCat("memory rank ", o_.rank, ": ", what, " of step ", step_id,
                           lanes > 1 ? absl::StrCat(" micro-batch ", j) : "", " layer ", layer),
              stream);
        };
        auto* in = static_cast<uint8_t*>(lane.qkv_dev.get());
        if (hello_.q_first) {
          RETURN_IF_ERROR(wait("q", 0, t * q_row));
          RETURN_IF_ERROR(lane.exec->MarkLayerStart());
          RETURN_IF_ERROR(lane.exec->LayerContext(layer, in));
          RETURN_IF_ERROR(lane.exec->MarkLayerEnd());
          RETURN_IF_ERROR(wait("k,v", kv_offset_, t * kv_row));
          RETURN_IF_ERROR(lane.exec->MarkLayerStart());
          RETURN_IF_ERROR(lane.exec->LayerNew(layer, in + kv_offset_, lane.out_dev.get()));
          RETURN_IF_ERROR(lane.exec->MarkLayerEnd());
        } else {
          RETURN_IF_ERROR(wait("q,k,v", 0, t * qkv_row));
          RETURN_IF_ERROR(lane.exec->MarkLayerStart());
          RETURN_IF_ERROR(lane.exec->Layer(layer, in, lane.out_dev.get()));
          RETURN_IF_ERROR(lane.exec->MarkLayerEnd());
        }
        RETURN_IF_ERROR(transport_->EnqueueWrite(
            OwnerPeer(j, layer), hello_.attn_out_buffer + static_cast<uint32_t>(j), lane.row_offset * out_row,
            lane.out_dev.get(), t * out_row, lane.seqno, stream));
      }
    }
    return transport_->SyncStream(stream, absl::Now() + 2 * o_.step_timeout);
  }

  // The compute rank that gets lane j's attention output of `layer` (common/pipeline_schedule.h).
  PeerId OwnerPeer(size_t j, uint32_t layer) const {
    return compute_peers_[static_cast<size_t>(schedule_.OwnerOf(static_cast<int64_t>(j), layer))];
  }

  MemoryRankOptions o_;
  std::unique_ptr<Transport> transport_;
  PeerId peer_ = 0;  // compute rank 0
  bool peer_set_ = false;
  std::map<uint16_t, PeerId> replicas_;        // compute rank -> its connection (compute.ranks > 1)
  std::set<uint16_t> lost_replicas_;           // given up (DropReplica): their messages are dropped
  std::optional<StepDiscardMessage> discard_;  // taken within a step's layers, applied by RunLayers
  std::deque<std::vector<uint8_t>> deferred_;  // compute rank 0's messages of after a device step
  std::vector<uint8_t> reply_;                 // the hello reply every compute rank gets
  uint32_t qkv_base_ = kQkvBuffer;             // lane j's receive buffer id: qkv_base_ + j
  std::vector<BackendBuffer> retired_;         // buffers of a slice before a re-partition (Repartition)
  HelloMessage hello_;
  AttentionShape shape_;
  std::unique_ptr<AttentionExecutor> exec_;
  std::unique_ptr<KvTable> kv_;
  std::unique_ptr<KvTiers> tiers_;  // kv.tiers.*; declared after exec_, which it copies from
  // One per micro-batch in flight (lane 0 uses exec_ itself).
  PipelineSchedule schedule_;          // which compute rank sends and gets which layer of a lane
  std::vector<PeerId> compute_peers_;  // compute rank c's connection
  struct Lane {
    std::unique_ptr<AttentionExecutor> owned;
    AttentionExecutor* exec = nullptr;
    AttentionBatch batch;
    int64_t rows = 0;         // this step's rows here
    uint64_t row_offset = 0;  // where they go in the compute rank's attention buffer
    size_t recv_bytes = 0;
    BackendBuffer recv{nullptr, nullptr}, send{nullptr, nullptr}, qkv_dev{nullptr, nullptr},
        out_dev{nullptr, nullptr};
    uint64_t seqno = 0;  // of its receive buffer's doorbell
  };
  std::vector<Lane> lanes_;
  size_t next_micro_batch_ = 0;  // of a pipelined step whose plans are arriving
  uint64_t micro_step_id_ = 0;
  size_t micro_count_ = 1;  // its micro_batches
  size_t elem_ = 4;
  size_t kv_offset_ = 0;       // q-first: where a lane's k,v message starts in its receive buffer
  int64_t steps_ = 0;          // steps with rows here
  uint64_t attention_ns_ = 0;  // their attention time (device time on a GPU)
  bool device_path_ = false;
  uint16_t placement_rank_ = 0;  // the memory_rank of the plan's requests this rank serves
};

}  // namespace

absl::Status RunMemoryRank(const MemoryRankOptions& options) { return MemoryRank(options).Run(); }

}  // namespace tandem
