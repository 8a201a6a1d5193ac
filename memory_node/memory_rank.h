// `tandem memory`: one memory rank as a process (docs/architecture.md, "Processes"). It owns a KV pool on one
// device and runs attention for the requests the controller placed on it (request partition), or for
// its slice of the KV heads of every request (head partition; common/head_partition.h).
//
// Life of a memory rank:
//   1. listen (transport address reported through on_listening, which writes the ready file);
//   2. accept the compute rank; its hello gives the model's attention shape, the partition and
//      this rank's KV head slice, the step limits, the wire dtype and how to size the KV pool; the
//      rank's attention shape is its slice (under the head partition H/M query and Hkv/M KV heads;
//      the executor runs it unchanged), and it sizes its pool for that shape from the device memory
//      it is given (kv.memory_fraction of what is free then, or kv.capacity_tokens) and replies
//      with its capacity (tokens of its slice) and the id of its q,k,v receive buffer;
//   3. serve: per step plan, place the step's rows of its requests in KV slots (KvTable) and, per
//      layer, wait for the q,k,v rows, append K and V, run attention and write the output back.
//      Under the head partition the plan places every request on rank 0 and every memory rank
//      applies it as rank 0: all ranks hold the same requests, slots and prefix blocks, each for
//      its heads; its q,k,v rows are the packed columns of its heads for every row of the step;
//      release messages free the KV of requests that ended; a stats request is answered with the
//      rank's totals (steps with rows here and their attention time: the pipeline
//      report of compute rank 0); a heartbeat (compute rank 0, while idle) is answered at once and
//      arms a watchdog: from then on, compute rank 0 silent (no message, no step) for longer
//      than the last heartbeat's silence_ms ends the rank with an error naming it, instead of
//      waiting forever for a compute rank 0 that was stopped or cut off; bye ends the rank cleanly. With
//      pipelining (the hello's lanes > 1) a step comes as micro-batch plans in order, each applied to the KV
//      table and begun on a lane of its own (an executor lane over the same pool, its own receive buffer) as
//      it arrives; after the last one the rank serves layer l of every micro-batch in turn, in the order the
//      compute rank sends them (docs/architecture.md, "Micro-batches").
// With KV tiers, a plan's evictions save the blocks to the tiers and its restores load them back;
// a plan with restores for this rank is answered with a restore reply (the ones that failed) as
// soon as it is applied, before its layers. With kv.tiers.persist the hello reply says so and is
// followed by persisted blocks reports to compute rank 0 (the blocks its disk tier found at start,
// with the tokens the plans' evictions carried when they were written).
// With the hello's q_first (pipeline.q_first), each layer comes as q rows and then k,v rows:
// attention over the context runs once q is there, the new rows' part once k,v are, merged by
// log-sum-exp (AttentionExecutor::LayerContext / LayerNew). Host-staged, they are two messages
// (on a CUDA rank each copied to the device as it comes); on the device path two writes into the
// rank's GPU buffer (q at 0, k,v at QFirstKvOffset), each with a device-side wait of its own.
// With the host-staged transport (ucx), CUDA ranks stage q,k,v and outputs through pinned host
// buffers, layer by layer. With a device-polling transport (p2p, nccl, verbs) a CUDA rank
// enqueues the whole step at once on its executor's stream, per layer: a device-side wait for
// the q,k,v rows (written straight into its GPU buffer) -> KV append and attention -> the write of
// the output straight into the compute rank's attention buffer at this rank's row offset (under the
// head partition: into the compute rank's buffer for this rank, at row 0); it then
// waits once for the step. A compute replica that fails or stops is let go, and compute rank 0
// decides what follows: a step discard (common/wire.h), taken in any state of the step, makes the
// rank leave its layers, apply the surviving compute ranks and the new seqno base, and run the
// step's layers again with its plans still applied; an error message ends it. On the device path
// the rank takes compute rank 0's messages while its host waits (Transport::SetDevicePoll): a
// discard releases the step's device waits, the stream drains, the device path is reset
// (Transport::ResetDevicePath) and the layers are enqueued again; compute rank 0 writes nothing of
// the rerun until this rank has answered a heartbeat sent after the discard.
// Every wait has a deadline; a malformed or unexpected frame, a peer that disappears
// or a deadline that passes ends the rank with an error naming it (the compute rank is told first when it can
// still be reached).
#pragma once

#include <functional>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/transport/factory.h"
#include "memory_node/kv_tier_store.h"

namespace tandem {

struct MemoryRankOptions {
  int rank = 0;                                // index in the deployment (for messages)
  std::string listen_address = "127.0.0.1:0";  // host:port; port 0 picks a free one
  std::string device = "cpu";                  // cpu or cuda:N
  // Memory ranks (this one included) that size their KV pools from this device's memory at the
  // same time: the hello's kv.memory_fraction is split among them, so that they never reserve more
  // than the fraction together (the launcher counts the ranks per device; all CPU ranks share the host).
  int kv_share = 1;
  transport::TransportKind transport = transport::TransportKind::kUcx;  // as the compute rank's
  absl::Duration startup_timeout = absl::Minutes(10);  // to accept the compute rank and get its hello
  // Within a step: for q,k,v of a layer, twice this (the compute rank may spend one step timeout on a
  // silent memory rank before it goes on without it); sends to the compute rank, this.
  absl::Duration step_timeout = absl::Minutes(2);
  // Called once the rank listens, with its transport address.
  std::function<absl::Status(const std::string& address)> on_listening;
  // Polled while idle; true ends the rank (OK status).
  std::function<bool()> stop_requested;
  // KV tiers (kv.tiers.*; memory_node/kv_tiers.h): evicted prefix blocks are saved to host memory
  // and disk (disk_dir/rank-<m>) and restored when the plan asks. CPU ranks under the request
  // partition only: otherwise the hello is answered with an error naming kv.tiers.
  KvTierOptions tiers;
  // Identifies the model in the tier files' fingerprint (the deployment's model.path and seed).
  std::string model;
};

absl::Status RunMemoryRank(const MemoryRankOptions& options);

}  // namespace tandem
