// `tandem compute`: compute rank 0 as a process, with the controller in it (docs/architecture.md,
// "Processes"). It holds the weights and runs every non-attention operator; the memory ranks hold
// the KV and run attention. Per step the controller's plan goes to every memory rank once; per
// layer each memory rank gets its q,k,v (written into its receive buffer with a doorbell) and
// writes the attention output back the same way. What a memory rank gets depends on the attention
// partition (ComputeRankOptions::partition, memory.partition; common/head_partition.h):
//   * request: the rows of its requests, one contiguous range of the step's rows, whole;
//   * head: every row of the step, but only the columns of its KV head slice, packed into one
//     contiguous (rows, qkv_width/M) buffer; its output (rows, q_dim/M) is scattered back into its
//     columns of the attention buffer.
//
// Start-up: connect to every memory rank, load the weights (first, so that a memory rank sharing
// the GPU sizes its KV from what the weights left), send each a hello with the model's attention
// shape, the partition and its KV head slice, and the step limits, and wait for the replies that
// carry each rank's KV capacity. Under the request partition the controller then places requests
// on ranks by free KV; under the head partition every rank holds every request, so the controller
// plans for one placement group whose capacity is the smallest rank's, places every request on
// rank 0, and every memory rank applies the plan as rank 0.
//
// Two data paths, by transport:
//   * host-staged (ucx): per layer, the q,k,v rows go device -> pinned host -> network, each with a
//     layer message header (and crc); the host waits for each rank's output and copies it in (head
//     partition: packing and scattering are row copies between the host staging buffers);
//   * device (p2p, nccl, verbs: a transport with device polling, CUDA ranks): the whole step is
//     enqueued at once on the backend's stream, per layer: QKV -> write each rank's rows straight
//     into its GPU buffer (payload, then doorbell) -> device-side waits for every rank's output,
//     which lands directly in the attention buffer at the rank's row offset -> the rest of the
//     layer. Under the head partition each rank's columns are first packed by strided device
//     copies (MemorySpace::CopyStrided) into a device buffer of its own, which is what is written,
//     and its output lands in a device buffer of its own (at row 0), scattered into its columns
//     of the attention buffer after the device-side wait for it. The host waits once per step
//     (SyncStream), and each device wait has the step timeout.
// Pipelining (micro_batches > 1, pipeline.mode pingpong): the controller's step is split into
// micro-batches (compute_node/micro_batches.h), each run on a lane (a backend lane over the same
// weights, buffers of its own, and lane j of every memory rank's buffers): every plan is sent
// first, then layer 0's QKV of every micro-batch, then per layer and micro-batch: its attention
// output -> the rest of its layer -> its next QKV -> send. So micro-batch B's linear layers run
// while the memory ranks run A's attention. The sampled tokens are merged back in the step's order.
// Every wait has a deadline; a memory rank that reports an error, disconnects or stays silent
// fails the step with a Status naming it, or, with recovery (ComputeRankOptions::
// recover_memory_ranks), is given up: on the host-staged path the step goes on without it; with
// replicas, and on a device path that can be reset (DeviceRecovery), the step is discarded and
// runs again without it.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_set>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/head_partition.h"
#include "common/layer_message.h"
#include "common/pipeline_schedule.h"
#include "common/status.h"
#include "common/transport/factory.h"
#include "compute_node/compute_backend.h"
#include "compute_node/controller.h"
#include "compute_node/engine.h"
#include "compute_node/pipeline_report.h"
#include "compute_node/weights.h"

namespace tandem {

struct ComputeRankOptions {
  int device = -1;                                                      // -1: cpu, else cuda:N
  transport::TransportKind transport = transport::TransportKind::kUcx;  // as the memory ranks
  std::vector<std::string> memory_addresses;  // transport address of memory rank m, in rank order
  // memory.partition. kHead needs the model's num_kv_heads >= the number of memory ranks (Create
  // refuses it otherwise, naming both numbers); the slices differ by one KV head where the number
  // of ranks does not divide them.
  AttentionPartition partition = AttentionPartition::kRequest;
  ControllerOptions scheduler;
  int64_t kv_capacity_tokens = 0;  // per memory rank; 0: each sizes its pool from its memory
  double kv_memory_fraction = 0.9;
  bool checksums = true;  // crc32c of every layer payload, checked by the receiver
  bool profile = false;
  bool cuda_graphs = false;  // ComputeBackendOptions::cuda_graphs
  // pipeline.mode pingpong / fixed: each step split into this many micro-batches (compute_node/
  // micro_batches.h) kept in flight at once; 1 runs each step whole (pipeline.mode none).
  int micro_batches = 1;
  // compute.ranks > 1 (pipeline.mode fixed): the compute replicas' addresses (`tandem compute
  // --replica r`, listening), compute rank r at replica_addresses[r - 1]. Micro-batch j runs on
  // compute rank j % compute.ranks, so micro_batches must be at least compute.ranks.
  std::vector<std::string> replica_addresses;
  // pipeline.mode rotational (pipeline.slice_layers): with compute replicas, micro-batch j's layer
  // slice k (slice_layers layers each) runs on compute rank (j + k) % compute.ranks, the residual
  // stream handed from rank to rank (common/pipeline_schedule.h); 0: fixed.
  int slice_layers = 0;
  // pipeline.q_first: per layer each memory rank gets its rows' q first and their k,v after, as
  // two layer messages (kinds q and kv) in its lane's receive buffer, and runs attention over the
  // existing context while the k,v are in flight (docs/architecture.md, "q-first overlap inside a
  // layer"). On the device path the q rows and the k,v rows are two device writes into the rank's
  // GPU buffer (at 0 and at QFirstKvOffset, common/layer_message.h), packed from the strided
  // [q | k | v] rows first. Every executor, transport and pipeline mode has it.
  bool q_first = false;
  absl::Duration startup_timeout = absl::Minutes(10);
  absl::Duration step_timeout = absl::Minutes(2);  // for each layer's attention output, and each send
  // launch.recover_memory_ranks: a memory rank that fails, disconnects or stays silent past the
  // step timeout is given up and its requests recomputed on the others (see ComputeRank::Step);
  // false: the step fails. Recovery needs the host-staged path (ucx) or a device path that can be
  // reset (p2p, nccl). Under the request partition, with compute replicas and on the device path, the
  // step in flight is discarded on the memory ranks and the replicas (which are told the rank is
  // lost and go on) and run again without the rank. Under the head partition the survivors split
  // the KV heads again and every request in flight is recomputed
  // (RepartitionHeads; with compute replicas, and on the device path, the step in flight is
  // discarded and dropped, DropStepForHeads). Elsewhere a loss fails the step.
  bool recover_memory_ranks = true;
  // launch.recover_compute_replicas: on the host-staged path and a device path that can be reset
  // (p2p, nccl: every rank drains and resets it before the rerun; a rotational ring made anew there
  // also needs Capabilities::device_path_new_peers, and deploy/deployment.cc keeps it off on nccl,
  // where it has not been run), a compute replica that fails,
  // disconnects or stays silent past the step timeout is given up: the step in flight is discarded
  // on the memory ranks and the other replicas and run again on the surviving compute ranks, which
  // share the micro-batches from then on (pipeline.mode fixed or rotational: the ring of residual
  // streams closes over the lost rank; see ComputeRank::Step); false (or elsewhere): the step
  // fails, naming it.
  bool recover_compute_replicas = true;
  // launch.heartbeat_s: while idle (Heartbeat), every memory rank gets a heartbeat this often and
  // must answer within step_timeout, or it is lost as in a step (recovered, or the error names
  // it); each heartbeat also tells the rank to stop once this rank has been silent for
  // heartbeat + step_timeout. Zero: no heartbeats.
  absl::Duration heartbeat = absl::ZeroDuration();
  // launch.rejoin_probe_s: a memory rank given up (recovery) is probed at its address this often
  // and rejoins when a new process of it answers there (see ComputeRank's rejoin); zero: a lost
  // rank stays lost.
  absl::Duration rejoin_probe = absl::ZeroDuration();
};

// A compute replica (compute rank r > 0 of compute.ranks; pipeline.mode fixed): the weights on its
// own device, no controller and no request state. It listens, connects to every memory rank (a
// compute hello each), tells compute rank 0 it is ready once rank 0 connects, and then runs the
// micro-batches rank 0 hands it (replica steps: a part's plan and input tokens) on lanes of its
// own, exchanging q,k,v and outputs with the memory ranks itself, and sends back the sampled tokens
// (replica results), until bye.
// Losing compute rank 0: compute rank 0's heartbeats (ComputeRankOptions::heartbeat) reach the
// replicas too, which answer them; a replica that hears nothing from compute rank 0 for the
// heartbeats' allowance while idle, or whose wait fails because compute rank 0's connection failed,
// stops with an error naming compute rank 0 (a memory rank that stops for compute rank 0's
// silence tells the replicas why, so they name rank 0, not it).
struct ComputeReplicaOptions {
  int compute_rank = 1;  // r, in [1, compute_ranks)
  int compute_ranks = 2;
  std::string listen_address = "127.0.0.1:0";
  std::function<absl::Status(const std::string& address)> on_listening;
  std::function<bool()> stop_requested;  // polled while idle; true ends the replica (OK)
  ComputeRankOptions rank;               // device, transport, memory addresses, limits, pipeline
};
absl::Status RunComputeReplica(const WeightSource& source, const ComputeReplicaOptions& options);

// Compute rank 0 implements the Engine interface (compute_node/engine.h): the same requests give
// the same tokens as the colocated engine.
class ComputeRank : public Engine {
 public:
  static absl::StatusOr<std::unique_ptr<ComputeRank>> Create(const WeightSource& source,
                                                             const ComputeRankOptions& options);
  ~ComputeRank() override;

  Controller& controller() { return *controller_; }
  // The Engine interface. Step: a memory rank that reports an error, disconnects or stays silent
  // past the step timeout is lost (recover_memory_ranks): the step goes on without it, its requests'
  // tokens of that step are dropped and the requests requeued (Controller::LoseRank) to be
  // recomputed on the surviving ranks, so their clients get the same tokens later; a waiting
  // request that now fits no surviving rank is reported finished with an error
  // (GenerationResult::error, Controller::FailUnplaceable). Without
  // recovery (or where it is not supported), or once every rank is lost, the step fails with a
  // Status naming the rank. A compute replica that fails or goes silent mid-step is given up
  // (recover_compute_replicas; host-staged path, p2p, nccl under fixed): the memory ranks and the other
  // replicas get a step discard and the step runs again on the surviving compute ranks, the micro-batches
  // mapped onto them as onto a pipeline of that many ranks, as every step after it (RecoverFromFailedStep,
  // LoseReplica, Regroup; docs/architecture.md, "Failures"); under pipeline.mode rotational the
  // lost rank's ring neighbours are connected to each other first (ReconnectRing). Elsewhere it
  // fails the step, naming it. A memory rank lost while replicas run is recovered the same way:
  // the step is discarded and run again by the same compute ranks without the lost rank (the
  // discard names it), whose requests are requeued. Cancel: the memory rank that holds the
  // request's KV is told to free it (a release message, as for a finished request).
  //
  // Rejoin (ComputeRankOptions::rejoin_probe): a lost rank's address (memory_addresses[m], where a
  // restarted `tandem memory --rank m` listens again) is probed every rejoin_probe, and a process
  // that answers there takes the rank's place. Nothing of it ever blocks or fails a step: the probe
  // connection is Close()d from the start (its refusal fails no other wait) and polled at the
  // start of each Step and in Heartbeat; once it is connected it gets a hello with attention-output
  // buffers of its own (fresh ids, doorbells at 0; its seqnos start again on both sides), and its
  // hello reply, taken wherever compute rank 0 reads messages, makes the rank live again at the
  // start of the next Step or Heartbeat (Controller::RejoinRank: its KV capacity back, a fresh
  // prefix registry). A probe that is refused, fails, or has no reply within the step timeout is
  // dropped (its late messages too) and tried again a rejoin_probe later, then less often while
  // nothing answers (the wait doubles, up to 30 s). With compute replicas running, the new process
  // waits for the compute hellos of the compute ranks that go on (the hello's compute_mask), and
  // the rank is live again only once every replica has connected to it and answered (a memory
  // rejoin message each way, RejoinReplicas); a replica that cannot reach it keeps it lost and the
  // probe is dropped. Probes reach the host-staged path, where recovery works (CanRecover,
  // CanRecoverByRerun), and a device path that connects new peers (capabilities().
  // device_path_new_peers: p2p, and nccl, whose communicators are set up between steps: the rank is
  // taken only once Connecting() is false after the reply); there a step reads no message, so the
  // reply is looked for, and the set-up pumped, between steps (TakeMessagesBetweenSteps). Under the head
  // partition (either path) the rank comes back through a new split of the heads (RepartitionHeads).
  absl::Status Check(const GenerationRequest& request) const override { return controller_->Check(request); }
  absl::StatusOr<int64_t> Submit(GenerationRequest request) override {
    return controller_->Submit(std::move(request));
  }
  absl::Status Step(std::vector<std::pair<int64_t, GenerationResult>>* finished) override;
  absl::StatusOr<GenerationResult> Cancel(int64_t id) override;
  bool Idle() const override { return controller_->Idle(); }
  // ComputeRankOptions::heartbeat (InfiniteDuration when off). Heartbeat never blocks: it takes
  // the replies that came, gives up the ranks that failed (the transport says so, or they sent an
  // error) or have not answered their heartbeat within the step timeout (each named by its own
  // silence, whatever its neighbours do), and sends the next heartbeats when they are due. A rank
  // it gives up is recovered as in Step (its requests, none while idle, requeued); without
  // recovery, or once every rank is lost, it returns the error naming the rank. The compute
  // replicas get heartbeats too; one that failed or left its heartbeat unanswered for the step
  // timeout is given up as in Step (with no step to discard), or, without that recovery, is an
  // error naming it.
  absl::Duration heartbeat_interval() const override {
    return options_.heartbeat > absl::ZeroDuration() ? options_.heartbeat : absl::InfiniteDuration();
  }
  absl::Status Heartbeat() override;
  const GenerationResult* Progress(int64_t id) const override { return controller_->Progress(id); }
  int64_t num_waiting() const override { return controller_->num_waiting(); }
  int64_t num_running() const override { return controller_->num_running(); }
  // One entry per memory rank; under the head partition every rank holds the same tokens (of its
  // heads), so every entry is the controller's one placement group.
  std::vector<KvUsage> kv_usage() const override;
  EngineStats stats() const override;
  const ModelSpec& spec() const override { return backend_->spec(); }
  std::string device() const override { return backend_->device(); }

  // Tells every memory rank to stop (bye), best effort: it never fails.
  absl::Status Shutdown();
  // The deployment cannot go on (`why`: a failed step or heartbeat): every memory rank and compute
  // replica still reachable (not given up or failed, not silent past its heartbeat) gets an error
  // message with `why` and stops naming it, so that whichever process the launcher sees leave
  // first names the cause.
  // Best effort, bounded by a 2 s flush.
  void Abandon(const absl::Status& why);

  // The pipeline's totals so far (compute_node/pipeline_report.h): this rank's step, compute and
  // attention-phase time, and each memory rank's attention time, asked for with a stats request
  // (so call it between steps; it waits up to `timeout` for the replies). Compute and attention
  // phase come from the backend's phase timing on a GPU (needs `profile`; without it they are 0)
  // and from host timers on the CPU.
  absl::StatusOr<PipelineTotals> Pipeline(absl::Duration timeout = absl::Seconds(10));
  absl::StatusOr<std::optional<PipelineTotals>> PipelineSnapshot() override {
    ASSIGN_OR_RETURN(PipelineTotals t, Pipeline());
    return std::optional<PipelineTotals>(std::move(t));
  }

  // "memory rank 1: cuda:0 (NVIDIA H200), 123456 KV tokens" per rank (head partition: "... KV
  // tokens of KV heads [4, 8)").
  const std::vector<std::string>& memory_ranks() const { return rank_names_; }
  // With ComputeRankOptions::profile: the backend's device time per phase so far (see
  // ComputeBackend::PhaseTotalsMs); "attention" is the time from the QKV rows being ready to the
  // last memory rank's output being in place: the exchange both ways plus the remote attention.
  std::vector<std::pair<std::string, double>> PhaseTotalsMs() const { return backend_->PhaseTotalsMs(); }

 private:
  friend absl::Status RunComputeReplica(const WeightSource& source, const ComputeReplicaOptions& options);
  ComputeRank() = default;
  absl::Status Connect(const WeightSource& source);
  // Compute rank 0: connects to the replicas and waits for each to say it is ready.
  absl::Status ConnectReplicas(absl::Time deadline);
  // A replica: serves rank 0's replica steps until bye (see RunComputeReplica).
  absl::Status ServeReplica(const ComputeReplicaOptions& options);
  // A replica: `st` (a failed wait or send) annotated with the peer the transport knows failed,
  // compute rank 0 before the others (its death takes the memory ranks with it); `st` when none did.
  // Waits up to 1 s for compute rank 0's failure to be known (its disconnect can come after those
  // of the memory ranks that saw it go) or for a memory rank's error message, which is then the
  // cause. When compute rank 0 is gone the memory ranks are told so.
  absl::Status NameFailedPeer(absl::Status st);
  // Whether this rank runs any part of micro-batch j (fixed: j % compute.ranks; rotational: see
  // common/pipeline_schedule.h), as its place among the compute ranks that go on.
  bool Runs(size_t micro_batch) const {
    return schedule_.Touches(place_, static_cast<int64_t>(micro_batch), num_layers_);
  }
  bool Finishes(size_t micro_batch) const {
    return schedule_.FinisherOf(static_cast<int64_t>(micro_batch), num_layers_) == place_;
  }
  // The buffers of micro-batch j on this rank: its backend lane, and its receive buffer of every
  // memory rank's outputs (no-ops when they exist: a lane taken over from a lost replica is set
  // up when it is).
  absl::Status SetUpLane(size_t j);
  absl::Status SetUpRankLane(size_t m, size_t j);
  // Compute rank 0, after the step's micro-batches failed with `ran`: finds the compute replica that
  // failed (its connection, an error it sent, or, after a step deadline, no answer to a heartbeat
  // within a quarter of the step timeout, 0.25 to 5 s) and, where recovery applies (CanRecoverReplica), gives
  // it up (LoseReplica) so that the step can run again: OK. When no replica failed but a memory rank
  // did (an error it sent, its connection, or a wait for it past its deadline: failed_ranks_) and
  // memory-rank recovery applies (CanRecoverByRerun), gives the rank up and keeps the replicas
  // (Regroup): OK. Otherwise the step's error, naming the replica when one failed.
  absl::Status RecoverFromFailedStep(absl::Status ran, uint64_t step_id);
  // Whether this rank can go on without a compute replica (see
  // ComputeRankOptions::recover_compute_replicas).
  bool CanRecoverReplica() const;
  // Gives up replica r (compute rank r + 1) for `why` (counted as lost) and goes on with the others
  // (Regroup, which keeps them; under pipeline.mode rotational the ring closes over the lost rank).
  absl::Status LoseReplica(size_t r, const absl::Status& why, uint64_t step_id);
  // The replicas not given up go on, each as its place among the survivors, in rank order (the
  // pipeline's compute ranks 1, 2, ...). The memory ranks of `lose` are given up (MarkRankLost)
  // first. Then every doorbell seqno jumps to a common base above any used so far
  // and the memory ranks and the replicas get a step discard of `step_id` (0: none in flight) with
  // the mask of the compute ranks that go on and every memory rank lost so far; a kept replica
  // answers it with a compute hello (awaited by AwaitKeptReplicas before its next replica step).
  // Under pipeline.mode rotational the ring goes over the compute ranks that go on, in rank order:
  // this rank hands residual streams to the first kept replica and takes them from the last, and a
  // kept replica whose successor changed to another replica gets a replica ring message with that
  // replica's address right after the discard (its successor is compute rank 0: nothing; it knows
  // from the mask). Returns the kept replicas' names (for the log).
  struct Regrouped {
    std::string kept;
  };
  absl::StatusOr<Regrouped> Regroup(uint64_t step_id, std::span<const std::pair<size_t, absl::Status>> lose);
  // Compute rank 0: waits (up to the step timeout) until every kept replica has answered the step
  // discard that kept it (TakeReplicaControl takes the answers wherever they come): what a replica
  // sent before it had the discard (a result of the step discarded) is dropped, and its writes of
  // that step are out before the rerun's. A restore reply that comes meanwhile is kept for after the
  // step.
  absl::Status AwaitKeptReplicas();
  // Whether a memory rank's loss can be recovered by discarding the step and running it again
  // without the rank: while replicas run (kept), or on the device path (DeviceRecovery); see
  // ComputeRankOptions::recover_memory_ranks.
  bool CanRecoverByRerun() const;
  // The device path under the head partition, after RecoverFromFailedStep gave a memory rank up
  // (the step discarded on every rank, their device paths drained and reset): every request of the
  // step had KV heads on the lost rank, so the step is not run again; its tokens are dropped and
  // RecoverLostRanks requeues every request and splits the heads again (RepartitionHeads).
  absl::Status DropStepForHeads(std::vector<std::pair<int64_t, GenerationResult>>* finished,
                                std::chrono::steady_clock::time_point t0);
  // The device path's recovery: a transport whose device path can be reset. The failed step has
  // drained (SyncStream); the device path is
  // reset, the step discarded (Regroup), and the rerun waits for AwaitDrained (under the head
  // partition there is none: DropStepForHeads).
  bool DeviceRecovery() const;
  // A heartbeat to every live memory rank (best effort: a failed send is its connection failing,
  // found by the caller), each awaiting the answer from `sent` (beat_seq, beat_sent).
  void BeatMemoryRanks(absl::Time sent, int64_t silence_ms);
  // Device path, after a step discard: a heartbeat to every memory rank left, and their answers
  // awaited (up to the step timeout): a memory rank takes it after it has drained the discarded
  // step and reset its device path, so that nothing of the failed attempt is still in flight
  // when the rerun writes. A rank that fails or does not answer is given up too (another
  // discard).
  absl::Status AwaitDrained(uint64_t step_id);
  // A replica's messages within a step, taken without waiting (WaitInput; the transport's device
  // poll, Transport::SetDevicePoll): compute rank 0's heartbeats answered; its step discard kept
  // (rank0_discard_, applied by the caller or AwaitRank0) and returned as Aborted, which stops a
  // device step; an error report returned.
  absl::Status ReplicaPoll();
  // The silence a heartbeat allows a memory rank (launch.heartbeat_s + launch.step_timeout_s).
  int64_t SilenceMs() const;
  // Memory rank m is given up (nothing more is sent to it or awaited from it; its requests are
  // requeued after the step, RecoverLostRanks): OK, or an error when no memory rank is left.
  absl::Status MarkRankLost(size_t m, const absl::Status& why);
  // A replica, after its step failed with `ran` while compute rank 0 is still there: waits (answering
  // heartbeats) for compute rank 0's word on what follows, up to twice the step timeout and 5 s: a
  // step discard that releases it (Cancelled: it stops cleanly), an error (returned), or nothing
  // (`ran`, named). A peer's failure is not this rank's to report: compute rank 0 finds it and
  // decides (see RecoverFromFailedStep).
  absl::Status AwaitRank0(absl::Status ran);
  // A replica: a step discard from compute rank 0. One whose mask leaves this rank out releases it:
  // Cancelled, logged (compute rank 0 keeps every replica it has not given up, so it sends none; a
  // replica given up is sent nothing, and stops on its own deadlines). One that keeps it is applied
  // (KeepAfterDiscard): Aborted, with kept_ set; the replica drops the step it was in and serves compute rank
  // 0's next replica steps (the rerun).
  absl::Status TakeRank0Discard(const std::vector<uint8_t>& msg);
  // A replica kept by step discard `d`: its place among the compute ranks that go on (the pipeline's
  // schedule over them), the memory ranks the discard names lost let go (nothing sent to or awaited
  // from them), its ring neighbours over the compute ranks that go on (ReconnectRing), every
  // doorbell seqno at the discard's base, the lanes it takes over set up, and compute rank 0
  // answered with a compute hello. A later step discard that came while the ring was being
  // reconnected (another rank lost meanwhile) is returned, to be taken next (this one is answered).
  absl::StatusOr<std::optional<StepDiscardMessage>> KeepAfterDiscard(const StepDiscardMessage& d);
  // A replica of a rotational pipeline, kept by a step discard whose mask is `mask`: its successor
  // and predecessor become the next and previous compute ranks of the mask (in rank order, round
  // the ring). A neighbour that changed: the old connection is let go (Close()d, its messages
  // dropped); compute rank 0 is reached over its own connection; a new successor replica is
  // connected to at the address that compute rank 0's replica ring message (right after the
  // discard) names, with a compute hello (as JoinRing); a new predecessor replica's connection is
  // accepted and its compute hello taken (one that came before the discard was kept by
  // KeepEarlyRingHello; another compute rank's is kept for a later discard). Answers compute rank
  // 0's heartbeats meanwhile and leaves a memory rejoin request for ServeReplica, up to twice the
  // step timeout and 5 s: compute rank 0 finds a predecessor that never connects lost (within its
  // step timeout and a heartbeat's allowance) and says so with a later step discard, which is
  // returned. A new successor that cannot be reached is left failed: the rerun's hand-off to it
  // fails, and compute rank 0 gives it up. An error for a broken protocol, compute rank 0 gone or
  // stopped, or no predecessor by the deadline.
  absl::StatusOr<std::optional<StepDiscardMessage>> ReconnectRing(uint8_t mask);
  // A replica of a rotational pipeline: a compute hello on a connection that is neither compute
  // rank 0's, a memory rank's nor a ring neighbour's is a new predecessor that connected before
  // this rank had the step discard that makes it one: kept (moved from `msg`) for ReconnectRing,
  // true. False for any other message.
  bool KeepEarlyRingHello(transport::PeerId from, uint32_t magic, std::vector<uint8_t>* msg);
  std::vector<std::pair<transport::PeerId, std::vector<uint8_t>>> early_ring_hellos_;
  // A replica: compute rank 0's messages that ReconnectRing leaves for ServeReplica (a memory
  // rejoin request), in order.
  std::deque<std::vector<uint8_t>> rank0_deferred_;
  // Waits until doorbell `buffer` reaches `seqno` (a layer's output or residual stream); a replica
  // answers compute rank 0's heartbeats meanwhile (see RecoverFromFailedStep).
  absl::Status WaitInput(uint32_t buffer, uint64_t seqno, absl::Time deadline);
  // Runs the step's micro-batches (one, or several interleaved: see the file comment) and sets
  // (*sampled)[k] to what part k sampled. Parts owned by replicas go to them; this rank runs its
  // own parts and collects the replicas' results (whoever ran parts[k]).
  // `rerun`: the step runs again after a step discard (LoseReplica): the memory ranks keep its plans.
  absl::Status RunParts(std::span<const PlannedStep> parts, std::vector<SampledTokens>* sampled,
                        bool rerun = false);
  // Sends micro-batch j's q,k,v rows of `layer` (in lane j's qkv buffer) to the memory ranks.
  absl::Status SendLayer(size_t j, const PlannedStep& step, uint32_t layer);
  // Waits for (host path) or enqueues the waits for (device path) micro-batch j's attention
  // outputs of `layer`, which end up in lane j's attention buffer.
  absl::Status ReceiveLayer(size_t j, const PlannedStep& step, uint32_t layer);
  // A layer message: `body` behind its header (crc with checksums on) at `offset` of the peer's
  // buffer `buffer`, doorbell what.seqno (host-staged path).
  absl::Status WriteLayer(uint32_t peer, uint32_t buffer, uint64_t offset, const LayerMessageExpect& what,
                          absl::Span<const uint8_t> body);
  // Rotational pipeline: a memory rank's seqno of micro-batch j's next layer, advanced by a rank
  // that neither sends nor receives that layer (every compute rank keeps the memory ranks' count).
  void SkipLayer(size_t j, const PlannedStep& step);
  // pipeline.q_first, host-staged: memory rank m's `n` rows of lane j (`row_bytes` each, [q | k | v]
  // of its heads) as a q message at offset 0 of its receive buffer and a k,v message at
  // QFirstKvOffset, each with a seqno of its own.
  absl::Status SendSplit(const PlannedStep& step, uint32_t layer, size_t m, size_t j, const uint8_t* rows,
                         size_t n, size_t row_bytes);
  // pipeline.q_first, device path: lane j's rows to every memory rank with rows as two device
  // writes on the backend's stream, its q rows at 0 (seqno s) and its k,v rows at QFirstKvOffset
  // (s + 1), packed into contiguous device buffers first (the lane's split buffer under the request
  // partition, the rank's pack buffer under the head partition).
  absl::Status SendSplitOnDevice(size_t j, const PlannedStep& step);
  // Rotational pipeline: hands micro-batch j's residual stream (after PreAttention(layer)) to the
  // next compute rank, and takes it from the previous one (before PostAttention(layer)).
  absl::Status SendResidual(size_t j, const PlannedStep& step, uint32_t layer);
  absl::Status ReceiveResidual(size_t j, const PlannedStep& step, uint32_t layer);
  // Rotational pipeline with 3 or more compute ranks: the replicas connect in a ring (each to its
  // successor); compute rank 0 gives each its successor's address (ConnectReplicas).
  absl::Status JoinRing(absl::Time deadline);
  // The status of a failed device-path step, naming the memory rank where it can.
  absl::Status DeviceStepError(absl::Status synced, uint64_t step_id);
  // The next control message, from memory rank m (returned) into `msg`, before `deadline`; an
  // error message the rank sent is returned as its Status, named. A message from a replica (rank 0)
  // is returned as ranks_.size() + r - 1 for compute rank r.
  absl::StatusOr<size_t> ReceiveFromRank(absl::Time deadline, const std::string& awaited,
                                         std::vector<uint8_t>* msg);
  // Gives up memory rank m for `why` (recovery; see Step): OK once it is marked lost, else `why`
  // (recovery off or unsupported) or an error when no rank is left.
  absl::Status LoseRank(size_t m, absl::Status why);
  // Whether this rank can go on without a memory rank (see ComputeRankOptions::recover_memory_ranks).
  bool CanRecover() const;
  // After a failed wait for memory rank `waited_on`: loses the ranks that failed (an error report
  // received, or a peer the transport knows failed), or `waited_on` itself when none did.
  absl::Status LoseFailedRanks(size_t waited_on, absl::Status why);
  // A heartbeat reply from memory rank m (ReceiveFromRank and LoseFailedRanks take them
  // wherever they arrive): clears its awaited heartbeat. False for any other message; an
  // error for a malformed reply.
  absl::StatusOr<bool> TakeHeartbeatReply(size_t m, const std::vector<uint8_t>& msg);
  // The step's rows memory rank m gets: its range (request partition) or all of them (head).
  std::pair<int32_t, int32_t> RowsOf(const PlannedStep& step, size_t m) const;
  // Sends the release messages of `released` (the controller's, per placement group).
  absl::Status SendReleases(uint64_t step_id, const std::vector<std::vector<uint64_t>>& released);
  // KV tiers: each memory rank that `plan` asks to restore blocks answers with a restore reply once
  // it applied the plan; the replies go to the controller (Controller::RestoreResult). A lost
  // rank's replies are not awaited; a rank that fails or stays silent past the step timeout
  // meanwhile is lost like in a step (LoseFailedRanks).
  absl::Status CollectRestoreReplies(const StepPlan& plan);
  // Hands the ranks lost during the step to the controller (Controller::LoseRank requeues their
  // requests; under the head partition RepartitionHeads); the waiting requests that now fit no
  // surviving rank end with an error (Controller::FailUnplaceable), appended to `finished`. An
  // error when the re-partition loses every rank.
  absl::Status RecoverLostRanks(std::vector<std::pair<int64_t, GenerationResult>>* finished);
  // Head partition: every request in flight has KV heads on every rank, so after a loss (or a
  // rejoin; with compute replicas the step in flight is dropped first, DropStepForHeads) all of
  // them go back to the queue (Controller::LoseRank of the one placement group)
  // and the live ranks split the KV heads again, slice i of k in rank order (HeadSlice, slices that
  // may differ by one KV head): each gets a hello with its slice and attention-output buffers of
  // its own (fresh ids, the old ones stay registered; on the device path device buffers, whose
  // descriptors go with their registration) and sets itself up again with an empty pool;
  // the group's capacity becomes the smallest reply's (Controller::RejoinRank). A rank that fails,
  // reports an error or does not answer within the step timeout is given up and the split starts
  // again over the others. Between steps only (every rank idle); requests that fit no longer end
  // with an error, appended to `finished`.
  absl::Status RepartitionHeads(std::vector<std::pair<int64_t, GenerationResult>>* finished);
  // RepartitionHeads with compute replicas running, once the `live` memory ranks have answered
  // their hellos: every replica gets a head split (wire.h: each live rank's slice, its receive
  // buffers and the attention-output buffer ids) and answers once it has set up its buffers for
  // it (TakeHeadSplit), within the step timeout. A replica that fails, refuses or stays silent is
  // given up (LoseReplica, where CanRecoverReplica; else the error). True when a memory rank
  // failed meanwhile (given up: the split starts again).
  absl::StatusOr<bool> SplitReplicas(const std::vector<size_t>& live);
  // A memory rank that fails during RepartitionHeads is given up: with replicas running by a step
  // discard of no step that names it (Regroup), so that they let it go too; else MarkRankLost.
  absl::Status LoseRankInSplit(size_t m, const absl::Status& why);
  // A replica: compute rank 0's head split, taken between steps: each listed memory rank's slice,
  // receive buffers and fresh attention-output buffers (compute rank 0's ids; the old ones stay
  // registered; seqnos at 0), set up for the lanes this rank runs; answered, with why not when a
  // listed rank is lost here or a buffer cannot be set up. An error only for a broken protocol.
  absl::Status TakeHeadSplit(const std::vector<uint8_t>& msg);
  // Compute rank 0 between steps (RepartitionHeads, SplitReplicas, TakeArrivedMessages): a message from a
  // replica that is no answer awaited there: its answer to a step discard or a heartbeat reply is taken
  // (TakeReplicaControl); an error report, or anything else (named `when`), gives the replica up
  // (GiveUpIdleReplica). A connection that is no live replica's: ignored.
  absl::Status TakeReplicaIdleMessage(transport::PeerId from, const std::vector<uint8_t>& msg,
                                      const char* when);
  // Replica r is given up between steps (LoseReplica of no step) where CanRecoverReplica, else
  // `why` named after it is the error.
  absl::Status GiveUpIdleReplica(size_t r, const absl::Status& why);
  uint64_t head_splits_ = 0;  // compute rank 0: the last head split's id (SplitReplicas)

  ComputeRankOptions options_;
  std::unique_ptr<transport::Transport> transport_;
  std::unique_ptr<ComputeBackend> backend_;
  std::unique_ptr<Controller> controller_;
  // What one micro-batch in flight has of a memory rank (lane j of every rank).
  struct RankLane {
    uint32_t attn_buffer = 0;              // ours, for its outputs
    BackendBuffer recv{nullptr, nullptr};  // attention outputs land here (host)
    size_t recv_bytes = 0;
    // Head partition: its q,k,v columns packed (host-staged path: host memory; device path:
    // device memory, what is written to it), and on the device path its outputs (device memory,
    // registered as attn_buffer).
    BackendBuffer pack{nullptr, nullptr}, out{nullptr, nullptr};
    bool registered = false;  // attn_buffer is registered with the transport (SetUpRankLane)
    uint64_t seqno = 0;
  };
  // SetUpRankLane for a lane of a rank's `slice` held elsewhere (a rejoin probe's).
  absl::Status SetUpRankLane(const HeadSlice& slice, size_t j, RankLane* lane);
  struct Rank {
    uint32_t peer = 0;
    uint32_t qkv_buffer = 0;  // its receive buffer of lane 0 (lane j: qkv_buffer + j)
    // Its heads: all of them (request partition: num_ranks 1) or its slice (head partition).
    HeadSlice slice;
    std::vector<RankLane> lanes;
    std::string name;
    bool lost = false;  // given up (LoseRank): nothing is sent to it or awaited from it
    // Heartbeat: the one not yet answered (seq 0: none) and when it was sent.
    uint64_t beat_seq = 0;
    absl::Time beat_sent;
  };
  std::vector<Rank> ranks_;
  // Whether `rank` has left a heartbeat unanswered for longer than the step timeout.
  bool SilentPastHeartbeat(const Rank& rank, absl::Time now) const {
    return rank.beat_seq != 0 && now - rank.beat_sent > options_.step_timeout;
  }
  // This rank and compute.ranks at start; compute_ranks_ then counts the compute ranks that go on
  // after a loss, among which this rank is the pipeline's compute rank place_ (compute rank 0: 0).
  int compute_rank_ = 0, compute_ranks_ = 1, initial_compute_ranks_ = 1, place_ = 0;
  bool kept_ = false;  // a replica: a step discard kept it (TakeRank0Discard); the step is dropped
  // A replica: compute rank 0's step discard taken by ReplicaPoll, applied by AwaitRank0.
  std::optional<std::vector<uint8_t>> rank0_discard_;
  PipelineSchedule
      schedule_;  // who runs which layers of which micro-batch (over the compute ranks that go on)
  int64_t num_layers_ = 0;
  // Rotational pipeline: the connections to the next and the previous compute rank of the ring,
  // and on a replica their compute ranks (numbered as at start-up; -1: a predecessor that has not
  // connected yet, ReconnectRing).
  uint32_t next_peer_ = 0, prev_peer_ = 0;
  std::string next_name_, prev_name_;
  int next_rank_ = 0, prev_rank_ = 0;
  struct Replica {  // compute rank 0's view of compute rank r > 0
    uint32_t peer = 0;
    std::string name;
    // Heartbeat, as Rank's: the one not yet answered (seq 0: none) and when it was sent.
    uint64_t beat_seq = 0;
    absl::Time beat_sent;
    bool lost = false;   // given up (LoseReplica): nothing is sent to it or awaited from it
    int place = 0;       // its place among the compute ranks that go on (the pipeline's compute rank)
    int unanswered = 0;  // step discards that kept it and that it has not answered yet (AwaitKeptReplicas)
    int next = 0;        // rotational: its successor in the ring, a compute rank (0: compute rank 0)
  };
  // Replica r's (compute rank r + 1) control message that is no step's answer: a heartbeat reply
  // (as TakeHeartbeatReply), its answer to a step discard that kept it (a compute hello), or a result
  // it sent before that answer (of a step discarded: dropped). True when taken; an error for a
  // malformed one.
  absl::StatusOr<bool> TakeReplicaControl(size_t r, const std::vector<uint8_t>& msg);
  // A replica: whether `from` is a memory rank compute rank 0 gave up, or a connection given up (a
  // lost process's when its rank rejoined, a failed rejoin's): its messages are dropped.
  bool FromLostRank(transport::PeerId from) const {
    return retired_peers_.contains(from) ||
           std::any_of(ranks_.begin(), ranks_.end(), [&](const Rank& r) { return r.lost && r.peer == from; });
  }
  // A replica: compute rank 0's memory rejoin request (wire.h): connects to the rank's new process
  // with a compute hello, takes its hello reply (within the step timeout, answering heartbeats
  // meanwhile), and takes the rank back with fresh attention-output buffers (the request's ids,
  // seqnos at 0); then answers compute rank 0, or, when the new process cannot be reached, answers
  // why and keeps the rank lost. An error only for a broken protocol.
  absl::Status TakeMemoryRejoin(const std::vector<uint8_t>& msg);
  // Compute rank 0, taking memory rank m back while replicas run: sends each replica a memory
  // rejoin request (its outputs to buffers `attn_buffer` + lane) and waits, up to the step timeout,
  // for every answer. "" once every replica has the rank; else why not, and the replicas that took
  // it let it go again (a step discard of no step that names it lost).
  absl::StatusOr<std::string> RejoinReplicas(size_t m, uint32_t attn_buffer);
  // The compute ranks that go on, as a hello's compute_mask (bit c: compute rank c).
  uint8_t LiveComputeMask() const;
  bool rank0_gone_ = false;  // a replica: compute rank 0 failed or went silent (it is not told why we stop)
  std::vector<Replica> replicas_;
  uint32_t rank0_peer_ = 0;     // a replica's connection to compute rank 0
  std::string listen_address_;  // a replica's (compute rank 0 does not listen)
  std::function<absl::Status(const std::string&)> on_listening_;
  std::vector<std::string> rank_names_;
  // Rejoins (see the class comment). Starts, advances and completes the probes of the lost ranks;
  // never blocks beyond one small send, except while replicas run: then a rank whose new process
  // answered is taken back once every replica is connected to it (RejoinReplicas, up to the step
  // timeout). Call between steps only. An error only where a step discard that lets the replicas
  // drop a failed rejoin fails (as Regroup).
  absl::Status AdvanceRejoins();
  // Between steps on the device path, where a step reads no message: takes what has arrived (a
  // probe's reply among it; see the .cc).
  absl::Status TakeMessagesBetweenSteps();
  // What the transport has, each wait 1 ms at most (UCX makes progress only before a deadline): a
  // probe's or a given-up connection's messages (TakeStrayMessage), a live memory rank's
  // (TakeIdleMessage) and a replica's (TakeReplicaIdleMessage), each named `when` if unexpected.
  // Heartbeat and TakeMessagesBetweenSteps.
  absl::Status TakeArrivedMessages(const char* when);
  // A message from live memory rank m outside a step (Heartbeat, TakeMessagesBetweenSteps): a
  // heartbeat reply is taken; an error report, or anything else (named `when`), loses the rank.
  absl::Status TakeIdleMessage(size_t m, const std::vector<uint8_t>& msg, const char* when);
  // A message from a probe (kept as its hello reply: true) or from a connection given up (a lost
  // rank's old one, a dropped probe: dropped, true); false for any other peer's.
  bool TakeStrayMessage(transport::PeerId from, std::vector<uint8_t>* msg);
  // Memory rank m's persisted blocks report (kv.tiers.persist; or an error report): its blocks
  // appended to `blocks`; true when it was the rank's last. Errors name the rank.
  absl::StatusOr<bool> TakePersistedReport(size_t m, const std::vector<uint8_t>& msg,
                                           std::vector<TierBlock>* blocks);
  // Registers the blocks memory rank m found on disk (Controller::AddTierBlocks) and logs how many.
  void OfferPersisted(size_t m, std::span<const TierBlock> blocks);
  // Drops rank m's probe (its connection's later messages are dropped too) and schedules the next.
  void DropProbe(size_t m, const std::string& why);
  // The hello that sets memory rank m up, its attention outputs going to buffers attn_buffer + j.
  HelloMessage MakeHello(size_t m, uint32_t attn_buffer) const;
  struct Probe {
    bool active = false;
    transport::PeerId peer = 0;
    absl::Time started;
    bool hello_sent = false;
    std::vector<RankLane> lanes;             // the rank's lanes once it rejoins: fresh buffers, seqnos at 0
    std::vector<uint8_t> reply;              // its hello reply, once it came
    std::vector<TierBlock> persisted;        // kv.tiers.persist: the blocks its reports offer
    bool reports_done = false;               // its last report came
    std::string report_error;                // a report that was refused: the probe is dropped
    absl::Time next = absl::InfinitePast();  // when the next probe may start
    absl::Duration backoff;                  // the wait before it (doubles while nothing answers)
  };
  std::vector<Probe> probes_;                            // per memory rank
  std::unordered_set<transport::PeerId> retired_peers_;  // connections given up: their messages are dropped
  uint32_t next_attn_buffer_ = 0;                        // the next free attention-output buffer id
  std::vector<RankLane> retired_lanes_;                  // buffers of lost processes and dropped probes
  PlannedStep step_;
  // One per micro-batch in flight: lane 0 is backend_ itself, lane j > 0 a backend lane over the
  // same weights (ComputeBackend::CreateLane).
  struct Lane {
    std::unique_ptr<ComputeBackend> owned;
    ComputeBackend* backend = nullptr;
    BackendBuffer qkv{nullptr, nullptr}, attn{nullptr, nullptr};  // backend memory
    BackendBuffer qkv_host{nullptr, nullptr};                     // staging of qkv rows (CUDA)
    BackendBuffer attn_host{nullptr, nullptr};  // staging of attention rows (CUDA, head partition)
    // Rotational pipeline: where the previous compute rank writes the residual stream (host-staged:
    // a layer message in host memory; device path: device memory), the staging of ours on the way
    // out (host-staged path on a GPU), and the two directions' doorbell seqnos.
    BackendBuffer resid_in{nullptr, nullptr}, resid_host{nullptr, nullptr};
    size_t resid_in_bytes = 0;
    uint64_t resid_in_seqno = 0, resid_out_seqno = 0;
    // pipeline.q_first: host-staged, one memory rank's rows split at a time, its q rows then its
    // k,v rows (host); device path under the request partition, every row's q rows then k,v rows
    // (device memory).
    BackendBuffer split{nullptr, nullptr};
  };
  std::vector<Lane> lanes_;
  HostMemorySpace host_copies_;  // packs and scatters of the host-staged path
  bool device_path_ = false;     // the whole step on the device (see the file comment)
  // Host timers of the CPU backend's phases (a GPU backend times its own, with `profile`).
  double host_compute_ms_ = 0, host_attention_ms_ = 0;
  uint64_t stats_cookie_ = 0;
  bool head_ = false;  // partition == kHead
  size_t elem_ = 4;
  double busy_seconds_ = 0;
  // Restore replies that arrived while the replicas' results were awaited or failed ranks were
  // looked for: (memory rank, frame).
  std::vector<std::pair<size_t, std::vector<uint8_t>>> early_replies_;
  std::vector<size_t> lost_in_step_;  // ranks lost during the current step
  // Compute rank 0 within RunParts with replicas running: memory ranks that LoseRank could not give
  // up yet (the step fails; RecoverFromFailedStep loses them and runs it again), with why.
  bool in_parts_ = false;
  std::vector<std::pair<size_t, absl::Status>> failed_ranks_;
  uint64_t beat_seq_ = 0;  // the last heartbeat sent
  // Requests ended by a loss found by Heartbeat (RecoverLostRanks), reported by the next Step.
  std::vector<std::pair<int64_t, GenerationResult>> ended_while_idle_;
  absl::Time next_beat_ = absl::InfinitePast();
  int64_t memory_ranks_lost_ = 0, requests_recovered_ = 0, memory_ranks_rejoined_ = 0;
  int64_t compute_ranks_lost_ = 0, steps_rerun_ = 0;
  // Replicas kept by a step discard (counted at each one); micro-batches whose tokens a replica
  // sampled.
  int64_t replicas_kept_ = 0, replica_micro_batches_ = 0;
  // Compute rank 0: at least every doorbell seqno used so far (each step's layers add at most
  // num_layers messages, two with q-first, to any one): where they all start again after a replica
  // is lost (LoseReplica).
  uint64_t seqno_ceiling_ = 0;
};

}  // namespace tandem
